"""The ranks as the parent's Jupyter side sees them: the seam between a cell and the processes.

:class:`CellRanks` is all one cell's run (:mod:`dist_kernel.parent.execution`) needs: send a
request, hear its IOPub, ask where a rank is, signal, tear down, re-form, and the words that
name a rank in a message. :class:`Ranks` adds what the kernel's other handlers need (start,
status, options, shutdown). :class:`SupervisedRanks` is the one implementation over real
processes: a :class:`~dist_kernel.parent.supervisor.RankSupervisor` (which starts, forms, watches
and ends them, and serves those members itself) with what the Jupyter side asks of them on top.
The unit tests drive the kernel through fakes of these two protocols, and nothing else
(``tests/unit/fake_ranks.py``; ``tests/unit/test_ranks_seam.py`` holds it to them).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from dist_kernel import protocol, tunnel
from dist_kernel.exceptions import RankDiedError
from dist_kernel.parent import formation, membership
from dist_kernel.parent.channels import RankChannel, shared_header
from dist_kernel.parent.launch.remote_rank import AgentListener, RemoteWire
from dist_kernel.parent.supervisor import RankSupervisor
from dist_kernel.processes import state_words

if TYPE_CHECKING:
    from dist_kernel.options import KernelConfig
    from dist_kernel.protocol import Place

#: an IOPub message of a rank, for the request it was sent for
IOPubHandler = Callable[[dict], None]
#: how many finished requests' listeners are kept per rank, to place late output (background threads)
RECENT = 64


class CellRanks(Protocol):
    """What one cell's run needs of the ranks."""

    def send(self, rank: int, msg_type: str, content: dict, metadata: dict | None = None,
             buffers: list | None = None, expect_reply: bool = True,
             header: tuple[str, bytes] | None = None) -> tuple[str, asyncio.Future | None]:
        """Send a shell request to a rank: its msg_id and the future of its reply message.
        ``header``: one shared by every rank the request goes to (``channels.shared_header``).
        Raises :class:`~dist_kernel.exceptions.RankDiedError` when the rank is gone."""

    def send_cell(self, ranks: tuple[int, ...], content: dict, metadata: dict,
                  on_replies: Callable[[list[int], dict], None]) -> tuple[list[str], dict[int, str]]:
        """Send a cell's ``execute_request`` to ``ranks``; their reply messages go to
        ``on_replies`` with the ranks that sent each (a node's ranks at once, issue 26). A rank
        that dies before it replies is reported to the kernel (``on_rank_death``), not here.
        Returns the msg_ids sent (each once) and the ranks it could not be sent to, with why."""

    def listen(self, rank: int, msg_id: str, handler: IOPubHandler) -> None:
        """Route the rank's IOPub messages for request ``msg_id`` to ``handler``."""

    def listen_all(self, msg_id: str, handler: Callable[[int, dict], None],
                   on_group: Callable[[list[int], dict], None] | None = None) -> None:
        """Route every rank's IOPub messages for request ``msg_id`` (sent to them with one shared
        header) to ``handler``, with the rank: one route for the cell, not one per rank. A message
        that a node's ranks sent alike goes to ``on_group`` once, with the ranks, when given."""

    async def where(self, rank: int) -> Place | None:
        """Where the rank's cell is; None when it does not answer."""

    async def interrupt(self, ranks: list[int]) -> None:
        """SIGINT each named live rank."""

    async def teardown(self, ranks: list[int] | tuple[int, ...]) -> list[int]:
        """Break the process group on these ranks; the ranks that did not confirm."""

    async def form_group(self) -> None:
        """Every rank joins a fresh process group."""

    async def respawn(self, ranks: list[int] | None = None, auto: bool = False) -> list[int]:
        """Start dead ranks anew (default: every dead one) and form the group again; the ranks
        started. Raises :class:`~dist_kernel.exceptions.ConfigError` saying why it cannot."""

    def alive(self, rank: int) -> bool:
        """Is the rank's process still there?"""

    def gone(self) -> list[int]:
        """The ranks whose process is gone, in order (one call per cell, not one per rank)."""

    def stopped_ranks(self) -> list[int]:
        """The ranks stopped now (SIGSTOP, a debugger), in order (one call per cell)."""

    def stopped(self, rank: int) -> str:
        """The OS state in words while the rank is stopped (SIGSTOP, a debugger); "" otherwise."""

    def pid(self, rank: int) -> int | None:
        """The rank's process id (on its own machine)."""

    def describe(self, rank: int) -> str:
        """The words that find the rank's process: ``pid 12`` or ``pid 12 on n2``."""

    def os_state(self, rank: int) -> str:
        """What the OS says the rank's process is doing, in words."""

    def log_tail(self, rank: int, lines: int = 15) -> str:
        """The end of what the rank's process wrote outside Jupyter."""


