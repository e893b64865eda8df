"""The node agent: one per machine of a multi-node kernel, started by a node starter (Slurm, ssh).

    python -m dist_kernel.node --parent tcp://ADDR:PORT [--node-rank I]

It reads its keys as one JSON line on stdin (:class:`dist_kernel.tunnel.keys.Bootstrap`), checks
that it can reach the parent, connects out to it (CurveZMQ), says hello, and once the parent
says ``start`` launches this node's ranks as ipykernels on IPC sockets in a private
directory, exactly as the parent does on one machine. From then on it relays each rank's
Jupyter messages both ways (the parent's as one message for several ranks, which it signs
with each rank's key; what the ranks say, checked and joined per turn, their cells' replies
summarised: :mod:`dist_kernel.tunnel`), beats
every half second with the ranks whose state changed, reports a rank that exits, and signals
ranks when the parent asks (the stop button).

It ends its ranks and itself when the parent says ``stop``, when its link to the parent has
been down for :data:`~dist_kernel.tunnel.LOST_AFTER` seconds (cut off, a SIGKILLed parent), or
when its stdin closes (the node starter's process ended). Each rank also dies with the agent
(``PR_SET_PDEATHSIG``), so a SIGKILLed agent leaves nothing behind either.

It imports no torch and nothing of the parent's kernel: it starts processes and moves bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import zmq

from dist_kernel import tunnel
from dist_kernel.load import LoadSampler, gpu_target
from dist_kernel.placement import rank_env, rank_of
from dist_kernel.processes import file_tail, proc_state
from dist_kernel.tunnel.keys import MUNGE_PREFIX, Bootstrap, munge_unwrap
from dist_kernel.tunnel.link import LinkWatch, agent_socket, interface_of, parse_endpoint, reach, route_address
from dist_kernel.tunnel.turns import Signer, Turn

#: how long the agent tries to reach the parent before it reports the address as unreachable
REACH_TIMEOUT = 10.0


def fail(message: str, code: int = 3) -> None:
    """A wiring mistake: one clear line on stderr (the node starter carries it to the parent), then exit."""
    print(f"dist_kernel node agent on {socket.gethostname()}: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def free_port(address: str, port_range: list[int] | None, avoid: tuple[int, ...]) -> int:
    """A port rank 0's rendezvous can bind on ``address``: from the range if one is given."""
    candidates = range(port_range[0], port_range[1] + 1) if port_range else [0] * 8
    for port in candidates:
        if port in avoid:
            continue
        with socket.socket() as s:
            try:
                s.bind((address, port))
            except OSError:
                continue
            found = s.getsockname()[1]
        if found not in avoid:
            return found
    raise OSError(f"no free port in {port_range[0]}-{port_range[1]} on {address}" if port_range else "no free port")


class RankChild:
    """One rank process on this node, and the sockets that relay its channels."""

    def __init__(self, rank: int, proc: subprocess.Popen, log_path: str, sockets: dict[bytes, zmq.Socket]) -> None:
        self.rank = rank
        self.proc = proc
        self.log_path = log_path
        self.sockets = sockets
        self.reported = False
        self.beaten: dict | None = None  # its state as the last beat told the parent

    def state(self) -> str:
        return proc_state(self.proc.pid)

    def log_tail(self, lines: int = 30) -> str:
        return file_tail(self.log_path, lines)

    def signal(self, signum: int) -> None:
        with contextlib.suppress(OSError):
            os.killpg(self.proc.pid, signum)  # the rank leads its own session: workers too


