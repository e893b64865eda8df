"""The parent kernel's own logic, driven in-process against fake ranks, in milliseconds.

Everything but the ranks is real: ipykernel's dispatch, the Jupyter session and its
signatures, the kernel's handlers, each cell's run, the merger and the fault policy. What the
real ranks do is proven in ``tests/kernel``; these tests claim only what the parent does with it.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from fake_ranks import Act, stdout
from inprocess import on_fake_ranks

pytestmark = pytest.mark.timeout(30)


def run(test):
    """Run ``test(frontend, ranks)`` against a kernel on two fake ranks (or ``world_size``)."""
    def go(script=None, world_size=2, hang_grace=0.2, ranks_ready=True):
        return on_fake_ranks(test, script, world_size, ready=ranks_ready, hang_grace=hang_grace)
    return go


async def running(fe, ranks, code: str = "while True: pass"):
    """Send a cell that keeps every rank busy; its request and the task that ends with its reply."""
    msg = fe.execute_request(code)
    task = asyncio.ensure_future(fe.send_shell(msg))
    await ranks.running(ranks.config.world_size)
    return msg, task


def msg_types(cell) -> list[str]:
    return [m["msg_type"] for m in cell.messages]


# ------------------------------------------------------------------ do_execute
def test_identical_output_of_every_rank_shows_once_and_the_reply_is_ok():
    async def test(fe, ranks):
        cell = await fe.execute("print('hi')")
        assert cell.status == "ok" and cell.reply["content"]["execution_count"] == 1
        assert cell.stream() == "hi\n"
        assert [r for r, t, _, _ in ranks.sent if t == "execute_request"] == [0, 1]

    run(test)(lambda rank, code: Act(out=[stdout("hi\n")]))


def test_busy_and_the_input_come_first_and_idle_last_even_while_busy_is_held():
    async def test(fe, ranks):
        cell = await fe.execute("print(rank)")
        types = msg_types(cell)
        assert types[:2] == ["status", "execute_input"] and types[-1] == "status"
        assert [m["content"]["execution_state"] for m in cell.messages if m["msg_type"] == "status"] == ["busy", "idle"]
        assert cell.stream() == "[rank 0] 0\n[rank 1] 1\n"

    run(test)(lambda rank, code: Act(out=[stdout(f"{rank}\n")]))


def test_a_rank_selection_runs_the_cell_on_those_ranks_only_and_tells_them_which():
    async def test(fe, ranks):
        msg = fe.execute_request("%%rank 1\nprint('one')")
        await fe.send_shell(msg)
        cell = fe.collect(msg)
        assert cell.status == "ok" and cell.stream() == "one\n"
        sent = [(r, c["code"].strip(), m) for r, t, c, m in ranks.sent if t == "execute_request"]
        # the frontend's msg_id travels too: comms the ranks open are named after it; the
        # source as sent, after which the rank names the cell's file (the debugger's name for it);
        # and the prompt's number, which every rank gives the cell (rank 0 ran none before it)
        assert sent == [(1, "# rank 1\nprint('one')", {"dist_kernel": {
            "ranks": [1], "cell": msg["header"]["msg_id"], "source": "%%rank 1\nprint('one')",
            "count": cell.reply["content"]["execution_count"]}})]

    run(test)(lambda rank, code: Act(out=[stdout("one\n")]))


def test_a_reply_without_a_count_waits_for_the_ranks_idle():
    async def test(fe, ranks):
        cell = await fe.execute("x")
        assert cell.status == "ok" and cell.stream() == "late\n"

    run(test)(lambda rank, code: Act(out=[stdout("late\n")], count=False))


def test_one_failing_rank_fails_the_cell_naming_it():
    async def test(fe, ranks):
        cell = await fe.execute("boom()")
        assert cell.status == "error" and cell.reply["content"]["ename"] == "ValueError"
        assert len(cell.errors) == 1 and "rank 1" in "".join(cell.errors[0]["traceback"])

    run(test)(lambda rank, code: Act(error=("ValueError", "bad") if rank == 1 else None))


def test_replies_that_agree_come_as_one_group_and_the_rank_that_differs_is_named():
    # a node agent sends one entry per distinct reply (issue 26): the cell takes each whole
    async def test(fe, ranks):
        cell = await fe.execute("step()")
        assert sorted(map(sorted, ranks.groups)) == [[0, 1, 3, 4, 5, 6, 7], [2]]
        assert cell.status == "error" and cell.stream() == "step\n"
        text = "".join(cell.errors[0]["traceback"])
        assert "rank 2" in text and "ValueError" in text
        assert (await fe.execute("x = 1")).status == "ok" and ranks.groups[-1] == list(range(8))

    run(test)(lambda rank, code: Act(out=[stdout("step\n")], error=("ValueError", "bad") if rank == 2 and "step" in code
                                     else None), world_size=8)


def test_a_rank_gone_without_word_to_the_kernel_still_ends_its_part_of_the_cell():
    # the kernel hears of a death from the supervisor; a rank found gone all the same (the kernel
    # was exiting when it died) is never waited for: the cell's tick ends its part
    async def test(fe, ranks):
        msg = fe.execute_request("while True: pass")
        task = asyncio.ensure_future(fe.send_shell(msg))
        await ranks.running(1)
        ranks._dead[1] = "exited with code 1"
        await task
        cell = fe.collect(msg)
        text = "".join(cell.errors[0]["traceback"])
        assert cell.status == "error" and "rank 1 (pid 1001) is gone" in text and "%dist_respawn" in text

    run(test)(lambda rank, code: Act(runs=rank == 1))


def test_a_bad_rank_selection_is_a_clear_error_and_no_rank_runs_anything():
    async def test(fe, ranks):
        cell = await fe.execute("%%rank 7\nx")
        assert cell.status == "error" and cell.reply["content"]["ename"] == "RankSpecError"
        assert "rank 7 does not exist" in cell.reply["content"]["evalue"]
        assert not [s for s in ranks.sent if s[1] == "execute_request"]

    run(test)()


def test_a_usage_error_of_a_parent_magic_names_the_fix():
    async def test(fe, ranks):
        cell = await fe.execute("%dist_output some")
        assert cell.reply["content"]["ename"] == "UsageError" and "%dist_output all" in cell.reply["content"]["evalue"]

    run(test)()


def test_after_an_error_the_requests_already_queued_are_aborted_and_a_later_one_runs():
    async def test(fe, ranks):
        first = fe.execute_request("fail()")
        queued = fe.execute_request("print('queued')")
        await asyncio.gather(fe.send_shell(first), fe.send_shell(queued))  # Run All: both arrived
        assert fe.collect(first).status == "error"
        assert fe.collect(queued).status == "aborted"
        later = await fe.execute("print('later')")
        assert later.status == "ok" and later.stream() == "later\n"

    run(test)(lambda rank, code: Act(error=("RuntimeError", "x")) if "fail" in code else Act(out=[stdout("later\n")]))


# ------------------------------------------------------------------- interrupt
def test_the_stop_button_interrupts_the_busy_ranks_and_the_cell_ends_with_one_keyboard_interrupt():
    async def test(fe, ranks):
        msg, task = await running(fe, ranks)
        reply = await fe.send_control(fe.request("interrupt_request", {}))
        assert reply["content"]["status"] == "ok"
        await task
        cell = fe.collect(msg)
        assert sorted(ranks.signalled) == [0, 1]
        assert cell.status == "error" and cell.reply["content"]["ename"] == "KeyboardInterrupt"
        assert len(cell.errors) == 1

    run(test)(lambda rank, code: Act(runs=True))


def test_a_stop_pressed_before_a_cell_was_sent_does_not_hit_it():
    async def test(fe, ranks):
        pressed = fe.request("interrupt_request", {})  # dated before the cell below
        msg, task = await running(fe, ranks)
        await fe.send_control(pressed)
        assert ranks.signalled == []
        await fe.send_control(fe.request("interrupt_request", {}))
        await task
        assert fe.collect(msg).reply["content"]["ename"] == "KeyboardInterrupt"

    run(test)(lambda rank, code: Act(runs=True))


def test_a_stopped_rank_is_named_and_the_stop_button_ends_the_cell_without_it():
    async def test(fe, ranks):
        msg, task = await running(fe, ranks)
        ranks.stop(1)
        await asyncio.sleep(0.02)
        notice = "".join(m["content"].get("text", "") for m in fe.published(msg))
        assert "rank 1 (pid 1001) is stopped (SIGSTOP)" in notice and "kill -CONT 1001" in notice
        await fe.send_control(fe.request("interrupt_request", {}))
        await task
        cell = fe.collect(msg)
        assert cell.status == "error" and "RankStoppedError" in "".join(cell.errors[0]["traceback"])
        assert fe.kernel.group.left_running == {1}
        assert sorted(ranks.signalled) == [0, 1]  # the stopped rank too: it sees the signal once resumed

    run(test)(lambda rank, code: Act(runs=True))


# ---------------------------------------------------------------------- faults
def test_a_rank_that_dies_mid_cell_frees_its_peers_and_later_cells_say_how_to_bring_it_back():
    async def test(fe, ranks):
        msg = fe.execute_request("dist.all_reduce(t)")
        task = asyncio.ensure_future(fe.send_shell(msg))
        await ranks.running(2)
        ranks.die(1)
        await task  # the survivor blocked with it is freed by tearing the group down, not signalled
        cell = fe.collect(msg)
        text = "".join(cell.errors[0]["traceback"])
        assert ranks.torn_down == [0] and ranks.signalled == []
        assert cell.status == "error" and "RankDiedError" in text and "rank 1's last words" in text
        assert "%dist_respawn" in text and "keep their variables" in text
        later = await fe.execute("x = 1")  # a cell on the dead rank does not run, and says what to do
        assert later.reply["content"]["ename"] == "RankDiedError"
        assert "%dist_respawn" in "".join(later.errors[0]["traceback"])
        assert (await fe.execute("%%rank 0\nx = 1")).status == "ok"  # the survivor runs cells
        back = await fe.execute("%dist_respawn")
        assert back.status == "ok" and ranks.respawned == [1] and "namespace is empty" in back.stream()
        assert (await fe.execute("x = 1")).status == "ok"

    run(test)(lambda rank, code: Act(blocked_in="all_reduce") if "all_reduce" in code else Act())


async def dying_in_a_collective(fe, ranks, *dying: int):
    """A cell of every rank in an all_reduce, during which ``dying`` die: the cell, ended."""
    msg = fe.execute_request("dist.all_reduce(t)")
    task = asyncio.ensure_future(fe.send_shell(msg))
    await ranks.running(ranks.config.world_size)
    for rank in dying:
        ranks.die(rank)
    await task
    return fe.collect(msg)


def test_with_respawn_on_a_dead_rank_is_started_anew_as_its_cell_ends():
    async def test(fe, ranks):
        ranks.config = dataclasses.replace(ranks.config, respawn=True)
        text = "".join((await dying_in_a_collective(fe, ranks, 1)).errors[0]["traceback"])
        assert "RankDiedError" in text and "started anew" in text and ranks.respawned == [1]
        assert (await fe.execute("x = 1")).status == "ok"

    run(test)(lambda rank, code: Act(blocked_in="all_reduce") if "all_reduce" in code else Act())


def test_what_the_kernel_says_of_two_dead_ranks_agrees_with_their_number_and_names_its_magic():
    async def test(fe, ranks):
        text = "".join((await dying_in_a_collective(fe, ranks, 1, 2)).errors[0]["traceback"])
        assert "until ranks 1,2 are back" in text and "start ranks 1,2 anew" in text, text
        later = await fe.execute("x = 1")
        assert "start ranks 1,2 anew (their namespaces are empty" in "".join(later.errors[0]["traceback"])
        bad = await fe.execute("%dist_respawn 7")
        assert bad.errors[0]["evalue"].startswith("%dist_respawn '7': rank 7 does not exist"), bad.errors
        back = await fe.execute("%dist_respawn")
        assert "ranks 1,2 were started anew" in back.stream() and "Their namespaces are empty" in back.stream()

    run(test)(lambda rank, code: Act(blocked_in="all_reduce") if "all_reduce" in code else Act(), world_size=3)


def test_dist_status_shows_an_automatic_respawn_in_progress_and_the_next_cell_waits_for_it():
    async def test(fe, ranks):
        ranks.config = dataclasses.replace(ranks.config, respawn=True)
        ranks.die(1)  # between cells: --respawn on starts it anew at once
        status = await fe.execute("%dist_status")
        text = next(c["data"]["text/plain"] for t, c in status.outputs if t == "display_data")
        row = next(line for line in text.splitlines() if line.startswith("1 "))
        assert "being started anew (--respawn on)" in row and ranks.respawned == [], text  # it did not wait
        later = await fe.execute("x = 1")
        assert later.status == "ok" and ranks.respawned == [1] and "rank 1 was started anew" in later.stream("stderr")

    run(test)()


def test_a_rank_waiting_in_a_collective_for_a_finished_rank_is_freed_and_the_group_re_formed():
    async def test(fe, ranks):
        cell = await fe.execute("if rank == 1: dist.barrier()")
        text = "".join(cell.errors[0]["traceback"])
        assert cell.status == "error" and "CollectiveHangError" in text and "barrier" in text
        assert ranks.torn_down and ranks.formations == 1
        assert "the process group was re-formed" in text
        assert (await fe.execute("print('again')")).status == "ok"

    run(test)(lambda rank, code: Act(blocked_in="barrier") if rank == 1 and "barrier" in code else Act())


def test_the_group_is_formed_again_only_once_the_teardown_that_freed_its_ranks_has_ended():
    async def test(fe, ranks):
        order: list[str] = []
        tear, form = ranks.teardown, ranks.form_group

        async def slow_teardown(on):
            failed = await tear(on)  # the blocked rank is freed at once: its reply comes...
            await asyncio.sleep(0.3)  # ...while another rank's own teardown is still on its way
            order.append("torn down")
            return failed

        async def form_group():
            order.append("formed")
            await form()

        ranks.teardown, ranks.form_group = slow_teardown, form_group
        cell = await fe.execute("if rank == 1: dist.barrier()")
        assert cell.status == "error" and order == ["torn down", "formed"]

    run(test)(lambda rank, code: Act(blocked_in="barrier") if rank == 1 and "barrier" in code else Act())


def test_a_cell_whose_error_broke_the_group_re_forms_it():
    async def test(fe, ranks):
        cell = await fe.execute("dist.all_reduce(t)")
        assert cell.status == "error" and ranks.formations == 1
        assert "the process group was re-formed" in "".join(cell.errors[0]["traceback"])

    def script(rank, code):
        return Act(blocked_in="all_reduce") if rank == 0 else Act(error=("DistBackendError", "peer gone"))

    run(test)(script)


def test_the_ranks_failing_to_start_is_the_error_of_every_cell():
    async def test(fe, ranks):
        ranks.start_error = "rank 1 could not join the gloo process group"
        await ranks.start()
        cell = await fe.execute("x")
        assert cell.reply["content"]["ename"] == "RankStartError" and "could not join" in cell.reply["content"]["evalue"]

    run(test)(ranks_ready=False)


# ----------------------------------------------------------------------- comms
def test_a_frontend_comm_message_goes_to_the_rank_that_opened_the_comm():
    async def test(fe, ranks):
        await fe.execute("w = Widget()")
        await fe.send_shell(fe.request("comm_msg", {"comm_id": "w1", "data": {"method": "update"}}))
        await asyncio.sleep(0)  # forwarded in a task
        assert [(r, c["comm_id"]) for r, t, c, _ in ranks.sent if t == "comm_msg"] == [(1, "w1")]

    def script(rank, code):
        return Act(out=[("comm_open", {"comm_id": "w1", "target_name": "jupyter.widget", "data": {}})] if rank == 1
                   else [])

    run(test)(script)


def _open(comm_id: str, value: int = 0) -> tuple[str, dict]:
    return ("comm_open", {"comm_id": comm_id, "target_name": "jupyter.widget",
                          "data": {"state": {"_model_name": "IntSliderModel", "value": value}}})


def _view(comm_id: str) -> tuple[str, dict]:
    return ("display_data", {"data": {"application/vnd.jupyter.widget-view+json": {"model_id": comm_id}},
                             "metadata": {}})


def test_a_widget_every_rank_creates_the_same_way_is_one_widget_that_every_rank_hears():
    async def test(fe, ranks):
        cell = await fe.execute("s = IntSlider()\ns")
        opens = [m for m in cell.messages if m["msg_type"] == "comm_open"]
        views = [m for m in cell.messages if m["msg_type"] == "display_data"]
        assert [m["content"]["comm_id"] for m in opens] == ["same"]
        assert len(views) == 1 and "[rank" not in str(views[0]["content"])
        await fe.send_shell(fe.request("comm_msg", {"comm_id": "same", "data": {"method": "update",
                                                                                 "state": {"value": 5}}}))
        await asyncio.sleep(0.01)  # forwarded in a task
        assert sorted(r for r, t, c, _ in ranks.sent if t == "comm_msg") == [0, 1]

    run(test)(lambda rank, code: Act(out=[_open("same"), _view("same")]))


def test_widgets_that_differ_between_ranks_stay_separate_and_labelled():
    async def test(fe, ranks):
        cell = await fe.execute("s = IntSlider(value=rank)\ns")
        assert sorted(m["content"]["comm_id"] for m in cell.messages if m["msg_type"] == "comm_open") == ["w0", "w1"]
        shown = [m["content"]["data"] for m in cell.messages if m["msg_type"] == "display_data"]
        # a frontend draws a widget's view alone: each one follows its rank's label
        assert [d.get("text/plain") for d in shown if "application/vnd.jupyter.widget-view+json" not in d] == [
            "[rank 0] ", "[rank 1] "]
        assert [d["application/vnd.jupyter.widget-view+json"]["model_id"] for d in shown
                if "application/vnd.jupyter.widget-view+json" in d] == ["w0", "w1"]
        assert ["widget-view" in str(d) for d in shown] == [False, True, False, True]
        await fe.send_shell(fe.request("comm_msg", {"comm_id": "w1", "data": {"method": "update"}}))
        await asyncio.sleep(0.01)
        assert [r for r, t, c, _ in ranks.sent if t == "comm_msg"] == [1]

    run(test)(lambda rank, code: Act(out=[_open(f"w{rank}", rank), _view(f"w{rank}")]))


def test_what_a_shared_widgets_callback_prints_on_every_rank_shows_once():
    async def test(fe, ranks):
        await fe.execute("b = Button()\nb")
        msg = fe.request("comm_msg", {"comm_id": "same", "data": {"method": "custom", "content": {"event": "click"}}})
        await fe.send_shell(msg)
        await asyncio.sleep(0.01)
        assert [m["dist_kernel"]["cell"] for _, t, _, m in ranks.sent if t == "comm_msg"] == [msg["header"]["msg_id"]] * 2
        forwarded = [(r, i) for r, t, i in ranks.msg_ids if t == "comm_msg"]
        assert [r for r, _ in forwarded] == [0, 1]
        for rank, msg_id in forwarded:
            ranks.iopub(rank, msg_id, "stream", {"name": "stdout", "text": "clicked\n"})
            ranks.iopub(rank, msg_id, "status", {"execution_state": "idle"})
        await asyncio.sleep(0.2)
        out = fe.published(msg)
        assert "".join(m["content"]["text"] for m in out if m["msg_type"] == "stream") == "clicked\n"

    run(test)(lambda rank, code: Act(out=[_open("same"), _view("same")]))


def test_comm_info_merges_the_comms_of_every_rank():
    async def test(fe, ranks):
        msg = fe.request("comm_info_request", {})
        await fe.send_shell(msg)
        reply = fe.collect(msg).reply
        assert set(reply["content"]["comms"]) == {"comm-of-0", "comm-of-1"}
        assert fe.kernel.comms.ranks_for("comm-of-1") == [1]  # the comm's leader hears the frontend

    run(test)()


def test_completion_is_answered_by_the_first_rank_a_selection_names():
    async def test(fe, ranks):
        msg = fe.request("complete_request", {"code": "%%rank 1\nx", "cursor_pos": 10})
        await fe.send_shell(msg)
        assert fe.collect(msg).reply["content"]["matches"] == ["from_rank_1"]

    run(test)()


# ------------------------------------------------------------------ %dist_sync, watched as a cell
def sync_script(**acts):
    """Each rank's Act for ``%dist_sync`` (``r0=Act(...)``), a plain one for any other code."""
    return lambda rank, code: acts.get(f"r{rank}", Act()) if code.startswith("%dist_sync") else Act()


