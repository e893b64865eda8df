"""Progress bars and ipywidgets ``Output`` captures, as a specification (issue 30): a line the
ranks rewrite with ``\\r`` is one line per rank, redrawn in place, that gives way to one shared
line when the ranks agree (rates and times aside) and leaves no earlier frame; a widget that rank 0
alone redraws with ``clear_output(wait=True)`` holds its last frame only, and nothing else lands
in it (dist_kernel.parent.merge.bars, .captures)."""

from __future__ import annotations

import re

import pytest
from merge_cases import W, final_displays, frontend, kinds, run_polled, say, say_branch, streams

from dist_kernel.parent.comms import CommRouter
from dist_kernel.parent.merge import CellMerger
from dist_kernel.parent.merge.units import progress_key
from dist_kernel.parent.relay import IN_ORDER


def tqdm_frame(n: int, total: int, rate: float, elapsed: int) -> str:
    """A state as plain tqdm draws it (``desc="train"``)."""
    pct = 100 * n // total
    return f"\rtrain: {pct:3d}%|{'#' * (pct // 10):10s}| {n}/{total} [00:{elapsed:02d}<00:00, {rate:5.2f}it/s]"


def capture(t: float, rank: int, on: bool, comm: str = "out") -> tuple:
    """An ipywidgets ``Output`` starting (``with out:``) or stopping its capture, as the parent
    hands it to the merger: the rank's comm message, in order with its outputs."""
    msg = {"header": {"msg_type": "comm_msg"}, "content": {"comm_id": comm, "data": {
        "method": "update", "state": {"msg_id": "cell-request" if on else ""}, "buffer_paths": []}}}
    return (t, rank, IN_ORDER, {"rank": rank, "msg": msg})


def clear(t: float, rank: int) -> tuple:
    return (t, rank, "clear_output", {"wait": True})


def run(merger: CellMerger, events, end: float = 3.0, tick: float = 0.05) -> list:
    """As the parent drives a cell: capture changes in order (``add_in_order``), the rest merged."""
    return run_polled(merger, events, end, tick)


def widget(out: list) -> tuple[list, list]:
    """(what the frontend puts in the widget, what it puts in the cell): outputs go into the
    widget while its capture is on, as JupyterLab and nbclient route them by message id."""
    inside, cell = [], []
    on = False
    for t, c in out:
        if t == IN_ORDER:
            on = bool(c["msg"]["content"]["data"]["state"]["msg_id"])
        else:
            (inside if on else cell).append((t, c))
    return inside, cell


def bar_states(out: list) -> list[str]:
    return [c["data"]["text/plain"] for t, c in out if t in ("display_data", "update_display_data")]


