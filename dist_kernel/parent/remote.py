"""Ranks on other machines: the parent's end of the node agents' connections.

The parent listens on ``--listen`` (CurveZMQ, one admitted client key; see
:mod:`dist_kernel.tunnel`). Each node's agent connects out, says hello, starts its ranks
when told, and relays their Jupyter messages. On this side each remote rank gets a stand-in
kernel: four IPC sockets in the private runtime dir (shell, control and stdin ROUTERs, an
IOPub PUB) that forward to and from the tunnel, so a plain jupyter_client client talks to
it exactly as to a local rank: channels, formation and fault handling do not change.

One thread moves the bytes (it also beats, and notices a node that went silent), and hands
control events to the kernel's event loop.
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
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.auth.thread
from jupyter_client.asynchronous import AsyncKernelClient

from dist_kernel import tunnel
from dist_kernel.exceptions import ConfigError, RankStartError
from dist_kernel.options import KernelConfig

#: a node whose agent has not said hello this long after its launcher started it (or left
#: the queue) is a wiring mistake, reported well before --startup-timeout
CONNECT_TIMEOUT = 30.0


class _NoHeartbeatClient(AsyncKernelClient):
    """A client of a stand-in kernel: liveness comes from the node's beats, not Jupyter's hb."""

    def start_channels(self, *args: object, **kwargs: object) -> None:
        kwargs["hb"] = False
        super().start_channels(*args, **kwargs)


class _Admit:
    """ZAP: admit exactly the client key this kernel start made."""

    def __init__(self, public: str) -> None:
        self.public = public.encode()

    def callback(self, domain: str, key: bytes) -> bool:  # noqa: ARG002 - key: z85, from pyzmq's ZAP
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


class Tunnel:
    """The parent's listener and the stand-in sockets of every remote rank; one thread."""

    def __init__(self, config: KernelConfig, keys: dict[str, str], runtime_dir: str,
                 on_event: Callable[[int, dict], None], log: logging.Logger) -> None:
        self.config = config
        self.keys = keys
        self.runtime_dir = runtime_dir
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
        self._stand_ins: dict[zmq.Socket, tuple[int, bytes]] = {}
        self._rank_sockets: dict[int, dict[bytes, zmq.Socket]] = {}
        self._client_id: dict[int, bytes] = {}
        self._commands = self.ctx.socket(zmq.PULL)
        self._commands.bind(f"inproc://dk-tunnel-{id(self)}")
        self._push = self.ctx.socket(zmq.PUSH)
        self._push.connect(f"inproc://dk-tunnel-{id(self)}")
        self._push_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

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

    def stand_in(self, rank: int) -> dict:
        """The stand-in kernel of a remote rank: its connection info for a jupyter_client client."""
        ip = os.path.join(self.runtime_dir, f"remote{rank}")
        sockets = {}
        for name, kind in ((b"shell", zmq.ROUTER), (b"control", zmq.ROUTER), (b"stdin", zmq.ROUTER),
                           (b"iopub", zmq.PUB)):
            s = self.ctx.socket(kind)
            s.linger = 0
            s.sndhwm = s.rcvhwm = 0
            s.bind(tunnel.ipc_endpoint(ip, name))
            sockets[name] = s
            self._stand_ins[s] = (rank, name)
        self._rank_sockets[rank] = sockets
        return {"transport": "ipc", "ip": ip, "signature_scheme": "hmac-sha256",
                "key": self.keys["rank_keys"][str(rank)],
                **tunnel.ipc_ports()}

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="dist_kernel-tunnel", daemon=True)
        self._thread.start()

    # ------------------------------------------------------- from other threads
    def send_ctl(self, node: int, event: dict) -> None:
        """Queue a control event for a node (thread-safe)."""
        with self._push_lock, contextlib.suppress(zmq.ZMQError):
            self._push.send_multipart([str(node).encode(), *tunnel.pack_ctl(self.keys["hmac_key"], event)])

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        with contextlib.suppress(Exception):
            self.auth.stop()
        with contextlib.suppress(Exception):
            self.ctx.destroy(linger=0)

    # --------------------------------------------------------------- the thread
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self._commands, zmq.POLLIN)
        registered: set[zmq.Socket] = set()
        next_beat = 0.0
        while not self._stop.is_set():
            for s in list(self._stand_ins):
                if s not in registered and self._stand_ins[s][1] != b"iopub":
                    poller.register(s, zmq.POLLIN)
                    registered.add(s)
            try:
                events = poller.poll(100)
            except zmq.ZMQError:
                return
            for s, _ in events:
                try:
                    if s is self.router:
                        self._from_node(self.router.recv_multipart())
                    elif s is self._commands:
                        node, *frames = self._commands.recv_multipart()
                        self._to_node(int(node), frames)
                    else:
                        rank, name = self._stand_ins[s]
                        ident, *frames = s.recv_multipart()
                        self._client_id[rank] = ident
                        self._to_node(rank // self.config.ranks_per_node, [tunnel.MSG, str(rank).encode(), name, *frames])
                except zmq.ZMQError:
                    if self._stop.is_set():
                        return
                except Exception:  # noqa: BLE001 - one bad frame never stops the relay
                    self.log.exception("tunnel: dropped a frame")
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + tunnel.BEAT_INTERVAL
                for node in self.nodes.values():
                    if not node.lost:
                        self._to_node(node.index, tunnel.pack_ctl(self.keys["hmac_key"], {"type": "beat"}))
                    if not node.lost and now - node.last_heard > tunnel.LOST_AFTER:
                        node.lost = f"silent for {now - node.last_heard:.1f}s"
                        self.on_event(node.index, {"type": "lost", "silent": now - node.last_heard})

    def _to_node(self, node: int, frames: list[bytes]) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.router.send_multipart([f"node{node}".encode(), *frames])

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
            sockets = self._rank_sockets.get(int(rank))
            if sockets is None or name not in sockets:
                return
            if name == b"iopub":
                sockets[name].send_multipart(msg)
            elif int(rank) in self._client_id:
                sockets[name].send_multipart([self._client_id[int(rank)], *msg])
            return
        if kind != tunnel.CTL:
            return
        try:
            event = tunnel.unpack_ctl(self.keys["hmac_key"], rest, tunnel.FROM_NODE)
        except tunnel.TunnelError as e:
            self.log.warning("tunnel: node %d: %s", index, e)
            return
        node = self.nodes.setdefault(index, Node(index))
        node.last_heard = time.monotonic()
        if event["type"] == "hello":
            node.host, node.address, node.pid, node.hello = (str(event.get("host", "")), str(event.get("address", "")),
                                                             int(event.get("pid", 0)), event)
        self.on_event(index, event)


class RemoteRankProcess:
    """A rank on another machine: what its node's agent says about it."""

    def __init__(self, rank: int, node: Node, tunnel_: Tunnel, connection: dict) -> None:
        self.rank = rank
        self.node = node
        self.tunnel = tunnel_
        self.connection = connection
        self.pid: int | None = None
        self.code: int | None = None
        self.state = ""
        self.log = ""
        self.gone = ""  # why the rank is gone without an exit code (its node was lost)

    @property
    def host(self) -> str:
        return self.node.host

    def exit_code(self) -> int | None:
        return self.code

    async def is_alive(self) -> bool:
        return self.code is None and not self.gone

    async def has_exited(self) -> bool:
        return self.code is not None or bool(self.gone)

    def os_state(self) -> str:
        return self.state

    def connection_info(self) -> dict:
        """The stand-in kernel's channels (IPC, in the runtime dir) and the rank's HMAC key."""
        return dict(self.connection)

    def client(self) -> AsyncKernelClient:
        kc = _NoHeartbeatClient()
        kc.load_connection_info(self.connection)
        return kc

    async def interrupt(self) -> None:
        self.tunnel.send_ctl(self.node.index, {"type": "signal", "rank": self.rank, "signum": int(signal.SIGINT)})

    async def shutdown(self, now: bool) -> None:  # noqa: ARG002 - the node's agent ends its ranks
        return None

    def kill(self) -> None:
        self.tunnel.send_ctl(self.node.index, {"type": "signal", "rank": self.rank, "signum": int(signal.SIGKILL)})

    def log_tail(self, lines: int = 30) -> str:
        return "".join(self.log.splitlines(keepends=True)[-lines:])


class RemoteLauncher:
    """Starts the node agents (through Slurm or SSH), waits for them, and hands out their ranks."""

    def __init__(self, config: KernelConfig, runtime_dir: str, extra_argv: list[str], log: logging.Logger,
                 on_note: Callable[[str], None], on_fault: Callable[[str, list[int], str], None],
                 on_rank_event: Callable[[int, dict], None]) -> None:
        self.config = config
        self.runtime_dir = runtime_dir
        self.extra_argv = extra_argv
        self.log = log
        self.on_note = on_note
        self.on_fault = on_fault
        self.on_rank_event = on_rank_event
        self.keys = tunnel.new_secrets()
        self.keys["rank_keys"] = {str(r): os.urandom(32).hex() for r in range(config.world_size)}  # type: ignore[assignment]
        self.tunnel: Tunnel | None = None
        self.nodes_launcher = None
        self.processes: dict[int, RemoteRankProcess] = {}
        self.master: tuple[str, int] | None = None
        self.endpoint = ""
        self._events: asyncio.Queue = asyncio.Queue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queued = False
        self._launched_at = 0.0
        self._munge = False
        self._fresh_keys: Callable[[], bytes] = bytes
        self.stopped = False

    def _event(self, node: int, event: dict) -> None:
        """From the tunnel's thread."""
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._on_event, node, event)

    def _on_event(self, node: int, event: dict) -> None:
        kind = event["type"]
        if kind in ("beat", "exited", "lost", "ending"):
            self._track(node, event)
        if not self.processes or kind in ("hello", "started", "failed"):
            self._events.put_nowait((node, event))

    def _note(self, text: str) -> None:
        if "queue" in text.lower() and "waiting" in text.lower():
            self._queued = True
        elif self._queued:  # out of the queue: the connect timeout counts from now
            self._queued = False
            self._launched_at = time.monotonic()
            if self._munge and self.nodes_launcher is not None:
                with contextlib.suppress(Exception):  # the first credentials may have expired meanwhile
                    self.nodes_launcher.send(self._fresh_keys())
        self.on_note(text)

    async def launch_all(self) -> dict[int, RemoteRankProcess]:
        """Start the agents and their ranks; raises :class:`RankStartError` naming the node and address."""
        from dist_kernel.parent import cluster

        cfg = self.config
        self._loop = asyncio.get_running_loop()
        cluster.check_allocation(cfg)
        address = cfg.listen or cluster.default_listen(cfg)
        try:  # ZMQ binds to addresses, not names; the nodes then connect to that address too
            address = socket.gethostbyname(address)
        except OSError as e:
            raise ConfigError(f"--listen {address}: cannot resolve it ({e}). Fix: give an IP address of this "
                              "machine that the nodes can reach, then restart the kernel.") from None
        self.tunnel = Tunnel(cfg, self.keys, self.runtime_dir, self._event, self.log)
        try:
            port = self.tunnel.bind(address)
        except zmq.ZMQError as e:
            raise ConfigError(f"--listen {address}: cannot listen there ({e}). Fix: give an address of this "
                              "machine that the nodes can reach, then restart the kernel.") from None
        self.endpoint = f"tcp://{address}:{port}"
        connections = {r: self.tunnel.stand_in(r) for r in range(cfg.world_size)}
        self.tunnel.start()
        boot = tunnel.Bootstrap(
            server_key=self.keys["server_public"], client_public=self.keys["client_public"],
            client_secret=self.keys["client_secret"], hmac_key=self.keys["hmac_key"],
            rank_keys=dict(self.keys["rank_keys"]), nodes=cfg.nodes, ranks_per_node=cfg.ranks_per_node,  # type: ignore[arg-type]
            gpus=list(cfg.gpus), port_range=list(cfg.port_range) if cfg.port_range else None,
            extra_argv=list(self.extra_argv), parent_pid=os.getpid(), parent_host=socket.gethostname(),
            cwd=os.getcwd(), pythonpath=os.environ.get("PYTHONPATH", ""))

        # srun's stdin crosses the network in clear: wrap the keys in MUNGE credentials, one per
        # node (nodes may share one munged, which decodes each credential once)
        self._munge = cfg.launcher == "slurm"
        munge_socket = cluster.munge_socket() if self._munge else None

        def keys() -> bytes:
            if not self._munge:
                return boot.encode()
            try:
                return b"".join(tunnel.munge_wrap(boot.encode(), munge_socket) for _ in range(cfg.nodes))
            except (OSError, tunnel.TunnelError) as e:
                raise RankStartError(f"cannot protect the keys for the nodes with MUNGE: {e}. Fix: run the kernel "
                                     "on a machine of the Slurm cluster (munge installed, munged running).") from None

        self._fresh_keys = keys

        def agent_argv(node: int | None) -> list[str]:
            argv = [sys.executable, "-m", "dist_kernel.node", "--parent", self.endpoint]
            if self._munge:
                argv += ["--munge", *(["--munge-socket", munge_socket] if munge_socket else [])]
            return argv + (["--node-rank", str(node)] if node is not None else [])

        self.nodes_launcher = cluster.make_launcher(cfg, agent_argv, self.runtime_dir, self.log, self._note)
        self._launched_at = time.monotonic()
        await self.nodes_launcher.start(keys())

        hellos = await self._gather("hello", lambda n: f"node {n} never connected to the parent at {self.endpoint}")
        master_addr = hellos[0]["address"]
        master_port = int(hellos[0]["master_port"])
        self.master = (master_addr, master_port)
        job = next((h.get("job") for h in hellos.values() if h.get("job")), None)
        if job and hasattr(self.nodes_launcher, "note_job"):
            self.nodes_launcher.note_job(str(job))
        for n in range(cfg.nodes):
            self.tunnel.send_ctl(n, {"type": "start", "master_addr": master_addr, "master_port": master_port})
        started = await self._gather("started", lambda n: f"node {n} ({self._host(n)}) did not start its ranks")
        for n, event in started.items():
            for rank_text, pid in event["ranks"].items():
                rank = int(rank_text)
                proc = RemoteRankProcess(rank, self.tunnel.nodes[n], self.tunnel, connections[rank])
                proc.pid = int(pid)
                self.processes[rank] = proc
        return self.processes

    def _host(self, node: int) -> str:
        n = self.tunnel.nodes.get(node) if self.tunnel else None
        if n is not None and n.host:
            return n.host
        hosts = self.nodes_launcher.hosts() if self.nodes_launcher is not None else None
        return hosts[node] if hosts and node < len(hosts) else "host unknown"

    async def _gather(self, kind: str, missing_words: Callable[[int], str]) -> dict[int, dict]:
        """Wait for one ``kind`` event from every node; a clear error for a launcher that
        failed or a node that stays silent past CONNECT_TIMEOUT."""
        got: dict[int, dict] = {}
        while len(got) < self.config.nodes:
            failure = self.nodes_launcher.failure() if self.nodes_launcher is not None else None
            if failure:
                # what an agent said of the wiring (no route, unreachable parent) comes first
                said = [ln.split(": ", 1)[1] for ln in self.nodes_launcher.tail() if "dist_kernel node agent on" in ln]
                if said:  # then the launcher's own words add only how it ended
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
                if proc is not None:
                    proc.state = str(st.get("state") or "")
            return
        if kind == "exited":
            proc = self.processes.get(int(event["rank"]))
            if proc is not None and proc.code is None:
                proc.log = str(event.get("log") or "")
                proc.code = int(event["code"])
                self.on_rank_event(proc.rank, event)
            return
        if kind == "ending" and not self.stopped:
            host = self._host(node)
            ranks = [r for r, p in self.processes.items() if p.node.index == node]
            self.on_fault(f"the node agent on node {node} ({host}) is ending its ranks: {event.get('reason')}", ranks,
                          "ending")
            return
        if kind == "lost" and not self.stopped:
            assert self.tunnel is not None
            host = self._host(node)
            ranks = [r for r, p in self.processes.items() if p.node.index == node]
            for r in ranks:
                self.processes[r].gone = f"was lost with its node {host} (silent for {event['silent']:.0f}s)"
            self.on_fault(f"node {node} ({host}) stopped answering for {event['silent']:.0f}s "
                          "(link down, the node agent killed, or the Slurm job ended)", ranks, "lost")

    def failure(self) -> str | None:
        return self.nodes_launcher.failure() if self.nodes_launcher is not None else None

    def local_pids(self) -> list[int]:
        return self.nodes_launcher.local_pids() if self.nodes_launcher is not None else []

    async def stop(self) -> None:
        """Tell every agent to stop (they end their ranks), then end the launcher (srun/ssh) and the tunnel."""
        self.stopped = True
        if self.nodes_launcher is not None:
            self.nodes_launcher.expect_exit()  # srun/ssh ending now is no failure
        if self.tunnel is not None:
            for n in range(self.config.nodes):
                self.tunnel.send_ctl(n, {"type": "stop"})
            await asyncio.sleep(0.3)  # the agents end their ranks; the launcher then ends by itself
        if self.nodes_launcher is not None:
            with contextlib.suppress(Exception):
                await self.nodes_launcher.stop()
        if self.tunnel is not None:
            self.tunnel.close()

    def stop_sync(self) -> None:
        """Last resort from any thread (atexit): stop the agents, end the launcher's processes."""
        self.stopped = True
        if self.tunnel is not None:
            for n in range(self.config.nodes):
                self.tunnel.send_ctl(n, {"type": "stop"})
            time.sleep(0.2)
        if self.nodes_launcher is not None:
            with contextlib.suppress(Exception):
                self.nodes_launcher.stop_sync()  # SIGTERM srun/ssh, scancel a job of our own
        if self.tunnel is not None:
            self.tunnel.close()
