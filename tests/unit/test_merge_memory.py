"""A finished cell's merger gives back the memory its output took.

A cell's merger stays routed after the cell for the output its threads print late (the last
``ranks.RECENT`` cells), so whatever it keeps, the parent keeps 64 times over: before this, a
cell of 300,000 lines per rank left 30-45 MB behind in the parent, cell after cell.
"""

from __future__ import annotations

import gc
import tracemalloc

from merge_cases import W, streams

from dist_kernel.parent.merge import CellMerger

LINES = 3_000


def _flood(m: CellMerger) -> str:
    """Rank 0 prints every line before rank 1 (its lines wait for their twins), half the lines
    the same on both ranks and half their own; the cell ends. What was shown."""
    shown = []
    for r in (0, 1):
        for i in range(LINES):
            text = f"{i}\n" if i % 2 else f"rank {r} line {i}\n"
            m.add(r, "stream", {"name": "stdout", "text": text}, 0.001 * r)
        shown += m.take()
    for r in (0, 1):
        m.rank_replied(r, {"status": "ok"}, 0.01)
        m.rank_done(r, 0.01)
    m.finish(1.0)
    return streams(shown + m.take())


def test_a_finished_cells_merger_keeps_nothing_that_grows_with_its_output():
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        m = CellMerger(range(2), W)
        text = _flood(m)
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - base - len(text.encode()) * 2  # the text itself
    finally:
        tracemalloc.stop()
    assert text.count("\n") == LINES // 2 + LINES  # shared lines once, each rank's own lines labelled
    assert "[rank 1] rank 1 line 0\n" in text and f"{LINES - 1}\n" in text
    assert kept < 512 * 1024, f"the finished merger keeps {kept >> 10} KiB after {LINES} lines per rank"
