"""Merging, as a specification: which outputs of N ranks are twins, shown once, and which are
labelled with their ranks; how long an output waits for its twins (dist_kernel.parent.merge.alignment)."""

from __future__ import annotations

import random
import re

import pytest
from merge_cases import (
    LINES,
    W,
    disp,
    drift,
    expand,
    final_displays,
    frontend,
    kinds,
    per_rank,
    run,
    run_polled,
    say,
    say_branch,
    say_solo,
    streams,
)

from dist_kernel.parent.merge import (
    LAG_BOUND,
    CellMerger,
    namespaced_display_id,
)


class TestStreams:
    def test_a_line_every_rank_prints_identically_appears_once_unlabelled(self):
        out = run(CellMerger([0, 1], W), [say(0, 0, "epoch 1\n"), say(0.01, 1, "epoch 1\n")])
        assert streams(out) == "epoch 1\n"

    def test_lines_that_differ_are_labelled_with_their_rank_in_rank_order(self):
        out = run(CellMerger([0, 1], W), [say(0, 1, "loss 0.5\n"), say(0.01, 0, "loss 0.7\n")])
        assert streams(out) == "[rank 0] loss 0.7\n[rank 1] loss 0.5\n"

    def test_a_line_some_ranks_share_is_labelled_with_that_subset(self):
        events = [say(0, 0, "a\n"), say(0, 1, "a\n"), say(0, 2, "b\n")]
        assert streams(run(CellMerger([0, 1, 2], W), events)) == "[rank 0,1] a\n[rank 2] b\n"

    def test_a_line_only_one_rank_prints_does_not_break_collapsing_of_the_rest(self):
        events = [say(0, 0, "only rank 0\ncommon\n"), say(0.02, 1, "common\n")]
        assert streams(run(CellMerger([0, 1], W), events)) == "[rank 0] only rank 0\ncommon\n"

    def test_each_ranks_order_is_kept_and_nothing_is_lost(self):
        rng = random.Random(7)
        texts = {r: [f"{'same' if rng.random() < 0.5 else f'r{r}'} {i}\n" for i in range(200)] for r in range(3)}
        events = []
        for r, lines in texts.items():
            t = 0.0
            for line in lines:
                t += rng.random() * 0.03
                events.append(say(t, r, line))
        out = streams(run(CellMerger([0, 1, 2], W), events, end=100))
        per_rank = {r: [] for r in range(3)}
        for line in out.splitlines(keepends=True):
            m = re.match(r"\[rank ([\d,-]+)\] (.*)", line, re.S)
            owners = expand(m.group(1)) if m else [0, 1, 2]
            for r in owners:
                per_rank[r].append(m.group(2) if m else line)
        assert per_rank == texts

    def test_stdout_and_stderr_stay_apart(self):
        out = run(CellMerger([0, 1], W), [say(0, 0, "out\n"), say(0, 1, "out\n"),
                                          say(0, 0, "err\n", "stderr"), say(0, 1, "err\n", "stderr")])
        assert streams(out, "stdout") == "out\n"
        assert streams(out, "stderr") == "err\n"

    def test_a_line_waits_for_a_silent_rank_at_most_the_lag_bound(self):
        m = CellMerger([0, 1], W)
        m.add(0, "stream", {"name": "stdout", "text": "early\n"}, 0.0)
        m.poll(LAG_BOUND - 0.01)
        assert m.take() == []  # rank 1 may be running late: its twin is waited for
        m.poll(LAG_BOUND)
        assert streams(m.take()) == "[rank 0] early\n"

    def test_a_line_that_differs_from_another_ranks_line_at_its_place_is_shown_at_once(self):
        m = CellMerger([0, 1], W)
        for now, rank, text in [(0, 1, "a\n"), (0, 1, "b\n"), (0.5, 0, "a\n"), (0.9, 0, "c\n")]:
            m.poll(now)
            m.add(rank, "stream", {"name": "stdout", "text": text}, now)
        assert streams(m.take()) == "a\n[rank 0] c\n[rank 1] b\n"  # at 0.9, not a window later

    def test_a_late_twin_of_a_line_already_shown_is_shown_at_once(self):
        m = CellMerger([0, 1], W)
        m.add(0, "stream", {"name": "stdout", "text": "a\nb\n"}, 0.0)
        m.poll(LAG_BOUND)  # rank 1 silent for the lag bound: not waited for
        m.add(1, "stream", {"name": "stdout", "text": "a\n"}, LAG_BOUND + 1)  # rank 0 is past it
        assert streams(m.take()) == "[rank 0] a\n[rank 0] b\n[rank 1] a\n"

    def test_a_single_rank_cell_is_never_labelled_nor_delayed(self):
        m = CellMerger([1], W)
        m.add(1, "stream", {"name": "stdout", "text": "hi\n"}, 0.0)
        assert streams(m.take()) == "hi\n"

    def test_an_unfinished_line_is_published_after_the_window_and_continued_without_a_second_label(self):
        m = CellMerger([0, 1], W)
        m.add(0, "stream", {"name": "stdout", "text": "working"}, 0.0)
        m.poll(0.25)
        m.add(0, "stream", {"name": "stdout", "text": "... done\n"}, 0.3)
        m.finish(1.0)
        assert streams(m.take()) == "[rank 0] working... done\n"

    def test_carriage_return_progress_from_several_ranks_does_not_garble(self):
        # each rank's \r-rewritten line is a line of one display, updated in place
        out = run(CellMerger([0, 1], W), [say(0, 0, "10%\r"), say(0, 1, "5%\r"), say(0.3, 0, "50%\r"),
                                          say(0.35, 1, "30%\r")])
        assert streams(out) == ""
        assert final_displays(out) == {"[rank 0] 50%\n[rank 1] 30%"}

    @pytest.mark.parametrize("n", [2, 3])
    def test_a_rank_left_alone_by_finished_ranks_is_never_delayed(self, n):
        m = CellMerger(range(n), W)
        for r in range(1, n):
            m.rank_done(r, 0.0)
        m.add(0, "stream", {"name": "stdout", "text": "late\n"}, 0.01)
        assert streams(m.take()) == "[rank 0] late\n"  # at once, not a window or a lag bound later

    def test_output_is_bounded_when_one_rank_floods(self):
        m = CellMerger([0, 1], W, max_pending=100)
        for i in range(1000):
            m.add(0, "stream", {"name": "stdout", "text": f"{i}\n"}, 0.0)
        assert m.pending <= 101


