"""The gang launcher of ranks on other machines: the parent's end of the node agents' connections.

A node starter (:mod:`dist_kernel.parent.launch.node_starters`: srun or ssh) starts one node
agent per machine. The parent listens on ``--listen`` (an :class:`AgentListener`: CurveZMQ,
one admitted client key; the wire format is :mod:`dist_kernel.tunnel`). Each node's agent
connects out, says hello, starts its ranks when told, and relays their Jupyter messages. The
listener is read on the kernel's event loop: a remote rank's channel hands its frames
straight to the listener's socket and gets the rank's frames straight from it (a
:class:`RemoteWire`), with no socket or thread in between. The same loop beats to the nodes
and notices a node that went silent.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import zmq
import zmq.auth.thread

from dist_kernel import tunnel
from dist_kernel.exceptions import ConfigError, RankStartError
from dist_kernel.options import KernelConfig
from dist_kernel.parent.channels import Wire, pending, zmq_fd
from dist_kernel.parent.fault_policy import RemoteCause
from dist_kernel.parent.launch.base import GangLauncher
from dist_kernel.parent.launch.node_starters import default_listen, make_node_starter, node_starter_class
from dist_kernel.parent.launch.node_starters.base import NodeStarter
from dist_kernel.parent.launch.node_starters.slurm import SrunEvent, munge_socket
from dist_kernel.processes import describe_exit

#: a node whose agent has not said hello this long after its node starter started it (or left
#: the queue) is a wiring mistake, reported well before --startup-timeout
CONNECT_TIMEOUT = 30.0
#: messages read from the listener per turn of the loop (a flood must not starve the rest)
_BATCH = 200


class _Admit:
    """ZAP: admit exactly the client key this kernel start made."""

    def __init__(self, public: str) -> None:
        self.public = public.encode()

    def callback(self, domain: str, key: bytes) -> bool:  # domain unused; key: z85, from pyzmq's ZAP
        return hmac.compare_digest(key, self.public)


@dataclass
class Node:
    """One node, as the parent knows it."""

    index: int
    host: str = ""
    address: str = ""
    pid: int = 0
    last_heard: float = 0.0
    hello: dict = field(default_factory=dict)
    lost: str = ""


class AgentListener:
    """The parent's listener for the node agents, read on the kernel's event loop (named apart
    from :mod:`dist_kernel.tunnel`, the wire format that both ends share)."""

    def __init__(self, config: KernelConfig, keys: dict[str, str],
                 on_event: Callable[[int, dict], None], log: logging.Logger) -> None:
        self.config = config
        self.keys = keys
        self.on_event = on_event
        self.log = log
        self.ctx = zmq.Context()
        self.auth = zmq.auth.thread.ThreadAuthenticator(self.ctx)
        self.auth.start()
        self.auth.configure_curve_callback(tunnel.ZAP_DOMAIN, _Admit(keys["client_public"]))
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.curve_server = True
        self.router.curve_secretkey = keys["server_secret"].encode()
        self.router.curve_publickey = keys["server_public"].encode()
        self.router.zap_domain = tunnel.ZAP_DOMAIN.encode()
        self.router.router_mandatory = False
        self.router.sndhwm = self.router.rcvhwm = 0
        self.router.linger = 0
        self.nodes: dict[int, Node] = {}
        #: rank -> where its channel takes its frames (channel name, frames)
        self._wires: dict[int, Callable[[str, list[bytes]], None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._beat: asyncio.TimerHandle | None = None
        self._closed = False
        self.sampling = False  # the beats ask the agents for their ranks' load (%dist_top)

    def bind(self, address: str) -> int:
        """Listen on ``address`` (a port from --port-range if given); the port."""
        rng = self.config.port_range
        if rng is None:
            return self.router.bind_to_random_port(f"tcp://{address}")
        for port in range(rng[0], rng[1] + 1):
            try:
                self.router.bind(f"tcp://{address}:{port}")
                return port
            except zmq.ZMQError:
                continue
        raise RankStartError(f"no free port in --port-range {rng[0]}-{rng[1]} on {address}. Fix: widen "
                             "--port-range (the parent needs one port, rank 0's rendezvous another), then restart.")

    def start(self) -> None:
        """Read the listener and beat, on the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(zmq_fd(self.router), self._drain)
        self._loop.call_soon(self._drain)
        self._tick()

    # ------------------------------------------------------- a remote rank's wire
    def attach(self, rank: int, deliver: Callable[[str, list[bytes]], None]) -> None:
        self._wires[rank] = deliver

    def detach(self, rank: int) -> None:
        self._wires.pop(rank, None)

    def send_msg(self, rank: int, channel: str, frames: list) -> None:
        """One Jupyter message to a rank, through its node's agent."""
        self._to_node(self.config.node_of(rank), [tunnel.MSG, str(rank).encode(), channel.encode(), *frames])

    # ------------------------------------------------------- control
    def send_ctl(self, node: int, event: dict) -> None:
        """A control event for a node; from another thread it is handed to the loop."""
        frames = tunnel.pack_ctl(self.keys["hmac_key"], event)
        loop = self._loop
        if loop is not None and loop.is_running() and not _in_loop(loop):
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._to_node, node, frames)
            return
        self._to_node(node, frames)

    def close(self) -> None:
        """Stop reading and beating, close the listener; from any thread."""
        loop = self._loop
        if loop is not None and loop.is_running() and not _in_loop(loop):
            done = threading.Event()

            def close_there() -> None:
                self._close()
                done.set()

            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(close_there)
                done.wait(2)
        self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._beat is not None:
            self._beat.cancel()
        loop = self._loop
        if loop is not None and not loop.is_closed() and _in_loop(loop):
            with contextlib.suppress(Exception):
                loop.remove_reader(zmq_fd(self.router))
        with contextlib.suppress(Exception):
            self.auth.stop()
        with contextlib.suppress(Exception):
            self.ctx.destroy(linger=0)

    # ------------------------------------------------------- on the loop
    def _tick(self) -> None:
        """Every BEAT_INTERVAL: beat to each node, and call a node that fell silent lost. What
        waits in the listener is read first: a loop that was busy for a moment heard nothing."""
        if self._closed:
            return
        self._drain(again=False)
        now = time.monotonic()
        for node in self.nodes.values():
            if node.lost:
                continue
            self._to_node(node.index, tunnel.pack_ctl(self.keys["hmac_key"], {"type": "beat", "sample": self.sampling}))
            if now - node.last_heard > tunnel.LOST_AFTER:
                node.lost = f"silent for {now - node.last_heard:.1f}s"
                self.on_event(node.index, {"type": "lost", "silent": now - node.last_heard})
        assert self._loop is not None
        self._beat = self._loop.call_later(tunnel.BEAT_INTERVAL, self._tick)

    def _drain(self, again: bool = True) -> None:
        """Handle what the listener holds, at most ``_BATCH`` messages per turn of the loop."""
        if self._closed:
            return
        try:
            for _ in range(_BATCH):
                if not pending(self.router):
                    return
                frames = self.router.recv_multipart(zmq.NOBLOCK)
                try:
                    self._from_node(frames)
                except Exception:  # one bad frame never stops the reading
                    self.log.exception("listener: dropped a frame")
        except zmq.ZMQError:
            return
        if again and self._loop is not None:  # more may wait: ZMQ's descriptor signals edges
            self._loop.call_soon(self._drain)

    def _to_node(self, node: int, frames: list) -> None:
        if self._closed:
            return
        with contextlib.suppress(zmq.ZMQError):
            self.router.send_multipart([f"node{node}".encode(), *frames])
        if self._loop is not None and _in_loop(self._loop):
            self._loop.call_soon(self._drain)  # a send can swallow the descriptor's edge

    def _from_node(self, frames: list[bytes]) -> None:
        ident, kind, *rest = frames
        try:
            index = int(ident.decode().removeprefix("node"))
        except ValueError:
            return
        if kind == tunnel.MSG and len(rest) >= 2:
            node = self.nodes.get(index)
            if node is not None:
                node.last_heard = time.monotonic()
            rank, name, *msg = rest
            deliver = self._wires.get(int(rank))
            if deliver is not None and name in tunnel.CHANNELS:
                deliver(name.decode(), msg)
            return
        if kind != tunnel.CTL:
            return
        try:
            event = tunnel.unpack_ctl(self.keys["hmac_key"], rest, tunnel.FROM_NODE)
        except tunnel.TunnelError as e:
            self.log.warning("listener: node %d: %s", index, e)
            return
        node = self.nodes.setdefault(index, Node(index))
        node.last_heard = time.monotonic()
        if event["type"] == "hello":
            node.host, node.address, node.pid, node.hello = (str(event.get("host", "")), str(event.get("address", "")),
                                                             int(event.get("pid", 0)), event)
        self.on_event(index, event)


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class RemoteWire:
    """A remote rank's channels: its frames go straight into the listener, and come straight
    out of it, tagged with the rank and the channel (see :mod:`dist_kernel.tunnel`)."""

    def __init__(self, listener: AgentListener, rank: int) -> None:
        self.listener = listener
        self.rank = rank

    def connect(self, identity: bytes) -> None:
        """Nothing to connect: the agent's sockets on the node carry the identity it gives them."""

    def open(self, deliver: Callable[[str, list[bytes]], None]) -> None:
        self.listener.attach(self.rank, deliver)

    def send(self, channel: str, frames: list) -> None:
        self.listener.send_msg(self.rank, channel, frames)

    def close(self) -> None:
        self.listener.detach(self.rank)


