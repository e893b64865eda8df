"""Output merging, as a specification: what a cell shows when N ranks print."""

from __future__ import annotations

import os
import random
import re

import pytest
from harness import visible

from dist_kernel.parent.merge import (
    ERROR_HOLD,
    LAG_BOUND,
    CellMerger,
    DisplayRegistry,
    merge_errors,
    namespaced_display_id,
    render_cr,
    unmarked,
)

W = 0.1  # merge window used throughout


def streams(emits, name="stdout"):
    return "".join(c["text"] for t, c in emits if t == "stream" and c["name"] == name)


def run(merger: CellMerger, events, end: float = 10.0):
    """Feed (time, rank, msg_type, content) events, polling as the parent does; return all emits."""
    out = []
    for now, rank, msg_type, content in sorted(events, key=lambda e: e[0]):
        merger.poll(now)
        merger.add(rank, msg_type, content, now)
        out += merger.take()
    merger.finish(end)
    return out + merger.take()


def say(t, rank, text, name="stdout"):
    return (t, rank, "stream", {"name": name, "text": text})


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
            owners = _expand(m.group(1)) if m else [0, 1, 2]
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
        # each rank's \r-rewritten line lives in its own display, updated in place
        out = run(CellMerger([0, 1], W), [say(0, 0, "10%\r"), say(0, 1, "5%\r"), say(0.3, 0, "50%\r"),
                                          say(0.35, 1, "30%\r")])
        assert streams(out) == ""
        assert final_displays(out) == {"[rank 0] 50%", "[rank 1] 30%"}

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


class TestRichOutput:
    def test_identical_results_show_once_without_label(self):
        c = {"data": {"text/plain": "2"}, "metadata": {}, "execution_count": 3}
        out = run(CellMerger([0, 1], W), [(0, 0, "execute_result", c), (0, 1, "execute_result", c)])
        assert [t for t, _ in out] == ["execute_result"]
        assert out[0][1]["data"] == {"text/plain": "2"}

    def test_differing_results_are_each_shown_labelled_with_the_rank_in_metadata(self):
        out = run(CellMerger([0, 1], W), [
            (0, 0, "execute_result", {"data": {"text/plain": "0", "text/html": "<b>0</b>"}, "metadata": {}}),
            (0, 1, "execute_result", {"data": {"text/plain": "1"}, "metadata": {}})])
        assert [c["data"]["text/plain"] for _, c in out] == ["[rank 0] 0", "[rank 1] 1"]
        assert [c["metadata"]["dist_kernel"]["ranks"] for _, c in out] == [[0], [1]]
        assert "[rank 0]" in out[0][1]["data"]["text/html"]

    def test_different_display_ids_on_different_ranks_stay_apart(self):
        out = run(CellMerger([0, 1], W), [
            (0, 0, "display_data", {"data": {"text/plain": "x"}, "metadata": {}, "transient": {"display_id": "a"}}),
            (0, 1, "display_data", {"data": {"text/plain": "x"}, "metadata": {}, "transient": {"display_id": "b"}})])
        assert [(c["transient"]["display_id"], c["data"]["text/plain"]) for _, c in out] == [
            ("a", "[rank 0] x"), ("b", "[rank 1] x")]

    def test_print_then_display_keeps_order(self):
        out = run(CellMerger([0, 1], W), [say(0, 0, "before\n"), say(0, 1, "before\n"),
                                          (0, 0, "display_data", {"data": {"text/plain": "fig"}, "metadata": {}}),
                                          (0, 1, "display_data", {"data": {"text/plain": "fig"}, "metadata": {}})])
        assert [t for t, _ in out] == ["stream", "display_data"]

    def test_clear_output_loops_in_lockstep_look_like_one_process(self):
        events = []
        for i in range(3):
            for r in (0, 1):
                events += [(i, r, "clear_output", {"wait": True}), say(i + 0.01, r, f"step {i}\n")]
        out = run(CellMerger([0, 1], W), events)
        assert [t for t, _ in out].count("clear_output") == 3  # one clear per step, not one per rank
        assert visible(out) == "step 2\n"

    def test_clear_output_loops_with_rank_specific_text_show_every_ranks_last_step(self):
        events = []
        for i in range(3):
            for r in (0, 1):
                events += [(i, r, "clear_output", {"wait": True}), say(i + 0.01, r, f"rank {r} step {i}\n")]
        assert visible(run(CellMerger([0, 1], W), events)) == "[rank 0] rank 0 step 2\n[rank 1] rank 1 step 2\n"

    def test_a_rank_clearing_out_of_step_does_not_erase_the_others(self):
        # rank 1 lags: its clears and lines come long after rank 0's
        events = []
        for i in range(3):
            events += [(i, 0, "clear_output", {"wait": True}), say(i + 0.01, 0, f"rank 0 step {i}\n"),
                       (i + 0.5, 1, "clear_output", {"wait": True}), say(i + 0.51, 1, f"rank 1 step {i}\n")]
        shown = visible(run(CellMerger([0, 1], W), events))
        assert "rank 0 step 2" in shown and "rank 1 step 2" in shown
        assert "step 1" not in shown

    def test_output_before_a_clear_stays_visible(self):
        out = run(CellMerger([0, 1], W), [say(0, 0, "header\n"), say(0, 1, "header\n"),
                                          (1, 0, "clear_output", {"wait": True}), say(1.1, 0, "tick\n")])
        assert streams(out) == "header\n" and final_displays(out) == {"[rank 0] tick\n"}

    def test_clear_output_in_a_single_rank_cell_is_forwarded(self):
        out = run(CellMerger([1], W), [say(0, 1, "x\n"), (0.1, 1, "clear_output", {"wait": True})])
        assert [t for t, _ in out] == ["stream", "clear_output"]