class TestDrift:
    @pytest.mark.parametrize("lag", [0.5, 2.0])
    @pytest.mark.parametrize("n", [2, 4, 8])
    def test_identical_lines_of_a_rank_that_lags_by_a_fixed_time_show_once(self, n, lag):
        events = drift({r: LINES for r in range(n)}, {r: lag if r == 1 else 0.0 for r in range(n)},
                       dict.fromkeys(range(n), 0.001))
        assert streams(run_polled(CellMerger(range(n), W), events, end=lag + 2)) == "".join(LINES)

    def test_identical_lines_of_a_rank_falling_further_and_further_behind_show_once(self):
        events = drift({0: LINES, 1: LINES}, {0: 0.0, 1: 0.0}, {0: 0.001, 1: 0.011})  # 3 s behind at the end
        assert streams(run_polled(CellMerger([0, 1], W), events, end=5)) == "".join(LINES)

    def test_a_burst_from_one_rank_merges_with_the_other_ranks_slower_lines(self):
        events = drift({0: LINES, 1: LINES}, {0: 0.0, 1: 0.0}, {0: 0.0, 1: 0.005})  # all of rank 0 at once
        assert streams(run_polled(CellMerger([0, 1], W), events, end=3)) == "".join(LINES)

    def test_a_rank_that_stalls_and_catches_up_is_merged(self):
        events = drift({0: LINES, 1: LINES}, {0: 0.0, 1: 0.0}, {0: 0.002, 1: 0.001}, pause=(1, 100, 1.5))
        assert streams(run_polled(CellMerger([0, 1], W), events, end=4)) == "".join(LINES)

    def test_a_rank_that_stalls_past_the_lag_bound_is_labelled_then_merged_again_with_nothing_lost(self):
        events = drift({0: LINES, 1: LINES}, {0: 0.0, 1: 0.0}, {0: 0.01, 1: 0.001},
                       pause=(1, 100, LAG_BOUND + 1))
        text = streams(run_polled(CellMerger([0, 1], W), events, end=LAG_BOUND + 6))
        assert per_rank(text, [0, 1]) == {0: LINES, 1: LINES}
        assert "[rank" in text and text.endswith("step 299\n")  # merged again by the end

    def test_a_rank_whose_output_reached_the_parent_late_is_not_silent_for_the_time_it_waited(self):
        # 8 ranks on 2 cores: the parent reads seconds behind; rank 1 sent its line 1 s after
        # rank 0, but it arrives past the lag bound. Silence is counted in send times
        m = CellMerger([0, 1, 2], W)
        m.add(0, "stream", {"name": "stdout", "text": "a\n"}, 0.0, sent=0.0)
        m.add(2, "stream", {"name": "stdout", "text": "a\n"}, 3.0, sent=0.1)  # the parent is behind
        m.poll(LAG_BOUND + 1)
        assert m.take() == []  # the merger's view reaches 3 s back: rank 1 silent for 3 s only
        m.add(1, "stream", {"name": "stdout", "text": "a\n"}, LAG_BOUND + 1.5, sent=1.0)
        m.poll(LAG_BOUND + 2)
        assert streams(m.take()) == "a\n"

    def test_a_rank_silent_past_the_lag_bound_in_send_times_is_not_waited_for(self):
        m = CellMerger([0, 1], W)
        m.add(0, "stream", {"name": "stdout", "text": "a\n"}, 0.0, sent=0.0)
        m.add(0, "stream", {"name": "stdout", "text": "b\n"}, 3.0, sent=2.0)  # read 1 s late
        m.poll(LAG_BOUND + 0.9)
        assert m.take() == []  # the view reaches LAG_BOUND - 0.1: rank 1 may still lag
        m.poll(LAG_BOUND + 1)
        assert streams(m.take()) == "[rank 0] a\n[rank 0] b\n"  # rank 1 sent nothing in LAG_BOUND of send time

    def test_a_lagging_rank_with_an_extra_line_is_matched_again_after_it(self):
        events = drift({0: LINES[:50], 1: ["rank 1 only\n", *LINES[:50]]}, {0: 0.0, 1: 0.5},
                       {0: 0.001, 1: 0.02})
        text = streams(run_polled(CellMerger([0, 1], W), events, end=3))
        assert per_rank(text, [0, 1]) == {0: LINES[:50], 1: ["rank 1 only\n", *LINES[:50]]}
        assert text.count("[rank") <= 3  # the extra line, and at most one line on each side

    def test_lines_that_differ_on_every_rank_are_not_held_once_the_ranks_diverge(self):
        texts = {r: [f"rank {r} step {i}\n" for i in range(100)] for r in (0, 1)}
        events = drift(texts, {0: 0.0, 1: 1.0}, {0: 0.01, 1: 0.01})
        m = CellMerger([0, 1], W)
        shown_at = {}
        for now, rank, t, c in sorted(events, key=lambda e: e[0]):
            m.poll(now)
            m.add(rank, t, c, now)
            for line in streams(m.take()).splitlines():
                shown_at[line] = now
        # rank 0's last line is shown within the window, not a second later with rank 1's
        assert shown_at["[rank 0] rank 0 step 99"] <= 0.99 + W + 0.05
        m.finish(3)
        assert per_rank("\n".join(shown_at) + "\n" + streams(m.take()), [0, 1]) == texts

    def test_identical_carriage_return_progress_that_drifts_is_one_line(self):
        def bar(r):
            return [say(0.3 * r + 0.02 * i, r, f"\r{i}%") for i in range(40)] + [say(0.3 * r + 0.8, r, "\n")]
        out = run_polled(CellMerger([0, 1], W), bar(0) + bar(1), end=2)
        assert "[rank" not in str(out) and final_displays(out) == {"39%"} and frontend(out) == "39%\n"

    def test_progress_units_do_not_depend_on_how_the_text_was_cut_into_messages(self):
        whole = "start\n\r1%\r2%\r3%\ndone\n"
        pieces = ["start\n", "\r1%", "\r", "2%", "\r3%", "\n", "done\n"]
        events = [say(0, 0, whole)] + [say(0.5 + 0.01 * i, 1, p) for i, p in enumerate(pieces)]
        out = run_polled(CellMerger([0, 1], W), events, end=2)
        assert "[rank" not in str(out) and frontend(out) == "start\n3%\ndone\n"

    def test_an_identical_display_with_an_id_and_its_update_show_once_when_a_rank_lags(self):
        events = [disp(0.5 * r, r, "same", "d") for r in (0, 1)] + [
            disp(0.05 + 0.5 * r, r, "updated", "d", "update_display_data") for r in (0, 1)]
        out = run_polled(CellMerger([0, 1], W), events, end=2)
        assert [(t, c["data"]["text/plain"]) for t, c in out] == [
            ("display_data", "same"), ("update_display_data", "updated")]

    def test_3000_identical_displays_of_a_lagging_rank_show_once(self):
        events = [(0.0005 * i + (0.5 if r else 0), r, "display_data", {"data": {"text/plain": str(i)}, "metadata": {}})
                  for r in (0, 1) for i in range(3000)]
        out = run_polled(CellMerger([0, 1], W), events, end=3)
        assert [c["data"]["text/plain"] for _, c in out] == [str(i) for i in range(3000)]

    def test_a_flood_held_for_a_lagging_rank_is_bounded_in_memory(self):
        m = CellMerger([0, 1], W, max_bytes=100_000)
        for i in range(10_000):
            m.add(0, "stream", {"name": "stdout", "text": f"{i}\n"}, 0.0)
        assert m.pending * 200 <= 100_000 + 1_000
        m.finish(1)
        assert per_rank(streams(m.take()), [0, 1])[0] == [f"{i}\n" for i in range(10_000)]

    def test_a_line_one_rank_sent_in_two_pieces_still_merges_with_its_whole_twins(self):
        events = [say(0, 0, "5087"), say(0.3, 0, "\n5088\n")] + [say(0.5, r, "5087\n5088\n") for r in (1, 2)]
        text = streams(run_polled(CellMerger([0, 1, 2], W), events, end=2))
        assert text == "5087\n5088\n"

    def test_identical_lines_between_differing_ones_of_a_lagging_rank_show_once(self):
        def lines(r, a, b):
            return "".join(f"{i}\nrank {r} at {i}\n" for i in range(a, b))
        events = [say(0.001 * k + 0.5 * r, r, lines(r, k, k + 50)) for r in (0, 1) for k in range(0, 500, 50)]
        text = streams(run_polled(CellMerger([0, 1], W), events, end=3))
        assert [line for line in text.splitlines() if not line.startswith("[rank")] == [str(i) for i in range(500)]
        assert per_rank(text, [0, 1]) == {r: lines(r, 0, 500).splitlines(keepends=True) for r in (0, 1)}

    def test_a_line_two_ranks_cut_at_different_places_still_merges(self):
        events = [say(0, 0, "50"), say(0.3, 0, "87\n"), say(0, 1, "508"), say(0.4, 1, "7\n"), say(0.5, 2, "5087\n")]
        assert streams(run_polled(CellMerger([0, 1, 2], W), events, end=2)) == "5087\n"


