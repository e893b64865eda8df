"""Faults, as a specification: nothing hangs, nothing is lost, nothing is left behind (issue 4).

Every test uses real processes at 2+ ranks. A "hang" shows up as the harness's own read
timeout (queue.Empty), far below torch's 30-minute collective timeout.
"""

from __future__ import annotations

import glob
import os
import signal
import socket
import threading
import time

import psutil
import pytest
from harness import GROUP_SETUP, DistKernel, assert_group_works_and_variables_survived, error_of

from dist_kernel.parent import throttle

pytestmark = pytest.mark.slow


@pytest.fixture
def fault_kernel(group_kernel):
    """The module's kernel (2 ranks, a 2 s hang grace, GROUP_SETUP run), shared by the tests whose
    fault leaves every rank alive: each ends by showing that the group works and ``kept`` survived,
    so the next one starts from a healthy kernel."""
    return group_kernel


@pytest.fixture
def fresh_fault_kernel():
    """A kernel of its own, as ``fault_kernel``, for a test whose rank dies."""
    k = DistKernel("--ranks", "2", "--hang-grace", "2")
    k.execute(GROUP_SETUP)
    yield k
    k.shutdown()


# ------------------------------------------------------------------ 1, 2: collectives
def test_one_rank_raising_while_the_other_waits_in_a_collective_ends_the_cell(fault_kernel):
    res = fault_kernel.execute("if rank == 1:\n    raise ValueError('bad batch on rank 1')\n"
                               "t = torch.ones(1)\ndist.all_reduce(t)", timeout=30)
    err = error_of(res)
    assert res.status == "error"
    assert "rank 1: ValueError: bad batch on rank 1" in err["evalue"]
    assert "rank 0: CollectiveHangError" in err["evalue"]
    text = "\n".join(err["traceback"])
    assert "dist.all_reduce(t)" in text  # where rank 0 was waiting
    assert "re-formed" in text
    assert_group_works_and_variables_survived(fault_kernel)


DDP_STEP = "model = DDP(torch.nn.Linear(8, 1))\nloss = model(torch.randn(4, 8)).sum()\n"


def test_one_rank_raising_before_a_ddp_backward_ends_the_cell_within_seconds(fault_kernel):
    # rank 0 waits in DDP's gradient all_reduce, started in C++: no torch.distributed call on
    # its stack. It waited for the 30-minute collective timeout, rank 1's error unseen, and after
    # the stop button it was left running, so every later cell hung
    fault_kernel.execute("from torch.nn.parallel import DistributedDataParallel as DDP")
    started = time.monotonic()
    res = fault_kernel.execute(DDP_STEP + "if rank == 1:\n    raise IndexError('list index out of range')\n"
                               "loss.backward()", timeout=60)
    took = time.monotonic() - started
    err = error_of(res)
    assert "rank 1: IndexError: list index out of range" in err["evalue"]
    assert ("rank 0: CollectiveHangError: rank 0 was blocked in a collective that torch started without a "
            "torch.distributed call (DDP's gradient all_reduce in backward(), say), which rank 1 never entered"
            ) in err["evalue"]
    text = "\n".join(err["traceback"])
    assert "loss.backward()" in text and "re-formed" in text
    assert took < 45, took
    assert_group_works_and_variables_survived(fault_kernel)
    # a DDP model made again on the re-formed group trains
    res = fault_kernel.execute(DDP_STEP + "loss.backward()\nprint('trained', rank)", timeout=60)
    assert res.status == "ok" and res.stream() == "[rank 0] trained 0\n[rank 1] trained 1\n"