def final_displays(out) -> set[str]:
    """The text each updatable display shows at the end."""
    shown: dict[str, str] = {}
    for t, c in out:
        if t in ("display_data", "update_display_data") and "transient" in c:
            shown[c["transient"]["display_id"]] = c["data"].get("text/plain", "")
    return set(shown.values())


class TestErrors:
    @staticmethod
    def err(ename, evalue, n=1):
        return {"ename": ename, "evalue": evalue,
                "traceback": [f"\x1b[36mCell In[{n}], line 1\x1b[0m", f"{ename}: {evalue}"]}

    def test_no_error_means_none(self):
        assert merge_errors({}, [0, 1]) is None

    def test_the_same_error_on_all_ranks_shows_once_saying_so(self):
        e = merge_errors({0: self.err("ZeroDivisionError", "division by zero", 3),
                          1: self.err("ZeroDivisionError", "division by zero", 5)}, [0, 1])
        assert e["ename"] == "ZeroDivisionError" and e["evalue"] == "division by zero"
        assert "all 2 ranks" in e["traceback"][0]
        assert sum("ZeroDivisionError:" in line for line in e["traceback"]) == 1

    def test_different_errors_name_each_failing_rank_with_its_traceback(self):
        e = merge_errors({0: self.err("KeyError", "'x'"), 2: self.err("ValueError", "bad")}, [0, 1, 2])
        assert e["ename"] == "DistributedError"
        assert "rank 0: KeyError" in e["evalue"] and "rank 2: ValueError" in e["evalue"]
        text = "\n".join(e["traceback"])
        assert "KeyError: 'x'" in text and "ValueError: bad" in text

    def test_an_error_on_some_ranks_names_them(self):
        e = merge_errors({1: self.err("RuntimeError", "boom")}, [0, 1])
        assert "rank 1" in e["traceback"][0]


def _expand(spec: str) -> list[int]:
    out: list[int] = []
    for piece in spec.split(","):
        lo, _, hi = piece.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