class TestLargeOutputs:
    def test_a_large_identical_output_waits_for_its_twin_long_enough_to_be_sent_once(self):
        big = {"data": {"text/plain": "x" * 5_000_000}, "metadata": {}}
        m = CellMerger([0, 1], W)
        m.add(0, "execute_result", big, 0.0)
        for now in (0.1, 0.2, 0.4):  # the twin takes 0.45 s to arrive: far past the window
            m.poll(now)
        m.add(1, "execute_result", dict(big), 0.45)
        m.finish(1.0)
        out = m.take()
        assert len(out) == 1 and out[0][1]["data"]["text/plain"] == "x" * 5_000_000

    def test_a_large_output_only_one_rank_shows_is_published_once_its_wait_is_over(self):
        m = CellMerger([0, 1], W)
        m.add(0, "display_data", {"data": {"text/plain": "x" * 1_000_000}, "metadata": {}}, 0.0)
        m.poll(LAG_BOUND + 0.05)
        assert m.take() == []  # rank 1 silent for the lag bound + 1 MB at 10 MB/s
        m.poll(LAG_BOUND + 0.15)
        assert kinds(m.take()) == ["display_data"]

    def test_100k_identical_displays_per_rank_merge_in_linear_time(self):
        import time as _time

        m = CellMerger([0, 1], W)
        t0 = _time.perf_counter()
        shown = 0
        for i in range(100_000):
            for r in (0, 1):
                m.add(r, "display_data", {"data": {"text/plain": str(i)}, "metadata": {}}, i * 1e-5)
            if i % 100 == 0:
                shown += len(m.take())
        m.finish(2.0)
        shown += len(m.take())
        elapsed = _time.perf_counter() - t0
        assert shown == 100_000
        assert elapsed < 30  # about 2 s here; quadratic work would take hours