def test_a_long_backward_on_one_rank_while_the_other_finished_is_left_alone(fault_kernel):
    # level counts: rank 0 started no collective rank 1 did not, so it may yet finish
    res = fault_kernel.execute("x = torch.ones(1, requires_grad=True)\nif rank == 0:\n"
                               "    class Slow(torch.autograd.Function):\n"
                               "        @staticmethod\n        def forward(ctx, x): return x * 2\n"
                               "        @staticmethod\n        def backward(ctx, g):\n"
                               "            time.sleep(5)\n            return g * 2\n"
                               "    Slow.apply(x).sum().backward()\nprint('done')", timeout=60)
    # rank 0 is silent for the 5 s that the merger waits for a lagging twin (LAG_BOUND), so its
    # "done" may come labelled beside rank 1's: what counts is that nothing was torn down
    assert res.status == "ok", res.explain()
    assert {line.split("] ", 1)[-1] for line in res.stream().splitlines()} == {"done"}, res.explain()
    assert not res.of_type("error") and "tearing" not in res.stream("stderr")


def test_a_collective_in_a_single_rank_cell_is_reported_with_its_stack(fault_kernel):
    res = fault_kernel.execute("%%rank 0\nt = torch.ones(1)\ndist.all_reduce(t)", timeout=30)
    err = error_of(res)
    assert err["ename"] == "CollectiveHangError"
    assert "rank 0 was blocked in torch.distributed.all_reduce()" in err["evalue"]
    assert any("dist.all_reduce(t)" in line for line in err["traceback"])
    assert_group_works_and_variables_survived(fault_kernel)


def test_a_long_collective_every_rank_is_in_is_not_cut_short(fault_kernel):
    # rank 0 waits 5 s (past the 2 s grace) for rank 1, which is busy, not idle
    res = fault_kernel.execute("if rank == 1:\n    time.sleep(5)\nt = torch.ones(1)\ndist.all_reduce(t)\n"
                               "print(int(t.item()))", timeout=60)
    assert res.status == "ok", res.explain()
    # both ranks summed: shown once, or (a rank starved of CPU past the merge window, as beside two
    # other test workers on 2 cores) once per rank, labelled, in the order the lines came; never cut short
    shown = res.stream()
    assert shown == "2\n" or sorted(shown.splitlines()) == ["[rank 0] 2", "[rank 1] 2"], res.explain()


def test_a_long_computation_in_a_single_rank_cell_is_left_alone(fault_kernel):
    res = fault_kernel.execute("%%rank 0\ntime.sleep(5)\nprint('done')", timeout=60)
    assert res.status == "ok" and res.stream() == "done\n"
    assert_group_works_and_variables_survived(fault_kernel)


def test_a_rank_holding_the_gil_is_named_once_it_misses_two_looks(fault_kernel):
    res = fault_kernel.execute("%%rank 0\nimport ctypes\nctypes.PyDLL(None).sleep(8)  # keeps the GIL",
                               timeout=60)
    assert res.status == "ok"
    assert "rank 0 (pid" in res.stream("stderr") and "holds the GIL" in res.stream("stderr")
    assert_group_works_and_variables_survived(fault_kernel)


# ------------------------------------------------------------------ 3: a rank dies
@pytest.mark.parametrize("how,words", [("os._exit(3)", "exited with code 3"),
                                       ("os.kill(os.getpid(), 9)", "killed by SIGKILL")])
def test_a_rank_that_dies_ends_the_cell_naming_it_and_later_cells_say_what_to_do(fresh_fault_kernel, how, words):
    res = fresh_fault_kernel.execute(f"if rank == 1:\n    {how}\nt = torch.ones(1)\ndist.all_reduce(t)", timeout=30)
    err = error_of(res)
    assert "rank 1" in err["evalue"] and words in err["evalue"]
    later = error_of(fresh_fault_kernel.execute("print('anything')", timeout=30))
    assert later["ename"] == "RankDiedError" and words in later["evalue"]
    assert "Run %dist_respawn" in "\n".join(later["traceback"]) and "restart the kernel" in "\n".join(
        later["traceback"])
    fresh_fault_kernel.km.restart_kernel(now=False)  # and a restart brings every rank back
    fresh_fault_kernel.kc.wait_for_ready(timeout=60)
    assert fresh_fault_kernel.execute("print(world_size)", timeout=60).stream() == "2\n"