class RemoteRank:
    """A rank on another machine: what its node's agent says about it; signals go through the
    agent (provisioner method names, as :class:`~dist_kernel.parent.launch.base.RankHandle`)."""

    def __init__(self, rank: int, node: Node, listener: AgentListener, key: str, pid: int) -> None:
        self.rank = rank
        self.node = node
        self.listener = listener
        self.key = key
        self._pid = pid
        self.returncode: int | None = None
        self.state = ""
        self.log = ""
        self.gone = ""  # why the rank is gone without an exit code (its node was lost)
        self.load: dict | None = None  # its agent's latest load sample (dist_kernel.load), while sampled

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def host(self) -> str:
        return self.node.host

    @property
    def address(self) -> str:
        return self.node.address

    async def poll(self) -> int | None:
        return self.returncode

    async def send_signal(self, signum: int) -> None:
        self.listener.send_ctl(self.node.index, {"type": "signal", "rank": self.rank, "signum": int(signum)})

    async def kill(self) -> None:
        await self.send_signal(signal.SIGKILL)

    async def terminate(self) -> None:
        await self.send_signal(signal.SIGTERM)

    def exit_reason(self) -> str:
        if self.gone:
            return self.gone
        return describe_exit(self.returncode) if self.returncode is not None else ""

    def os_state(self) -> str:
        return self.state

    def log_tail(self, lines: int = 30) -> str:
        return "".join(self.log.splitlines(keepends=True)[-lines:])

    def wire(self) -> tuple[dict, Wire]:
        return {"key": self.key, "signature_scheme": "hmac-sha256"}, RemoteWire(self.listener, self.rank)


