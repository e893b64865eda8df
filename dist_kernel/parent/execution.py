"""One cell's run across its ranks: forward, relay outputs live, decide when it is over.

A rank is finished with a cell when its ``execute_reply`` (shell) has arrived and all of its
output has: the reply can overtake the last outputs, and frontends stop reading a cell at the
parent's ``idle``. All of its output is there once the rank's ``idle`` status for the request
(IOPub) has come, or once as many IOPub messages have come as the reply's metadata says the
cell published before it (``dist_kernel.iopub``): the idle follows the reply through the
rank's IOPub thread, a quarter of a millisecond later, so the count ends a cell sooner.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence

from dist_kernel.parent import fault_policy
from dist_kernel.parent.comms import COMM_TYPES, OUTPUT_TYPES
from dist_kernel.parent.merge import CellMerger, DisplayRegistry, error_content, merge_errors
from dist_kernel.parent.throttle import OutputBudget, StreamThrottle

#: how often held output is looked at while a cell runs
TICK = 0.05
#: ready output is published at once, but at most once per MIN_FLUSH (keeps the message rate low)
MIN_FLUSH = 0.01

#: the merger's name for a comm message it keeps in order with the outputs
IN_ORDER = "dist_kernel.in_order"
#: a rank whose reply came but whose ``idle`` did not, and that sent nothing for this long,
#: is finished all the same: a lost message never leaves a cell waiting forever
IDLE_LOST_AFTER = 3.0

Publish = Callable[[str, dict], None]
#: asks the fault policy about the busy ranks (the kernel does the I/O: where, teardown, ...)
OnLook = Callable[["CellRun"], Awaitable[None]]


class CellRun:
    """Relays and merges the outputs of one request on ``ranks``; see :meth:`wait`."""

    parent: dict = {}  # the frontend request, for messages published outside the merger

    def __init__(self, ranks: Sequence[int], publish: Publish, execution_count: int,
                 window: float, world: Sequence[int] | None = None, clock: Callable[[], float] = time.monotonic,
                 on_look: OnLook | None = None, hang_grace: float = 10.0,
                 rich_from: int | None = None, on_comm: Callable[[int, dict], None] | None = None,
                 dead: Callable[[], Sequence[int]] = tuple, budget: OutputBudget | None = None,
                 displays: DisplayRegistry | None = None) -> None:
        self.ranks = tuple(ranks)
        # budget and displays: the kernel's, so the output cap and display ids span its lifetime
        self.throttle = StreamThrottle(publish, budget=budget)
        self.publish = self.throttle.publish
        self.world = tuple(world) if world is not None else self.ranks
        self.started = clock()
        self.execution_count = execution_count
        self.clock = clock
        self.merger = CellMerger(self.ranks, window=window, rich_from=rich_from,
                                 displays=displays if displays is not None else DisplayRegistry())
        self.on_look = on_look
        self.on_comm = on_comm
        self.dead = dead
        self.hang_grace = hang_grace
        self.judge = fault_policy.Judge()
        self.finished_at: dict[int, float] = {}
        self.interrupted_at: float | None = None
        self.signalled: dict[int, float] = {}  # rank -> when it was last sent SIGINT
        self.group_broken = False  # the process group was torn down during this cell
        self.notes: list[str] = []  # lines appended to the cell's error, if any
        self.child_ids: dict[int, str] = {}  # rank -> the msg_id of the request it runs
        self.reply_metadata: dict[int, dict] = {}  # rank -> its execute_reply's metadata
        self.noticed: set[tuple] = set()  # kernel notices already shown in this cell
        self._last_look: float | None = None
        self._looking: asyncio.Task | None = None
        self._replied_at: dict[int, float] = {}
        self._heard: dict[int, float] = {}  # rank -> when it last sent anything for this cell
        self.replies: dict[int, dict] = {}
        self._expected: dict[int, int] = {}  # rank -> IOPub messages its reply says it published
        self._got: dict[int, int] = {}  # rank -> IOPub messages received for this cell
        self.idle: set[int] = set()
        self.finished: set[int] = set()
        self.closed = False
        self._last_flush = 0.0
        self._done: asyncio.Future | None = None  # resolved when every rank is finished
        self._all_finished = False

    # ------------------------------------------------ called by the kernel
    def on_iopub(self, rank: int, msg: dict) -> None:
        self._heard[rank] = self.clock()
        self._got[rank] = self._got.get(rank, 0) + 1
        self._on_iopub(rank, msg)
        if rank in self._expected:
            self._check(rank)

    def _on_iopub(self, rank: int, msg: dict) -> None:
        msg_type = msg["header"]["msg_type"]
        content = msg["content"]
        if msg_type in COMM_TYPES:
            if _capture_change(msg_type, content) and not self.closed:
                # an Output widget starts or stops capturing: what the rank printed before
                # must reach the frontend before the widget's state changes
                self.merger.add_in_order(rank, IN_ORDER, {"rank": rank, "msg": msg}, self.clock())
            elif self.on_comm is not None:
                self.on_comm(rank, msg)
            return
        if msg_type == "status":
            if content.get("execution_state") == "idle":
                self.idle.add(rank)
                self._check(rank)
        elif msg_type in OUTPUT_TYPES:
            if msg_type == "execute_result":
                content = dict(content, execution_count=self.execution_count)
            if self.closed:
                # printed after the cell ended (a background thread): publish it as it comes,
                # labelled with its rank, under the same output budget as the cells
                for late_type, late_content in self.merger.late(rank, msg_type, content, len(self.world) > 1):
                    self.publish(late_type, late_content)
                return
            self.merger.add(rank, msg_type, content, self.clock())
            if self.merger.ready and self.clock() - self._last_flush >= MIN_FLUSH:
                self.flush()  # publish at once, but not more often than MIN_FLUSH

    def on_reply(self, rank: int, content: dict, metadata: dict | None = None) -> None:
        published = ((metadata or {}).get("dist_kernel") or {}).get("iopub")
        if isinstance(published, int) and not isinstance(published, bool):
            self._expected[rank] = published
        self.replies[rank] = content
        self._replied_at[rank] = self.clock()
        self.merger.rank_replied(rank, content, self.clock())
        self._check(rank)

    def on_rank_lost(self, rank: int, ename: str, evalue: str, hint: str = "") -> None:
        """A rank will never answer (it died): end its part of the cell with an error."""
        if rank in self.finished or rank not in self.ranks:
            return
        err = error_content(ename, evalue, [hint] if hint else [])
        self.merger.errors[rank] = err
        self.replies.setdefault(rank, {"status": "error", **err})
        self.idle.add(rank)
        self._check(rank)

    def _check(self, rank: int) -> None:
        if rank in self.finished or rank not in self.replies:
            return
        if rank in self.idle or self._got.get(rank, 0) >= self._expected.get(rank, 1 << 62):
            self.finished.add(rank)
            self.finished_at[rank] = self.clock()
            self.merger.rank_done(rank, self.clock())
            if len(self.finished) == len(self.ranks):
                self._all_finished = True
                if self._done is not None and not self._done.done():
                    self._done.set_result(None)

    # ------------------------------------------------------------- driving
    def flush(self, force: bool = False) -> None:
        """Publish what is due; ``force``: everything held, twins or not."""
        self._last_flush = self.clock()
        self.merger.poll(self._last_flush + (self.merger.window + 1.0 if force else 0.0))
        self._publish_merged()

    def _publish_merged(self) -> None:
        for msg_type, content in self.merger.take():
            if msg_type == IN_ORDER:
                if self.on_comm is not None:
                    self.on_comm(content["rank"], content["msg"])
            else:
                self.publish(msg_type, content)

    async def wait(self) -> dict | None:
        """Relay output until every rank is finished; returns the merged error or None.

        The cell ends the moment its last rank is finished (one future, resolved from the
        reader that saw it); held output is looked at every TICK meanwhile, from a timer."""
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        if self._all_finished:
            self._done.set_result(None)
        timer = loop.call_later(TICK, self._tick, loop)
        try:
            await self._done
        finally:
            self._timer_cancel()
            timer.cancel()
        if self._looking is not None and not self._looking.done():
            # a late look must not tear down the group that is about to be re-formed
            self._looking.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._looking
        self.merger.finish(self.clock())
        self._publish_merged()
        self.throttle.close()
        self.closed = True
        return merge_errors(self.merger.errors, self.ranks)

    _timer: asyncio.TimerHandle | None = None

    def _timer_cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        """Every TICK while the cell runs: publish what is due, and look at the busy ranks."""
        done = self._done
        if done is None or done.done():
            return
        try:
            self.flush()
            self._idle_lost()
            self._maybe_look()
        except Exception as e:  # noqa: BLE001 - raised in wait(), as when it ran there
            if not done.done():
                done.set_exception(e)
            return
        if not done.done():
            self._timer = loop.call_later(TICK, self._tick, loop)

    def mark_stuck(self, rank: int, ename: str, evalue: str, lines: list[str]) -> None:
        """Record why a rank is being unblocked; this becomes its error for the cell."""
        self.merger.errors[rank] = error_content(ename, evalue, lines)

    def _idle_lost(self) -> None:
        """A rank that replied and then went quiet is done, even if its ``idle`` was lost."""
        now = self.clock()
        for rank in self.busy_ranks:
            if rank in self.replies and rank not in self.idle:
                quiet_since = max(self._replied_at.get(rank, now), self._heard.get(rank, 0.0))
                if now - quiet_since >= IDLE_LOST_AFTER or self.interrupted_at is not None:
                    self.idle.add(rank)
                    self._check(rank)

    def state(self) -> fault_policy.Cell:
        """This run, as the fault policy sees it."""
        errored = any(self.replies.get(r, {}).get("status") == "error" for r in self.finished)
        return fault_policy.Cell(
            ranks=self.ranks, world=self.world, busy=tuple(self.busy_ranks), dead=tuple(self.dead()),
            started=self.started, first_finished=min(self.finished_at.values(), default=None),
            errored=errored, interrupted_at=self.interrupted_at, hang_grace=self.hang_grace,
            torn_down=self.group_broken)

    def _maybe_look(self) -> None:
        """Ask ``on_look`` to look at the busy ranks when the fault policy says it is time."""
        if self.on_look is None or (self._looking is not None and not self._looking.done()):
            return
        now = self.clock()
        if fault_policy.look_due(self.state(), now, self._last_look):
            self._last_look = now
            self._looking = asyncio.ensure_future(self.on_look(self))

    def interrupt(self) -> list[int]:
        """The stop button: the busy ranks to send SIGINT now. A rank is signalled at most
        once a second: a storm of interrupts must not hit a rank that is already unwinding."""
        now = self.clock()
        if self.interrupted_at is None:
            self.interrupted_at = now
        due = [r for r in self.busy_ranks if now - self.signalled.get(r, -1e9) >= 1.0]
        for r in due:
            self.signalled[r] = now
        self._last_look = None  # look again soon: ranks blocked in a collective need a teardown
        return due

    @property
    def busy_ranks(self) -> list[int]:
        return [r for r in self.ranks if r not in self.finished]


def _capture_change(msg_type: str, content: dict) -> bool:
    """Does this comm message start or stop an ipywidgets ``Output`` capture?"""
    data = content.get("data") or {}
    state = data.get("state") if isinstance(data, dict) else None
    return msg_type == "comm_msg" and isinstance(state, dict) and "msg_id" in state