def test_a_rank_busy_computing_when_another_dies_is_not_stopped_and_keeps_what_it_computed(fresh_fault_kernel):
    res = fresh_fault_kernel.execute("if rank == 1:\n    os._exit(5)\ntime.sleep(3)\ndone = rank + 1", timeout=40)
    err = error_of(res)
    assert err["evalue"].startswith("rank 1 (pid") and "exited with code 5" in err["evalue"], res.explain()
    assert fresh_fault_kernel.execute("%%rank 0\nprint(done, kept)").stream() == "1 100\n"


OUT_OF_MEMORY = (
    "import resource\n"
    "if rank == 1:  # rank 1 runs out of memory and keeps what it took, while rank 0 waits for it\n"
    "    used = int(open('/proc/self/statm').read().split()[0]) * resource.getpagesize()\n"
    "    resource.setrlimit(resource.RLIMIT_AS, (used + {headroom} * 2**20, resource.RLIM_INFINITY))\n"
    "    hog = []\n"
    "    while True:\n"
    "        hog.append(bytearray({chunk} * 2**20))\n"
    "t = torch.ones(1)\ndist.all_reduce(t)")


@pytest.mark.parametrize("headroom,chunk", [(300, 20), (301, 1), (256, 8)])
def test_a_rank_out_of_memory_inside_a_collective_ends_the_cell_by_itself_and_the_group_is_re_formed(
        fault_kernel, headroom, chunk):
    # the chunks leave rank 1 from nothing up to a chunk of address space when MemoryError hits
    res = fault_kernel.execute(OUT_OF_MEMORY.format(headroom=headroom, chunk=chunk), timeout=30)
    err = error_of(res)
    assert "rank 1: MemoryError" in err["evalue"] and "rank 0: CollectiveHangError" in err["evalue"], err
    assert "did not confirm" not in res.stream("stderr")
    assert "re-formed" in "\n".join(err["traceback"])
    assert_group_works_and_variables_survived(fault_kernel)
    res = fault_kernel.execute("%%rank 1\ndel hog\nresource.setrlimit(resource.RLIMIT_AS, "
                               "(resource.RLIM_INFINITY, resource.RLIM_INFINITY))", timeout=30)
    assert res.status == "ok", res.outputs


# ------------------------------------------------------------------ 4: interrupt
def test_interrupt_while_a_rank_is_blocked_in_a_collective_returns(fault_kernel):
    threading.Timer(1.5, fault_kernel.km.interrupt_kernel).start()
    res = fault_kernel.execute("if rank == 1:\n    time.sleep(600)\nt = torch.ones(1)\ndist.all_reduce(t)",
                               timeout=30)
    err = error_of(res)
    # one KeyboardInterrupt: rank 1 stopped; rank 0, whose collective rank 1 left, was freed
    assert err["ename"] == "KeyboardInterrupt", err
    assert "rank 0 was interrupted while blocked in torch.distributed.all_reduce()" in err["evalue"]
    assert_group_works_and_variables_survived(fault_kernel)


# ------------------------------------------------------------------ 5, 6: lifecycle
def runtime_dirs(*owners: int) -> set[str]:
    """The runtime directories of the kernels whose parent pids are named. Other kernels come
    and go on the same machine (a second suite, other users): a test counts only its own."""
    base = os.environ.get("TMPDIR", "/tmp")
    return {d for pid in owners for d in glob.glob(os.path.join(base, f"dist_kernel-{pid}-*"))}


def test_killing_the_parent_ends_every_rank_and_leaves_no_files_or_ports():
    k = DistKernel("--ranks", "2")
    k.execute("import torch.distributed as dist")
    ranks = [psutil.Process(p) for p in k.rank_pids()]
    family = psutil.Process(k.pid).children(recursive=True)  # ranks and the reaper
    ports = {c.laddr.port for r in ranks for c in r.net_connections("inet") if c.status == psutil.CONN_LISTEN}
    mine = runtime_dirs(k.pid)
    assert len(ranks) == 2 and len(mine) == 1
    os.kill(k.pid, signal.SIGKILL)
    _, alive = psutil.wait_procs(family, timeout=5)
    assert len(ranks) == 2 and len(family) == 3 and alive == []
    assert not any(os.path.exists(d) for d in mine)  # the reaper removed the runtime directory
    for port in ports:  # nothing listens on the ranks' ports any more
        with socket.socket() as s:
            assert s.connect_ex(("127.0.0.1", port)) != 0
    k.kc.stop_channels()
    k.km.cleanup_resources()