class Ranks(CellRanks, Protocol):
    """What the parent kernel needs of its ranks besides running cells."""

    @property
    def config(self) -> KernelConfig: ...
    @property
    def ready(self) -> asyncio.Event:
        """Set once the ranks started and formed their group, or failed to."""
    @property
    def start_error(self) -> str | None: ...
    @property
    def runtime_dir(self) -> str: ...

    async def start(self) -> None:
        """Start the ranks and form their group; never raises, sets ``start_error``."""

    def live(self) -> list[int]:
        """The ranks whose process is still there."""

    def exit_reason(self, rank: int) -> str:
        """How a gone rank ended, in words ("" while it runs)."""

    async def shell_request(self, rank: int, msg_type: str, content: dict, timeout: float = 10.0,
                            channel: str = "shell") -> dict:
        """One round trip (completion, inspection, comm_info); the reply content. ``channel="control"``:
        on the rank's control channel (``debug_request``, answered by the rank's debugger)."""

    def reply_input(self, rank: int, value: str) -> None:
        """Answer the rank's ``input()``."""

    async def status(self) -> dict[int, dict]:
        """Each rank's ``%dist_status`` row."""

    def host(self, rank: int) -> str:
        """The machine the rank runs on ("" for this one)."""

    def agent_load(self, rank: int) -> dict | None:
        """A remote rank's latest load sample from its node agent (:mod:`dist_kernel.load`); None
        for local ranks, or before the agent sent one."""

    def sample_remote(self, on: bool) -> None:
        """Ask the node agents to add their ranks' load samples to their beats (``%dist_top``)."""

    async def set_option(self, name: str, on: bool) -> list[int]:
        """Switch a rank-side option everywhere; the ranks that did not confirm."""

    async def resize(self, n: int) -> tuple[list[int], list[int]]:
        """``%dist_ranks N``: the ranks started and ended to have ``n``; the group is formed again."""

    def sync(self, names: list[str], src: int) -> dict[int, asyncio.Future]:
        """``%dist_sync``: ask every rank at once to copy ``names`` from rank ``src``; each rank's
        reply to come (a :class:`~dist_kernel.protocol.Synced`, or it raises why the rank gave
        none). Raises :class:`~dist_kernel.exceptions.ConfigError` when a rank is dead."""

    async def shutdown(self, now: bool = False) -> None:
        """End every rank."""

    def cleanup_sync(self) -> None:
        """End every rank now, from any thread (at exit)."""


@dataclass
class _SendPlan:
    """How a cell goes to its ranks (:meth:`SupervisedRanks.send_cell`)."""

    ranks: tuple[int, ...]
    stamp: tuple[int, int, int]  # what it was made under (see SupervisedRanks._send_plan)
    #: behind each node listener (there is one): each node and its ranks, as they travel
    remote: dict[AgentListener, list[tuple[int, bytes]]] = field(default_factory=dict)
    packer: RankChannel | None = None  # a remote rank's channel, which packs the cell's frames for all
    each: list[int] = field(default_factory=list)  # sent one by one: on this machine, or gone


