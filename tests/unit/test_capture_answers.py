"""A cell's reply waits for nbclient's answers to the output its ``Output`` widgets captured
(issue 36): the rule (``parent/answers.py``), and the parent kernel in-process holding the reply.

nbclient answers each captured output with a ``comm_msg`` on the shell socket; sent as the reply
arrives, that send hid the reply from nbclient until its timeout (the kernel lane's
``test_widgets.py`` shows it beside CPU hogs). Here: which outputs are answered, and that the
reply goes out once they are, at once for a frontend that does not answer so.
"""

from __future__ import annotations

import asyncio

import pytest
from fake_ranks import Act, FakeRanks, stdout
from inprocess import Frontend

from dist_kernel.parent import answers
from dist_kernel.parent.answers import CaptureAnswers

pytestmark = pytest.mark.timeout(30)


def request(msg_id: str = "req-1", session: str = "nbclient") -> dict:
    return {"header": {"msg_id": msg_id, "session": session, "msg_type": "execute_request"}}


def capture(comm_id: str, msg_id: str) -> tuple[str, dict]:
    """An ``Output`` widget's state change: it captures the output of ``msg_id`` ('' stops)."""
    return ("comm_msg", {"comm_id": comm_id, "data": {"method": "update", "state": {"msg_id": msg_id},
                                                      "buffer_paths": []}})


def answer(comm_id: str, parent: dict | None, session: str = "nbclient") -> dict:
    """nbclient's answer to a captured output: the widget's outputs, under the cell's request."""
    return {"header": {"msg_type": "comm_msg", "session": session},
            "parent_header": parent["header"] if parent else {},
            "content": {"comm_id": comm_id, "data": {"method": "update", "state": {"outputs": []},
                                                    "buffer_paths": []}}}


def owed(answers_: CaptureAnswers, req: dict) -> int:
    cell = answers_._cells[req["header"]["msg_id"]]
    return cell.sent - cell.answered


# ------------------------------------------------------------------ the rule
def test_outputs_inside_a_capture_of_the_cell_are_owed_an_answer_and_others_are_not():
    a, req = CaptureAnswers(), request()
    a.begin(req)
    a.published(req, *stdout("before\n"))
    a.published(req, *capture("w", "req-1"))
    a.published(req, *stdout("in\n"))
    a.published(req, "display_data", {"data": {"text/plain": "'x'"}, "metadata": {}})
    a.published(req, "clear_output", {"wait": True})  # nbclient only marks the widget: no answer
    a.published(req, "clear_output", {"wait": False})  # nbclient sends the emptied widget
    a.published(req, "update_display_data", {"data": {}, "metadata": {}, "transient": {"display_id": "d"}})
    a.published(req, *capture("w", ""))
    a.published(req, *stdout("after\n"))
    a.published(request("other"), *stdout("another request's\n"))
    assert owed(a, req) == 3


def test_nested_and_paused_captures_count_while_any_widget_captures_for_the_cell():
    a, req = CaptureAnswers(), request()
    a.begin(req)
    for msg in (capture("inner", "req-1"), stdout("in inner\n"), capture("outer", "req-1"), stdout("in outer\n"),
                capture("outer", ""), stdout("also in inner\n"), capture("inner", ""),
                # the merger pauses a capture around another rank's output, and resumes it
                capture("w", "req-1"), capture("w", ""), stdout("[rank 1] outside\n"), capture("w", "req-1"),
                stdout("[rank 0] inside\n"), capture("w", "")):
        a.published(req, *msg)
    assert owed(a, req) == 4


def test_settle_returns_once_every_captured_output_is_answered():
    async def main():
        a, req = CaptureAnswers(), request()
        a.begin(req)
        for msg in (capture("w", "req-1"), stdout("1\n"), stdout("2\n"), capture("w", "")):
            a.published(req, *msg)
        settled = asyncio.ensure_future(a.settle(req))
        await asyncio.sleep(0.05)
        a.answered(answer("w", req))
        await asyncio.sleep(0.05)
        assert not settled.done()  # one answer of two
        a.answered(answer("w", req))
        await asyncio.wait_for(settled, 5)
        assert a._cells == {}  # nothing kept of a finished cell

    asyncio.run(main())


def test_a_frontend_that_never_answers_is_waited_for_once_and_one_without_requests_never(monkeypatch):
    monkeypatch.setattr(answers, "FIRST_ANSWER", 0.05)

    async def cell(a: CaptureAnswers, req: dict) -> None:
        a.begin(req)
        for msg in (capture("w", req["header"]["msg_id"]), stdout("in\n"), capture("w", "")):
            a.published(req, *msg)
        await asyncio.wait_for(a.settle(req), 5)

    async def main():
        a = CaptureAnswers()
        await cell(a, request("c1", session="harness"))  # waits FIRST_ANSWER, then knows
        monkeypatch.setattr(answers, "FIRST_ANSWER", 60.0)
        await cell(a, request("c2", session="harness"))  # not waited for: the timeout would fail it
        # JupyterLab's widget manager answers under no request: nothing to wait for
        a.answered(answer("w", None, session="lab"))
        await cell(a, request("c3", session="lab"))
        # a late answer (to c1) says the first frontend answers after all: it is waited for again
        a.answered(answer("w", request("c1", session="harness"), session="harness"))
        a.begin(request("c4", session="harness"))
        a.published(request("c4", session="harness"), *capture("w", "c4"))
        a.published(request("c4", session="harness"), *stdout("in\n"))
        settled = asyncio.ensure_future(a.settle(request("c4", session="harness")))
        await asyncio.sleep(0.05)
        assert not settled.done()
        a.answered(answer("w", request("c4", session="harness"), session="harness"))
        await asyncio.wait_for(settled, 5)

    asyncio.run(main())


# ----------------------------------------------------- the kernel holds the reply
def test_the_kernel_sends_a_captured_cells_reply_only_after_the_frontend_answered(monkeypatch):
    monkeypatch.setattr(answers, "FIRST_ANSWER", 60.0)  # the frontend's answer, never the time, ends the wait

    async def main():
        fe = Frontend()
        msg = fe.execute_request("with out:\n    print('in')")
        req_id = msg["header"]["msg_id"]
        script = lambda rank, code: Act(out=[capture("w", req_id), stdout("in\n"), capture("w", "")])  # noqa: E731
        ranks = FakeRanks(fe.kernel, world_size=1, script=script)
        fe.kernel.dist_config = ranks.config
        fe.kernel.attach(ranks)
        await ranks.start()
        try:
            task = asyncio.ensure_future(fe.send_shell(msg))
            for _ in range(200):
                if any(m["msg_type"] == "stream" for m in fe.published(msg)):
                    break
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            assert not task.done(), "the reply went out before the frontend answered the captured output"
            # nbclient's answer, under the cell's request, while the cell holds the shell lock
            reply_to = fe.session.msg("comm_msg", {"comm_id": "w", "data": {
                "method": "update", "state": {"outputs": [{"output_type": "stream", "name": "stdout",
                                                           "text": "in\n"}]}, "buffer_paths": []}}, parent=msg)
            await fe.send_shell(reply_to)
            await asyncio.wait_for(task, 5)
            cell = fe.collect(msg)
            assert cell.status == "ok" and cell.stream() == "in\n"
            # the answer reached the widget's rank, as a frontend's comm message does
            assert [r for r, t, c, _ in ranks.sent if t == "comm_msg"] == [0]
        finally:
            fe.close()

    asyncio.run(main())