def test_killing_the_parent_ends_ranks_stuck_in_c_code_holding_the_gil():
    # A rank blocked in C code that holds the GIL (a CUDA sync in .item(), a C extension)
    # cannot run any thread of its own: the OS and the parent's reaper must end it.
    k = DistKernel("--ranks", "2")
    k.execute("import ctypes")
    family = psutil.Process(k.pid).children(recursive=True)  # ranks and the reaper
    mine = runtime_dirs(k.pid)
    k.kc.execute("ctypes.PyDLL(None).sleep(120)")  # PyDLL keeps the GIL for the whole call
    time.sleep(1.5)
    os.kill(k.pid, signal.SIGKILL)
    _, alive = psutil.wait_procs(family, timeout=5)
    assert alive == []
    assert len(mine) == 1 and not any(os.path.exists(d) for d in mine)
    k.kc.stop_channels()
    k.km.cleanup_resources()


# the reaper and the sweep of stale runtime dirs are tested in test_cleanup.py


def test_five_restarts_give_fresh_ranks_and_they_and_a_shutdown_leave_nothing_behind():
    # each restart starts a new parent process, with its own runtime dir and ranks: whatever one
    # restart leaves behind (a dir, a rank, a file) shows after the first, and five show it piling up
    # (test_kernel.py's restart and shutdown tests were folded in here: one kernel, CI time)
    k = DistKernel("--ranks", "2")
    parents = [k.pid]
    try:
        for _ in range(5):
            k.execute("x = 41")
            old = [psutil.Process(p) for p in k.rank_pids()]
            k.km.restart_kernel(now=False)
            parents.append(k.pid)
            k.kc.wait_for_ready(timeout=60)
            # fresh ranks: an empty namespace, and the old ranks are gone
            assert k.execute("print(world_size, 'x' in dir())", timeout=60).stream() == "2 False\n"
            _, alive = psutil.wait_procs(old, timeout=10)
            assert alive == []
        parent = psutil.Process(k.pid)
        ranks = [psutil.Process(p) for p in k.rank_pids()]
        assert len(ranks) == 2  # only the current ranks exist
        assert runtime_dirs(*parents) == runtime_dirs(k.pid) and len(runtime_dirs(k.pid)) == 1
        assert parent.num_fds() < 200
    finally:
        k.shutdown()
    _, alive = psutil.wait_procs(ranks, timeout=10)
    assert alive == []  # shutdown ends every rank process
    assert runtime_dirs(*parents) == set()


def test_several_kernels_side_by_side_do_not_interfere():
    kernels = [DistKernel("--ranks", "2") for _ in range(3)]
    try:
        for i, k in enumerate(kernels):
            k.execute(f"import torch, torch.distributed as dist\nt = torch.ones(1) * {i + 1}")
        outs = [k.execute("dist.all_reduce(t)\nprint(int(t.item()))").stream() for k in kernels]
        assert outs == ["2\n", "4\n", "6\n"]
    finally:
        for k in kernels:
            k.shutdown()


# ------------------------------------------------------------------ 9: bad configuration
@pytest.mark.parametrize("options,words", [
    (("--ranks", "0"), "--ranks 0 must be at least 1"),
    (("--gpus", "9"), "GPU 9 does not exist"),
    (("--backend", "mpi"), "--backend 'mpi' is unknown"),
])
def test_bad_configuration_is_a_clear_error_in_the_first_cell(options, words):
    k = DistKernel(*options)
    try:
        err = error_of(k.execute("print(1)", timeout=30))
        assert err["ename"] == "ConfigError" and words in err["evalue"]
    finally:
        k.shutdown()


