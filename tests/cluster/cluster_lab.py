"""The two-node Slurm + SSH lab of ``tests/cluster/lab.sh``, and what any test of it needs.

    from cluster_lab import lab_env
    env = lab_env()   # {"SLURM_CONF": ..., "LAB_SSH_OPTS": ..., "LAB_NODE_ADDRS": ..., ...}

:func:`lab_env` runs ``lab.sh up`` (idempotent; the first call in a session brings the lab up,
later calls reuse the answer) and returns the variables of its generated ``env.sh``. Where the
lab cannot be made here (not root, no namespaces: ``lab.sh`` exits 77) it calls
``pytest.skip`` with the lab's ``SKIP: ...`` line, every time it is called. Any other failure of
``up`` fails the test with the lab's output. The lab is never torn down here: other tests reuse
it, and a CI machine is discarded after the run (``bash tests/cluster/lab.sh down`` by hand).

Below that, the cluster lane's shared helpers: the options of a kernel on the lab, the processes
and TCP sockets in a node's namespace, a packet capture of the lab's links, Slurm's job table,
and what the node starters' tests hand their starters (a kernel on the lab: cluster_kernel.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import select
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from dist_kernel.options import KernelConfig

if TYPE_CHECKING:  # the unit lane imports this module too (tests/conftest.py): nothing heavy at run time
    from dist_kernel.parent.launch.node_starters.base import NodeStarter

ROOT = Path(__file__).resolve().parents[2]
LAB_SH = ROOT / "tests" / "cluster" / "lab.sh"

_cached: dict[str, str] | None = None
_skip_reason: str | None = None


def lab_dir() -> Path:
    return Path(os.environ.get("LAB_DIR", "/run/dk-cluster-lab"))


_held: dict[str, int] = {}  # "fd": the open lock file while this process holds the lab


def hold_lab() -> None:
    """Have the lab to this test session alone, waiting for any other session that has it (a
    second copy of the suite on the same machine, issue 20: its link-cut test would cut our
    nodes too, and ``lab.sh up`` needs them idle). ``lab.sh up`` and ``down`` take the same lock;
    ``LAB_LOCK_HELD`` tells the ones this session runs that it is held. Where the lock file
    cannot be made (not root: no lab either) nothing is held."""
    if "fd" in _held:
        return
    try:
        fd = os.open(f"{lab_dir()}.lock", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError:
        return
    fcntl.flock(fd, fcntl.LOCK_EX)
    _held["fd"] = fd
    os.environ["LAB_LOCK_HELD"] = "1"


def release_lab() -> None:
    """Let another session have the lab (this one's cluster tests are over)."""
    fd = _held.pop("fd", None)
    if fd is not None:
        os.environ.pop("LAB_LOCK_HELD", None)
        os.close(fd)


def lab_env() -> dict[str, str] | None:
    """Bring the lab up (once per session) and return env.sh's ``LAB_*`` and ``SLURM_CONF``."""
    global _cached, _skip_reason
    if _cached is not None:
        return dict(_cached)
    if _skip_reason is not None:
        pytest.skip(_skip_reason)
    p = subprocess.run(["bash", str(LAB_SH), "up"], capture_output=True, text=True, timeout=600)
    if p.returncode == 77:
        _skip_reason = next((ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("SKIP:")),
                            "SKIP: tests/cluster/lab.sh up cannot make the lab here")
        pytest.skip(_skip_reason)
    if p.returncode != 0:
        pytest.fail(f"tests/cluster/lab.sh up failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    env_sh = lab_dir() / "env.sh"
    out = subprocess.run(["bash", "-c", 'set -a; . "$0"; env -0', str(env_sh)], capture_output=True,
                         check=True, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}).stdout
    env = dict(kv.split("=", 1) for kv in out.decode().split("\0") if "=" in kv)
    _cached = {k: v for k, v in env.items() if k.startswith("LAB_") or k == "SLURM_CONF"}
    return dict(_cached)


def netns_pids(ns: str) -> set[int]:
    """The pids in a lab node's network namespace (``ip netns pids``)."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10).stdout
    return {int(p) for p in out.split()}


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


# ====================================================================== kernels on the lab
NODES = {"n1": "10.77.0.11", "n2": "10.77.0.12"}
HEAD = "10.77.0.1"
LAB_IFACES = ("dklab0", "dklabh1", "dklabh2")  # the bridge and the root-side ends of the nodes' links
SLURM_ENV = {**os.environ, "SLURM_CONF": os.path.join(os.environ.get("LAB_DIR", "/run/dk-cluster-lab"), "slurm.conf")}


def kernel_env(lab: dict[str, str]) -> dict[str, str]:
    """What the parent kernel needs in its environment for either launcher."""
    return {"SLURM_CONF": lab["SLURM_CONF"], "DIST_KERNEL_SSH_OPTS": lab["LAB_SSH_OPTS"]}


SLURM_OPTS = ("--launcher", "slurm", "--nodes", "2", "--ranks-per-node", "2", "--listen", HEAD)
SSH_OPTS = ("--launcher", "ssh", "--hosts", ",".join(NODES.values()), "--ranks-per-node", "1", "--listen", HEAD)


# ============================================================== processes in the namespaces
@dataclass(frozen=True)
class NsProc:
    ns: str
    pid: int
    cmdline: str
    argv: tuple[str, ...] = ()

    def runs_module(self, module: str) -> bool:
        """A Python process started as ``python -m module`` (not a shell that wraps one)."""
        a = self.argv
        return bool(a) and "python" in os.path.basename(a[0]) and any(
            a[i] == "-m" and a[i + 1] == module for i in range(len(a) - 1))

    @property
    def ours(self) -> bool:
        """A dist_kernel process: a node agent or a rank."""
        return "dist_kernel" in self.cmdline


def ns_procs(ns: str) -> list[NsProc]:
    """Every process in node namespace ``ns`` (``ip netns pids``) with its command line."""
    procs = []
    for pid in sorted(netns_pids(ns)):
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and raw:  # a zombie is dead: it only waits for its parent to reap it
            argv = tuple(raw.decode(errors="replace").rstrip("\0").split("\0"))
            procs.append(NsProc(ns, pid, " ".join(argv), argv))
    return procs


def our_procs(exclude: set[int] = frozenset()) -> list[NsProc]:
    """dist_kernel processes (agents, ranks) in any node namespace, except pids in ``exclude``."""
    return [p for ns in NODES for p in ns_procs(ns) if p.ours and p.pid not in exclude]


def rank_procs(ns: str) -> list[NsProc]:
    return [p for p in ns_procs(ns) if p.runs_module("dist_kernel.rank")]


def agent_procs(ns: str) -> list[NsProc]:
    return [p for p in ns_procs(ns) if p.runs_module("dist_kernel.node")]


def wait_until(pred, timeout: float, step: float = 0.1):
    """``pred()`` once it is truthy, or its last value after ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() > end:
            return v
        time.sleep(step)


@dataclass(frozen=True)
class Sock:
    ns: str
    state: str
    addr: str
    port: int
    peer: str
    peer_port: int | None
    pid: int | None
    comm: str


_SS_USER = re.compile(r'\("([^"]*)",pid=(\d+),fd=\d+\)')


def _hostport(text: str) -> tuple[str, int | None]:
    host, _, port = text.rpartition(":")
    host = host.strip("[]").removeprefix("::ffff:")
    return host, int(port) if port.isdigit() else None


def tcp_sockets(ns: str) -> list[Sock]:
    """Every TCP socket in a node namespace (``ip netns exec ns ss -tanpH``; psutil would read this
    process's own namespace), one row per owning process."""
    out = []
    cmd = ["ip", "netns", "exec", ns, "ss", "-tanpH"]
    for line in subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines():
        cols = line.split()
        if len(cols) < 5:
            continue
        (addr, port), (peer, peer_port) = _hostport(cols[3]), _hostport(cols[4])
        for comm, pid in _SS_USER.findall(line) or [("?", None)]:
            out.append(Sock(ns, cols[0], addr, port or 0, peer, peer_port, int(pid) if pid else None, comm))
    return out


def listeners(ns: str) -> list[Sock]:
    """The TCP listeners in node namespace ``ns``."""
    return [x for x in tcp_sockets(ns) if x.state == "LISTEN"]



# ============================================================================ packet capture
@dataclass
class Capture:
    """Every frame on the lab's links (bridge + the nodes' veths), read with AF_PACKET sockets in
    a thread: raw bytes to search for secrets, and TCP/UDP payload per flow to prove the capture
    sees what it should. Loopback (our own client <-> parent traffic) is not captured."""

    ifaces: tuple[str, ...] = LAB_IFACES
    frames: list[tuple[str, bytes]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> Capture:
        self._socks = []
        for name in self.ifaces:
            s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(0x0003))  # ETH_P_ALL
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
            s.bind((name, 0))
            self._socks.append((name, s))
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        by_fd = {s.fileno(): (n, s) for n, s in self._socks}
        while not self._stop.is_set():
            ready, _, _ = select.select(list(by_fd), [], [], 0.05)
            for fd in ready:
                name, s = by_fd[fd]
                with contextlib.suppress(BlockingIOError):
                    self.frames.append((name, s.recv(65535)))

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.3)  # frames in flight
        self._stop.set()
        assert self._thread is not None
        self._thread.join(5)
        for _, s in self._socks:
            s.close()

    def packets(self) -> Iterator[tuple[str, int, str, int, str, int, bytes]]:
        """(iface, proto, src, sport, dst, dport, payload) of every IPv4 TCP/UDP frame."""
        for name, f in self.frames:
            if len(f) < 34 or f[12:14] != b"\x08\x00":
                continue
            ip = f[14:]
            ihl = (ip[0] & 15) * 4
            proto, src, dst = ip[9], socket.inet_ntoa(ip[12:16]), socket.inet_ntoa(ip[16:20])
            total = struct.unpack("!H", ip[2:4])[0]
            l4 = ip[ihl:total]
            if proto == 6 and len(l4) >= 20:
                sport, dport = struct.unpack("!HH", l4[:4])
                yield name, proto, src, sport, dst, dport, l4[(l4[12] >> 4) * 4:]
            elif proto == 17 and len(l4) >= 8:
                sport, dport = struct.unpack("!HH", l4[:4])
                yield name, proto, src, sport, dst, dport, l4[8:]

    def tcp_bytes(self, port: int, host: str = HEAD) -> tuple[int, int]:
        """Payload bytes seen on the bridge to and from ``host:port`` (each frame once: dklab0 only)."""
        to = frm = 0
        for name, proto, src, sport, dst, dport, payload in self.packets():
            if name == "dklab0" and proto == 6:
                if (dst, dport) == (host, port):
                    to += len(payload)
                elif (src, sport) == (host, port):
                    frm += len(payload)
        return to, frm

    def blob(self) -> bytes:
        """Everything captured, raw frames and each TCP flow's payload joined (a secret split across
        two segments is found too)."""
        flows: dict[tuple, list[bytes]] = {}
        for name, proto, src, sport, dst, dport, payload in self.packets():
            if proto == 6 and payload:
                flows.setdefault((name, src, sport, dst, dport), []).append(payload)
        return b"\n".join([f for _, f in self.frames] + [b"".join(v) for v in flows.values()])

    def holds(self, secret: str | bytes) -> bool:
        s = secret.encode() if isinstance(secret, str) else secret
        return s in self.blob()



