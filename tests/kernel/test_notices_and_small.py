"""Issue 30, sections 4-7, on a real kernel (real ipykernel ranks, a real gloo group, 2 ranks):
the output budget's notices, accelerate's ``mixed_precision``, small things (a shared widget's
close, a stopped cell's traceback, ``num_processes`` of the wrong type, where ``%%rank`` may
stand) and the backend where ranks must share GPUs. The pure logic is in tests/unit
(test_throttle_notices, test_accelerate_launcher, test_comm_close, test_interrupt_traceback,
test_rank_magic_lines, test_backend_default)."""

from __future__ import annotations

import re
import threading
import time

import pytest
from harness import DistKernel, error_of, kernel_for_module

from dist_kernel.parent.throttle import BURST, RATE

pytestmark = pytest.mark.slow

NOT_SHOWN = re.compile(r"\[dist_kernel\] (.*) (was|were) not shown; full output: ")


@pytest.fixture(scope="module")
def k2():
    yield from kernel_for_module("--ranks", "2", "--merge-window-ms", "1000")


def quiet() -> None:
    """Let the kernel's output budget (it lasts the kernel's lifetime) fill up again."""
    time.sleep(BURST / RATE + 0.5)


def not_shown(stderr: str) -> tuple[str, str]:
    """What the notice at the end of a spill says was not shown, and its verb."""
    m = NOT_SHOWN.search(stderr)
    assert m, stderr
    return m[1], m[2]


# ------------------------------------------------------------------ 4: budget and notices
def test_a_cell_that_floods_still_shows_its_result_and_so_does_the_next(k2):
    quiet()
    res = k2.execute("import sys\nsys.stdout.write('x' * 1_000_000 + '\\n')\n"
                     "sys.stdout.write('x' * 1_000_000 + '\\n')\n'the result'")
    assert "saved in full to" in res.stream("stderr")  # the streams spilled ...
    results = res.of_type("execute_result")
    assert [r.text for r in results] == ["'the result'"]  # ... the result did not
    assert res.outputs[-1].msg_type == "execute_result"  # after the notice and the last lines
    what, verb = not_shown(res.stream("stderr"))
    assert "output" not in what  # the result is not among what was not shown
    assert verb == ("was" if re.fullmatch(r"1 line \(.*\)", what) else "were"), what
    after = k2.execute("41 + 1")
    assert [r.text for r in after.of_type("execute_result")] == ["42"]


def test_an_error_after_a_flood_is_shown(k2):
    quiet()
    res = k2.execute("import sys\nsys.stdout.write('y' * 3_000_000)\nraise ValueError('after the flood')")
    assert res.status == "error" and "after the flood" in error_of(res)["evalue"]


def test_a_huge_line_without_a_newline_is_counted_as_a_line(k2):
    quiet()
    res = k2.execute("print('z' * 3_000_000, end='')")
    what, verb = not_shown(res.stream("stderr"))
    m = re.fullmatch(r"(\d+) lines? \((\d+\.\d) MiB\)", what)
    assert m and int(m[1]) >= 1, what  # one line (two when the ranks' copies were told apart)
    assert verb == ("was" if int(m[1]) == 1 else "were") and (m[1] == "1") == (" line " in f" {what} ")


# ------------------------------------------------------------------ 5: accelerate's mixed_precision
LAUNCHED = """\
import torch
from accelerate import Accelerator, notebook_launcher
def train():
    acc = Accelerator()
    acc.prepare(torch.nn.Linear(2, 2))
    with acc.autocast():  # what a training step computes in (a prepared model's outputs are float32)
        out = torch.ones(1, 2) @ torch.ones(2, 2)
    print(acc.mixed_precision, out.dtype)
"""


def test_notebook_launcher_trains_with_the_precision_asked_for_whatever_came_before(k2):
    assert k2.execute(LAUNCHED + "before = Accelerator()\nprint(before.mixed_precision)").stream() == "no\n"
    launch = "Launching training on 2 CPUs: the kernel's ranks, in their process group (no new processes).\n"
    res = k2.execute("notebook_launcher(train, mixed_precision='bf16')")
    assert res.status == "ok", res.reply
    assert res.stream() == launch + "bf16 torch.bfloat16\n"  # an Accelerator existed: bf16 all the same
    res = k2.execute("notebook_launcher(train, mixed_precision='no')")
    assert res.stream() == launch + "no torch.float32\n"  # after a bf16 launch, "no" is "no"
    # the notebook's own Accelerator, and one made after the launches, are as before them
    assert k2.execute("print(before.mixed_precision, Accelerator().mixed_precision)").stream() == "no no\n"


def test_notebook_launcher_refuses_an_unknown_precision(k2):
    res = k2.execute("from accelerate import notebook_launcher\nnotebook_launcher(print, mixed_precision='fp12')")
    assert res.status == "error" and "Unknown mixed_precision mode: fp12" in error_of(res)["evalue"]


