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


def _mixed_cell(together: bool) -> list:
    """1,024 ranks: rank 5 left an unfinished line, rank 9 a line of its own, rank 700 a progress
    bar's last ``\\r``; the others printed nothing. Every rank replies ok and ends, one by one or
    as one node's group (``ranks_replied``, ``ranks_done``); what is shown, in order."""
    m = CellMerger(range(N), W)
    m.add(5, "stream", {"name": "stdout", "text": "partial"}, 0.0)
    m.add(9, "stream", {"name": "stdout", "text": "own line\n"}, 0.0)
    m.add(700, "stream", {"name": "stderr", "text": "50%\r"}, 0.0)
    shown = m.take()
    if together:
        m.ranks_replied(list(range(N)), {"status": "ok"}, 0.001)
        m.ranks_done(list(range(N)), 0.001)
    else:
        for r in range(N):
            m.rank_replied(r, {"status": "ok"}, 0.001, settle=False)
            m.rank_done(r, 0.001, settle=False)
        m.settle(0.001)
    shown += m.take()
    m.finish(1.0)
    return shown + m.take()


def test_a_nodes_ranks_ended_as_one_group_show_what_they_show_ended_one_by_one():
    # issue 26: the ranks that printed nothing are only counted done; the others take the whole path
    def shown(together: bool) -> list:  # display ids are unique per merger: left out of the comparison
        return [(t, {k: v for k, v in c.items() if k != "transient"}) for t, c in _mixed_cell(together)]

    grouped = shown(together=True)
    assert grouped == shown(together=False)
    assert streams(grouped) == "[rank 5] partial\n[rank 9] own line\n"
    assert ("display_data", {"data": {"text/plain": "[rank 700] 50%"}, "metadata": {}}) in grouped