def send_udp_marker(marker: bytes, from_ns: str | None, dst: str) -> None:
    """A plaintext UDP datagram to ``dst``:9 (discard), from the root namespace or from node ``from_ns``."""
    code = (f"import socket; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); "
            f"[s.sendto({marker!r}, ({dst!r}, 9)) for _ in range(3)]")
    cmd = [sys.executable, "-c", code]
    subprocess.run(cmd if from_ns is None else ["ip", "netns", "exec", from_ns, *cmd], check=True, timeout=30)



def assert_capture_sees_markers(cap: Capture, markers: dict[str, bytes]) -> None:
    blob = cap.blob()
    missing = [where for where, m in markers.items() if m not in blob]
    assert not missing, f"the capture missed the plaintext markers sent {missing}: it does not see the lab's links"


def send_markers() -> dict[str, bytes]:
    markers = {"root -> n1": f"dk-marker-{uuid.uuid4().hex}".encode(),
               "n2 -> root": f"dk-marker-{uuid.uuid4().hex}".encode()}
    send_udp_marker(markers["root -> n1"], None, NODES["n1"])
    send_udp_marker(markers["n2 -> root"], "n2", HEAD)
    return markers



# ====================================================================== Slurm's jobs
_JOB = re.compile(r"JobId=(\d+) .*?JobState=(\S+) .*?AllocNode:Sid=\S*?:(\d+)")
#: job states squeue lists (a job that ended stays in scontrol's table for MinJobAge, 300 s)
QUEUED = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "SIGNALING",
          "STAGE_OUT", "STOPPED")


