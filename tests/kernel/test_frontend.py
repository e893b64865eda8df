"""What a JupyterLab user relies on every day, with N ranks behind the kernel (issue 3)."""

from __future__ import annotations

import queue
import threading
import time

import pytest
from harness import DistKernel, error_of, shell_reply, visible

pytestmark = pytest.mark.slow


# ------------------------------------------------------------ completion & co
def test_completion_and_inspection_see_the_selected_ranks_variables(kernel2):
    kernel2.execute("%%rank 1\nonly_on_rank_one = 1")
    code = "%%rank 1\nonly_on_r"
    assert "only_on_rank_one" in shell_reply(kernel2, kernel2.kc.complete(code, len(code)))["matches"]
    plain = "only_on_r"  # rank 0 does not have it
    assert "only_on_rank_one" not in shell_reply(kernel2, kernel2.kc.complete(plain, len(plain)))["matches"]
    info = shell_reply(kernel2, kernel2.kc.inspect("world_size", 10))
    assert info["found"] and "int" in info["data"]["text/plain"]


def test_is_complete_and_history_are_answered_by_a_rank(kernel2):
    assert shell_reply(kernel2, kernel2.kc.is_complete("for i in range(3):"))["status"] == "incomplete"
    assert shell_reply(kernel2, kernel2.kc.is_complete("x = 1"))["status"] == "complete"
    kernel2.execute("history_marker = 7")
    hist = shell_reply(kernel2, kernel2.kc.history(hist_access_type="tail", n=5))["history"]
    assert any("history_marker" in entry[2] for entry in hist)


# ------------------------------------------------------------------ input()
def test_input_shows_one_prompt_and_every_rank_gets_the_answer(kernel2):
    msg_id = kernel2.kc.execute("name = input('your name? ')\nprint('hello', name, rank)", allow_stdin=True)
    request = kernel2.kc.get_stdin_msg(timeout=30)
    assert request["content"]["prompt"] == "your name? "
    kernel2.kc.input("ada")
    with pytest.raises(queue.Empty):
        kernel2.kc.get_stdin_msg(timeout=2)  # no second prompt
    shell_reply(kernel2, msg_id, timeout=30)
    assert kernel2.execute("print(name)").stream() == "ada\n"


def test_input_without_stdin_fails_cleanly_once(kernel2):
    res = kernel2.execute("input('?')")  # allow_stdin=False, as nbclient sends
    (err,) = res.of_type("error")
    assert err.content["ename"] == "StdinNotImplementedError"
    assert kernel2.execute("print('ok')").stream() == "ok\n"


# ------------------------------------------------------------------ widgets & comms
def test_widgets_from_every_rank_reach_the_frontend_and_messages_reach_their_owner(kernel2):
    res = kernel2.execute("import ipywidgets as w\ns = w.IntSlider(value=10 + rank)\ns")
    opens = [o.content for o in res.of_type("comm_open")]
    sliders = {o["data"]["state"]["value"]: o["comm_id"] for o in opens
               if o["data"]["state"].get("_model_name") == "IntSliderModel"}
    assert set(sliders) == {10, 11}
    views = [o for o in res.of_type("execute_result") if "application/vnd.jupyter.widget-view+json" in o.content["data"]]
    assert len(views) == 2  # one widget view per rank, labelled by rank
    # the frontend moves rank 1's slider: only rank 1's widget changes
    msg = kernel2.kc.session.msg("comm_msg", {"comm_id": sliders[11], "data": {
        "method": "update", "state": {"value": 42}, "buffer_paths": []}})
    kernel2.kc.shell_channel.send(msg)
    time.sleep(0.5)
    assert kernel2.execute("print(s.value)").stream() == "[rank 0] 10\n[rank 1] 42\n"
    info = shell_reply(kernel2, kernel2.kc.comm_info(target_name="jupyter.widget"))["comms"]
    assert {sliders[10], sliders[11]} <= set(info)


# ------------------------------------------------------------------ displays
def test_clear_output_progress_loops_do_not_erase_other_ranks_output(kernel2):
    # rank 1 runs behind rank 0, as real ranks do; each rank's last step must stay visible
    res = kernel2.execute(
        "from IPython.display import clear_output\nimport time\ntime.sleep(0.3 * rank)\n"
        "for i in range(4):\n    clear_output(wait=True)\n    print(f'rank {rank} step {i}')\n    time.sleep(0.25)")
    shown = visible([(o.msg_type, o.content) for o in res.outputs])
    assert "rank 0 step 3" in shown and "rank 1 step 3" in shown
    assert "step 2" not in shown


