"""A cell run while the ranks start, or after they could not: it waits for them, or says why
the kernel cannot run cells.

What the launcher says while the ranks start (waiting in the Slurm queue, the job id) is shown
in the cell that waits for them, or in the first cell. The stop button ends the waiting cell and
never signals a starting rank: the ranks go on starting, and the next cell runs on them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime
from typing import TYPE_CHECKING

from dist_kernel.exceptions import RankDiedError, RankStartError, error_content
from dist_kernel.parent import membership_words as words
from dist_kernel.parent.held import pressed_before

if TYPE_CHECKING:
    from dist_kernel.parent.ranks import Ranks

#: (the frontend's request, msg_type, content) on the parent's IOPub
Publish = Callable[[dict, str, dict], None]


class StartWait:
    """The cell that waits while the ranks start, and what the launcher said meanwhile."""

    def __init__(self, publish: Publish) -> None:
        self._publish = publish
        self._stopped = asyncio.Event()  # the stop button while the ranks start
        self.waiting: dict | None = None  # the request of the cell that waits now
        self._notes: list[str] = []  # what the launcher said while the ranks start

    def note(self, text: str) -> None:
        """The launcher's news: shown in the waiting cell, or in the first cell."""
        self._notes.append(text)
        if self.waiting is not None:
            self._say(self.waiting, text)

    def stop(self, pressed: datetime | None) -> None:
        """The stop button (pressed at ``pressed``, by the frontend's clock): ends the waiting
        cell, unless the frontend sent that cell after it was pressed."""
        if self.waiting is not None and not pressed_before(pressed, self.waiting):
            self._stopped.set()

    async def wait(self, ranks: Ranks, request: dict) -> dict | None:
        """Wait in the cell of ``request`` until the ranks are ready; the error to show when
        the stop button ended the wait first."""
        self._stopped.clear()
        self.waiting = request
        for text in self._notes:
            self._say(request, text)
        ready = asyncio.ensure_future(ranks.ready.wait())
        stop = asyncio.ensure_future(self._stopped.wait())
        await asyncio.wait([ready, stop], return_when=asyncio.FIRST_COMPLETED)
        for task in (ready, stop):
            task.cancel()
        self.waiting = None
        if ranks.ready.is_set():
            return None
        return error_content(KeyboardInterrupt, "interrupted while the ranks were starting; they "
                             "go on starting, and the next cell runs on them")

    def _say(self, request: dict, text: str) -> None:
        self._publish(request, "stream", {"name": "stderr", "text": f"[dist_kernel] {text}\n"})


def unusable(ranks: Ranks) -> dict | None:
    """Once the ranks are ready: the error to show when no cell can run on them (they did not start)."""
    if ranks.start_error:
        return error_content(RankStartError, ranks.start_error)
    return None


def dead_in(ranks: Ranks, cell_ranks: tuple[int, ...]) -> dict | None:
    """The error of a cell that names a rank that has died (and was not started anew): the
    cell does not run; the survivors kept their variables, and cells on them alone still run."""
    gone = ranks.gone()
    if not gone:
        return None
    dead = [r for r in cell_ranks if r in gone]
    if not dead:
        return None
    what = "; ".join(f"rank {r} ({ranks.describe(r)}) {ranks.exit_reason(r)}" for r in dead)
    if not ranks.live():  # nothing survived (a lost node, a cancelled job): nothing to keep
        return error_content(RankDiedError, what, [words.ALL_GONE])
    return error_content(RankDiedError, what, [words.dead_cell(dead)])
