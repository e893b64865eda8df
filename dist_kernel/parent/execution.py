"""One cell's run across its ranks: forward, relay outputs live, decide when it is over.

A rank is finished with a cell when both its ``execute_reply`` (shell) and its ``idle``
status for the request (IOPub) have arrived: the reply can overtake the last outputs, and
frontends stop reading a cell at the parent's ``idle``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence

from dist_kernel.parent.merge import CellMerger, DisplayRegistry, error_content, merge_errors
from dist_kernel.parent.throttle import OutputBudget, StreamThrottle

#: IOPub message types that are cell outputs and go through the merger
OUTPUT_TYPES = {"stream", "display_data", "execute_result", "update_display_data", "clear_output", "error"}
#: how often held output is looked at while a cell runs
TICK = 0.05
#: ready output is published at once, but at most once per MIN_FLUSH (keeps the message rate low)
MIN_FLUSH = 0.01

Publish = Callable[[str, dict], None]
#: called when some ranks finished and others are still busy past the grace period
OnStall = Callable[["CellRun", list[int], list[int]], Awaitable[None]]
#: after a rank errors or an interrupt, how long the others may stay busy before a look
FAST_GRACE = 1.0


class CellRun:
    """Relays and merges the outputs of one request on ``ranks``; see :meth:`wait`."""

    parent: dict = {}  # the frontend request, for messages published outside the merger

    def __init__(self, ranks: Sequence[int], publish: Publish, execution_count: int,
                 window: float, world: Sequence[int] | None = None, clock: Callable[[], float] = time.monotonic,
                 on_stall: OnStall | None = None, hang_grace: float = 10.0,
                 rich_from: int | None = None, budget: OutputBudget | None = None,
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
        self.on_stall = on_stall
        self.hang_grace = hang_grace
        self.finished_at: dict[int, float] = {}
        self.interrupted_at: float | None = None
        self.group_broken = False  # the process group was torn down during this cell
        self.notes: list[str] = []  # lines appended to the cell's error, if any
        self._last_look = 0.0
        self._looking: asyncio.Task | None = None
        self.replies: dict[int, dict] = {}
        self.idle: set[int] = set()
        self.finished: set[int] = set()
        self.closed = False
        self._last_flush = 0.0
        self._done = asyncio.Event()

    # ------------------------------------------------ called by the kernel
    def on_iopub(self, rank: int, msg: dict) -> None:
        msg_type = msg["header"]["msg_type"]
        content = msg["content"]
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

    def on_reply(self, rank: int, content: dict) -> None:
        self.replies[rank] = content
        if content.get("status") == "error" and rank not in self.merger.errors:
            self.merger.errors[rank] = {k: content.get(k) for k in ("ename", "evalue", "traceback")}
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
        if rank in self.replies and rank in self.idle and rank not in self.finished:
            self.finished.add(rank)
            self.finished_at[rank] = self.clock()
            self.merger.rank_done(rank, self.clock())
            if len(self.finished) == len(self.ranks):
                self._done.set()

    # ------------------------------------------------------------- driving
    def flush(self) -> None:
        self._last_flush = self.clock()
        self.merger.poll(self._last_flush)
        self._publish_merged()

    def _publish_merged(self) -> None:
        for msg_type, content in self.merger.take():
            self.publish(msg_type, content)

    async def wait(self) -> dict | None:
        """Relay output until every rank is finished; returns the merged error or None."""
        while not self._done.is_set():
            try:
                await asyncio.wait_for(self._done.wait(), TICK)
            except asyncio.TimeoutError:
                pass
            self.flush()
            self._maybe_look()
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

    def mark_stuck(self, rank: int, ename: str, evalue: str, lines: list[str]) -> None:
        """Record why a rank is being unblocked; this becomes its error for the cell."""
        self.merger.errors[rank] = error_content(ename, evalue, lines)

    def _maybe_look(self) -> None:
        """Some ranks idle (finished, or outside a %%rank cell), others busy past the grace
        period: ask ``on_stall`` to look at where the busy ones are."""
        busy = self.busy_ranks
        idle = [r for r in self.world if r not in busy]
        if not busy or not idle or self.on_stall is None or self.group_broken:
            return  # after a teardown the blocked ranks raise by themselves
        if self._looking is not None and not self._looking.done():
            return
        now = self.clock()
        errored = any(self.replies.get(r, {}).get("status") == "error" for r in self.finished)
        grace = FAST_GRACE if (errored or self.interrupted_at is not None) else self.hang_grace
        outsiders = len(self.world) > len(self.ranks)
        since = self.started if outsiders else min(self.finished_at.values())
        since = max(since, self.interrupted_at or 0.0)
        if now - since >= grace and now - self._last_look >= grace:
            self._last_look = now
            self._looking = asyncio.ensure_future(self.on_stall(self, busy, idle))

    @property
    def busy_ranks(self) -> list[int]:
        return [r for r in self.ranks if r not in self.finished]