# ------------------------------------------------------------------ bars
class TestBars:
    def test_progress_states_that_differ_only_in_rates_and_times_are_twins(self):
        assert progress_key(tqdm_frame(10, 12, 8.02, 1)) == progress_key(tqdm_frame(10, 12, 12.5, 0) + "   ")
        assert progress_key(tqdm_frame(10, 12, 8.02, 1)) != progress_key(tqdm_frame(11, 12, 8.02, 1))
        assert progress_key("\rloss 0.31") != progress_key("\rloss 0.32")  # a value, not a clock

    @pytest.mark.parametrize("n", [2, 4])
    def test_a_tqdm_bar_on_every_rank_ends_as_one_line_unlabelled_the_slowest_ranks(self, n):
        # each rank runs at its own pace (rank r is the slowest at the end), and drifts
        events = [say(0.05 * i * (1 + 0.1 * r), r, tqdm_frame(i, 12, 10.0 - r, i // 10), "stderr")
                  for r in range(n) for i in range(13)]
        events += [say(0.05 * 13 * (1 + 0.1 * r), r, "\n", "stderr") for r in range(n)]
        out = run(CellMerger(range(n), W), events)
        assert frontend(out) == tqdm_frame(12, 12, 10.0 - (n - 1), 1).lstrip("\r") + "\n"
        assert not any("[rank" in state for state in bar_states(out))  # never a per-rank frame
        assert kinds(out)[0] == "display_data" and set(kinds(out)[1:]) <= {"update_display_data"}

    @pytest.mark.parametrize("n", [2, 4])
    def test_a_line_that_differs_per_rank_for_two_steps_is_one_line_per_rank_then_the_shared_line(self, n):
        def line(r, i):
            return f"\rstep {i}" + (f" (rank {r})" if i in (1, 2) else "")
        events = [say(0.2 * i + 0.01 * r, r, line(r, i)) for r in range(n) for i in range(5)]
        events += [say(1.0 + 0.01 * r, r, "\n") for r in range(n)] + [say(1.1 + 0.01 * r, r, "done\n") for r in range(n)]
        out = run(CellMerger(range(n), W), events)
        assert frontend(out) == "step 4\ndone\n"  # no earlier frame is left
        states = bar_states(out)
        assert "\n".join(f"[rank {r}] step 2 (rank {r})" for r in range(n)) in states  # one line per rank
        assert all(len(s.splitlines()) in (1, n) for s in states)
        assert states[-1] == "step 4" and len(final_displays(out)) == 1  # redrawn in place, in one display

    def test_a_bar_shows_the_slowest_ranks_progress(self):
        # rank 1 lags by a second: rank 0's next state waits for its twin, as a line would
        events = [say(0.0, 0, "\r1/2"), say(0.05, 0, "\r2/2"), say(0.1, 0, "\n"), say(0.0, 1, "\r1/2 (slow)")]
        events += [say(1.0, 1, "\r2/2"), say(1.05, 1, "\n")]
        out = run(CellMerger([0, 1], W), events)
        assert bar_states(out)[0] == "[rank 0] 1/2\n[rank 1] 1/2 (slow)"
        assert set(bar_states(out)[1:]) == {"2/2"} and frontend(out) == "2/2\n"

    def test_a_line_printed_while_a_bar_runs_stays_above_it(self):
        # tqdm.write: the bar's line is blanked, the message printed, the bar drawn again below
        events = [say(0.0, r, "\r 50%") for r in (0, 1)]
        events += [say(0.2, r, "\r     \rsaved checkpoint\n\r 60%") for r in (0, 1)]
        events += [say(0.4, r, "\r100%\n") for r in (0, 1)]
        assert frontend(run(CellMerger([0, 1], W), events)) == "saved checkpoint\n100%\n"

    def test_a_shared_line_rewritten_alike_on_every_rank_stays_stream_text(self):
        events = [say(0.0, r, "Loading...") for r in (0, 1)] + [say(0.3, r, "\rDone.     \n") for r in (0, 1)]
        out = run(CellMerger([0, 1], W), events)
        assert set(kinds(out)) == {"stream"} and frontend(out) == "Done.     \n"

    def test_a_shared_line_a_rank_then_rewrites_alone_leaves_no_frame_behind(self):
        events = [say(0.0, r, "Loading...") for r in (0, 1)] + [say(0.3, r, f"\rrank {r} done\n") for r in (0, 1)]
        shown = frontend(run(CellMerger([0, 1], W), events))
        assert "Loading" not in shown and shown.strip().splitlines() == ["[rank 0] rank 0 done", "[rank 1] rank 1 done"]

    def test_a_bar_in_a_cell_of_one_rank_is_stream_text_as_in_one_process(self):
        out = run(CellMerger([0], W), [say(0.0, 0, "\r1/2"), say(0.1, 0, "\r2/2\n")])
        assert streams(out) == "\r1/2\r2/2\n"


# ------------------------------------------------------------------ Output widgets
class TestOutputWidgets:
    @staticmethod
    def redraws(frames: int, show=lambda t, i: say_branch(t, 0, f"frame {i}\n")) -> list:
        """Rank 0 alone redraws a shared widget: ``with out: clear_output(wait=True); print(...)``."""
        events = []
        for i in range(frames):
            t = 0.1 * i
            events += [capture(t, 0, True), clear(t + 0.01, 0), show(t + 0.02, i), capture(t + 0.03, 0, False)]
        return events

    def test_rank_0_redrawing_a_shared_widget_alone_leaves_its_last_frame_in_it(self):
        out = run(CellMerger([0, 1], W), self.redraws(5))
        inside, cell = widget(out)
        assert frontend(inside) == "[rank 0] frame 4\n" and cell == []
        assert kinds(inside).count("clear_output") == 5 and "update_display_data" not in kinds(out)

    def test_a_display_rank_0_redraws_in_a_widget_stays_in_the_widget(self):
        def show(t, i):
            return (t, 0, "display_data", {"data": {"text/plain": f"frame {i}", "text/html": f"<b>frame {i}</b>"},
                                           "metadata": {"dist_kernel": {"solo": True}}})
        inside, cell = widget(run(CellMerger([0, 1], W), self.redraws(5, show)))
        assert frontend(inside) == "frame 4\n" and cell == []

    def test_what_another_rank_prints_meanwhile_goes_to_the_cell_not_into_the_widget(self):
        events = self.redraws(5) + [say_branch(0.1 * i + 0.025, 1, f"meanwhile {i}\n") for i in range(5)]
        out = run(CellMerger([0, 1], W), events)
        inside, cell = widget(out)
        assert frontend(inside) == "[rank 0] frame 4\n"
        assert frontend(cell) == "".join(f"[rank 1] meanwhile {i}\n" for i in range(5))
        # the capture was paused around rank 1's lines and resumed for rank 0's, with its own
        # message; the frontend never hears of a stop without its start (nbclient fails on one)
        states = [c["msg"]["content"]["data"]["state"]["msg_id"] for t, c in out if t == IN_ORDER]
        assert states == ["cell-request", ""] * (len(states) // 2) and len(states) > 10

    def test_what_the_ranks_print_after_rank_0s_widget_loop_merges(self):
        # Lightning's rich bar: rank 0 alone redraws it (solo displays), then both ranks print
        solo = {"dist_kernel": {"solo": True}}
        events = [(0.0, 0, "display_data", {"data": {"text/plain": "Output()"}, "metadata": solo})]
        events += self.redraws(8, lambda t, i: (t, 0, "display_data", {"data": {"text/plain": f"epoch {i}"},
                                                                       "metadata": solo}))
        events += [say(1.0 + 0.3 * r, r, "after fit 2\n") for r in (0, 1)]
        inside, cell = widget(run(CellMerger([0, 1], W), events))
        assert frontend(inside) == "epoch 7\n"
        assert frontend(cell) == "Output()\nafter fit 2\n"  # unlabelled: shown once, as one process

    def test_every_rank_redrawing_a_shared_widget_in_step_clears_it_once_per_frame(self):
        events = [e for r in (0, 1) for i in range(3) for e in (
            capture(0.1 * i + 0.001 * r, r, True), clear(0.1 * i + 0.01 + 0.001 * r, r),
            say(0.1 * i + 0.02 + 0.001 * r, r, f"frame {i}\n"), capture(0.1 * i + 0.03 + 0.001 * r, r, False))]
        out = run(CellMerger([0, 1], W), events)
        assert kinds(out).count("clear_output") == 3 and re.sub(r"\s", "", frontend(widget(out)[0])) == "frame2"

    def test_a_widget_every_rank_captures_into_starts_and_stops_once_at_the_frontend(self):
        events = [capture(0.0, 0, True), capture(0.01, 1, True), say(0.02, 0, "x\n"), say(0.02, 1, "x\n"),
                  capture(0.03, 1, False), capture(0.04, 0, False), say(0.5, 0, "after\n"), say(0.5, 1, "after\n")]
        out = run(CellMerger([0, 1], W), events)
        assert [(t, c.get("rank")) for t, c in out if t == IN_ORDER] == [(IN_ORDER, 0), (IN_ORDER, 0)]
        inside, cell = widget(out)
        assert frontend(inside) == "x\n" and frontend(cell) == "after\n"


def test_an_output_widgets_capture_reaches_the_frontend_from_whichever_owner_enters_it():
    router = CommRouter()
    for rank in (1, 0):  # rank 1 opened the shared widget first: it leads
        router.from_rank("comm_open", {"comm_id": "out", "data": {}}, rank)
    capture = {"comm_id": "out", "data": {"method": "update", "state": {"msg_id": "x"}, "buffer_paths": []}}
    other = {"comm_id": "out", "data": {"method": "update", "state": {"outputs": []}, "buffer_paths": []}}
    assert router.from_rank("comm_msg", capture, 0) is not None  # rank 0 alone runs `with out:`
    assert router.from_rank("comm_msg", other, 0) is None  # its other state changes: the leader's are shown