@dataclass
class _Recent:
    """What :class:`SupervisedRanks` keeps of the requests and cells it sent, to route what comes late."""

    listening: deque[tuple[int, str]] = field(default_factory=deque)  # (rank, msg_id) of recent requests
    routed: deque[str] = field(default_factory=deque)  # msg_ids of recent cells (listen_all)
    owed: dict[str, set[int]] = field(default_factory=dict)  # cell msg_id -> the ranks whose reply has not come
    plan: _SendPlan | None = None  # how the last cell was sent (send_cell)


class SupervisedRanks(RankSupervisor):
    """:class:`Ranks` over the real rank processes: what the Jupyter side asks of them, over the
    processes, channels and group a :class:`RankSupervisor` keeps (starting, forming, watching and
    ending them is the supervisor's: :meth:`~RankSupervisor.start`, :meth:`~RankSupervisor.teardown`,
    :meth:`~RankSupervisor.shutdown`, ...). Here: the cells sent and what comes back routed (a
    node's grouped replies and outputs through the supervisor's hooks, :meth:`grouped_reply`,
    :meth:`grouped_output`), the typed requests the kernel's handlers make, each rank's record."""

    @functools.cached_property
    def _recent(self) -> _Recent:
        """Made at the first cell (the supervisor's constructor is this class's)."""
        return _Recent()

    # the group's members changed while the kernel runs: functions over the supervisor, as methods
    form_group = formation.form_group
    respawn = membership.respawn
    resize = membership.resize
    sync = membership.sync
    gone = membership.dead_ranks

    # ------------------------------------------------------------ typed requests
    async def where(self, rank: int) -> Place | None:
        """Where a rank's cell is; None when it does not answer (stopped, stuck holding the GIL)."""
        reply = await self.ask(rank, protocol.Where())
        return reply if isinstance(reply, protocol.Place) else None

    async def set_option(self, name: str, on: bool) -> list[int]:
        """Switch a rank-side option on every live rank, and on those started later (it is the kernel's
        option now: :func:`~dist_kernel.parent.formation.form_group`); the ranks that did not confirm."""
        self.config = self.config.with_switch(name, on)
        live = self.live()
        replies = await asyncio.gather(*(self.ask(r, protocol.SetOption(name=name, on=on)) for r in live))
        return [r for r, reply in zip(live, replies, strict=True) if reply is None]

    async def status(self) -> dict[int, dict]:
        """Each rank's status row; answered from the rank's control thread even while it is busy."""

        async def one(rank: int) -> dict:
            r = self.ranks[rank]
            base = {"pid": r.pid, "device": r.device, **({"host": r.host} if r.host else {})}
            if not r.alive:
                return {**base, "state": r.exit_reason}
            if r.stopped:
                return {**base, "state": r.stopped}
            reply = await self.ask(rank, protocol.Status())
            if not isinstance(reply, protocol.RankStatus):
                return {**base, "state": f"not answering ({state_words(r.process.os_state())})"}
            row = {k: v for k, v in vars(reply).items() if k not in ("busy", "line")}
            row["state"] = f"busy: {reply.line}" if reply.busy and reply.line else ("busy" if reply.busy else "idle")
            return row

        results = await asyncio.gather(*(one(r) for r in self.ranks))
        return dict(zip(self.ranks, results, strict=True))

    async def interrupt(self, ranks: list[int]) -> None:
        """SIGINT each named live rank (its whole process group, as Jupyter does)."""
        known = self.ranks
        await self.launcher.signal([known[r].process for r in ranks if r in known and known[r].alive], signal.SIGINT)

    def reply_input(self, rank: int, value: str) -> None:
        with contextlib.suppress(RankDiedError):
            self.channel(rank).input(value)

    async def shell_request(self, rank: int, msg_type: str, content: dict, timeout: float = 10.0,
                            channel: str = "shell") -> dict:
        return await self.channel(rank).shell_request(msg_type, content, timeout, channel=channel)

    # ------------------------------------------------------------ %dist_top (parent/top.py)
    def host(self, rank: int) -> str:
        r = self.ranks.get(rank)
        return r.host if r is not None else ""

    def agent_load(self, rank: int) -> dict | None:
        r = self.ranks.get(rank)
        return getattr(r.process, "load", None) if r is not None else None  # RemoteRank only

    def sample_remote(self, on: bool) -> None:
        self.launcher.sample(on)

    # ------------------------------------------------------------ cells and their routes
    def send(self, rank: int, msg_type: str, content: dict, metadata: dict | None = None,
             buffers: list | None = None, expect_reply: bool = True,
             header: tuple[str, bytes] | None = None) -> tuple[str, asyncio.Future | None]:
        return self.channel(rank).send(msg_type, content, metadata=metadata, buffers=buffers,
                                       expect_reply=expect_reply, header=header)

    def listen(self, rank: int, msg_id: str, handler: IOPubHandler) -> None:
        """The last ``RECENT`` requests per rank stay routed, so output a background thread
        prints after its cell ended still finds its place."""
        self.channel(rank).listen(msg_id, handler)
        listening = self._recent.listening
        listening.append((rank, msg_id))
        while len(listening) > RECENT * max(1, self.config.world_size):
            old_rank, old_id = listening.popleft()
            r = self.ranks.get(old_rank)
            if r is not None and r.channel is not None:
                r.channel.unlisten(old_id)

    def listen_all(self, msg_id: str, handler: Callable[[int, dict], None],
                   on_group: Callable[[list[int], dict], None] | None = None) -> None:
        """The last ``RECENT`` cells stay routed, as :meth:`listen`'s requests."""
        self.routes.iopub[msg_id] = handler
        if on_group is not None:
            self.routes.iopub_groups[msg_id] = on_group
        self._routed_now(msg_id)

    def _routed_now(self, msg_id: str) -> None:
        """Keep the routes of the last ``RECENT`` cells (IOPub and replies). An older cell keeps
        its reply route while a live rank still owes its reply (a rank the cell gave up on and
        left running): that reply tells the group the rank is back, however late it comes."""
        recent = self._recent
        if recent.routed and recent.routed[-1] == msg_id:
            return
        recent.routed.append(msg_id)
        routes = self.routes
        while len(recent.routed) > RECENT:
            old = recent.routed.popleft()
            routes.iopub.pop(old, None)
            routes.iopub_groups.pop(old, None)
        if len(recent.owed) > RECENT:
            gone = set(self.gone())
            for old in [m for m in list(recent.owed)[:-RECENT] if not recent.owed[m] - gone]:
                routes.replies.pop(old, None)
                del recent.owed[old]

    def send_cell(self, ranks: tuple[int, ...], content: dict, metadata: dict,
                  on_replies: Callable[[list[int], dict], None]) -> tuple[list[str], dict[int, str]]:
        """One header for every rank. A remote rank's request goes into its node's entry of the
        listener's outbox with the others', in one call per listener; its node's agent groups
        their replies, which :meth:`grouped_reply` hands over whole."""
        header = shared_header("execute_request")
        owed = self._recent.owed[header[0]] = set(ranks)  # the ranks whose reply has not come

        def replied(ranks: list[int], msg: dict) -> None:
            owed.difference_update(ranks)
            on_replies(ranks, msg)

        self.routes.replies[header[0]] = replied
        self._routed_now(header[0])
        lost: dict[int, str] = {}
        plan = self._send_plan(ranks)
        known = self.ranks
        for rank in plan.each:
            r = known.get(rank)
            if r is None or r.channel is None:
                lost[rank] = f"rank {rank} is not running"
                continue
            try:  # on this machine (or gone: send says why)
                r.channel.send("execute_request", content, metadata=metadata, expect_reply=False, header=header)
            except RankDiedError as e:
                lost[rank] = str(e)
        if plan.remote:
            assert plan.packer is not None
            frames = plan.packer.cell_frames(content, metadata)
            for listener, nodes in plan.remote.items():
                listener.send_to_nodes(nodes, "shell", header[1], frames)
        owed.difference_update(lost)
        return ([header[0]] if len(lost) < len(ranks) else []), lost

    def _send_plan(self, ranks: tuple[int, ...]) -> _SendPlan:
        """Which of ``ranks`` go through which node listener, and which are sent to one by one.
        A kernel's cells mostly name the same ranks, so the plan is kept while nothing changed
        that it depends on: the group's generation (a respawn or resize forms it again), the
        rank count and the deaths."""
        stamp = (self.generation, len(self.ranks), sum(map(len, self.deaths.values())))
        plan = self._recent.plan
        if plan is not None and plan.stamp == stamp and plan.ranks == ranks:
            return plan
        plan = self._recent.plan = _SendPlan(ranks, stamp)
        by_node: dict[AgentListener, dict[int, list[int]]] = {}
        for rank in ranks:
            r = self.ranks.get(rank)
            channel = r.channel if r is not None else None
            if channel is not None and type(channel.wire) is RemoteWire and channel.dead is None \
                    and not channel.closing:
                by_node.setdefault(channel.wire.listener, {}).setdefault(self.config.node_of(rank), []).append(rank)
                plan.packer = channel
            else:
                plan.each.append(rank)
        plan.remote = {listener: [(node, tunnel.rank_list(on_node)) for node, on_node in nodes.items()]
                       for listener, nodes in by_node.items()}
        return plan

    def grouped_output(self, ranks: list[int], msg: dict) -> bool:
        """An IOPub message that several of a node's ranks sent alike (the launcher's
        ``on_outputs``): checked as the first rank's channel checks one, then to its cell's
        relay at once. False: no cell takes it so (each rank's channel then gets it)."""
        on_group = self.routes.iopub_groups.get(msg["parent_header"].get("msg_id"))
        first = self.ranks.get(ranks[0])
        if on_group is None or first is None or first.channel is None:
            return False
        checked = first.channel.checked_iopub(msg)
        if checked is not None:
            on_group(ranks, checked)
        return True

    def grouped_reply(self, ranks: list[int], msg: dict) -> bool:
        """A node agent's group of ranks with one same reply (the launcher's ``on_replies``): to
        its cell's run at once, without the ranks being declared gone (``hold_replies``)."""
        route = self.routes.replies.get(msg["parent_header"].get("msg_id"))
        if route is None:
            return False
        taken = ranks
        if self.fault.settling:  # a fault that takes every rank: its cause speaks for them
            held = self.ranks
            taken = [r for r in ranks if (x := held.get(r)) is not None and x.channel is not None
                     and x.channel.takes_replies]
        if taken:
            route(taken, msg)
        return True

    def alive(self, rank: int) -> bool:
        r = self.ranks.get(rank)
        return r is not None and r.alive

    def live(self) -> list[int]:
        return [r for r, rk in self.ranks.items() if rk.alive]

    def stopped_ranks(self) -> list[int]:
        known = self.ranks  # the supervisor's set of ranks seen stopped: no walk over every rank
        return sorted(r for r in self.seen_stopped if (x := known.get(r)) is not None and x.stopped)

    def exit_reason(self, rank: int) -> str:
        r = self.ranks.get(rank)
        return (r.exit_reason or "") if r is not None else "did not start"

    def stopped(self, rank: int) -> str:
        r = self.ranks.get(rank)
        return r.stopped if r is not None else ""

    def pid(self, rank: int) -> int | None:
        r = self.ranks.get(rank)
        return r.pid if r is not None else None

    def describe(self, rank: int) -> str:
        r = self.ranks.get(rank)
        return r.where if r is not None else "pid ?"

    def os_state(self, rank: int) -> str:
        r = self.ranks.get(rank)
        return state_words(r.process.os_state() if r is not None else "")

    def log_tail(self, rank: int, lines: int = 15) -> str:
        r = self.ranks.get(rank)
        if r is None:
            return ""
        with contextlib.suppress(Exception):
            return r.log_tail(lines)
        return ""