class TestSoloOutput:
    def test_output_a_rank_marks_as_its_alone_is_shown_unlabelled_at_once(self):
        c = {"data": {"text/html": "<progress>"}, "metadata": {"dist_kernel": {"solo": True}},
             "transient": {"display_id": "bar"}}
        m = CellMerger([0, 1], W)
        m.add(0, "display_data", c, 0.0)
        ((t, out),) = m.take()
        assert t == "display_data" and out["data"] == {"text/html": "<progress>"}
        assert out["metadata"] == {} and out["transient"]["display_id"] == namespaced_display_id("bar", 0)


class TestThrottle:
    def test_a_flood_is_cut_to_head_and_tail_with_the_full_text_saved(self, tmp_path):
        from dist_kernel.parent.throttle import StreamThrottle

        shown: list[tuple[str, dict]] = []
        now = [0.0]
        th = StreamThrottle(lambda t, c: shown.append((t, c)), rate=1000, burst=2000,
                            clock=lambda: now[0], spill_dir=str(tmp_path))
        lines = [f"line {i}\n" for i in range(1000)]
        for i in range(0, 1000, 10):
            th.publish("stream", {"name": "stdout", "text": "".join(lines[i:i + 10])})
            now[0] += 0.01
        th.close()
        first_note = next(i for i, (_, c) in enumerate(shown) if c["name"] == "stderr")
        live = "".join(c["text"] for _, c in shown[:first_note])
        tail = "".join(c["text"] for _, c in shown[first_note:] if c["name"] == "stdout")
        assert live.startswith("line 0\n") and len(live) <= 2000 + 1000 * now[0]  # burst + rate
        assert tail == "".join(lines[-20:])  # the cell's final lines are delivered
        assert live + open(th.spill_path).read() == "".join(lines)  # and nothing is lost
        notes = "".join(c["text"] for _, c in shown if c["name"] == "stderr")
        assert th.spill_path in notes and "were not shown" in notes

    def test_ordinary_output_passes_untouched(self):
        from dist_kernel.parent.throttle import StreamThrottle

        shown = []
        th = StreamThrottle(lambda t, c: shown.append(c["text"]))
        th.publish("stream", {"name": "stdout", "text": "hello\n"})
        th.close()
        assert shown == ["hello\n"]


# ------------------------------------------------------------- issue 11 items
def disp(t, rank, text, display_id, msg_type="display_data"):
    return (t, rank, msg_type, {"data": {"text/plain": text}, "metadata": {}, "transient": {"display_id": display_id}})


def err(t, rank, ename, evalue="boom"):
    return (t, rank, "error", {"ename": ename, "evalue": evalue, "traceback": [f"{ename}: {evalue}"]})


def kinds(out):
    return [t for t, _ in out]


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