class NodeAgent:
    """Runs this node's ranks and relays them to the parent."""

    def __init__(self, parent: str, node: int, boot: Bootstrap) -> None:
        self.parent = parent
        self.node = node
        self.boot = boot
        self.host = socket.gethostname()
        self.ctx = zmq.Context()
        self.ranks: dict[int, RankChild] = {}
        self.runtime_dir = tempfile.mkdtemp(prefix=f"dk-node{node}-")  # mode 0700
        self.stdin_closed = threading.Event()
        self.link: LinkWatch | None = None  # the parent's connection, once connect() made it
        self.ending = ""
        #: the parent's beats ask for the ranks' load while a cell runs with %dist_top on; only then
        #: is anything sampled (psutil and NVML from here, never inside the ranks)
        self.sampling = False
        self.sampler: LoadSampler | None = None
        self.master: tuple[str, int | None] = ("", None)  # the ranks' MASTER_ADDR and MASTER_PORT
        self.retired: list[zmq.Socket] = []  # sockets of ranks started anew, closed by the loop
        self.signer = Signer(boot.rank_keys)  # the parent's fan messages, signed per rank
        self.turn = Turn(self.signer)  # what the ranks say in a turn: checked, joined, summarised
        self.beat_sampled = False  # the last beat carried loads: the next tells every rank without

    # ---------------------------------------------------------------- start
    def connect(self) -> None:
        host, port = parse_endpoint(self.parent)
        try:
            self.address = route_address(host, port)
        except OSError as e:
            fail(f"node {self.node} has no route to the parent at {host}:{port} ({e.strerror or e}). "
                 "Fix: start the kernel with --listen set to an address of the parent's machine that the nodes can reach.")
        error = reach(host, port, REACH_TIMEOUT)
        if error is not None:
            fail(f"node {self.node} cannot reach the parent at {host}:{port} ({error}). Fix: --listen must be "
                 "an address of the parent's machine that the nodes can reach (not loopback), and a firewall "
                 "must let the nodes connect to --port-range.")
        self.ifname = interface_of(self.address)
        sock = agent_socket(self.ctx, self.boot, self.node)
        self.link = LinkWatch(sock)
        sock.connect(self.parent)
        self.sock = sock
        hello = {"type": "hello", "node": self.node, "host": self.host, "address": self.address,
                 "ifname": self.ifname, "pid": os.getpid(), "job": os.environ.get("SLURM_JOB_ID"),
                 "step": os.environ.get("SLURM_STEP_ID")}
        if self.node == 0:  # rank 0 hosts the rendezvous on this node's cluster address
            hello["master_port"] = master_port = free_port(self.address, self.boot.port_range, avoid=(port,))
            # and MASTER_PORT is another free port: the kernel's TCPStore holds the first for its
            # life, so dist.init_process_group() by hand (env://, rank 0 binds MASTER_PORT) needs its own
            hello["user_port"] = free_port(self.address, self.boot.port_range, avoid=(port, master_port))
        self.send_ctl(hello)

    def cwd(self) -> str:
        """Where the ranks start: the parent's directory when this node has it (a shared
        filesystem), else the agent's own (under Slurm: the same; ssh: the login's home)."""
        return self.boot.cwd if self.boot.cwd and os.path.isdir(self.boot.cwd) else os.getcwd()

    def send_ctl(self, event: dict) -> None:
        self.sock.send_multipart(tunnel.pack_ctl(self.boot.hmac_key, event))

    def start_ranks(self, master_addr: str, master_port: int | None) -> None:
        self.master = (master_addr, master_port)
        for local in range(self.boot.ranks_per_node):
            self.start_rank(rank_of(self.node, local, self.boot.ranks_per_node))
        self.send_ctl({"type": "started", "node": self.node,
                       "ranks": {str(r): c.proc.pid for r, c in self.ranks.items()}})

    def respawn(self, rank: int) -> None:
        """The parent's ``respawn``: start a rank of this node that died anew, in its place
        (``%dist_respawn``); its relaying sockets are new, the old ones closed."""
        old = self.ranks.get(rank)
        if old is None or old.proc.poll() is None:
            raise RuntimeError(f"rank {rank} is {'running' if old else 'not on this node'}")
        self.retired += old.sockets.values()
        from dist_kernel.cleanup import kill_rank_processes  # what the dead one started ends with it

        kill_rank_processes(self.runtime_dir, rank, old.proc.pid,
                            [c.proc.pid for c in self.ranks.values() if c.proc.poll() is None])
        self.start_rank(rank)
        self.send_ctl({"type": "respawned", "rank": rank, "pid": self.ranks[rank].proc.pid})

    def start_rank(self, rank: int) -> None:
        """Start one rank process and the sockets that relay its channels."""
        from jupyter_client.connect import write_connection_file

        boot = self.boot
        master_addr, master_port = self.master
        ipc = os.path.join(self.runtime_dir, f"rank{rank}")
        cf = os.path.join(self.runtime_dir, f"rank{rank}.json")
        ports = tunnel.ipc_ports()
        write_connection_file(cf, transport="ipc", ip=ipc, key=boot.rank_keys[str(rank)].encode(),
                              signature_scheme="hmac-sha256", kernel_name="dist-kernel-rank",
                              shell_port=ports["shell_port"], iopub_port=ports["iopub_port"],
                              stdin_port=ports["stdin_port"], control_port=ports["control_port"],
                              hb_port=ports["hb_port"])
        env = rank_env(dict(os.environ), rank=rank, ranks_per_node=boot.ranks_per_node,
                       world_size=boot.world_size, master_addr=master_addr, master_port=master_port,
                       runtime_dir=self.runtime_dir, parent_pid=os.getpid(), gpus=boot.gpus,
                       ifname=self.ifname, kernel_pid=boot.parent_pid)
        if boot.pythonpath and "PYTHONPATH" not in os.environ:
            env["PYTHONPATH"] = boot.pythonpath
        log_path = os.path.join(self.runtime_dir, f"rank{rank}.log")
        with open(log_path, "ab") as log:  # appended: a respawned rank keeps its predecessor's words
            proc = subprocess.Popen([sys.executable, "-m", "dist_kernel.rank", "-f", cf, *boot.extra_argv],
                                    env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    start_new_session=True, cwd=self.cwd())
        sockets = {}
        identity = f"relay-{rank}".encode()  # one identity on shell and stdin: input() needs it
        for name, kind in ((b"shell", zmq.DEALER), (b"control", zmq.DEALER), (b"stdin", zmq.DEALER),
                           (b"iopub", zmq.SUB)):
            s = self.ctx.socket(kind)
            s.linger = 0
            s.sndhwm = s.rcvhwm = 0
            if kind == zmq.SUB:
                s.setsockopt(zmq.SUBSCRIBE, b"")
            else:
                s.setsockopt(zmq.IDENTITY, identity)
            s.connect(tunnel.ipc_endpoint(ipc, name))
            sockets[name] = s
        self.ranks[rank] = RankChild(rank, proc, log_path, sockets)

    # ----------------------------------------------------------------- loop
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        link = self.link
        assert link is not None, "connect() first"
        poller.register(link.monitor, zmq.POLLIN)
        owners: dict[zmq.Socket, tuple[int, bytes]] = {}
        while not self.ending:
            for s in self.retired:  # a respawned rank's old sockets
                if s in owners:
                    poller.unregister(s)
                    del owners[s]
                s.close()
            self.retired.clear()
            for rank, child in self.ranks.items():
                for name, s in child.sockets.items():
                    if s not in owners:
                        owners[s] = (rank, name)
                        poller.register(s, zmq.POLLIN)
            for s, _ in poller.poll(100):
                if s is self.sock:
                    self.from_parent(self.sock.recv_multipart(copy=True))
                elif s is link.monitor:
                    link.read()
                else:
                    rank, name = owners[s]
                    self.turn.add(rank, name, s.recv_multipart(copy=True))
            for frames in self.turn.pack(self.boot.hmac_key):
                self.sock.send_multipart(frames)
            self.ending = link.turn(self.beat, self.stdin_closed.is_set(), "its node starter ended")

    def beat(self) -> None:
        """The ranks whose state changed since the last beat (all of them, with their load, while
        the parent samples, and once after): an idle parent does no work per rank."""
        states = {}
        every, self.beat_sampled = self.sampling or self.beat_sampled, self.sampling
        for rank, child in self.ranks.items():
            code = child.proc.poll()
            st = {"pid": child.proc.pid, "state": child.state(), "exit": code}
            if st != child.beaten or every:
                child.beaten = dict(st)
                states[str(rank)] = st
            if self.sampling and code is None:
                st["load"] = self.load(rank, child.proc.pid)
            if code is not None and not child.reported:
                child.reported = True
                self.send_ctl({"type": "exited", "rank": rank, "code": code, "log": child.log_tail()})
        if states or every:  # the parent hears of a lost node from its connection, not from beats
            self.send_ctl({"type": "beat", "ranks": states})

    def load(self, rank: int, pid: int) -> dict:
        """One rank's load sample (dist_kernel.load), its GPU named as this node sees it."""
        if self.sampler is None:
            self.sampler = LoadSampler()
        local = rank % self.boot.ranks_per_node
        return self.sampler.sample(pid, gpu_target(self.boot.gpus, local, os.environ.get("CUDA_VISIBLE_DEVICES")))

    def from_parent(self, frames: list[bytes]) -> None:
        if self.link is not None:
            self.link.heard()
        if frames[0] == tunnel.FAN:
            self.fan_out(frames[1:])
        elif frames[0] == tunnel.CTL:
            try:
                event = tunnel.unpack_ctl(self.boot.hmac_key, frames[1:], tunnel.TO_NODE)
            except tunnel.TunnelError:
                return
            self.control(event)

    def fan_out(self, frames: list[bytes]) -> None:
        """One message for some of this node's ranks: each rank's copy signed with its own key."""
        try:
            channel, headers, shared = tunnel.unfan(frames)
        except tunnel.TunnelError:
            return
        for rank, header in headers:
            child = self.ranks.get(rank)
            if child is not None and channel != b"iopub":
                child.sockets[channel].send_multipart(self.signer.message(rank, header, shared))

    def control(self, event: dict) -> None:
        """A control event of the parent's (verified): start, respawn, signal, stop, beat."""
        kind = event["type"]
        if kind in ("start", "respawn"):
            try:
                if kind == "start" and not self.ranks:
                    self.start_ranks(event["master_addr"], event.get("master_port"))
                elif kind == "respawn":
                    self.respawn(int(event["rank"]))
            except Exception as e:  # noqa: BLE001 - reported to the parent, which shows it
                said = {"type": "failed", "node": self.node} if kind == "start" else \
                    {"type": "respawn_failed", "rank": int(event["rank"])}
                self.send_ctl({**said, "error": f"{type(e).__name__}: {e}"})
        elif kind == "signal":
            child = self.ranks.get(int(event["rank"]))
            if child is not None:
                child.signal(int(event["signum"]))
        elif kind == "stop":
            self.ending = "the parent asked it to stop"
        elif kind == "beat":
            self.sampling = bool(event.get("sample"))

    # ------------------------------------------------------------------ end
    def close(self) -> None:
        """End every rank (its whole session), then remove the private directory."""
        for child in self.ranks.values():
            child.signal(signal.SIGTERM)
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and any(c.proc.poll() is None for c in self.ranks.values()):
            time.sleep(0.05)
        for child in self.ranks.values():
            child.signal(signal.SIGKILL)
            with contextlib.suppress(OSError):
                child.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(timeout=2)
        with contextlib.suppress(Exception):
            from dist_kernel.cleanup import kill_kernel_processes

            kill_kernel_processes(self.runtime_dir, [c.proc.pid for c in self.ranks.values()])
        shutil.rmtree(self.runtime_dir, ignore_errors=True)
        with contextlib.suppress(Exception):
            self.ctx.destroy(linger=0)


