"""One cell's run across its ranks: forward, relay outputs live, decide when it is over.

A rank is finished with a cell when both its ``execute_reply`` (shell) and its ``idle``
status for the request (IOPub) have arrived: the reply can overtake the last outputs, and
frontends stop reading a cell at the parent's ``idle``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from dist_kernel.merge import CellMerger, merge_errors

#: IOPub message types that are cell outputs and go through the merger
OUTPUT_TYPES = {"stream", "display_data", "execute_result", "update_display_data", "clear_output", "error"}
#: how often held output is published while a cell runs (keeps message rate low)
TICK = 0.05

Publish = Callable[[str, dict], None]


class CellRun:
    """Relays and merges the outputs of one request on ``ranks``; see :meth:`wait`."""

    def __init__(self, ranks: Sequence[int], publish: Publish, execution_count: int,
                 window: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.ranks = tuple(ranks)
        self.publish = publish
        self.execution_count = execution_count
        self.clock = clock
        self.merger = CellMerger(self.ranks, window=window)
        self.replies: dict[int, dict] = {}
        self.idle: set[int] = set()
        self.finished: set[int] = set()
        self.msg_ids: dict[str, int] = {}  # child msg_id -> rank
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
            self.merger.add(rank, msg_type, content, self.clock())

    def on_reply(self, rank: int, content: dict) -> None:
        self.replies[rank] = content
        if content.get("status") == "error" and rank not in self.merger.errors:
            self.merger.errors[rank] = {k: content.get(k) for k in ("ename", "evalue", "traceback")}
        self._check(rank)

    def on_rank_lost(self, rank: int, ename: str, evalue: str, hint: str = "") -> None:
        """A rank will never answer (it died): end its part of the cell with an error."""
        if rank in self.finished or rank not in self.ranks:
            return
        tb = [f"\x1b[1;31m{ename}\x1b[0m: {evalue}"] + ([hint] if hint else [])
        self.merger.errors[rank] = {"ename": ename, "evalue": evalue, "traceback": tb}
        self.replies.setdefault(rank, {"status": "error", "ename": ename, "evalue": evalue, "traceback": tb})
        self.idle.add(rank)
        self._check(rank)

    def _check(self, rank: int) -> None:
        if rank in self.replies and rank in self.idle and rank not in self.finished:
            self.finished.add(rank)
            self.merger.rank_done(rank, self.clock())
            if len(self.finished) == len(self.ranks):
                self._done.set()

    # ------------------------------------------------------------- driving
    def flush(self) -> None:
        self.merger.poll(self.clock())
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
        self.merger.finish(self.clock())
        for msg_type, content in self.merger.take():
            self.publish(msg_type, content)
        return merge_errors(self.merger.errors, self.ranks)

    @property
    def busy_ranks(self) -> list[int]:
        return [r for r in self.ranks if r not in self.finished]
