"""The gang launcher of ranks on other machines: the parent's end of the node agents' connections.

A node starter (:mod:`dist_kernel.parent.launch.node_starters`, of the kind ``--launcher``
names) starts one node agent per machine; this module never asks which kind, and hears of a
batch queue only as the starter's phases (pending, started, ended). The parent listens on
``--listen`` (an :class:`AgentListener`, listener.py: CurveZMQ, one admitted client key; the
wire format is :mod:`dist_kernel.tunnel`). Each node's
agent connects out, says hello, starts its ranks when told, and relays their Jupyter messages.
The listener is read on the kernel's event loop: a remote rank's channel hands its messages to
the listener, which sends them once per node, and gets the rank's frames straight from it (a
:class:`RemoteWire`), with no socket or thread in between. The listener also notices a node
whose connection dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable

import zmq

from dist_kernel.exceptions import ConfigError, RankStartError
from dist_kernel.options import KernelConfig
from dist_kernel.parent.fault_policy import RemoteCause
from dist_kernel.parent.launch.base import GangLauncher
from dist_kernel.parent.launch.listener import AgentListener
from dist_kernel.parent.launch.node_starters import default_listen, make_node_starter, node_starter_class
from dist_kernel.parent.launch.node_starters.base import NodeStarter, Phase
from dist_kernel.parent.launch.remote_rank import RemoteRank
from dist_kernel.processes import describe_exit
from dist_kernel.tunnel.keys import Bootstrap, new_secrets

#: a node whose agent has not said hello this long after its node starter started it (or left
#: the queue) is a wiring mistake, reported well before --startup-timeout
CONNECT_TIMEOUT = 30.0


class RemoteLauncher(GangLauncher):
    """Starts the node agents (through the node starter that ``--launcher`` names), waits for
    them, and hands out their ranks.

    ``on_note`` gets progress for the first cell (waiting in a batch queue, ...); faults that
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
        self.keys = new_secrets()
        self.keys["rank_keys"] = {str(r): os.urandom(32).hex() for r in range(config.world_size)}  # type: ignore[assignment]
        self.listener: AgentListener | None = None
        self.node_starter: NodeStarter | None = None
        self.processes: dict[int, RemoteRank] = {}
        self.master: tuple[str, int] | None = None
        self.endpoint = ""
        self._events: asyncio.Queue = asyncio.Queue()
        self._queued = False
        self._launched_at = 0.0
        self._fresh_keys: Callable[[], bytes] = bytes
        self.stopped = False
        self._respawns: dict[int, asyncio.Future] = {}  # rank -> its agent's answer to "respawn"

    async def launch(self, rank: int) -> RemoteRank:
        """The rank's node agent starts it anew, in place of the one that died (same rank number,
        GPU and environment on the same node)."""
        old = self.processes[rank]
        assert self.listener is not None
        if self.stopped or old.gone:  # the whole gang ended (a lost node, a cancelled job): no agent to ask
            raise RankStartError(f"rank {rank} {old.gone or 'was stopped with every rank'}; restart the kernel "
                                 "to start fresh ranks.")
        answer = asyncio.get_running_loop().create_future()
        self._respawns[rank] = answer
        self.listener.send_ctl(old.node.index, {"type": "respawn", "rank": rank})
        try:
            event = await asyncio.wait_for(answer, self.config.startup_timeout)
        except asyncio.TimeoutError:
            raise RankStartError(f"the node agent on {old.host} did not start rank {rank} again within "
                                 f"{self.config.startup_timeout:.0f}s; restart the kernel.") from None
        finally:
            self._respawns.pop(rank, None)
        if event["type"] == "respawn_failed":
            raise RankStartError(f"the node agent on {old.host} could not start rank {rank} again: {event['error']}")
        new = RemoteRank(rank, old.node, self.listener, old.key, int(event["pid"]))
        self.processes[rank] = new
        return new

    def _on_event(self, node: int, event: dict) -> None:
        kind = event["type"]
        if kind in ("beat", "exited", "lost", "ending"):
            self._track(node, event)
        if not self.processes or kind in ("hello", "started", "failed"):
            self._events.put_nowait((node, event))
        elif kind in ("respawned", "respawn_failed"):
            waiter = self._respawns.pop(int(event["rank"]), None)
            if waiter is not None and not waiter.done():
                waiter.set_result(event)

    def _on_phase(self, phase: Phase) -> None:
        """What the node starter says of the nodes it asked for: while they are pending (a
        batch queue) the connect timeout does not run."""
        if phase == "pending":
            self._queued = True
        elif phase == "started" and self._queued:  # out of the queue: the connect timeout counts from now
            self._queued = False
            self._launched_at = time.monotonic()
            if self.node_starter is not None:
                with contextlib.suppress(Exception):  # sealed keys may have expired meanwhile
                    self.node_starter.send(self._fresh_keys())
        elif phase == "ended":  # no longer waiting: the starter's failure() says how it ended
            self._queued = False

    async def start(self, ranks: int) -> AsyncIterator[RemoteRank]:
        processes = await self.launch_all()
        for rank in range(ranks):
            yield processes[rank]

    async def launch_all(self) -> dict[int, RemoteRank]:
        """Start the agents and their ranks; raises :class:`RankStartError` naming the node and address."""
        cfg = self.config
        node_starter_class(cfg.launcher).check(cfg)
        address = default_listen(cfg)
        try:  # ZMQ binds to addresses, not names; the nodes then connect to that address too
            address = socket.gethostbyname(address)
        except OSError as e:
            raise ConfigError(f"--listen {address}: cannot resolve it ({e}). Fix: give an IP address of this "
                              "machine that the nodes can reach, then restart the kernel.") from None
        self.listener = AgentListener(cfg, self.keys, self._on_event, self.log,
                                      on_replies=lambda ranks, msg: self.on_replies(ranks, msg),
                                      on_outputs=lambda ranks, msg: self.on_outputs(ranks, msg))
        try:
            port = self.listener.bind(address)
        except zmq.ZMQError as e:
            raise ConfigError(f"--listen {address}: cannot listen there ({e}). Fix: give an address of this "
                              "machine that the nodes can reach, then restart the kernel.") from None
        self.endpoint = f"tcp://{address}:{port}"
        self.listener.start()
        boot = Bootstrap(
            server_key=self.keys["server_public"], client_public=self.keys["client_public"],
            client_secret=self.keys["client_secret"], hmac_key=self.keys["hmac_key"],
            rank_keys=dict(self.keys["rank_keys"]), nodes=cfg.nodes, ranks_per_node=cfg.ranks_per_node,  # type: ignore[arg-type]
            gpus=list(cfg.gpus), port_range=list(cfg.port_range) if cfg.port_range else None,
            extra_argv=list(self.extra_argv), parent_pid=os.getpid(), parent_host=socket.gethostname(),
            cwd=os.getcwd(), pythonpath=os.environ.get("PYTHONPATH", ""))

        def agent_argv(node: int | None) -> list[str]:  # when the starter starts its processes
            assert self.node_starter is not None
            return [sys.executable, "-m", "dist_kernel.node", "--parent", self.endpoint,
                    *self.node_starter.agent_flags(), *(["--node-rank", str(node)] if node is not None else [])]

        starter = self.node_starter = make_node_starter(cfg, agent_argv, self.runtime_dir, self.log, self.on_note,
                                                        on_phase=self._on_phase)
        self._fresh_keys = lambda: starter.seal(boot.encode())  # as the starter's processes carry them
        self._launched_at = time.monotonic()
        await starter.start(self._fresh_keys())

        hellos = await self._gather("hello", lambda n: f"node {n} never connected to the parent at {self.endpoint}")
        master_addr = hellos[0]["address"]
        master_port = int(hellos[0]["master_port"])  # the kernel's TCPStore, held for its life
        user_port = int(hellos[0].get("user_port", master_port))  # the ranks' MASTER_PORT: free for env://
        self.master = (master_addr, master_port)
        starter.hello(hellos)
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
            # a rank exited (the OOM killer, a crash): one rank's death, as on one machine (the
            # survivors keep their variables; %dist_respawn asks its agent for a new one). SIGTERM
            # comes from outside (a cancelled job, a time limit), which takes every rank: a fault
            # of the gang, whose cause the agent's own word names better
            proc = self.processes.get(int(event["rank"]))
            if proc is not None and proc.returncode is None:
                proc.log = str(event.get("log") or "")
                proc.returncode = code = int(event["code"])
                self.on_change(proc)
                if code == -signal.SIGTERM:
                    self.on_fault(RemoteCause("terminated", f"rank {proc.rank} on {proc.host} {describe_exit(code)}",
                                              (proc.rank,)))
        elif kind == "ending":
            self.on_fault(RemoteCause("ending", f"the node agent on node {node} ({host}) is ending its ranks: "
                                                f"{event.get('reason')}", ranks))
        elif kind == "lost":
            for r in ranks:
                self.processes[r].gone = f"was lost with its node {host} (silent for {event['silent']:.0f}s)"
            self.on_fault(RemoteCause("lost", f"node {node} ({host}) stopped answering for {event['silent']:.0f}s "
                                              "(link down, the node agent killed, or its job ended)", ranks))

    def sample(self, on: bool) -> None:
        if self.listener is not None:
            self.listener.sampling = on
        if not on:  # the beats carry loads only while sampling, and otherwise only changes
            for proc in self.processes.values():
                proc.load = None

    def failure(self) -> str | None:
        if self.stopped or self.node_starter is None:
            return None
        return self.node_starter.failure()

    def state(self) -> dict:
        """The node starter's launch record (its kind, processes, and what else it started): the
        ranks' pids mean nothing here, their agents end them."""
        if self.node_starter is None:
            return {}
        return self.node_starter.launch_record().to_json()

    def record(self) -> None:
        if self.node_starter is not None:
            self.node_starter.record()

    async def stop(self, now: bool = False) -> None:  # now unused: the agents end their ranks at once
        """Tell every agent to stop (they end their ranks), then end the node starter and the listener."""
        if self.node_starter is not None:
            self.node_starter.expect_exit()  # its processes ending now is no failure
        if self.listener is not None and not self.stopped:
            self.stopped = True
            for n in range(self.config.nodes):
                self.listener.send_ctl(n, {"type": "stop"})
            await asyncio.sleep(0.3)  # the agents end their ranks; the starter's processes then end by themselves
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
                self.node_starter.stop_sync()  # its processes, then what else it started (a job of our own)
        if self.listener is not None:
            self.listener.close()