def read_bootstrap(munge: bool, socket_path: str | None, fd: int = 0) -> Bootstrap:
    """The keys from stdin: one JSON line (ssh), or MUNGE credential lines (Slurm), of which the
    first that decodes on this node wins: one may have expired in the queue, or (several nodes
    sharing one munged) been decoded by another node already."""
    errors: list[str] = []
    while True:
        line = _read_line(fd)
        if not line.strip():
            fail("no key line on stdin that decodes here"
                 + (f" ({'; '.join(dict.fromkeys(errors))})" if errors else "")
                 + ". Fix: the keys come from the parent's launcher; with Slurm, munged must run on every "
                 "node with the cluster's key", 2)
        if not munge:
            return Bootstrap.decode(line)
        if not line.startswith(MUNGE_PREFIX):
            fail("refused a key line that is not MUNGE-wrapped (this stdin crosses the network in clear)", 2)
        try:
            return Bootstrap.decode(munge_unwrap(line, socket_path))
        except tunnel.TunnelError as e:
            errors.append(str(e))


def _read_line(fd: int = 0) -> bytes:
    """The bootstrap line, read straight from the file descriptor: Python's buffered stdin
    would leave a lock held by the watcher thread at exit (a fatal error on shutdown)."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(fd, 1)
        if not chunk:
            break
        line += chunk
    return line


def _watch_stdin(closed: threading.Event, fd: int = 0) -> None:
    """stdin stays open while the node starter's process runs: its EOF means the parent is gone."""
    with contextlib.suppress(OSError):
        while os.read(fd, 4096):
            pass
    closed.set()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dist_kernel.node", description=__doc__.split("\n")[0])
    parser.add_argument("--parent", required=True, help="tcp://ADDR:PORT of the parent's listener")
    parser.add_argument("--node-rank", type=int, default=None, help="this node's rank (default: SLURM_NODEID)")
    parser.add_argument("--munge", action="store_true", help="the key lines are MUNGE credentials (Slurm)")
    parser.add_argument("--munge-socket", default=None, help="munged's socket (default: munged's own default)")
    args = parser.parse_args(argv)
    node = args.node_rank if args.node_rank is not None else int(os.environ.get("SLURM_NODEID", "-1"))
    if node < 0:
        fail("no node rank: pass --node-rank or run as a Slurm task (SLURM_NODEID)", 2)
    try:
        boot = read_bootstrap(args.munge, args.munge_socket)
    except tunnel.TunnelError as e:
        fail(str(e), 2)
    agent = NodeAgent(args.parent, node, boot)

    def on_signal(signum: int, _frame: object) -> None:
        # a cancelled job, its time limit, the node starter ending: the loop ends the ranks and says why
        agent.ending = (f"it got {signal.Signals(signum).name} (its job cancelled or out of time, "
                        "or its node starter ending)")
        if not hasattr(agent, "sock"):
            sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGHUP, on_signal)
    threading.Thread(target=_watch_stdin, args=(agent.stdin_closed,), daemon=True).start()
    try:
        agent.connect()
        agent.run()
        if agent.ending:
            print(f"dist_kernel node agent on {agent.host}: ending: {agent.ending}", file=sys.stderr, flush=True)
            with contextlib.suppress(Exception):  # the parent names the host and the cause at once
                agent.send_ctl({"type": "ending", "node": node, "reason": agent.ending})
    finally:
        agent.close()


if __name__ == "__main__":
    main()
