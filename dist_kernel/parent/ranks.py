"""The ranks as the parent's Jupyter side sees them: the seam between a cell and the processes.

:class:`CellRanks` is all one cell's run (:mod:`dist_kernel.parent.execution`) needs: send a
request, hear its IOPub, ask where a rank is, signal, tear down, re-form, and the words that
name a rank in a message. :class:`Ranks` adds what the kernel's other handlers need (start,
status, options, shutdown). :class:`SupervisedRanks` is the one implementation over real
processes (a :class:`~dist_kernel.parent.supervisor.RankSupervisor`); the unit tests drive the
kernel through fakes of these two protocols, and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from dist_kernel import tunnel
from dist_kernel.exceptions import RankDiedError
from dist_kernel.parent import formation, membership
from dist_kernel.parent.channels import RankChannel, shared_header
from dist_kernel.parent.launch.remote_rank import AgentListener, RemoteWire
from dist_kernel.processes import state_words

if TYPE_CHECKING:
    from dist_kernel.options import KernelConfig
    from dist_kernel.parent.supervisor import RankSupervisor
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

    async def shell_request(self, rank: int, msg_type: str, content: dict, timeout: float = 10.0) -> dict:
        """One shell round trip (completion, inspection, comm_info); the reply content."""

    async def control_request(self, rank: int, msg_type: str, content: dict, timeout: float = 10.0) -> dict:
        """One control round trip (``debug_request``, answered by the rank's debugger); the reply content."""

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


class SupervisedRanks:
    """:class:`Ranks` over the real rank processes of a :class:`RankSupervisor`."""

    def __init__(self, supervisor: RankSupervisor) -> None:
        self.sup = supervisor
        supervisor.launcher.on_replies = self._replied
        supervisor.launcher.on_outputs = self._output
        self._listening: deque[tuple[int, str]] = deque()  # (rank, msg_id) of recent requests
        self._routed: deque[str] = deque()  # msg_ids of recent cells (listen_all)
        self._plan: _SendPlan | None = None  # how the last cell was sent (send_cell)
        self._owed: dict[str, set[int]] = {}  # cell msg_id -> the ranks whose reply has not come

    # what the supervisor holds, as is
    @property
    def config(self) -> KernelConfig:
        return self.sup.config

    @property
    def ready(self) -> asyncio.Event:
        return self.sup.ready

    @property
    def start_error(self) -> str | None:
        return self.sup.start_error

    @property
    def runtime_dir(self) -> str:
        return self.sup.runtime_dir

    async def start(self) -> None:
        await self.sup.start()

    async def where(self, rank: int) -> Place | None:
        return await self.sup.where(rank)

    async def interrupt(self, ranks: list[int]) -> None:
        await self.sup.interrupt(ranks)

    async def teardown(self, ranks: list[int] | tuple[int, ...]) -> list[int]:
        return await self.sup.teardown(ranks)

    async def form_group(self) -> None:
        await formation.form_group(self.sup)

    async def respawn(self, ranks: list[int] | None = None, auto: bool = False) -> list[int]:
        return await membership.respawn(self.sup, ranks, auto=auto)

    async def resize(self, n: int) -> tuple[list[int], list[int]]:
        return await membership.resize(self.sup, n)

    def sync(self, names: list[str], src: int) -> dict[int, asyncio.Future]:
        return membership.sync(self.sup, names, src)

    def live(self) -> list[int]:
        return self.sup.live_ranks()

    def reply_input(self, rank: int, value: str) -> None:
        self.sup.reply_input(rank, value)

    async def status(self) -> dict[int, dict]:
        return await self.sup.status()

    async def set_option(self, name: str, on: bool) -> list[int]:
        return await self.sup.set_option(name, on)

    # %dist_top (parent/top.py)
    def host(self, rank: int) -> str:
        r = self.sup.ranks.get(rank)
        return r.host if r is not None else ""

    def agent_load(self, rank: int) -> dict | None:
        r = self.sup.ranks.get(rank)
        return getattr(r.process, "load", None) if r is not None else None  # RemoteRank only

    def sample_remote(self, on: bool) -> None:
        self.sup.launcher.sample(on)

    async def shutdown(self, now: bool = False) -> None:
        await self.sup.shutdown(now=now)

    def cleanup_sync(self) -> None:
        self.sup.cleanup_sync()

    # one rank
    def send(self, rank: int, msg_type: str, content: dict, metadata: dict | None = None,
             buffers: list | None = None, expect_reply: bool = True,
             header: tuple[str, bytes] | None = None) -> tuple[str, asyncio.Future | None]:
        return self.sup.channel(rank).send(msg_type, content, metadata=metadata, buffers=buffers,
                                           expect_reply=expect_reply, header=header)

    def listen(self, rank: int, msg_id: str, handler: IOPubHandler) -> None:
        """The last ``RECENT`` requests per rank stay routed, so output a background thread
        prints after its cell ended still finds its place."""
        self.sup.channel(rank).listen(msg_id, handler)
        self._listening.append((rank, msg_id))
        while len(self._listening) > RECENT * max(1, self.sup.config.world_size):
            old_rank, old_id = self._listening.popleft()
            r = self.sup.ranks.get(old_rank)
            if r is not None and r.channel is not None:
                r.channel.unlisten(old_id)

    def listen_all(self, msg_id: str, handler: Callable[[int, dict], None],
                   on_group: Callable[[list[int], dict], None] | None = None) -> None:
        """The last ``RECENT`` cells stay routed, as :meth:`listen`'s requests."""
        self.sup.routes.iopub[msg_id] = handler
        if on_group is not None:
            self.sup.routes.iopub_groups[msg_id] = on_group
        self._routed_now(msg_id)

    def _routed_now(self, msg_id: str) -> None:
        """Keep the routes of the last ``RECENT`` cells (IOPub and replies). An older cell keeps
        its reply route while a live rank still owes its reply (a rank the cell gave up on and
        left running): that reply tells the group the rank is back, however late it comes."""
        if self._routed and self._routed[-1] == msg_id:
            return
        self._routed.append(msg_id)
        routes = self.sup.routes
        while len(self._routed) > RECENT:
            old = self._routed.popleft()
            routes.iopub.pop(old, None)
            routes.iopub_groups.pop(old, None)
        if len(self._owed) > RECENT:
            gone = set(self.gone())
            for old in [m for m in list(self._owed)[:-RECENT] if not self._owed[m] - gone]:
                routes.replies.pop(old, None)
                del self._owed[old]

    def send_cell(self, ranks: tuple[int, ...], content: dict, metadata: dict,
                  on_replies: Callable[[list[int], dict], None]) -> tuple[list[str], dict[int, str]]:
        """One header for every rank. A remote rank's request goes into its node's entry of the
        listener's outbox with the others', in one call per listener; its node's agent groups
        their replies, which :meth:`_replied` hands over whole."""
        header = shared_header("execute_request")
        owed = self._owed[header[0]] = set(ranks)  # the ranks whose reply has not come

        def replied(ranks: list[int], msg: dict) -> None:
            owed.difference_update(ranks)
            on_replies(ranks, msg)

        self.sup.routes.replies[header[0]] = replied
        self._routed_now(header[0])
        lost: dict[int, str] = {}
        plan = self._send_plan(ranks)
        known = self.sup.ranks
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
        sup = self.sup
        stamp = (sup.generation, len(sup.ranks), sum(map(len, sup.deaths.values())))
        plan = self._plan
        if plan is not None and plan.stamp == stamp and plan.ranks == ranks:
            return plan
        plan = self._plan = _SendPlan(ranks, stamp)
        by_node: dict[AgentListener, dict[int, list[int]]] = {}
        for rank in ranks:
            r = sup.ranks.get(rank)
            channel = r.channel if r is not None else None
            if channel is not None and type(channel.wire) is RemoteWire and channel.dead is None \
                    and not channel.closing:
                by_node.setdefault(channel.wire.listener, {}).setdefault(sup.config.node_of(rank), []).append(rank)
                plan.packer = channel
            else:
                plan.each.append(rank)
        plan.remote = {listener: [(node, tunnel.rank_list(on_node)) for node, on_node in nodes.items()]
                       for listener, nodes in by_node.items()}
        return plan

    def _output(self, ranks: list[int], msg: dict) -> bool:
        """An IOPub message that several of a node's ranks sent alike (the launcher's
        ``on_outputs``): checked as the first rank's channel checks one, then to its cell's
        relay at once. False: no cell takes it so (each rank's channel then gets it)."""
        on_group = self.sup.routes.iopub_groups.get(msg["parent_header"].get("msg_id"))
        first = self.sup.ranks.get(ranks[0])
        if on_group is None or first is None or first.channel is None:
            return False
        checked = first.channel.checked_iopub(msg)
        if checked is not None:
            on_group(ranks, checked)
        return True

    def _replied(self, ranks: list[int], msg: dict) -> bool:
        """A node agent's group of ranks with one same reply (the launcher's ``on_replies``): to
        its cell's run at once, without the ranks being declared gone (``hold_replies``)."""
        route = self.sup.routes.replies.get(msg["parent_header"].get("msg_id"))
        if route is None:
            return False
        taken = ranks
        if self.sup.holding_replies:  # a fault that takes every rank: its cause speaks for them
            held = self.sup.ranks
            taken = [r for r in ranks if (x := held.get(r)) is not None and x.channel is not None
                     and x.channel.takes_replies]
        if taken:
            route(taken, msg)
        return True

    async def shell_request(self, rank: int, msg_type: str, content: dict, timeout: float = 10.0) -> dict:
        return await self.sup.channel(rank).shell_request(msg_type, content, timeout)

    async def control_request(self, rank: int, msg_type: str, content: dict, timeout: float = 10.0) -> dict:
        return await self.sup.channel(rank).shell_request(msg_type, content, timeout, channel="control")

    def alive(self, rank: int) -> bool:
        r = self.sup.ranks.get(rank)
        return r is not None and r.alive

    def gone(self) -> list[int]:
        return membership.dead_ranks(self.sup)

    def stopped_ranks(self) -> list[int]:
        known = self.sup.ranks  # the supervisor's set of ranks seen stopped: no walk over every rank
        return sorted(r for r in self.sup.stopped if (x := known.get(r)) is not None and x.stopped)

    def exit_reason(self, rank: int) -> str:
        r = self.sup.ranks.get(rank)
        return (r.exit_reason or "") if r is not None else "did not start"

    def stopped(self, rank: int) -> str:
        r = self.sup.ranks.get(rank)
        return r.stopped if r is not None else ""

    def pid(self, rank: int) -> int | None:
        r = self.sup.ranks.get(rank)
        return r.pid if r is not None else None

    def describe(self, rank: int) -> str:
        r = self.sup.ranks.get(rank)
        return r.where if r is not None else "pid ?"

    def os_state(self, rank: int) -> str:
        r = self.sup.ranks.get(rank)
        return state_words(r.process.os_state() if r is not None else "")

    def log_tail(self, rank: int, lines: int = 15) -> str:
        r = self.sup.ranks.get(rank)
        if r is None:
            return ""
        with contextlib.suppress(Exception):
            return r.log_tail(lines)
        return ""
