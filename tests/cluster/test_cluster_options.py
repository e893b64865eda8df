"""Options across machines: each changes what a kernel on the lab's nodes does."""

from __future__ import annotations

import psutil
from harness import DistKernel
from test_cluster import HEAD, SSH_OPTS, kernel_env


def test_port_range_holds_the_parents_listener_and_rank_0s_rendezvous(lab):
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
    finally:
        k.shutdown()
