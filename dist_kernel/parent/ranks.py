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
from typing import TYPE_CHECKING, Protocol

from dist_kernel.parent import membership
from dist_kernel.processes import state_words

if TYPE_CHECKING:
    from dist_kernel.options import KernelConfig
    from dist_kernel.parent.supervisor import RankSupervisor
    from dist_kernel.protocol import Place, Synced

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

    def listen(self, rank: int, msg_id: str, handler: IOPubHandler) -> None:
        """Route the rank's IOPub messages for request ``msg_id`` to ``handler``."""

    def listen_all(self, msg_id: str, handler: Callable[[int, dict], None]) -> None:
        """Route every rank's IOPub messages for request ``msg_id`` (sent to them with one shared
        header) to ``handler``, with the rank: one route for the cell, not one per rank."""

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

    async def sync(self, names: list[str], src: int) -> dict[int, Synced | str]:
        """``%dist_sync``: each rank's reply, or why it gave none."""

    async def shutdown(self, now: bool = False) -> None:
        """End every rank."""

    def cleanup_sync(self) -> None:
        """End every rank now, from any thread (at exit)."""


class SupervisedRanks:
    """:class:`Ranks` over the real rank processes of a :class:`RankSupervisor`."""

    def __init__(self, supervisor: RankSupervisor) -> None:
        self.sup = supervisor
        self._listening: deque[tuple[int, str]] = deque()  # (rank, msg_id) of recent requests
        self._routed: deque[str] = deque()  # msg_ids of recent cells (listen_all)

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
        await self.sup.form_group()

    async def respawn(self, ranks: list[int] | None = None, auto: bool = False) -> list[int]:
        return await membership.respawn(self.sup, ranks, auto=auto)

    async def resize(self, n: int) -> tuple[list[int], list[int]]:
        return await membership.resize(self.sup, n)

    async def sync(self, names: list[str], src: int) -> dict[int, Synced | str]:
        return await membership.sync(self.sup, names, src)

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

    def listen_all(self, msg_id: str, handler: Callable[[int, dict], None]) -> None:
        """The last ``RECENT`` cells stay routed, as :meth:`listen`'s requests."""
        self.sup.routes[msg_id] = handler
        self._routed.append(msg_id)
        while len(self._routed) > RECENT:
            self.sup.routes.pop(self._routed.popleft(), None)

    async def shell_request(self, rank: int, msg_type: str, content: dict, timeout: float = 10.0) -> dict:
        return await self.sup.channel(rank).shell_request(msg_type, content, timeout)

    async def control_request(self, rank: int, msg_type: str, content: dict, timeout: float = 10.0) -> dict:
        return await self.sup.channel(rank).shell_request(msg_type, content, timeout, channel="control")

    def alive(self, rank: int) -> bool:
        r = self.sup.ranks.get(rank)
        return r is not None and r.alive

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
