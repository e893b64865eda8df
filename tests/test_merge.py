"""Output merging, as a specification: what a cell shows when N ranks print."""

from __future__ import annotations

import random
import re

from harness import visible

from dist_kernel.parent.merge import CellMerger, merge_errors, namespaced_display_id

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

    def test_a_line_waits_at_most_the_window_for_its_twins(self):
        m = CellMerger([0, 1], W)
        m.add(0, "stream", {"name": "stdout", "text": "early\n"}, 0.0)
        m.poll(0.05)
        assert m.take() == []
        m.poll(0.1)
        assert streams(m.take()) == "[rank 0] early\n"

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

    def test_a_finished_rank_does_not_hold_back_the_others(self):
        m = CellMerger([0, 1], W)
        m.rank_done(1, 0.0)
        m.add(0, "stream", {"name": "stdout", "text": "late\n"}, 0.01)
        assert streams(m.take()) == "[rank 0] late\n"

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

    def test_display_ids_never_collide_across_ranks(self):
        c = {"data": {"text/plain": "x"}, "metadata": {}, "transient": {"display_id": "bar"}}
        out = run(CellMerger([0, 1], W), [(0, 0, "display_data", c), (0, 1, "display_data", c),
                                          (0.5, 1, "update_display_data", c)])
        ids = [c["transient"]["display_id"] for _, c in out]
        assert ids == [namespaced_display_id("bar", 0), namespaced_display_id("bar", 1),
                       namespaced_display_id("bar", 1)]

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