class RemoteLauncher(GangLauncher):
    """Starts the node agents (through the node starter that ``--launcher`` names: Slurm or SSH),
    waits for them, and hands out their ranks.

    ``on_note`` gets progress for the first cell (waiting in the Slurm queue, ...); faults that
    take the gang (a node lost, an agent ending, a rank that exited, the node starter gone) go to
    :attr:`on_fault`."""

    watches = True  # the agents' beats and exit events reach on_change (see _track)

    def __init__(self, config: KernelConfig, runtime_dir: str, extra_argv: list[str], log: logging.Logger,
                 on_note: Callable[[str], None]) -> None:
        self.config = config
        self.runtime_dir = runtime_dir
        self.extra_argv = extra_argv
        self.log = log
        self.on_note = on_note
        self.wave = config.world_size  # the agents start their node's ranks themselves
        self.keys = tunnel.new_secrets()
        self.keys["rank_keys"] = {str(r): os.urandom(32).hex() for r in range(config.world_size)}  # type: ignore[assignment]
        self.listener: AgentListener | None = None
        self.node_starter: NodeStarter | None = None
        self.processes: dict[int, RemoteRank] = {}
        self.master: tuple[str, int] | None = None
        self.endpoint = ""
        self._events: asyncio.Queue = asyncio.Queue()
        self._queued = False
        self._launched_at = 0.0
        self._munge = False
        self._fresh_keys: Callable[[], bytes] = bytes
        self.stopped = False

    def _on_event(self, node: int, event: dict) -> None:
        kind = event["type"]
        if kind in ("beat", "exited", "lost", "ending"):
            self._track(node, event)
        if not self.processes or kind in ("hello", "started", "failed"):
            self._events.put_nowait((node, event))

    def _on_queue(self, event: SrunEvent) -> None:
        """What srun says of the job: while it is queued the connect timeout does not run."""
        if event.kind == "queued":
            self._queued = True
        elif self._queued:  # out of the queue: the connect timeout counts from now
            self._queued = False
            self._launched_at = time.monotonic()
            if self._munge and self.node_starter is not None:
                with contextlib.suppress(Exception):  # the first credentials may have expired meanwhile
                    self.node_starter.send(self._fresh_keys())

    async def start(self, ranks: int) -> AsyncIterator[RemoteRank]:
        processes = await self.launch_all()
        for rank in range(ranks):
            yield processes[rank]

    async def launch_all(self) -> dict[int, RemoteRank]:
        """Start the agents and their ranks; raises :class:`RankStartError` naming the node and address."""
        cfg = self.config
        starter = node_starter_class(cfg)
        starter.check(cfg)
        address = default_listen(cfg)
        try:  # ZMQ binds to addresses, not names; the nodes then connect to that address too
            address = socket.gethostbyname(address)
        except OSError as e:
            raise ConfigError(f"--listen {address}: cannot resolve it ({e}). Fix: give an IP address of this "
                              "machine that the nodes can reach, then restart the kernel.") from None
        self.listener = AgentListener(cfg, self.keys, self._on_event, self.log)
        try:
            port = self.listener.bind(address)
        except zmq.ZMQError as e:
            raise ConfigError(f"--listen {address}: cannot listen there ({e}). Fix: give an address of this "
                              "machine that the nodes can reach, then restart the kernel.") from None
        self.endpoint = f"tcp://{address}:{port}"
        self.listener.start()
        boot = tunnel.Bootstrap(
            server_key=self.keys["server_public"], client_public=self.keys["client_public"],
            client_secret=self.keys["client_secret"], hmac_key=self.keys["hmac_key"],
            rank_keys=dict(self.keys["rank_keys"]), nodes=cfg.nodes, ranks_per_node=cfg.ranks_per_node,  # type: ignore[arg-type]
            gpus=list(cfg.gpus), port_range=list(cfg.port_range) if cfg.port_range else None,
            extra_argv=list(self.extra_argv), parent_pid=os.getpid(), parent_host=socket.gethostname(),
            cwd=os.getcwd(), pythonpath=os.environ.get("PYTHONPATH", ""))

        # srun's stdin crosses the network in clear: wrap the keys in MUNGE credentials, one per
        # node (nodes may share one munged, which decodes each credential once)
        self._munge = starter.munge_keys
        munge_path = munge_socket() if self._munge else None

        def keys() -> bytes:
            if not self._munge:
                return boot.encode()
            try:
                return b"".join(tunnel.munge_wrap(boot.encode(), munge_path) for _ in range(cfg.nodes))
            except (OSError, tunnel.TunnelError) as e:
                raise RankStartError(f"cannot protect the keys for the nodes with MUNGE: {e}. Fix: run the kernel "
                                     "on a machine of the Slurm cluster (munge installed, munged running).") from None

        self._fresh_keys = keys

        def agent_argv(node: int | None) -> list[str]:
            argv = [sys.executable, "-m", "dist_kernel.node", "--parent", self.endpoint]
            if self._munge:
                argv += ["--munge", *(["--munge-socket", munge_path] if munge_path else [])]
            return argv + (["--node-rank", str(node)] if node is not None else [])

        self.node_starter = make_node_starter(cfg, agent_argv, self.runtime_dir, self.log, self.on_note,
                                              on_queue=self._on_queue)
        self._launched_at = time.monotonic()
        await self.node_starter.start(keys())

        hellos = await self._gather("hello", lambda n: f"node {n} never connected to the parent at {self.endpoint}")
        master_addr = hellos[0]["address"]
        master_port = int(hellos[0]["master_port"])  # the kernel's TCPStore, held for its life
        user_port = int(hellos[0].get("user_port", master_port))  # the ranks' MASTER_PORT: free for env://
        self.master = (master_addr, master_port)
        job = next((h.get("job") for h in hellos.values() if h.get("job")), None)
        if job:
            self.node_starter.note_job(str(job))
        for n in range(cfg.nodes):
            self.listener.send_ctl(n, {"type": "start", "master_addr": master_addr, "master_port": user_port})
        started = await self._gather("started", lambda n: f"node {n} ({self._host(n)}) did not start its ranks")
        for n, event in started.items():
            for rank_text, pid in event["ranks"].items():
                rank = int(rank_text)
                self.processes[rank] = RemoteRank(rank, self.listener.nodes[n], self.listener,
                                                  self.keys["rank_keys"][rank_text], int(pid))
        return self.processes

    def store(self, generation: int) -> str:
        """Rank 0's TCPStore on its node's cluster address, a prefix per formation."""
        assert self.master is not None
        addr, port = self.master
        return f"tcp://{addr}:{port}/gen{generation}"

    def _host(self, node: int) -> str:
        n = self.listener.nodes.get(node) if self.listener else None
        if n is not None and n.host:
            return n.host
        hosts = self.node_starter.hosts() if self.node_starter is not None else None
        return hosts[node] if hosts and node < len(hosts) else "host unknown"

    async def _gather(self, kind: str, missing_words: Callable[[int], str]) -> dict[int, dict]:
        """Wait for one ``kind`` event from every node; a clear error for a node starter that
        failed or a node that stays silent past CONNECT_TIMEOUT."""
        got: dict[int, dict] = {}
        while len(got) < self.config.nodes:
            failure = self.node_starter.failure() if self.node_starter is not None else None
            if failure:
                assert self.node_starter is not None  # only a starter fails
                # what an agent said of the wiring (no route, unreachable parent) comes first
                said = [ln.split(": ", 1)[1] for ln in self.node_starter.tail() if "dist_kernel node agent on" in ln]
                if said:  # then the starter's own words add only how it ended
                    failure = "\n".join([*dict.fromkeys(said), failure.split(":", 1)[0] + "."])
                raise RankStartError(f"The node agents could not start:\n{failure}\n{self._fix()}")
            waited = time.monotonic() - self._launched_at
            if not self._queued and waited > CONNECT_TIMEOUT:
                missing = [n for n in range(self.config.nodes) if n not in got]
                raise RankStartError("; ".join(missing_words(n) for n in missing)
                                     + f" within {CONNECT_TIMEOUT:.0f}s.\n{self._fix()}")
            try:
                node, event = await asyncio.wait_for(self._events.get(), 0.5)
            except asyncio.TimeoutError:
                continue
            if event["type"] == "failed":
                raise RankStartError(f"node {node} ({self._host(node)}): {event.get('error')}\n{self._fix()}")
            if event["type"] == kind:
                got[node] = event
        return got

    def _fix(self) -> str:
        return (f"Fix: check that every node can reach this machine at {self.endpoint} (--listen, "
                "--port-range, firewalls), that `python -m dist_kernel.node` runs there with the same "
                f"python ({sys.executable}), and that --nodes matches the allocation; then restart the kernel.")

    def _track(self, node: int, event: dict) -> None:
        """Beats, exits and a lost node, as they change what the parent knows of each rank."""
        kind = event["type"]
        if kind == "beat":
            for rank_text, st in event.get("ranks", {}).items():
                proc = self.processes.get(int(rank_text))
                state = str(st.get("state") or "")
                if proc is not None:
                    proc.load = st.get("load")  # present only while the parent asks (sample)
                if proc is not None and proc.state != state:
                    proc.state = state
                    self.on_change(proc)
            return
        if self.stopped:
            return
        host = self._host(node)
        ranks = tuple(r for r, p in self.processes.items() if p.node.index == node)
        if kind == "exited":
            # a rank exited (the OOM killer, a crash): reported as on one machine, then the ranks
            # on every node are stopped (a group cannot go on without it)
            proc = self.processes.get(int(event["rank"]))
            if proc is not None and proc.returncode is None:
                proc.log = str(event.get("log") or "")
                proc.returncode = code = int(event["code"])
                self.on_change(proc)
                # SIGTERM comes from outside (scancel, a time limit): the agent's own word names it better
                self.on_fault(RemoteCause("terminated" if code == -signal.SIGTERM else "exited",
                                          f"rank {proc.rank} on {proc.host} {describe_exit(code)}", (proc.rank,)))
        elif kind == "ending":
            self.on_fault(RemoteCause("ending", f"the node agent on node {node} ({host}) is ending its ranks: "
                                                f"{event.get('reason')}", ranks))
        elif kind == "lost":
            for r in ranks:
                self.processes[r].gone = f"was lost with its node {host} (silent for {event['silent']:.0f}s)"
            self.on_fault(RemoteCause("lost", f"node {node} ({host}) stopped answering for {event['silent']:.0f}s "
                                              "(link down, the node agent killed, or the Slurm job ended)", ranks))

    def sample(self, on: bool) -> None:
        if self.listener is not None:
            self.listener.sampling = on

    def failure(self) -> str | None:
        if self.stopped or self.node_starter is None:
            return None
        return self.node_starter.failure()

    def state(self) -> dict:
        """The starter processes (srun, ssh) and the Slurm job: the ranks' pids mean nothing
        here, their agents end them."""
        if self.node_starter is None:
            return {"launchers": [], "slurm": None}
        return self.node_starter.state()

    def record(self) -> None:
        if self.node_starter is not None:
            self.node_starter.record()

    async def stop(self, now: bool = False) -> None:  # now unused: the agents end their ranks at once
        """Tell every agent to stop (they end their ranks), then end the node starter (srun/ssh) and the listener."""
        if self.node_starter is not None:
            self.node_starter.expect_exit()  # srun/ssh ending now is no failure
        if self.listener is not None and not self.stopped:
            self.stopped = True
            for n in range(self.config.nodes):
                self.listener.send_ctl(n, {"type": "stop"})
            await asyncio.sleep(0.3)  # the agents end their ranks; srun/ssh then end by themselves
        self.stopped = True
        if self.node_starter is not None:
            with contextlib.suppress(Exception):
                await self.node_starter.stop()
        if self.listener is not None:
            self.listener.close()

    def stop_now(self) -> None:
        """Last resort from any thread (atexit): stop the agents, end the node starter's processes."""
        self.stopped = True
        if self.listener is not None:
            for n in range(self.config.nodes):
                self.listener.send_ctl(n, {"type": "stop"})
            time.sleep(0.2)
        if self.node_starter is not None:
            with contextlib.suppress(Exception):
                self.node_starter.stop_sync()  # SIGTERM srun/ssh, scancel a job of our own
        if self.listener is not None:
            self.listener.close()