def job_table() -> dict[int, tuple[str, int]]:
    """{job id: (state, the session id of the process that asked for it)} from ``scontrol``."""
    out = subprocess.run(["scontrol", "-o", "show", "job"], capture_output=True, text=True, timeout=30, env=SLURM_ENV)
    assert out.returncode == 0, out.stderr
    return {int(m.group(1)): (m.group(2), int(m.group(3))) for m in map(_JOB.search, out.stdout.splitlines()) if m}


def environ_of(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


# ====================================================================== node starters under test
BOOTSTRAP = b'{"key": "s3cret-bootstrap"}\n'

# a stand-in node agent: reads the bootstrap line, reports it, waits for EOF on stdin
AGENT = ("import sys, os, socket\n"
         "line = sys.stdin.readline()\n"
         "print('got', socket.gethostname(), os.environ.get('SLURM_NODEID'), os.environ.get('SLURM_JOB_ID'),"
         " len(line), repr(sys.argv[1:]), flush=True, file=sys.stderr)\n"
         "sys.stdin.read()\n"
         "print('eof', socket.gethostname(), flush=True, file=sys.stderr)\n")
# a stuck one: reads the bootstrap, then never looks at stdin again (ignores EOF)
STUCK_AGENT = ("import sys, os, socket, time\n"
               "line = sys.stdin.readline()\n"
               "print('got', socket.gethostname(), os.environ.get('SLURM_NODEID'), os.environ.get('SLURM_JOB_ID'),"
               " len(line), flush=True, file=sys.stderr)\n"
               "time.sleep(600)\n")


def config(**kw) -> KernelConfig:
    """A kernel's configuration as options.py makes it (1 rank per node unless told)."""
    base = {"launcher": "slurm", "nodes": 2, "ranks_per_node": 1, "hosts": (), "slurm_args": (),
            "listen": None, "port_range": None, "startup_timeout": 30.0}
    cfg = {**base, **kw}
    return KernelConfig(world_size=cfg["nodes"] * cfg["ranks_per_node"], backend="gloo", **cfg)


def runtime(tmp_path: Path) -> str:
    """A runtime directory named as a live kernel's (this process's pid)."""
    d = tmp_path / f"dist_kernel-{os.getpid()}-launch"
    d.mkdir()
    return str(d)


def dead_pid() -> int:
    """A pid no process has now (one that just exited)."""
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


async def until(predicate, timeout: float, launcher: NodeStarter | None = None, allow_failure: bool = False):
    """Wait for ``predicate()``; a starter that fails meanwhile fails the test (unless allowed)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if launcher is not None and not allow_failure:
            assert launcher.failure() is None, launcher.failure()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; output: {launcher.tail() if launcher else ''}")
        await asyncio.sleep(0.05)