# ------------------------------------------------------------------ 6: small
def test_a_process_count_of_the_wrong_type_is_named(k2):
    res = k2.execute("from accelerate import notebook_launcher\nnotebook_launcher(print, num_processes='2')")
    err = error_of(res)
    assert err["ename"] == "TypeError"
    assert "num_processes must be an int, not str" in err["evalue"] and "num_processes=2" in err["evalue"]


def test_a_widget_every_rank_shares_is_closed_once(k2):
    res = k2.execute("import ipywidgets as w\nshared = w.IntSlider()\nshared")
    (slider,) = [o.content["comm_id"] for o in res.of_type("comm_open")
                 if o.content["data"]["state"].get("_model_name") == "IntSliderModel"]
    res = k2.execute("shared.close()")
    closes = [o.content["comm_id"] for o in res.of_type("comm_close")]
    assert closes.count(slider) == 1, closes


def test_a_stopped_cells_traceback_ends_in_the_users_code(k2):
    k2.execute("x = 1")
    threading.Timer(1.0, k2.km.interrupt_kernel).start()
    res = k2.execute("import time\ndef wait():\n    time.sleep(60)\nwait()", timeout=30)
    err = error_of(res)
    assert err["ename"] == "KeyboardInterrupt"
    text = re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(err["traceback"]))
    assert "_interrupt_cell" not in text and "dist_kernel" not in text, text
    last_frame = re.split(r"^(?=Cell In\[|File )", text, flags=re.M)[-1]  # as a plain kernel ends it
    assert last_frame.startswith("Cell In[") and "in wait()" in last_frame.splitlines()[0], text
    assert "----> 3     time.sleep(60)" in last_frame, text


@pytest.mark.parametrize("first", ["%%time\n%%rank 0", "%%rank 0 # the logger\n%%time"])
def test_rank_below_or_above_another_cell_magic_and_with_a_comment(k2, first):
    res = k2.execute(first + "\nprint('on', rank)")
    assert res.status == "ok", res.reply
    assert res.stream().startswith("on 0\nCPU times: ") and "Wall time: " in res.stream(), res.stream()
    assert "[rank" not in res.stream()  # rank 0 alone: unlabelled


def test_rank_with_a_full_width_digit_is_refused(k2):
    res = k2.execute("%%rank \uff11\nprint(rank)")
    err = error_of(res)
    assert err["ename"] == "RankSpecError" and "cannot parse" in err["evalue"]


# ------------------------------------------------------------------ 7: ranks that share a GPU
def test_two_ranks_on_one_gpu_by_default_share_it_over_gloo_said_once():
    # a fake GPU count: the parent counts GPUs by CUDA_VISIBLE_DEVICES (it never imports torch)
    import torch

    k = DistKernel("--ranks", "2", env={"CUDA_VISIBLE_DEVICES": "0"})
    try:
        first = k.execute("import torch.distributed as dist\nprint(dist.get_backend())", timeout=120)
        notes = first.stream("stderr")
        assert notes.count("backend gloo, not nccl: 2 ranks on 1 GPU(s)") == 1, notes
        assert "Accelerator(cpu=True)" in notes and "TrainingArguments(use_cpu=True)" in notes
        if torch.cuda.is_available():  # a GPU machine: the ranks share the GPU
            assert first.stream() == "gloo\n", first.outputs
        else:  # this CPU machine: the configuration passed (not "nccl needs 2 GPUs"); the ranks cannot use CUDA
            err = error_of(first)
            assert "nccl" not in err["evalue"] and "torch.cuda.is_available() is False" in err["evalue"], err
        assert "backend gloo" not in k.execute("x = 1", timeout=60).stream("stderr")  # once
    finally:
        k.shutdown()


def test_an_explicit_nccl_on_one_gpu_keeps_its_error():
    k = DistKernel("--ranks", "2", "--backend", "nccl", env={"CUDA_VISIBLE_DEVICES": "0"})
    try:
        err = error_of(k.execute("x = 1", timeout=60))
        assert err["ename"] == "ConfigError"
        assert "--ranks 2 with nccl needs 2 GPUs but only 1 are selected" in err["evalue"]
    finally:
        k.shutdown()


def test_every_rank_numbers_a_cell_as_the_prompt_does_after_a_rank_cell(k2):
    """A ``%%rank 0`` cell leaves rank 1 out; the next cell's traceback still says the prompt's
    number on both ranks (one merged error, not two that differ by their ``Cell In[n]``)."""
    k2.execute("%%rank 0\nx = 1")
    res = k2.execute("1/0")
    count = res.reply["execution_count"]
    err = error_of(res)
    text = "\n".join(err["traceback"])
    assert err["ename"] == "ZeroDivisionError" and "[rank" not in err["evalue"], err
    assert re.search(rf"Cell In\[{count}\]", re.sub(r"\x1b\[[0-9;]*m", "", text)), text
    res = k2.execute(f"print(_i{count}.strip())")
    assert res.stream() == "1/0\n", res.outputs