class TestDisplayIds:
    def test_an_identical_display_and_its_identical_updates_show_once_with_their_id(self):
        events = [disp(0, r, "0%", "bar") for r in (0, 1)] + [
            disp(0.5, r, "100%", "bar", "update_display_data") for r in (0, 1)]
        out = run(CellMerger([0, 1], W), events)
        assert [(t, c["transient"]["display_id"], c["data"]["text/plain"]) for t, c in out] == [
            ("display_data", "bar", "0%"), ("update_display_data", "bar", "100%")]

    def test_updates_that_differ_show_every_ranks_value_labelled_in_the_same_display(self):
        events = [disp(0, r, "loss ?", "d") for r in (0, 1)] + [
            disp(0.5, r, f"loss {r}", "d", "update_display_data") for r in (0, 1)]
        out = run(CellMerger([0, 1], W), events)
        assert kinds(out).count("display_data") == 1
        assert {c["transient"]["display_id"] for _, c in out} == {"d"}
        assert visible(out) == "[rank 0] loss 0\n[rank 1] loss 1\n"

    def test_a_twin_that_comes_late_is_the_same_display(self):
        out = run(CellMerger([0, 1], W), [disp(0, 0, "fig", "d"), disp(2.0, 1, "fig", "d")])
        assert kinds(out) == ["display_data"] and visible(out) == "fig\n"

    def test_a_twin_that_comes_after_the_lag_bound_joins_the_display_instead_of_adding_one(self):
        out = run(CellMerger([0, 1], W), [disp(0, 0, "fig", "d"), disp(LAG_BOUND + 0.5, 1, "fig", "d")])
        assert kinds(out) == ["display_data", "update_display_data"]
        assert visible(out) == "fig\n"  # labelled "[rank 0]" for a moment, then everyone's

    def test_rich_displays_of_differing_ranks_are_combined_in_html_with_their_images(self):
        out = run(CellMerger([0, 1], W), [
            (0, r, "display_data", {"data": {"text/plain": f"<Figure {r}>", "image/png": f"PNG{r}"}, "metadata": {},
                                    "transient": {"display_id": "f"}}) for r in (0, 1)])
        final = out[-1][1]
        assert "data:image/png;base64,PNG0" in final["data"]["text/html"] and "PNG1" in final["data"]["text/html"]
        assert final["metadata"]["dist_kernel"]["groups"] == [[0], [1]]

    def test_an_update_in_a_later_cell_keeps_what_the_other_ranks_show(self):
        displays = DisplayRegistry()
        run(CellMerger([0, 1], W, displays=displays), [disp(0, r, "start", "d") for r in (0, 1)])
        later = run(CellMerger([0], W, displays=displays), [disp(0, 0, "rank 0 done", "d", "update_display_data")])
        assert [c["data"]["text/plain"] for _, c in later] == ["[rank 0] rank 0 done\n[rank 1] start"]

    def test_output_a_rank_marks_as_its_alone_keeps_a_display_id_of_its_own(self):
        c = {"data": {"text/plain": "bar"}, "metadata": {"dist_kernel": {"solo": True}}, "transient": {"display_id": "b"}}
        m = CellMerger([0, 1], W)
        m.add(1, "display_data", c, 0.0)
        assert m.take()[0][1]["transient"]["display_id"] == namespaced_display_id("b", 1)


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


