"""Errors, as a specification: the one error a cell shows when ranks fail, and errors shown inline
(dist_kernel.parent.merge.errors, and the merger's held errors)."""

from __future__ import annotations

from merge_cases import (
    W,
    err,
    kinds,
    say,
)

from dist_kernel.parent.merge import (
    ERROR_HOLD,
    CellMerger,
    merge_errors,
)


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



class TestErrorsAfterTheCell:
    """One error output per cell, always (issue 36): a rank the cell gave up on (it did not stop
    after the interrupt) can raise after the cell's error was merged and published."""

    TB = ["\x1b[31mRuntimeError\x1b[0m: Connection closed by peer",
          "\nDuring handling of the above exception, another exception occurred:\n", "KeyboardInterrupt: "]

    def test_a_ranks_error_after_its_cell_ended_is_told_as_text_not_a_second_error(self):
        m = CellMerger([0, 1], W)
        m.finish(0.0)
        out = m.late(0, "error", {"ename": "KeyboardInterrupt", "evalue": "", "traceback": self.TB}, labelled=True)
        assert kinds(out) == ["stream"] and out[0][1]["name"] == "stderr"
        text = out[0][1]["text"]
        assert text.startswith("[rank 0] after its cell had ended, rank 0 raised:\n")
        assert all(line.startswith("[rank 0] ") for line in text.splitlines())
        assert "Connection closed by peer" in text and "KeyboardInterrupt" in text  # nothing of it lost
        (one,) = m.late(0, "error", {"ename": "ValueError", "evalue": "x", "traceback": []}, labelled=False)
        assert one == ("stream", {"name": "stderr", "text": "after its cell had ended, rank 0 raised:\nValueError: x\n"})

    def test_the_relay_publishes_one_error_when_a_given_up_rank_raises_after_the_cell(self):
        from dist_kernel.parent.relay import Outlet, OutputRelay

        published: list[tuple[str, dict]] = []
        relay = OutputRelay([0], Outlet(lambda t, c: published.append((t, c))), 1, W, world=[0, 1])
        relay.end_rank(0, {"ename": "KeyboardInterrupt", "evalue": "rank 0 did not stop", "traceback": []})
        error = relay.close()  # the cell's one error: the kernel publishes it
        assert error is not None and "did not stop" in error["evalue"]
        relay.on_iopub(0, {"header": {"msg_type": "error"}, "parent_header": {}, "metadata": {},
                           "content": {"ename": "KeyboardInterrupt", "evalue": "", "traceback": self.TB}})
        assert kinds(published) == ["stream"], published
