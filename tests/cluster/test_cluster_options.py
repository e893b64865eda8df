"""Options across machines: each changes what a kernel on the lab's nodes does."""

from __future__ import annotations

import psutil
from cluster_lab import HEAD, SSH_OPTS, kernel_env
from harness import DistKernel


def test_port_range_holds_the_parents_listener_rank_0s_rendezvous_and_a_free_master_port(lab):
    """Across machines (the two-node lab of tests/cluster/lab.sh), through ssh."""
    lo, hi = 29650, 29659
    k = DistKernel(*SSH_OPTS, "--port-range", f"{lo}-{hi}", env=kernel_env(lab))
    try:
        res = k.execute("import os\nprint(os.environ['MASTER_PORT'])", timeout=240)
        assert res.status == "ok", res.outputs
        # the same on every rank (shown once, or labelled when a loaded machine kept the ranks apart)
        (master_port,) = {line.split()[-1] for line in res.stream().splitlines()}
        assert lo <= int(master_port) <= hi
        listening = {c.laddr.port for c in psutil.Process(k.pid).net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN and c.laddr.ip == HEAD}
        assert listening and all(lo <= p <= hi for p in listening), listening
        # MASTER_PORT is free (the kernel's rendezvous holds another port): after the group is
        # destroyed on every rank, dist.init_process_group() by hand (env://) works across machines
        res = k.execute("import torch, torch.distributed as dist\ndist.destroy_process_group()", timeout=60)
        assert res.status == "ok" and "process group is down" in res.stream("stderr"), res.outputs
        res = k.execute('dist.init_process_group("gloo")\nt = torch.ones(1)\ndist.all_reduce(t)\n'
                        "print(int(t.item()), os.environ['MASTER_PORT'])", timeout=120)
        assert res.status == "ok" and res.stream() == f"2 {master_port}\n", res.outputs
    finally:
        k.shutdown()
