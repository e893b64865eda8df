"""Cells that used to hang (issue 30, section 1), through a real kernel: 2 ipykernel ranks, a
real gloo group.

- A cell with a top-level ``await`` ends as in a plain kernel, and the stop button cancels one
  that awaits for long.
- ``%%rank 0`` around code whose collective starts in C++ (``DDP(...)``'s constructor, which
  accelerate's ``prepare`` and ``notebook_launcher`` run too) is reported within
  ``--hang-grace``, naming rank 0 and the call; one stop ends it and re-forms the group.

Timings are printed (``-s``), never asserted: the bounds below only keep a hang from passing.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import nbformat
import pytest
from harness import DistKernel, Output, Result, end_process_tree, error_of

AWAIT_CELL = "import asyncio\nawait asyncio.sleep(0.1)\nprint('awaited')"
SETUP = ("import torch, torch.nn as nn, torch.distributed as dist\n"
         "from torch.nn.parallel import DistributedDataParallel as DDP\n"
         "kept = 100 + rank\n"
         "_warm = DDP(nn.Linear(2, 2))  # every rank: torch's lazy imports are done before the hang")
RANK0_DDP = "%%rank 0\nprint('constructing', flush=True)\nm = DDP(nn.Linear(2, 2))"
HANG_GRACE = 3.0


def all_reduce_gives_two_and_variables_survived(k: DistKernel) -> None:
    res = k.execute("t = torch.ones(1)\ndist.all_reduce(t)\nprint(int(t.item()), kept)", timeout=60)
    assert res.status == "ok", res.reply
    assert res.stream() == "[rank 0] 2 100\n[rank 1] 2 101\n", res.outputs


@pytest.fixture(scope="module")
def hang_kernel() -> Iterator[DistKernel]:
    """2 ranks, ``--hang-grace`` HANG_GRACE, SETUP run: shared by the tests whose hang is reported
    and whose group is then shown to work."""
    k = DistKernel("--ranks", "2", "--hang-grace", str(HANG_GRACE))
    try:
        assert k.execute(SETUP, timeout=180).status == "ok"
        yield k
    finally:
        k.shutdown()


def timed(k: DistKernel, code: str, timeout: float, **kw: object) -> tuple[Result, float]:
    t0 = time.monotonic()
    res = k.execute(code, timeout=timeout, **kw)
    return res, time.monotonic() - t0


# ------------------------------------------------------------------ 1.1: top-level await
@pytest.mark.timeout(240)
def test_a_cell_with_top_level_await_ends_ok_and_the_stop_button_cancels_a_long_one():
    k = DistKernel("--ranks", "2")
    try:
        assert k.execute("x = 1", timeout=120).status == "ok"
        res, took = timed(k, AWAIT_CELL, timeout=30)  # it never ended before: a 30 s read runs out
        print(f"await cell: {took:.3f} s")
        assert res.status == "ok", res.reply
        assert res.stream() == "awaited\n", res.outputs
        assert res.busy_idle == ["busy", "idle"]

        # the stop button during a long await: the awaited call is cancelled, as in a plain kernel
        # (which shows CancelledError), not left running as a rank that "did not stop"
        stop = threading.Timer(2.0, k.km.interrupt_kernel)
        stop.start()
        try:
            res, took = timed(k, "await asyncio.sleep(120)\nprint('not cancelled')", timeout=60)
        finally:
            stop.cancel()
        print(f"stopped await cell: {took:.3f} s")
        assert res.status == "error", res.reply
        err = error_of(res)
        assert err["ename"] == "CancelledError", err
        assert "did not stop" not in err["evalue"] and "not cancelled" not in res.stream(), err

        res = k.execute("await asyncio.sleep(0)\nprint(rank)", timeout=30)
        assert res.status == "ok" and res.stream() == "[rank 0] 0\n[rank 1] 1\n", res.outputs
    finally:
        k.shutdown()


@pytest.mark.timeout(300)
def test_python_m_dist_kernel_run_ends_on_a_notebook_with_an_await_cell(tmp_path: Path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(AWAIT_CELL), nbformat.v4.new_code_cell("print('after', rank)")]
    path = tmp_path / "await.ipynb"
    nbformat.write(nb, path)
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "dist_kernel", "run", str(path), "--ranks", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        end_process_tree(proc)
        pytest.fail("python -m dist_kernel run did not end within 240 s on a notebook with an await cell")
    print(f"dist_kernel run: {time.monotonic() - t0:.1f} s (kernel start included)")
    assert proc.returncode == 0, err[-3000:]
    assert "awaited\n" in out and "[rank 0] after 0\n[rank 1] after 1\n" in out, out[-3000:]


# ------------------------------------------------------------------ 1.2: %%rank 0 around DDP(...)
@pytest.mark.timeout(300)
def test_rank_0_alone_constructing_ddp_is_reported_within_the_hang_grace_naming_rank_0_and_the_call(hang_kernel):
    k = hang_kernel
    # the look comes hang_grace after the start; the bound leaves room for a loaded machine
    res, took = timed(k, RANK0_DDP, timeout=HANG_GRACE * 3 + 30)
    print(f"%%rank 0 DDP(...) reported after {took:.2f} s (--hang-grace {HANG_GRACE})")
    assert res.status == "error", res.reply
    err = error_of(res)
    text = err["evalue"] + "\n".join(err["traceback"])
    assert err["ename"] == "CollectiveHangError", err
    assert "rank 0 was blocked in DistributedDataParallel(...)" in err["evalue"], err["evalue"]
    assert "_verify_params_across_processes" in err["evalue"], err["evalue"]
    assert "rank 1 never entered" in err["evalue"], err["evalue"]
    assert "m = DDP(nn.Linear(2, 2))" in text, text  # where it waited: the cell's line
    assert "re-formed" in text, text
    all_reduce_gives_two_and_variables_survived(k)


@pytest.mark.timeout(300)
def test_one_stop_ends_rank_0_alone_constructing_ddp_and_re_forms_the_group():
    k = DistKernel("--ranks", "2", "--hang-grace", "300")  # the stop, not the hang rule, ends it
    try:
        assert k.execute(SETUP, timeout=180).status == "ok"
        stops: list[threading.Timer] = []

        def stop_once_constructing(out: Output) -> None:
            if not stops and "constructing" in out.text:
                stops.append(threading.Timer(1.0, k.km.interrupt_kernel))  # one stop, once in DDP(...)
                stops[0].start()

        try:
            res, took = timed(k, RANK0_DDP, timeout=60, on_output=stop_once_constructing)
        finally:
            for s in stops:
                s.cancel()
        print(f"%%rank 0 DDP(...) ended {took:.2f} s after it started, by one stop")
        assert len(stops) == 1
        assert res.status == "error", res.reply
        err = error_of(res)
        text = err["evalue"] + "\n".join(err["traceback"])
        assert err["ename"] == "KeyboardInterrupt", err
        assert "did not stop" not in text and "may still be running" not in text, text
        assert "rank 0 was interrupted while blocked in DistributedDataParallel(...)" in err["evalue"], err
        assert "re-formed" in text, text
        all_reduce_gives_two_and_variables_survived(k)
    finally:
        k.shutdown()


@pytest.mark.timeout(300)
def test_accelerate_prepare_and_notebook_launcher_under_rank_0_are_reported_and_the_group_works_after(hang_kernel):
    k = hang_kernel
    setup = ("import torch, torch.nn as nn, torch.distributed as dist\nkept = 100 + rank\n"
             "from accelerate import Accelerator, notebook_launcher\nacc = Accelerator()\n"
             "_warm = acc.prepare(nn.Linear(2, 2))\n"
             "def train():\n    m = Accelerator().prepare(nn.Linear(2, 2))\n    print('prepared')")
    assert k.execute(setup, timeout=180).status == "ok"
    for code in ("%%rank 0\nm = acc.prepare(nn.Linear(2, 2))", "%%rank 0\nnotebook_launcher(train, num_processes=2)"):
        res, took = timed(k, code, timeout=HANG_GRACE * 3 + 30)
        print(f"{code.splitlines()[1]}: reported after {took:.2f} s (--hang-grace {HANG_GRACE})")
        assert res.status == "error", res.reply
        err = error_of(res)
        assert err["ename"] == "CollectiveHangError", err
        assert "rank 0 was blocked in DistributedDataParallel(...)" in err["evalue"], err["evalue"]
        assert "prepared" not in res.stream()
        all_reduce_gives_two_and_variables_survived(k)


# ------------------------------------------------------------------ issue 36, item 13: hangs seen only by their tensors
@pytest.mark.timeout(300)
def test_one_all_reduce_of_a_different_shape_on_each_rank_is_named_by_its_tensors(hang_kernel, busy_machine):
    k = hang_kernel
    res, took = timed(k, "dist.all_reduce(torch.ones(rank + 1))", timeout=HANG_GRACE * 4 + 60)
    print(f"all_reduce of [1] and [2]: reported after {took:.2f} s (--hang-grace {HANG_GRACE})")
    err = error_of(res)
    text = err["evalue"] + "\n".join(err["traceback"])
    assert err["ename"] == "CollectiveHangError", err
    assert "rank 0 all_reduce of [1] float32, rank 1 of [2] float32: all_reduce needs the same shape and dtype " \
           "on every rank" in err["evalue"], err["evalue"]
    assert "re-formed" in text, text
    all_reduce_gives_two_and_variables_survived(k)


@pytest.mark.timeout(300)
def test_ddp_forward_with_uneven_inputs_against_a_barrier_is_reported(hang_kernel, busy_machine):
    # rank 0 runs one more step than rank 1: its second forward re-builds DDP's buckets, a
    # broadcast started in C++, while rank 1 waits in a barrier called from Python
    k = hang_kernel
    k.execute("ddp = DDP(nn.Linear(2, 2))")
    code = ("for step in range(2 if rank == 0 else 1):\n"
            "    ddp(torch.randn(4, 2)).sum().backward()\n"
            "dist.barrier()")
    res, took = timed(k, code, timeout=HANG_GRACE * 4 + 60)
    print(f"DDP uneven inputs against a barrier: reported after {took:.2f} s (--hang-grace {HANG_GRACE})")
    err = error_of(res)
    text = err["evalue"] + "\n".join(err["traceback"])
    assert err["ename"] == "CollectiveHangError", err
    assert "rank 0 in DistributedDataParallel.forward" in err["evalue"], err["evalue"]
    assert "a collective that torch started in C++" in err["evalue"], err["evalue"]
    assert "rank 1 in barrier(" in err["evalue"], err["evalue"]
    assert "re-formed" in text, text
    all_reduce_gives_two_and_variables_survived(k)