class TestErrorsInline:
    def test_the_error_a_ranks_reply_reports_is_not_published_inline(self):
        m = CellMerger([0, 1], W)
        for now, rank, t, c in [err(0, 0, "KeyError"), err(0, 1, "KeyError")]:
            m.add(rank, t, c, now)
        for r in (0, 1):
            m.rank_replied(r, {"status": "error", "ename": "KeyError", "evalue": "boom", "traceback": ["KeyError: boom"]}, 0.1)
        m.finish(1)
        assert m.take() == [] and sorted(m.errors) == [0, 1]

    def test_an_error_the_reply_does_not_report_is_an_ordinary_output_merged_when_identical(self):
        m = CellMerger([0, 1], W)
        for now, rank, t, c in [err(0, 0, "ValueError"), err(0, 1, "ValueError"), say(0.01, 0, "after\n"),
                                say(0.01, 1, "after\n")]:
            m.add(rank, t, c, now)
        for r in (0, 1):
            m.rank_replied(r, {"status": "ok"}, 0.1)
        m.finish(1)
        out = m.take()
        assert [(t, c.get("ename", c.get("text"))) for t, c in out] == [("error", "ValueError"), ("stream", "after\n")]
        assert m.errors == {}  # the cell did not fail

    def test_differing_shown_errors_are_labelled_with_their_rank(self):
        m = CellMerger([0, 1], W)
        m.add(0, *err(0, 0, "ValueError")[2:], 0)
        m.add(1, *err(0, 1, "TypeError")[2:], 0)
        for r in (0, 1):
            m.rank_replied(r, {"status": "ok"}, 0.5)
        m.finish(1)
        assert [c["traceback"][0] for _, c in m.take()] == ["\x1b[1;31m[rank 0]\x1b[0m", "\x1b[1;31m[rank 1]\x1b[0m"]

    def test_the_reply_may_come_before_its_error(self):
        m = CellMerger([0], W)
        m.rank_replied(0, {"status": "error", "ename": "KeyError", "evalue": "boom", "traceback": ["KeyError: boom"]}, 0)
        m.add(0, *err(0.01, 0, "KeyError")[2:], 0.01)
        m.finish(1)
        assert m.take() == [] and m.errors[0]["ename"] == "KeyError"

    def test_a_shown_error_before_the_cells_own_error_is_published_and_the_cells_is_not(self):
        m = CellMerger([0], W)
        m.add(0, *err(0, 0, "ZeroDivisionError")[2:], 0)
        m.add(0, *err(0.1, 0, "KeyError")[2:], 0.1)
        m.rank_replied(0, {"status": "error", "ename": "KeyError", "evalue": "boom", "traceback": ["KeyError: boom"]}, 0.2)
        m.finish(1)
        assert [c["ename"] for _, c in m.take()] == ["ZeroDivisionError"]

    def test_a_shown_error_does_not_hold_back_a_rank_that_keeps_running(self):
        m = CellMerger([0], W)
        m.add(0, *err(0, 0, "ValueError")[2:], 0)
        m.add(0, "stream", {"name": "stdout", "text": "training...\n"}, 0.01)
        m.poll(ERROR_HOLD / 2)
        assert m.take() == []  # the reply may still say it was the cell's error
        m.poll(ERROR_HOLD + 0.01)
        assert kinds(m.take()) == ["error", "stream"]

    def test_without_a_reply_a_failed_ranks_last_error_is_its_cell_error(self):
        m = CellMerger([0], W)
        m.add(0, *err(0, 0, "ValueError")[2:], 0)
        m.add(0, *err(0.01, 0, "KeyError")[2:], 0.01)
        m.errors[0] = {"ename": "KeyError", "evalue": "boom", "traceback": []}
        m.rank_done(0, 0.02)
        m.finish(1)
        assert [c["ename"] for _, c in m.take()] == ["ValueError"]


class TestLateOutput:
    def test_output_after_the_cell_is_labelled_with_its_rank_and_updates_displays_in_place(self):
        m = CellMerger([0, 1], W)
        run(m, [disp(0, r, "0%", "bar") for r in (0, 1)])
        assert m.late(1, "stream", {"name": "stdout", "text": "a\nb\n"}, True) == [
            ("stream", {"name": "stdout", "text": "[rank 1] a\n[rank 1] b\n"})]
        ((t, c),) = m.late(1, "update_display_data", disp(0, 1, "50%", "bar")[3], True)
        assert t == "update_display_data" and c["transient"]["display_id"] == "bar"
        assert c["data"]["text/plain"] == "[rank 0] 0%\n[rank 1] 50%"