# ------------------------------------------------------------------ 10: security
def test_a_message_with_a_wrong_signature_is_dropped(kernel2):
    from jupyter_client.session import Session

    forged = Session(key=b"not-the-kernel-key")
    msg = forged.msg("execute_request", {"code": "forged = True", "silent": False})
    forged.send(kernel2.kc.shell_channel.socket, msg)
    time.sleep(1)
    assert kernel2.execute("print('forged' in dir())").stream() == "False\n"


def test_every_rank_has_its_own_key_and_the_sockets_are_local(kernel2):
    import json

    keys = set()
    for pid in kernel2.rank_pids():
        conn = next(c for c in psutil.Process(pid).cmdline() if c.endswith(".json"))
        info = json.loads(open(conn).read())
        assert info["transport"] == "ipc" and info["signature_scheme"] == "hmac-sha256" and info["key"]
        keys.add(info["key"])
    parent_key = kernel2.km.session.key.decode()
    assert len(keys) == 2 and parent_key not in keys


# ------------------------------------------------------------------ 7, 8: floods and soak
def test_a_flood_of_lines_on_each_of_four_ranks_stays_bounded_and_delivers_the_end():
    # 300,000 lines a rank: 8 MB in all, 8 times the burst, enough to spill (test_wedges prints a
    # million lines at 2 ranks; a million at 4 ranks proves nothing more and takes 100 s)
    lines = 300_000
    k = DistKernel("--ranks", "4")
    try:
        k.execute("x = 1")
        parent = psutil.Process(k.pid)
        t0 = time.monotonic()
        res = k.execute(f"for i in range({lines}):\n    print(i)\nprint('the end', rank)", timeout=600)
        took = time.monotonic() - t0
        assert res.status == "ok"
        shown = sum(len(o.content["text"]) for o in res.of_type("stream"))
        # a notebook gets what the output budget lets through in the time the cell ran (a burst, then
        # a rate, then the tail), not the 27 MB printed: ~5 MB on a quiet machine, more on a loaded
        # one, where the same cell runs longer (13.6 MB in 30 s at a load average of 5 on 2 cores)
        assert shown < throttle.BURST + throttle.RATE * took + 4 * throttle.TAIL_BYTES + 2**20, (shown, took)
        assert "the end" in res.stream()  # the cell's final lines arrive
        notes = res.stream("stderr")
        spill = notes.split("saved in full to ")[1].split(" and")[0]
        with open(spill) as f:
            saved_lines = sum(1 for _ in f)
        assert saved_lines + res.stream("stdout").count("\n") >= lines  # nothing lost: it is on disk
        os.unlink(spill)
        assert parent.memory_info().rss < 300 * 2**20
        assert k.execute("print('responsive')").stream() == "responsive\n"
    finally:
        k.shutdown()


def test_two_thousand_cells_keep_the_parents_memory_and_files_flat():
    k = DistKernel("--ranks", "2")
    try:
        parent = psutil.Process(k.pid)
        for _ in range(300):
            k.execute("x = 1")
        rss0, fds0 = parent.memory_info().rss, parent.num_fds()
        for _ in range(1700):
            k.execute("x = 1")
        rss1, fds1 = parent.memory_info().rss, parent.num_fds()
        assert fds1 <= fds0 + 2
        assert rss1 - rss0 < 8 * 2**20, (rss0, rss1)
    finally:
        k.shutdown()


def test_nothing_is_ever_unpickled():
    # the parent and the ranks exchange JSON only (Jupyter messages, dist_kernel.protocol);
    # no module of dist_kernel, at any depth, may load pickles, which would execute code
    from pathlib import Path

    import dist_kernel

    paths = list(Path(dist_kernel.__file__).parent.rglob("*.py"))
    assert any("protocol" in p.name for p in paths) and any("rank" in p.parts for p in paths)
    for path in paths:
        text = path.read_text()
        assert "import pickle" not in text and "pickle.load" not in text and "cloudpickle" not in text, path