class TestSoloOutput:
    def test_output_a_rank_marks_as_its_alone_is_shown_unlabelled_at_once(self):
        c = {"data": {"text/html": "<progress>"}, "metadata": {"dist_kernel": {"solo": True}},
             "transient": {"display_id": "bar"}}
        m = CellMerger([0, 1], W)
        m.add(0, "display_data", c, 0.0)
        ((t, out),) = m.take()
        assert t == "display_data" and out["data"] == {"text/html": "<progress>"}
        assert out["metadata"] == {} and out["transient"]["display_id"] == namespaced_display_id("bar", 0)


class TestSoloStreams:
    def test_text_only_rank_0_prints_but_marked_as_its_alone_shows_once_unlabelled_without_the_mark(self):
        out = run(CellMerger([0, 1], W), [say(0, 0, "start\n"), say(0.01, 1, "start\n"),
                                          say_solo(0.02, 0, "epoch 0: loss 0.5"), say_solo(0.03, 0, "\n"),
                                          say(0.04, 0, "done\n"), say(0.05, 1, "done\n")])
        assert streams(out) == "start\nepoch 0: loss 0.5\ndone\n"
        assert all(set(c) == {"name", "text"} for t, c in out if t == "stream")

    def test_unmarked_text_only_rank_0_prints_is_still_labelled(self):
        out = run(CellMerger([0, 1], W), [say(0, 0, "mine\n")])
        assert streams(out) == "[rank 0] mine\n"

    def test_solo_text_keeps_its_place_among_the_ranks_own_output(self):
        out = run(CellMerger([0, 1], W), [say(0, 0, "a\n"), say_solo(0.01, 0, "bar 100%\n"), say(0.02, 1, "a\n")])
        assert streams(out) == "a\nbar 100%\n"

    def test_in_a_one_rank_cell_the_mark_is_dropped_and_the_text_is_plain(self):
        out = run(CellMerger([1], W), [say_solo(0, 1, "x\n")])
        assert out == [("stream", {"name": "stdout", "text": "x\n"})]


