"""``%dist_sync`` on every rank, watched as a cell is: the same looks, fault rules, stop button
and re-formation as a :class:`~dist_kernel.parent.execution.CellRun`.

The copy is a chain of collectives on every rank (:mod:`dist_kernel.rank.sync`). The ranks
agree on what can be copied before the first one, so a value that cannot travel never leaves
a rank waiting; but a rank can still die in the middle, be stopped, or a module's own
``state_dict()`` can block. So each rank's ``sync`` request is a cell to the run: a rank is
busy until its reply comes, the fault policy judges the busy ones (blocked in a broadcast that a
rank which already answered never enters: rule 2; a rank that died: rule 1; calls that cannot
complete each other: rule 3; the stop button: rule 4), the group is torn down when it must be
and formed again after. The kernel holds the run as its current cell meanwhile, so the stop
button and a rank's death reach it.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING

from dist_kernel import protocol
from dist_kernel.exceptions import RankRequestError, UsageError, error_content
from dist_kernel.parent import fault_policy
from dist_kernel.parent.execution import CellRun, CellSpec, GroupState
from dist_kernel.parent.group_magics import MagicFailed, copied_lines, sync_report
from dist_kernel.parent.relay import Outlet
from dist_kernel.parent.selection import format_ranks

if TYPE_CHECKING:
    import asyncio

    from dist_kernel.parent.ranks import Ranks

#: the words for a rank that answered while others still copy (the fault policy's idle rank)
ANSWERED = "it had finished its part of %dist_sync"


class SyncRun(CellRun):
    """One ``%dist_sync``: :meth:`copy` asks every rank, watches them until each answered (or
    was freed, or given up on), re-forms a group it broke, and says what was copied."""

    def __init__(self, spec: CellSpec, outlet: Outlet, via: Ranks, group: GroupState | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 debug_stopped: Callable[[], tuple[int, ...]] | None = None) -> None:
        super().__init__(spec, outlet, via, group, clock=clock, debug_stopped=debug_stopped)
        self.every = via
        self.synced: dict[int, protocol.Synced] = {}  # each rank's answer, once it gave one
        self.failed: set[int] = set()  # ranks whose request failed as a whole (or never came back)

    async def copy(self, names: list[str], src: int) -> str:
        """Copy ``names`` from rank ``src``; what was copied, in words. Raises
        :class:`~dist_kernel.exceptions.UsageError` naming each value that could not be copied
        and why, or :class:`~dist_kernel.parent.group_magics.MagicFailed` when a rank failed, hung,
        died or was stopped in the copy (the error names it, the group is formed again)."""
        if self.group.left_running:  # its main thread is not free to take part: everyone would wait for it
            raise UsageError(f"rank {format_ranks(sorted(self.group.left_running))} is still running a cell the "
                             "kernel gave up on, so it cannot take part in %dist_sync: wait until it is back (or "
                             "restart the kernel), then run %dist_sync again.")
        await self.group.reform_if_due(self.every, self.spec.reform_timeout)  # a group an earlier cell broke
        for rank, fut in self.every.sync(names, src).items():
            fut.add_done_callback(functools.partial(self._answered, rank))
        result = await self.finish()
        if result.error is None:
            return sync_report(names, src, dict(self.synced))
        error = result.error
        done = "; ".join(copied_lines(names, src, dict(self.synced)))
        raise MagicFailed(dict(error, evalue=f"%dist_sync {' '.join(names)} from rank {src}: nothing was copied "
                               f"where it failed; {error['evalue']}" + (f"; copied: {done}" if done else "")))

    def _answered(self, rank: int, fut: asyncio.Future) -> None:
        """A rank's reply (or its failure) came: its part of the copy is over."""
        if fut.cancelled() or rank in self.relay.finished:
            return
        exc = fut.exception()
        if exc is None and isinstance(fut.result(), protocol.Synced):
            self.synced[rank] = fut.result()
            content: dict = {"status": "ok"}
        else:
            self.failed.add(rank)
            if isinstance(exc, RankRequestError) and exc.ename:  # the rank's own error, as a cell's would show
                ename, evalue = exc.ename, exc.evalue
            else:  # it died (RankDiedError), or never answered
                ename, evalue = type(exc).__name__ if exc else "Error", str(exc) if exc else f"{fut.result()!r}"
            content = {"status": "error", **error_content(ename, evalue)}
        self.relay.on_replies([([rank], content, protocol.with_meta({}, {protocol.META_IOPUB: 0}))])

    def state(self) -> fault_policy.Cell:
        return replace(super().state(), idle_means=ANSWERED)

    def group_broke(self) -> bool:
        """A rank whose copy failed as a whole may have left the others mid-way: the group is
        formed again (the ranks that answered are in step, each having taken every step)."""
        return bool(self.failed)

    def destroyed(self) -> list[int]:
        return []
