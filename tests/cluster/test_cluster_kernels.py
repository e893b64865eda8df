"""Kernels whose ranks run on the two-node lab of ``tests/cluster/lab.sh`` (issue 13): it works, and
it keeps its secrets.

The lab is a real Slurm cluster and one sshd per node, built from network namespaces on this
machine: the parent kernel runs in the root namespace on the bridge ``dklab0`` (10.77.0.1), the
nodes ``n1`` (10.77.0.11) and ``n2`` (10.77.0.12) are namespaces with their own hostname. Every
test talks only to those addresses and to loopback. Two kernels stay up for the module (Slurm 2
nodes x 2 ranks, SSH 2 nodes x 1 rank).

* **works**: all_reduce, hostnames in rank order (node-major), identical output shown once,
  torchrun's variables, ``%dist_status`` hosts; the DDP example notebook through nbclient and
  through ``python -m dist_kernel run``.
* **security**: no Jupyter port in a node's namespace (ranks are on IPC), a client without the
  keys gets nothing from the parent's port and runs nothing, and a packet capture on the lab's
  links holds neither a secret a cell printed nor key material the nodes were given (the capture
  proves itself first: it sees the kernel's traffic and a plaintext marker).

Faults and restarts: test_cluster_faults.py.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from cluster_kernel import (
    ALL_REDUCE,
    ClusterKernel,
    Owned,
    assert_nothing_left,
    connection_file_of,
    error_text,
    per_rank,
)
from cluster_lab import (
    HEAD,
    NODES,
    ROOT,
    SLURM_OPTS,
    SSH_OPTS,
    Capture,
    assert_capture_sees_markers,
    kernel_env,
    listeners,
    ns_procs,
    send_markers,
    tcp_sockets,
    wait_until,
)
from harness import end_process_tree

pytestmark = pytest.mark.slow

EXAMPLE = ROOT / "examples" / "ddp_synthetic.ipynb"


@pytest.fixture(scope="module")
def slurm_kernel(lab):
    k = ClusterKernel(lab, SLURM_OPTS, ranks_per_node=2, capture=True)
    yield k
    k.shutdown()


@pytest.fixture(scope="module")
def ssh_kernel(lab):
    k = ClusterKernel(lab, SSH_OPTS, ranks_per_node=1, capture=True)
    yield k
    k.shutdown()


@pytest.fixture(params=["slurm", "ssh"])
def any_kernel(request):
    return request.getfixturevalue(f"{request.param}_kernel")



# ------------------------------------------------------------------------------ it works
def _expected_hosts(k: ClusterKernel) -> dict[int, str]:
    """Node-major: ranks 0..G-1 on n1, G..2G-1 on n2."""
    names = list(NODES)
    return {r: names[r // k.ranks_per_node] for r in range(k.world)}


def test_all_reduce_sums_over_both_nodes_and_identical_output_shows_once(any_kernel):
    k = any_kernel
    res = k.execute(ALL_REDUCE + "\nprint('the same line on every rank')", timeout=60)
    assert res.status == "ok", error_text(res)
    assert res.stream() == f"{k.world}\nthe same line on every rank\n"


def test_each_rank_runs_on_its_node_in_node_major_order(any_kernel):
    k = any_kernel
    res = k.execute("print(rank, dist.get_rank(), socket.gethostname())", timeout=60)
    lines = per_rank(res.stream())
    assert lines == {r: f"{r} {r} {h}" for r, h in _expected_hosts(k).items()}
    # and the OS agrees: the rank processes are in those namespaces
    for ns in NODES:
        assert len(k.ranks_on(ns)) == k.ranks_per_node, (ns, k.ranks_on(ns))


def test_ranks_get_torchruns_variables_and_gloo_uses_the_cluster_interface(any_kernel):
    k = any_kernel
    names = ["RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
             "GLOO_SOCKET_IFNAME"]
    res = k.execute(f"print(json.dumps({{n: os.environ.get(n) for n in {names!r}}}))", timeout=60)
    got = {r: json.loads(v) for r, v in per_rank(res.stream()).items()}
    assert sorted(got) == list(range(k.world))
    G = k.ranks_per_node
    master_port = got[0]["MASTER_PORT"]
    assert master_port and master_port.isdigit()
    for r, env in got.items():
        assert env == {"RANK": str(r), "LOCAL_RANK": str(r % G), "NODE_RANK": str(r // G),
                       "WORLD_SIZE": str(k.world), "LOCAL_WORLD_SIZE": str(G), "MASTER_ADDR": NODES["n1"],
                       "MASTER_PORT": master_port, "GLOO_SOCKET_IFNAME": "lab0"}, (r, env)
    # rank 0 (on n1) holds the kernel's rendezvous on n1's cluster address, on a port of its own:
    # MASTER_PORT stays free for dist.init_process_group() by hand
    store = json.loads(per_rank(k.execute("from dist_kernel.rank.rendezvous import store_port\n"
                                          "print(json.dumps([store_port(), rank]))", timeout=60).stream())[0])[0]
    ls = listeners("n1")
    assert any(x.port == store and x.pid in {p.pid for p in k.ranks_on("n1")} for x in ls), (store, ls)
    assert store != int(master_port) and not any(x.port == int(master_port) for x in ls), (master_port, ls)
    # the group's connections between the ranks are on the lab's addresses, never loopback
    for ns in NODES:
        socks = tcp_sockets(ns)
        for p in k.ranks_on(ns):
            conns = [c for c in socks if c.pid == p.pid and c.state == "ESTAB"]
            assert conns, f"rank pid {p.pid} on {ns} has no TCP connection (gloo?)"
            assert all(c.addr.startswith("10.77.0.") and c.peer.startswith("10.77.0.") for c in conns), (ns, conns)


def test_dist_status_names_each_ranks_host(any_kernel):
    k = any_kernel
    res = k.execute("%dist_status", timeout=60)
    assert res.status == "ok", error_text(res)
    text = "".join(o.text for o in res.outputs)
    rows = {}
    for line in text.splitlines():
        m = re.match(r"^\s*\|?\s*(\d+)\s*\|?\s+(\d+)\s*\|?\s+(\S+)", line)  # rank, pid, host
        if m:
            rows[int(m.group(1))] = m.group(3)
    assert rows == _expected_hosts(k), text


# -------------------------------------------------------------------------- notebooks
def test_the_ddp_example_runs_through_nbclient_on_the_slurm_kernel(lab, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    from dist_kernel.runner import kernel_manager

    for name, value in kernel_env(lab).items():
        monkeypatch.setenv(name, value)
    nb = nbformat.read(EXAMPLE, as_version=4)
    km = kernel_manager(list(SLURM_OPTS))
    owned = Owned(lambda: [km.provisioner.process.pid] if km.has_kernel else []).poll()
    try:
        NotebookClient(nb, km=km, timeout=240).execute()
        assert owned.agent_pids and owned.job_ids, "the notebook's kernel was never seen on the nodes"
    finally:
        km.shutdown_kernel()
        owned.stop_polling()
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "rank 0 of 4" in text and "on cpu, backend gloo" in text
    assert "epoch 7: loss" in text and "replicas equal: True" in text
    assert "max weight error" in text
    assert_nothing_left(owned, 15, "after the notebook's kernel shut down")
    assert wait_until(lambda: not owned.jobs(), 15), owned.jobs()


def test_the_ddp_example_runs_with_dist_kernel_run_over_ssh(lab, tmp_path):
    import nbformat

    out = tmp_path / "out.ipynb"
    proc = subprocess.Popen([sys.executable, "-m", "dist_kernel", "run", str(EXAMPLE), *SSH_OPTS, "--output", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env={**os.environ, **kernel_env(lab)})
    owned = Owned(lambda: [proc.pid] if proc.poll() is None else []).poll()
    try:
        stdout, stderr = proc.communicate(timeout=280)
    finally:
        end_process_tree(proc)
        owned.stop_polling()
    assert proc.returncode == 0, stderr[-3000:]
    assert owned.agent_pids, "the run's kernel was never seen on the nodes"
    assert "replicas equal: True" in stdout and "rank 0 of 2" in stdout
    nb = nbformat.read(out, as_version=4)
    assert any("epoch 7: loss" in o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert_nothing_left(owned, 15, "after dist_kernel run ended")


# --------------------------------------------------------------------------- security
def test_no_jupyter_port_is_open_on_the_nodes(any_kernel):
    """The ranks' kernels are on IPC and the agent connects out, so a node listens (besides sshd,
    slurmd and slurmstepd) only on what torch and ipykernel open in any process: rank 0's
    rendezvous (the kernel's TCPStore, not MASTER_PORT), one gloo listener per rank on the cluster address, and ipykernel's
    IOPub pipe for forked subprocesses' output (on 127.0.0.1, authenticated by a random token)."""
    k = any_kernel
    k.check_works()
    res = k.execute("import sys\nfrom dist_kernel.rank.rendezvous import store_port\n"
                    "print(json.dumps({'pid': os.getpid(), 'store_port': store_port(), "
                    "'pipe_port': getattr(getattr(sys.stdout, 'pub_thread', None), '_pipe_port', None)}))", timeout=60)
    info = {r: json.loads(v) for r, v in per_rank(res.stream()).items()}
    store_port = info[0]["store_port"]
    lab_daemons = ("sshd", "slurmd", "slurmstepd")
    for ns, addr in NODES.items():
        ranks = {p.pid: p for p in k.ranks_on(ns)}
        agent = k.agent_on(ns)
        pipes = {(v["pid"], v["pipe_port"]) for v in info.values()}
        conn_ports = set()
        for p in ranks.values():
            cf = connection_file_of(p)
            assert cf["transport"] == "ipc", (ns, cf)
            conn_ports |= {cf[f"{c}_port"] for c in ("shell", "iopub", "stdin", "control", "hb")}
        ls = listeners(ns)
        ss_ltn = subprocess.run(["ip", "netns", "exec", ns, "ss", "-ltnH"], capture_output=True, text=True).stdout
        assert {x.port for x in ls} == {int(c.split()[3].rpartition(":")[2]) for c in ss_ltn.splitlines()}
        others = {p.pid: p for p in ns_procs(ns) if p.ours and p.pid not in ranks and p.pid != agent.pid}
        gloo: dict[int, list] = {pid: [] for pid in ranks}
        for x in ls:
            if x.comm in lab_daemons:
                continue
            assert x.port not in conn_ports, f"a rank's Jupyter port listens on {ns}: {x}"
            assert x.pid != agent.pid, f"the node agent listens on {ns}: {x}"
            if x.pid in others:  # another kernel on the same lab (this module keeps two up): the same rules
                other = others[x.pid]
                assert other.runs_module("dist_kernel.rank"), f"a node agent listens on {ns}: {x} {other}"
                cf = connection_file_of(other)
                assert cf["transport"] == "ipc" and x.port not in {cf[f"{c}_port"] for c in
                                                                  ("shell", "iopub", "stdin", "control", "hb")}, (x, cf)
                continue
            assert x.pid in ranks, f"something else listens on {ns}: {x} ({Path(f'/proc/{x.pid}/cmdline').read_bytes()!r})"
            if ns == "n1" and x.port == store_port:
                continue  # the kernel's TCPStore, in rank 0 (it binds every address, as PyTorch documents)
            if (x.pid, x.port) in pipes:
                assert x.addr == "127.0.0.1", f"ipykernel's IOPub pipe is not on loopback on {ns}: {x}"
                continue
            assert x.addr == addr, f"a rank listens on {x.addr}:{x.port} on {ns}, not on gloo's {addr}"
            gloo[x.pid].append(x)
        assert all(len(v) == 1 for v in gloo.values()), f"not exactly gloo's one listener per rank on {ns}: {gloo}"
    assert any(x.port == store_port and x.pid in {p.pid for p in k.ranks_on("n1")} for x in listeners("n1"))


ATTACK = r'''
import json, os, sys, time, uuid, zmq
host, port, marker = sys.argv[1], int(sys.argv[2]), sys.argv[3]
code = f"open({marker!r}, 'w').write('ran')"
header = {"msg_id": uuid.uuid4().hex, "session": uuid.uuid4().hex, "username": "x", "date": "2026-01-01T00:00:00Z",
          "msg_type": "execute_request", "version": "5.3"}
jmsg = [b"<IDS|MSG>", b"", json.dumps(header).encode(), b"{}", b"{}",
        json.dumps({"code": code, "silent": False, "store_history": True, "user_expressions": {},
                    "allow_stdin": False, "stop_on_error": True}).encode()]
hello = json.dumps({"type": "hello", "node": 0, "host": "n1", "address": "10.77.0.11", "pid": 1}).encode()
attempts = {
    "no keys (NULL mechanism)": {},
    "CURVE, random server key, random client keys": "random",
}
ctx = zmq.Context()
report = {}
for label, how in attempts.items():
    s = ctx.socket(zmq.DEALER)
    s.linger = 0
    if how == "random":
        spub, _ = zmq.curve_keypair()
        cpub, csec = zmq.curve_keypair()
        s.curve_serverkey, s.curve_publickey, s.curve_secretkey = spub, cpub, csec
    s.setsockopt(zmq.IDENTITY, b"node0")
    s.connect(f"tcp://{host}:{port}")
    for frames in ([b"ctl", hello, b"0" * 64], [b"msg", b"0", b"shell", *jmsg], [b"msg", b"0", b"control", *jmsg],
                   jmsg):
        s.send_multipart(frames, flags=zmq.NOBLOCK) if s.poll(0, zmq.POLLOUT) else None
    got = []
    end = time.monotonic() + 3
    while time.monotonic() < end:
        if s.poll(100):
            got.append(s.recv_multipart())
    report[label] = len(got)
    s.close()
# what the listener demands: the mechanism in its ZMTP 3 greeting
import socket
with socket.create_connection((host, port), timeout=5) as raw:
    raw.settimeout(3)
    raw.sendall(b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03")  # signature + major version: libzmq then sends the rest
    greeting = b""
    try:
        while len(greeting) < 64:
            chunk = raw.recv(64 - len(greeting))
            if not chunk:
                break
            greeting += chunk
    except OSError:
        pass
report["server mechanism"] = greeting[12:32].rstrip(b"\0").decode(errors="replace")
# and a raw TCP client that sends junk
with socket.create_connection((host, port), timeout=5) as raw:
    raw.sendall(os.urandom(2048))
print(json.dumps(report))
'''


def test_a_client_without_the_keys_gets_nothing_and_runs_nothing(any_kernel, tmp_path):
    k = any_kernel
    port = k.listen_port()
    marker = tmp_path / f"ran-{uuid.uuid4().hex}"
    p = subprocess.run(["ip", "netns", "exec", "n1", sys.executable, "-c", ATTACK, HEAD, str(port), str(marker)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    report = json.loads(p.stdout.strip().splitlines()[-1])
    assert report["no keys (NULL mechanism)"] == 0 and report["CURVE, random server key, random client keys"] == 0, report
    # the listener is a CurveZMQ server: a client must know its public key and hold an admitted key pair
    assert report["server mechanism"] == "CURVE", report
    # nothing ran: not on the parent's machine, not on any node (they share this filesystem)
    time.sleep(1)
    assert not marker.exists()
    k.check_works(60)  # and the kernel did not mind
    assert not marker.exists()


def test_a_capture_of_the_lab_links_holds_no_secret_a_cell_printed(any_kernel):
    k = any_kernel
    secret = f"dk-secret-{uuid.uuid4().hex}"
    port = k.listen_port()
    with Capture() as cap:
        markers = send_markers()
        res = k.execute(f"print(bytes.fromhex({secret.encode().hex()!r}).decode())", timeout=60)
    assert res.status == "ok", error_text(res)
    assert res.stream() == secret + "\n"  # it went through, merged once
    # the capture works: it saw plaintext sent across the links, and the kernel's own traffic
    assert_capture_sees_markers(cap, markers)
    to_parent, from_parent = cap.tcp_bytes(port)
    assert to_parent > 0 and from_parent > 0, (to_parent, from_parent)
    assert not cap.holds(secret), "the printed secret crossed the lab's links in clear"
    assert not cap.holds(secret.encode().hex()), "the cell's code crossed the lab's links in clear"


def test_the_keys_the_nodes_were_given_never_crossed_the_network_in_clear(any_kernel):
    """The capture ran from before the kernel started to the end of its first cell: the keys went
    to the nodes in that window (the ranks' HMAC keys travel in the same bootstrap line as the
    node's CurveZMQ secret key). Nor did the notebook client's own key."""
    k = any_kernel
    cap = k.startup_capture
    assert cap is not None and cap.frames
    assert cap.tcp_bytes(k.listen_port()) != (0, 0), "the startup capture saw none of the kernel's traffic"
    keys = {}
    for ns in NODES:
        for p in k.ranks_on(ns):
            keys[f"HMAC key of rank pid {p.pid} on {ns}"] = connection_file_of(p)["key"]
    keys["the notebook client's HMAC key"] = k.km.session.key.decode()
    assert len(keys) == k.world + 1 and all(len(v) >= 16 for v in keys.values()), keys
    leaked = [what for what, key in keys.items() if cap.holds(key)]
    assert not leaked, f"in clear on the lab's links during startup: {leaked}"