class TestOutputInABranchOnTheRank:
    """Issue 19: a print that only rank 0 makes reaches the frontend within the merge window,
    even while the other ranks still run the cell silently (they may not merely lag)."""

    def test_it_is_shown_labelled_one_window_after_it_came_while_the_others_run_silently(self):
        m = CellMerger([0, 1], W)
        m.add(0, "stream", say_branch(0, 0, "loss 0.5\n")[3], 0.0)
        m.poll(W - 0.01)
        assert m.take() == []  # a twin made in step may still come within the window
        m.poll(W)
        assert streams(m.take()) == "[rank 0] loss 0.5\n"

    def test_the_same_line_unmarked_still_waits_for_a_rank_that_may_lag(self):
        m = CellMerger([0, 1], W)
        m.add(0, "stream", {"name": "stdout", "text": "loss 0.5\n"}, 0.0)
        m.poll(1.0)
        assert m.take() == []

    def test_ranks_that_both_enter_the_branch_in_step_are_merged(self):
        out = run(CellMerger([0, 1, 2, 3], W), [say_branch(0, 0, "hi\n"), say_branch(0.02, 1, "hi\n")])
        assert streams(out) == "[rank 0,1] hi\n"

    def test_it_takes_no_place_so_later_identical_lines_still_merge_whichever_rank_leads(self):
        loop = [say_branch(0.01 * i, 0, f"rank 0 stamp {i}\n") for i in range(50)]
        events = [*loop, *drift({0: LINES[:30], 1: LINES[:30]}, {0: 1.5, 1: 0.6}, {0: 0.001, 1: 0.001})]
        text = streams(run_polled(CellMerger([0, 1], W), events, end=4))
        assert text == "".join(f"[rank 0] rank 0 stamp {i}\n" for i in range(50)) + "".join(LINES[:30])

    def test_a_line_begun_in_a_branch_and_ended_outside_it_is_the_ranks_own(self):
        m = CellMerger([0, 1], W)
        m.add(0, "stream", say_branch(0, 0, "epoch 3: ")[3], 0.0)
        m.add(0, "stream", {"name": "stdout", "text": "done\n"}, 0.01)
        m.poll(0.01 + W)
        assert streams(m.take()) == "[rank 0] epoch 3: done\n"

    def test_a_display_made_in_a_branch_is_shown_after_the_window_without_the_mark(self):
        c = {"data": {"text/plain": "table"}, "metadata": {"dist_kernel": {"branch": True}, "isolated": True}}
        m = CellMerger([0, 1], W)
        m.add(0, "display_data", c, 0.0)
        m.poll(W)
        ((t, out),) = m.take()
        assert t == "display_data" and out["data"]["text/plain"].endswith("table")
        assert out["metadata"]["isolated"] is True and out["metadata"]["dist_kernel"] == {"ranks": [0]}

    def test_in_a_one_rank_cell_the_mark_is_dropped_and_the_text_is_plain(self):
        out = run(CellMerger([0], W), [say_branch(0, 0, "x\n")])
        assert out == [("stream", {"name": "stdout", "text": "x\n"})]