class TestOutputBudget:
    @staticmethod
    def throttle(tmp_path, clock, budget=None, **kw):
        from dist_kernel.parent.throttle import OutputBudget, StreamThrottle

        shown: list[tuple[str, dict]] = []
        budget = budget or OutputBudget(clock=lambda: clock[0], spill_dir=str(tmp_path), **kw)
        return StreamThrottle(lambda t, c: shown.append((t, c)), budget=budget), shown

    def test_rich_outputs_past_the_message_rate_go_to_the_file_as_text_and_are_counted(self, tmp_path):
        now = [0.0]
        th, shown = self.throttle(tmp_path, now, msg_rate=10, msg_burst=20)
        for i in range(100):
            th.publish("display_data", {"data": {"text/plain": str(i)}, "metadata": {}})
        th.close()
        displays = [int(c["data"]["text/plain"]) for t, c in shown if t == "display_data"]
        notes = "".join(c["text"] for t, c in shown if t == "stream")
        assert displays == list(range(20)) and "80 outputs were not shown" in notes
        assert [int(line) for line in open(th.spill_path)] == list(range(20, 100))
        assert os.path.dirname(th.spill_path) == str(tmp_path)

    def test_no_stream_message_is_longer_than_the_limit(self, tmp_path):
        from dist_kernel.parent.throttle import MAX_MESSAGE

        now = [0.0]
        th, shown = self.throttle(tmp_path, now, burst=10_000_000)
        text = "".join(f"{i}\n" for i in range(500_000))  # 3.4 MB in one message
        th.publish("stream", {"name": "stdout", "text": text})
        assert max(len(c["text"]) for _, c in shown) <= MAX_MESSAGE
        assert "".join(c["text"] for _, c in shown) == text

    def test_a_huge_line_goes_to_the_file_and_its_tail_is_bounded(self, tmp_path):
        from dist_kernel.parent.throttle import TAIL_BYTES

        now = [0.0]
        th, shown = self.throttle(tmp_path, now)
        th.publish("stream", {"name": "stdout", "text": "y" * 10_000_000})
        th.close()
        assert sum(len(c["text"]) for _, c in shown) < 2 * TAIL_BYTES
        assert "more characters in the file" in shown[-1][1]["text"]
        assert open(th.spill_path).read() == "y" * 10_000_000
        assert th._file is None  # closed

    def test_the_budget_spans_cells_and_output_after_a_cell_ended(self, tmp_path):
        from dist_kernel.parent.throttle import OutputBudget

        now = [0.0]
        budget = OutputBudget(rate=1000, burst=2000, clock=lambda: now[0], spill_dir=str(tmp_path))
        first, shown1 = self.throttle(tmp_path, now, budget)
        first.publish("stream", {"name": "stdout", "text": "x" * 1500 + "\n"})
        first.close()
        first.publish("stream", {"name": "stdout", "text": "late " * 200 + "\n"})  # a background thread
        assert "after its cell ended" in shown1[-1][1]["text"] and first._file is None
        second, shown2 = self.throttle(tmp_path, now, budget)
        second.publish("stream", {"name": "stdout", "text": "z" * 600 + "\n"})
        assert "faster than a notebook can show" in shown2[0][1]["text"]
        now[0] += 10  # quiet: the late output is shown again, after saying what was not
        first.publish("stream", {"name": "stdout", "text": "back\n"})
        assert "were not shown" in shown1[-3][1]["text"] and shown1[-1][1]["text"] == "back\n"

    def test_the_newest_state_of_a_display_updated_while_spilling_is_shown_at_the_end(self, tmp_path):
        now = [0.0]
        th, shown = self.throttle(tmp_path, now, msg_burst=5, msg_rate=1)
        for i in range(50):
            th.publish("update_display_data", {"data": {"text/plain": f"{i}%"}, "metadata": {},
                                               "transient": {"display_id": "bar"}})
        th.close()
        assert shown[-1] == ("update_display_data", {"data": {"text/plain": "49%"}, "metadata": {},
                                                     "transient": {"display_id": "bar"}})

    def test_a_message_of_wide_characters_is_cut_by_its_bytes(self, tmp_path):
        from dist_kernel.parent.throttle import MAX_MESSAGE

        now = [0.0]
        th, shown = self.throttle(tmp_path, now, burst=10_000_000)
        text = "€" * 200_000 + "a" * 400_000  # 1 MB, the wide characters first
        th.publish("stream", {"name": "stdout", "text": text})
        assert max(len(c["text"].encode()) for _, c in shown) <= MAX_MESSAGE
        assert "".join(c["text"] for _, c in shown) == text

    def test_the_last_lines_keep_carriage_return_progress_as_one_line(self, tmp_path):
        now = [0.0]
        th, shown = self.throttle(tmp_path, now, burst=3)  # not even one line fits
        th.publish("stream", {"name": "stdout", "text": "start\n10%\r20%\r30%\ndone\n"})
        th.close()
        assert shown[-1][1]["text"] == "start\n10%\r20%\r30%\ndone\n"


