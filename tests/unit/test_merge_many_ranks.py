"""Many ranks, as a specification: at 1,024 ranks a cell's output is shown complete, in order and
labelled, as it is at 2, and while the cell runs (issue 26: the merger's work per output does not
grow with the rank count; its cost is measured in benchmarks/merge_cpu.py, not asserted here)."""

from __future__ import annotations

import random

import pytest
from merge_cases import W, streams

from dist_kernel.parent.merge import CellMerger

N = 1024


def _cell(n: int, split: bool, seed: int) -> tuple[list, list]:
    """Every rank prints ``hello`` then ``rank <r>``, the ranks in a shuffled order, each rank's
    reply and end right after its output; returns what was shown while the cell ran, and at its end."""
    order = list(range(n))
    random.Random(seed).shuffle(order)
    m = CellMerger(range(n), W)
    during: list = []
    now = 0.0
    for r in order:
        now += 1e-5
        texts = ["hello\n", f"rank {r}\n"] if split else [f"hello\nrank {r}\n"]
        for text in texts:
            m.add(r, "stream", {"name": "stdout", "text": text}, now)
            during += m.take()
        m.rank_replied(r, {"status": "ok"}, now)
        m.rank_done(r, now)
        during += m.take()
    m.finish(now + 1.0)
    return during, m.take()


@pytest.mark.parametrize("split", [True, False], ids=["a message per line", "both lines in one message"])
def test_1024_ranks_show_the_shared_line_once_and_every_ranks_own_line_labelled_in_rank_order(split):
    during, at_end = _cell(N, split, seed=26)
    expected = "hello\n" + "".join(f"[rank {r}] rank {r}\n" for r in range(N))
    assert streams(during) == expected  # complete, ordered, labelled, and shown while the cell ran
    assert at_end == []


def test_1024_ranks_printing_the_same_line_show_it_once():
    m = CellMerger(range(N), W)
    for r in reversed(range(N)):
        m.add(r, "stream", {"name": "stdout", "text": "1\n"}, r * 1e-5)
        m.rank_replied(r, {"status": "ok"}, r * 1e-5)
    out = m.take()
    for r in range(N):
        m.rank_done(r, 0.1)
    m.finish(0.2)
    assert out == [("stream", {"name": "stdout", "text": "1\n"})] and m.take() == []