def test_a_sync_copies_and_says_what_each_rank_got():
    async def test(fe, ranks):
        cell = await fe.execute("%dist_sync t")
        assert cell.status == "ok" and cell.stream() == "%dist_sync from rank 0: t to rank 1: tensor 2 float32\n"

    run(test)(sync_script())


def test_a_sync_whose_rank_waits_for_one_that_failed_is_freed_and_the_group_re_formed():
    async def test(fe, ranks):
        cell = await fe.execute("%dist_sync t")
        text = cell.errors[0]["evalue"] + "".join(cell.errors[0]["traceback"])
        assert cell.status == "error" and cell.errors[0]["evalue"].startswith("%dist_sync t from rank 0: nothing was "
                                                                              "copied where it failed;")
        assert "rank 0: ValueError: boom" in text
        assert "rank 1 was blocked in torch.distributed.broadcast(), which rank 0 never entered (it had finished its " \
               "part of %dist_sync)" in text
        assert ranks.torn_down == [0, 1] and ranks.formations == 1 and "re-formed" in text
        assert (await fe.execute("x = 1")).status == "ok"
        assert fe.kernel._current is None

    run(test)(sync_script(r0=Act(error=("ValueError", "boom")), r1=Act(blocked_in="broadcast")))


def test_the_stop_button_frees_a_sync_whose_source_does_not_return():
    async def test(fe, ranks):
        msg, task = await running(fe, ranks, "%dist_sync m")
        await fe.send_control(fe.request("interrupt_request", {}))
        await task
        cell = fe.collect(msg)
        text = "".join(cell.errors[0]["traceback"])
        assert cell.status == "error" and cell.reply["content"]["ename"] == "KeyboardInterrupt"
        assert "rank 1 was interrupted while blocked in torch.distributed.broadcast()" in text
        assert sorted(ranks.signalled) == [0, 1] and ranks.torn_down == [0, 1] and ranks.formations == 1
        assert (await fe.execute("x = 1")).status == "ok"

    run(test)(sync_script(r0=Act(runs=True), r1=Act(blocked_in="broadcast")))


def test_a_rank_that_dies_in_a_sync_ends_it_naming_the_rank_and_how_to_bring_it_back():
    async def test(fe, ranks):
        msg, task = await running(fe, ranks, "%dist_sync m")
        ranks.die(1)
        await task
        cell = fe.collect(msg)
        text = cell.errors[0]["evalue"] + "".join(cell.errors[0]["traceback"])
        assert cell.reply["content"]["ename"] == "RankDiedError" and "rank 1 (pid 1001) exited with code -9" in text
        assert "%dist_respawn" in text and ranks.torn_down == [0]

    run(test)(sync_script(r0=Act(blocked_in="broadcast"), r1=Act(blocked_in="broadcast")))


def test_a_sync_while_a_rank_still_runs_a_cell_given_up_on_is_refused_naming_it():
    async def test(fe, ranks):
        fe.kernel.group.left_running.add(1)
        cell = await fe.execute("%dist_sync t")
        assert cell.status == "error" and cell.reply["content"]["ename"] == "UsageError"
        assert "rank 1 is still running a cell the kernel gave up on" in cell.errors[0]["evalue"]
        assert ranks._sync == ([], 0)  # no rank was asked

    run(test)(sync_script())
