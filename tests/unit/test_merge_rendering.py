"""Rendering, as a specification: what a frontend is sent for merged output: clears, areas, display
ids, and output after the cell (dist_kernel.parent.merge.rendering, .labels)."""

from __future__ import annotations

from harness import visible
from merge_cases import (
    W,
    disp,
    final_displays,
    kinds,
    run,
    say,
    say_branch,
    streams,
)

from dist_kernel.parent.merge import (
    LAG_BOUND,
    CellMerger,
    DisplayRegistry,
    namespaced_display_id,
    unmarked,
)


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


class TestLateOutput:
    def test_output_after_the_cell_is_labelled_with_its_rank_and_updates_displays_in_place(self):
        m = CellMerger([0, 1], W)
        run(m, [disp(0, r, "0%", "bar") for r in (0, 1)])
        assert m.late(1, "stream", {"name": "stdout", "text": "a\nb\n"}, True) == [
            ("stream", {"name": "stdout", "text": "[rank 1] a\n[rank 1] b\n"})]
        ((t, c),) = m.late(1, "update_display_data", disp(0, 1, "50%", "bar")[3], True)
        assert t == "update_display_data" and c["transient"]["display_id"] == "bar"
        assert c["data"]["text/plain"] == "[rank 0] 0%\n[rank 1] 50%"


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