class TestLinesALibraryWritesOnRank0Only:
    """Issue 30 §3.1: a library that logs on rank 0 only, from code the cell does not show (so
    unmarked), must not split the identical prints around it. A rank's stderr is sent apart from
    its stdout: the flushed log lines of rank 0 come before the prints it made first."""

    @staticmethod
    def cell(n: int, lines: int) -> list:
        logs = [say(0.01 + 0.001 * i, 0, f"lib line {i}\n", "stderr") for i in range(lines)]
        # stdout is sent at the cell's end: rank 0's a little after the others'
        ends = [say(0.3 + 0.01 * ((r - 1) % n), r, "hello\nbye\n") for r in range(n)]
        return logs + ends

    @pytest.mark.parametrize("n", [2, 4])
    @pytest.mark.parametrize("lines", [3, 6])
    def test_identical_prints_around_rank_0s_log_lines_show_once(self, n, lines):
        out = run_polled(CellMerger(list(range(n)), W), self.cell(n, lines), end=2)
        assert streams(out) == "hello\nbye\n"
        assert streams(out, "stderr") == "".join(f"[rank 0] lib line {i}\n" for i in range(lines))

    @pytest.mark.parametrize("n", [2, 4])
    @pytest.mark.parametrize("lines", [3, 6])
    def test_they_do_not_split_the_prints_of_ranks_that_finished_before_they_came(self, n, lines):
        # as a real kernel sends it: the other ranks finish first, then rank 0's flushed log
        # lines come, then its prints (its stdout is sent at the cell's end)
        m = CellMerger(list(range(n)), W)
        out = []
        for r in range(1, n):
            m.add(r, "stream", {"name": "stdout", "text": "hello\nbye\n"}, 0.0)
            m.rank_done(r, 0.0)
        for i in range(lines):
            m.add(0, "stream", {"name": "stderr", "text": f"lib line {i}\n"}, 0.003 + 0.001 * i)
            out += m.take()
        m.add(0, "stream", {"name": "stdout", "text": "hello\nbye\n"}, 0.01)
        m.rank_done(0, 0.01)
        m.finish(0.01)
        out += m.take()
        assert streams(out) == "hello\nbye\n"
        assert streams(out, "stderr") == "".join(f"[rank 0] lib line {i}\n" for i in range(lines))

    @pytest.mark.parametrize("n", [2, 4])
    def test_log_lines_in_step_with_the_prints_do_not_split_them(self, n):
        events = [say(0.01 * r, r, "hello\n") for r in range(n)]
        events += [say(0.05 + 0.001 * i, 0, f"lib line {i}\n", "stderr") for i in range(6)]
        events += [say(0.1 + 0.01 * r, r, "bye\n") for r in range(n)]
        out = run_polled(CellMerger(list(range(n)), W), events, end=2)
        assert streams(out) == "hello\nbye\n"

    def test_a_line_of_the_other_stream_waits_at_most_the_lag_bound(self):
        m = CellMerger([0, 1], W)
        m.add(0, "stream", {"name": "stderr", "text": "log\n"}, 0.0)
        m.add(1, "stream", {"name": "stdout", "text": "x\n"}, 0.0)
        m.poll(LAG_BOUND - 0.01)
        assert m.take() == []  # rank 0's stdout twin may still come after its log line
        m.poll(LAG_BOUND)
        out = m.take()
        assert streams(out) == "[rank 1] x\n" and streams(out, "stderr") == "[rank 0] log\n"

    def test_lines_that_differ_on_one_stream_are_still_labelled_at_once(self):
        m = CellMerger([0, 1], W)
        m.add(0, "stream", {"name": "stderr", "text": "log\n"}, 0.0)
        m.add(1, "stream", {"name": "stderr", "text": "other\n"}, 0.0)
        assert streams(m.take(), "stderr") == "[rank 0] log\n[rank 1] other\n"


def test_a_display_after_rank_0s_branch_display_shows_once_at_4_ranks():
    """``if rank == 0: display('mine')`` then ``display('shared')``: the branch item takes no
    place, so it is not "something else" at the place of the shared display."""
    mine = {"data": {"text/plain": "'mine'"}, "metadata": {"dist_kernel": {"branch": True}}}
    shared = {"data": {"text/plain": "'shared'"}, "metadata": {}}
    for lag0 in (0.0, 0.02, 0.05):
        events = [(lag0, 0, "display_data", mine), (lag0 + 0.001, 0, "display_data", shared)]
        events += [(0.01 * r, r, "display_data", shared) for r in (1, 2, 3)]
        out = run_polled(CellMerger([0, 1, 2, 3], W), events, end=2)
        assert [c["data"]["text/plain"] for _, c in out] == ["[rank 0] 'mine'", "'shared'"], lag0
