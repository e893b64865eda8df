"""Units, as a specification: how a rank's stream is cut into the lines and progress states its
twins are matched by (dist_kernel.parent.merge.units)."""

from __future__ import annotations

from harness import visible
from merge_cases import (
    W,
    err,
    run,
    say,
)

from dist_kernel.parent.merge import (
    CellMerger,
)


class TestPartialLines:
    def test_an_unfinished_line_before_a_clear_does_not_join_the_line_after_it(self):
        for ranks in ([0], [0, 1]):
            events = []
            for r in ranks:
                events += [say(0, r, "Hello"), (0.001, r, "clear_output", {"wait": True}), say(0.002, r, "world\n")]
            assert visible(run(CellMerger(ranks, W), events)) == "world\n"

    def test_an_unfinished_line_of_one_stream_is_not_held_behind_the_other_stream(self):
        out = run(CellMerger([0], W), [say(0, 0, "Hello"), say(0.001, 0, "warn\n", "stderr"), say(0.002, 0, "world\n")])
        assert [(c["name"], c["text"]) for _, c in out] == [("stdout", "Hello"), ("stderr", "warn\n"),
                                                             ("stdout", "world\n")]

    def test_an_unfinished_line_stays_before_an_error_shown_after_it(self):
        m = CellMerger([0], W)
        for now, rank, t, c in [say(0, 0, "Hello"), err(0.001, 0, "ValueError"), say(0.002, 0, "world\n")]:
            m.add(rank, t, c, now)
        m.rank_replied(0, {"status": "ok"}, 0.01)
        m.finish(1)
        assert [c.get("text", c.get("ename")) for _, c in m.take()] == ["Hello", "ValueError", "world\n"]