def test_carriage_return_progress_bars_stay_one_line_per_rank(kernel2):
    res = kernel2.execute("import time\nfor i in range(0, 101, 25):\n"
                          "    print(f'\\r{i + rank}%', end='', flush=True)\n    time.sleep(0.2)\nprint()")
    final = {}
    for o in res.outputs:
        if o.msg_type in ("display_data", "update_display_data"):
            final[o.content["transient"]["display_id"]] = o.text.strip()
    assert list(final.values()) == ["[rank 0] 100%\n[rank 1] 101%"]  # one display, a line per rank


def test_output_policy_rank0_shows_rich_output_of_rank_0_only(kernel2):
    try:
        kernel2.execute("%dist_output rank0")
        res = kernel2.execute("from IPython.display import display\ndisplay(f'figure of rank {rank}')\nprint(rank)")
        assert [o.text for o in res.of_type("display_data")] == ["'figure of rank 0'"]
        assert res.stream() == "[rank 0] 0\n[rank 1] 1\n"  # streams still from every rank
    finally:
        kernel2.execute("%dist_output all")
    res = kernel2.execute("from IPython.display import display\ndisplay(f'figure of rank {rank}')")
    assert len(res.of_type("display_data")) == 2
    assert kernel2.execute("%dist_output sometimes").status == "error"


def test_output_policy_as_a_kernel_option():
    k = DistKernel("--ranks", "2", "--rich-output", "rank0")
    try:
        assert [o.text for o in k.execute("rank").of_type("execute_result")] == ["0"]
    finally:
        k.shutdown()


# ------------------------------------------------------------------ status, cache, interrupt
def test_dist_status_lists_every_rank(kernel2):
    res = kernel2.execute("%dist_status")
    (table,) = res.of_type("display_data")
    lines = table.text.splitlines()
    assert "2 ranks, backend gloo" in lines[0]
    for needed in ("pid", "host", "device", "state", "RSS MB"):
        assert needed in lines[1]
    assert len(lines) == 5 and all(" idle " in line and " cpu " in line for line in lines[2:4])
    assert lines[4].startswith("output log: ") and lines[4].endswith("follow it with tail -F)")
    assert "<table>" in table.content["data"]["text/html"]


def test_empty_cache_after_each_cell_can_be_switched_off_and_on(kernel2):
    kernel2.execute("%dist_empty_cache off")
    assert "False" in kernel2.execute("%dist_status").of_type("display_data")[0].text
    kernel2.execute("%dist_empty_cache on")
    assert "False" not in kernel2.execute("%dist_status").of_type("display_data")[0].text


#: each rank's fastai switch, merged into one line when the ranks agree
FASTAI_FLAG = "from dist_kernel.rank.integration import fastai as _fastai\nprint(_fastai.enabled)"


def test_a_rank_line_around_a_switch_cannot_leave_the_ranks_disagreeing(kernel2):
    """Issue 37: ``%%rank 1`` + ``%dist_fastai off`` switched rank 1 alone. Now the kernel refuses
    it, a rank refuses the magic below code, and the kernel's magic switches every rank."""
    refused = kernel2.execute("%%rank 1\n%dist_fastai off")
    assert refused.status == "error" and "%dist_fastai under `%%rank 1`" in error_of(refused)["evalue"]
    below = kernel2.execute("%%rank 1\nx = 1\n%dist_fastai off")
    assert below.status == "error" and "a rank never switches fastai alone" in below.stream("stderr"), below.explain()
    run = kernel2.execute("get_ipython().run_line_magic('dist_fastai', 'off')")
    assert run.status == "error" and "a rank never switches fastai alone" in run.stream("stderr"), run.explain()
    assert kernel2.execute(FASTAI_FLAG).stream() == "True\n"  # the same on both ranks: merged
    try:
        assert kernel2.execute("%dist_fastai off").stream() == "fastai: off on every rank\n"
        assert kernel2.execute(FASTAI_FLAG).stream() == "False\n"
    finally:
        assert kernel2.execute("%dist_fastai on").status == "ok"
    assert kernel2.execute(FASTAI_FLAG).stream() == "True\n"


def test_interrupt_stops_every_busy_rank_once_and_the_kernel_stays_usable(kernel2):
    kernel2.execute("x = 1")  # ranks ready: the stop button before that ends the waiting cell instead
    threading.Timer(1.0, kernel2.km.interrupt_kernel).start()
    res = kernel2.execute("import time\ntime.sleep(60)", timeout=30)
    (err,) = res.of_type("error")
    assert err.content["ename"] == "KeyboardInterrupt"
    assert sum("Traceback (most recent call last)" in line for line in err.content["traceback"]) == 1
    assert kernel2.execute("print('alive')").stream() == "alive\n"