# ------------------------------------------------- issue 19: ranks that drift apart
def drift(texts: dict[int, list[str]], start: dict[int, float], step: dict[int, float],
          pause: tuple[int, int, float] | None = None):
    """Stream events: rank r prints its texts from ``start[r]``, one every ``step[r]`` seconds;
    ``pause`` (rank, index, seconds): that rank stalls before that text."""
    events = []
    for r, lines in texts.items():
        t = start[r]
        for i, line in enumerate(lines):
            if pause and pause[:2] == (r, i):
                t += pause[2]
            events.append(say(t, r, line))
            t += step[r]
    return events


def per_rank(text: str, ranks) -> dict[int, list[str]]:
    """What each rank printed, read back from merged output (unlabelled lines belong to all)."""
    out = {r: [] for r in ranks}
    for line in text.splitlines(keepends=True):
        m = re.match(r"\[rank ([\d,-]+)\] (.*)", line, re.S)
        for r in _expand(m.group(1)) if m else ranks:
            out[r].append(m.group(2) if m else line)
    return out


def run_polled(merger: CellMerger, events, end: float, tick: float = 0.05):
    """As ``run``, with the parent's poll every ``tick`` between events too."""
    ticks = [(i * tick, None, None, None) for i in range(int(end / tick))]
    out = []
    for now, rank, msg_type, content in sorted(events + ticks, key=lambda e: e[0]):
        merger.poll(now)
        if rank is not None:
            merger.add(rank, msg_type, content, now)
        out += merger.take()
    for r in merger.ranks:
        merger.rank_done(r, end)
    merger.finish(end)
    return out + merger.take()


LINES = [f"step {i}\n" for i in range(300)]


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
        assert "[rank" not in streams(out) and final_displays(out) == set()
        assert render_cr(streams(out)) == "39%\n"

    def test_progress_units_do_not_depend_on_how_the_text_was_cut_into_messages(self):
        whole = "start\n\r1%\r2%\r3%\ndone\n"
        pieces = ["start\n", "\r1%", "\r", "2%", "\r3%", "\n", "done\n"]
        events = [say(0, 0, whole)] + [say(0.5 + 0.01 * i, 1, p) for i, p in enumerate(pieces)]
        assert streams(run_polled(CellMerger([0, 1], W), events, end=2)) == "start\n\r1%\r2%\r3%\ndone\n"

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


def say_solo(t, rank, text, name="stdout"):
    """A stream message a rank marked as its alone (``agent.solo_output(streams=True)``)."""
    return (t, rank, "stream", {"name": name, "text": text, "metadata": {"dist_kernel": {"solo": True}}})


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


def say_branch(t, rank, text, name="stdout"):
    """A stream message a rank made inside a branch on the rank (``if rank == 0: print(...)``)."""
    return (t, rank, "stream", {"name": name, "text": text, "metadata": {"dist_kernel": {"branch": True}}})


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


def test_output_shown_without_the_merger_loses_the_ranks_marks():
    assert unmarked("stream", say_branch(0, 0, "x\n")[3]) == {"name": "stdout", "text": "x\n"}
    rich = {"data": {"text/plain": "1"}, "metadata": {"dist_kernel": {"solo": True}, "isolated": True}}
    assert unmarked("display_data", rich) == {"data": {"text/plain": "1"}, "metadata": {"isolated": True}}
    plain = {"name": "stdout", "text": "y\n"}
    assert unmarked("stream", plain) is plain
    m = CellMerger([0, 1], W)
    m.finish(0.0)
    assert m.late(0, "stream", say_branch(0, 0, "x\n")[3], labelled=True) == [
        ("stream", {"name": "stdout", "text": "[rank 0] x\n"})]
