"""Wedges, as a specification: no cell, burst, deadlock, frozen rank or odd request stalls the
kernel (issue 11). Real parent, real ipykernel ranks, real gloo group, 2 ranks on CPU.

Every test that wedges a kernel starts its own (a wedged one must not poison the next) and ends
every process it started, also when it fails: a wedge shows up as a bounded wait running out,
never as a hang. The odd requests that must *not* wedge it share one kernel (``steady``).
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import signal
import time
from collections.abc import Callable, Iterator

import psutil
import pytest
from harness import DistKernel, is_rank_process, memory_guard, own_session
from jupyter_client import KernelManager

from dist_kernel.runner import spec_manager

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
SPILL = re.compile(r"/\S*dist_kernel-output-\S*\.txt")


# ------------------------------------------------------------------ a frontend that records
class Msg:
    def __init__(self, raw: dict, t: float) -> None:
        self.type = raw["msg_type"]
        self.content = raw["content"]
        self.parent = raw["parent_header"].get("msg_id")
        self.t = t

    @property
    def text(self) -> str:
        if self.type == "stream":
            return self.content["text"]
        if self.type == "error":
            return ANSI.sub("", self.content.get("evalue", "") + "\n" + "\n".join(self.content.get("traceback", [])))
        return self.content.get("data", {}).get("text/plain", "")


class Kernel(DistKernel):
    """A DistKernel whose start can fail without leaking processes, and that records every
    IOPub message in arrival order (any parent), so tests can check exact sequences."""

    def __init__(self, *options: str, extra_arguments: list[str] | None = None) -> None:
        self.km = KernelManager(kernel_name="distributed-python", kernel_spec_manager=spec_manager(list(options)))
        self.km.shutdown_wait_time = 5
        self.seen: list[psutil.Process] = []
        self.log: list[Msg] = []
        self.idle: set[str] = set()  # the requests whose idle status came: done() must not scan the log
        self.replies: dict[str, dict] = {}
        self.t0 = time.monotonic()
        self.km.start_kernel(**({"extra_arguments": extra_arguments} if extra_arguments else {}))
        self.kc = own_session(self.km.client())
        self.kc.start_channels()
        self.remember()

    def remember(self) -> None:
        """Note the parent and everything under it, to end it all at the end."""
        with contextlib.suppress(psutil.Error, AttributeError, RuntimeError):
            parent = psutil.Process(self.pid)
            for p in [parent, *parent.children(recursive=True)]:
                if all(p.pid != q.pid for q in self.seen):
                    self.seen.append(p)

    def rank_pids(self) -> list[int]:
        self.remember()
        return [p.pid for p in psutil.Process(self.pid).children() if is_rank_process(p)]

    # -- sending and pumping
    def send(self, code: str) -> str:
        return self.kc.execute(code, allow_stdin=False)

    def pump(self, until: Callable[[], bool], timeout: float) -> bool:
        """Read IOPub and shell until ``until()`` holds or ``timeout`` s pass; says which."""
        deadline = time.monotonic() + timeout
        while not until():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            with contextlib.suppress(queue.Empty):
                raw = self.kc.get_iopub_msg(timeout=min(left, 0.05))
                msg = Msg(raw, time.monotonic() - self.t0)
                self.log.append(msg)
                if msg.type == "status" and msg.content["execution_state"] == "idle":
                    self.idle.add(msg.parent)
            while self.kc.shell_channel.msg_ready():
                reply = self.kc.get_shell_msg(timeout=1)
                self.replies[reply["parent_header"].get("msg_id")] = reply
        return True

    def seq(self, msg_id: str) -> list[Msg]:
        return [m for m in self.log if m.parent == msg_id]

    def done(self, msg_id: str) -> bool:
        # asked after every message pumped: a scan of the log here made a burst's test quadratic
        return msg_id in self.replies and msg_id in self.idle

    def run(self, code: str, timeout: float = 60) -> Cell:
        cell = Cell(self, self.send(code))
        cell.finish(timeout)
        return cell

    # -- the end
    def dispose(self) -> None:
        self.remember()
        for p in self.seen:
            with contextlib.suppress(psutil.Error):
                p.resume()  # a stopped rank cannot even take SIGTERM
        with contextlib.suppress(Exception):
            self.kc.stop_channels()
        with contextlib.suppress(Exception):
            if self.km.has_kernel:
                self.km.shutdown_kernel(now=False)  # kills after shutdown_wait_time
        _, alive = psutil.wait_procs(self.seen, timeout=5)
        for p in alive:
            with contextlib.suppress(psutil.Error, OSError):
                if p.is_running() and os.getpgid(p.pid) == p.pid and p.pid != os.getpgid(0):
                    os.killpg(p.pid, signal.SIGKILL)  # a rank's group: its DataLoader workers too
            with contextlib.suppress(psutil.Error):
                p.kill()
        with contextlib.suppress(Exception):
            self.km.cleanup_resources()


class Cell:
    def __init__(self, k: Kernel, msg_id: str) -> None:
        self.k, self.msg_id = k, msg_id

    def finish(self, timeout: float) -> bool:
        return self.k.pump(lambda: self.k.done(self.msg_id), timeout)

    @property
    def ended(self) -> bool:
        return self.k.done(self.msg_id)

    @property
    def seq(self) -> list[Msg]:
        return self.k.seq(self.msg_id)

    @property
    def reply(self) -> dict:
        return self.k.replies[self.msg_id]["content"]

    def outputs(self, *types: str) -> list[Msg]:
        return [m for m in self.seq if m.type in (types or ("stream", "display_data", "execute_result", "error"))]

    def stream(self, name: str = "stdout") -> str:
        return "".join(m.content["text"] for m in self.seq if m.type == "stream" and m.content["name"] == name)

    def errors(self) -> list[Msg]:
        return self.outputs("error")


def gone(p: psutil.Process) -> bool:
    try:
        return not p.is_running() or p.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def all_gone(procs: list[psutil.Process], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not all(gone(p) for p in procs):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


@contextlib.contextmanager
def started(*options: str, ranks: int = 2, extra_arguments: list[str] | None = None,
            ready: float = 60) -> Iterator[Kernel]:
    k = Kernel("--ranks", str(ranks), *options, extra_arguments=extra_arguments)
    try:
        k.kc.wait_for_ready(timeout=ready)
        yield k
    finally:
        k.dispose()


@pytest.fixture(scope="module")
def steady() -> Iterator[Kernel]:
    """One kernel for the tests of odd requests that must leave it working: each checks that it
    answers, so a request that wedged it fails there, and the tests after it fail too."""
    with started() as k:
        assert k.run("x = 1", timeout=120).ended
        yield k


def pids_by_rank(k: Kernel) -> dict[int, int]:
    cell = k.run("import os\nprint(rank, os.getpid())", timeout=120)
    assert cell.ended, "the first cell never ended"
    found = {int(r): int(p) for r, p in re.findall(r"(\d+) (\d+)\s*$", cell.stream(), re.M)}
    assert sorted(found) == [0, 1] and sorted(found.values()) == sorted(k.rank_pids()), cell.stream()
    return found


def prints_ranks(k: Kernel, timeout: float = 30) -> None:
    cell = k.run("print(rank)", timeout)
    assert cell.ended, "the next cell never ended"
    assert cell.reply["status"] == "ok" and cell.stream() == "[rank 0] 0\n[rank 1] 1\n", cell.stream()


def all_reduce_gives_two(k: Kernel, timeout: float = 30) -> None:
    cell = k.run("import torch, torch.distributed as dist\n_t = torch.ones(1)\ndist.all_reduce(_t)\n"
                 "print(int(_t.item()))", timeout)
    assert cell.ended, "the all_reduce after the wedge never ended"
    assert cell.reply["status"] == "ok" and cell.stream() == "2\n", (cell.stream(), cell.reply.get("evalue"))


# ------------------------------------------------------------------ 1: output bursts
LABELLED = re.compile(r"^(?:\[rank ([\d,-]+)\] )?(\d+)$")


def shown_values(texts: list[str], ranks: int = 2) -> list[tuple[int, int]]:
    """(rank, value) for each display: an unlabelled one is every rank's, `[rank 1] 7` rank 1's."""
    out = []
    for text in texts:
        m = LABELLED.match(text.strip())
        assert m, f"a display that is not one of the numbers: {text!r}"
        who = [int(r) for r in m[1].split(",")] if m[1] and "-" not in m[1] else list(range(ranks))
        out += [(r, int(m[2])) for r in who]
    return out


def displays_then_spill(cell: Cell, n: int) -> None:
    """Displays of 0..n-1 arrived at most once each (per rank, when labelled by rank); every one
    that did not arrive is announced: a stderr notice names the spill file, which holds it."""
    shown = shown_values([m.content["data"]["text/plain"] for m in cell.outputs("display_data")])
    assert len(shown) == len(set(shown)), "a display arrived twice"
    assert {v for _, v in shown} <= set(range(n)), "a display that was never made"
    missing = {(r, v) for r in range(2) for v in range(n)} - set(shown)
    if not missing:
        return
    notes = SPILL.findall(cell.stream("stderr"))
    assert notes, (f"{len(missing)} of {2 * n} rank displays never arrived and no stderr notice names "
                   "a dist_kernel-output-*.txt file")
    assert os.path.exists(notes[0]), f"the spill file {notes[0]} does not exist while the kernel runs"
    with open(notes[0]) as f:
        saved = set(shown_values([line for line in f if LABELLED.match(line.strip())]))
    assert missing <= saved, f"{len(missing - saved)} lost displays are not in the spill file either"
    remove_spills(cell)


def remove_spills(cell: Cell) -> None:
    for path in set(SPILL.findall(cell.stream("stderr"))):
        with contextlib.suppress(OSError):
            os.unlink(path)


@pytest.mark.parametrize("n", [
    pytest.param(3000, marks=pytest.mark.timeout(150), id="3000"),
    pytest.param(100_000, marks=[pytest.mark.slow, pytest.mark.timeout(420)], id="100000"),
])
def test_a_burst_of_displays_to_a_slow_client_ends_and_loses_nothing_unannounced(n):
    with started() as k:
        k.run("from IPython.display import display", timeout=120)
        msg_id = k.send(f"for i in range({n}):\n    display(i)")
        time.sleep(3)  # a slow frontend: nothing read for 3 s
        cell = Cell(k, msg_id)
        assert cell.finish(57 if n <= 3000 else 300), "the cell did not end (reply + idle) in time"
        displays_then_spill(cell, n)
        prints_ranks(k)


@pytest.mark.slow
@pytest.mark.timeout(480)
def test_a_million_printed_lines_per_rank_end_and_the_last_line_is_shown():
    with started() as k:
        k.run("x = 1", timeout=120)
        cell = k.run("for i in range(10**6):\n    print(i)", timeout=360)
        assert cell.ended, "the cell did not end"
        assert "999999\n" in cell.stream(), "the last printed line is not shown"
        remove_spills(cell)
        prints_ranks(k)


# ------------------------------------------------------------------ 2: every rank in a deadlock
DEADLOCKS = {
    "both_ranks_receive": ("t = torch.zeros(1)\ndist.recv(t, src=1-rank)", ["dist.recv(t, src=1-rank)"]),
    "ranks_in_different_collectives": ("if rank == 0:\n    dist.all_reduce(torch.ones(1))\n"
                                       "else:\n    dist.broadcast(torch.ones(1), src=1)",
                                       ["dist.all_reduce(torch.ones(1))", "dist.broadcast(torch.ones(1), src=1)"]),
}


def kept_and_group_work(k: Kernel) -> None:
    cell = k.run("t = torch.ones(1)\ndist.all_reduce(t)\nprint(int(t.item()), kept)", timeout=30)
    assert cell.ended, "the cell after the deadlock never ended"
    assert cell.stream() == "[rank 0] 2 100\n[rank 1] 2 101\n", (cell.stream(), cell.reply.get("evalue"))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("case", DEADLOCKS)
def test_a_deadlock_with_every_rank_busy_ends_the_cell_showing_each_ranks_stack(case):
    code, blocked_lines = DEADLOCKS[case]
    with started("--hang-grace", "3") as k:
        assert k.run("import torch, torch.distributed as dist\nkept = 100 + rank", timeout=120).ended
        cell = k.run(code, timeout=20)
        assert cell.ended, "the deadlocked cell did not end within 20 s"
        assert cell.reply["status"] == "error"
        (err,) = cell.errors()
        assert err.content["ename"] in ("CollectiveHangError", "DistributedError"), err.content["ename"]
        assert "rank 0" in err.text and "rank 1" in err.text, err.text
        for line in blocked_lines:
            assert line in err.text, f"{line!r} not in the error"
        kept_and_group_work(k)


@pytest.mark.timeout(150)
def test_the_stop_button_ends_a_deadlock_of_every_rank_long_before_the_hang_grace():
    with started("--hang-grace", "120") as k:
        assert k.run("import torch, torch.distributed as dist\nkept = 100 + rank", timeout=120).ended
        cell = Cell(k, k.send("t = torch.zeros(1)\ndist.recv(t, src=1-rank)"))
        k.pump(lambda: False, 2)
        k.km.interrupt_kernel()
        assert cell.finish(10), "the cell did not end within 10 s of the interrupt"
        assert cell.reply["status"] == "error"
        kept_and_group_work(k)


# ------------------------------------------------------------------ 3: a frozen rank
def names_the_stopped_rank(cell: Cell, pid: int, timeout: float) -> bool:
    def said() -> bool:
        return any("rank 1" in m.text and str(pid) in m.text and "stopped" in m.text
                   for m in cell.outputs("stream", "error"))
    return cell.k.pump(said, timeout)


@pytest.mark.timeout(150)
def test_a_rank_frozen_during_a_cell_is_named_and_the_stop_button_ends_the_cell():
    with started() as k:
        pids = pids_by_rank(k)
        frozen = psutil.Process(pids[1])
        try:
            cell = Cell(k, k.send("import time\ntime.sleep(40)"))
            k.pump(lambda: False, 1)
            frozen.suspend()
            assert names_the_stopped_rank(cell, pids[1], 10), "no output names rank 1, its pid and 'stopped'"
            k.km.interrupt_kernel()
            assert cell.finish(10), "the interrupt did not end the cell within 10 s"
            assert cell.reply["status"] == "error"
        finally:
            with contextlib.suppress(psutil.Error):
                frozen.resume()
        prints_ranks(k)


@pytest.mark.timeout(150)
def test_a_rank_frozen_while_idle_is_named_and_a_restart_replaces_it():
    with started() as k:
        pids = pids_by_rank(k)
        old = [psutil.Process(p) for p in pids.values()]
        try:
            psutil.Process(pids[1]).suspend()
            cell = Cell(k, k.send("print('x')"))
            assert names_the_stopped_rank(cell, pids[1], 10), "no output names rank 1, its pid and 'stopped'"
            k.km.interrupt_kernel()
            assert cell.finish(10), "the interrupt did not end the cell within 10 s"
            k.km.restart_kernel(now=True)
            k.kc.wait_for_ready(timeout=60)
            assert all_gone(old, 10), "an old rank (the stopped one?) outlived the restart by 10 s"
        finally:
            for p in old:
                with contextlib.suppress(psutil.Error):
                    p.resume()
        new = pids_by_rank(k)
        assert not set(new.values()) & set(pids.values())
        prints_ranks(k)


# ------------------------------------------------------------------ 4: interrupt during the start
@pytest.mark.timeout(180)
def test_the_stop_button_while_the_ranks_start_does_not_break_the_kernel():
    with started() as k:
        for i in range(3):
            k.km.interrupt_kernel()
            if i < 2:
                time.sleep(1)
        code = "import torch.distributed as dist, torch\nx = torch.ones(1)\ndist.all_reduce(x)\nprint(x.item())"
        cell = k.run(code, timeout=120)
        assert cell.ended, "the first cell did not end"
        texts = "".join(m.text for m in cell.outputs())
        if cell.reply["status"] == "error" and cell.reply.get("ename") == "KeyboardInterrupt":
            cell = k.run(code, timeout=60)
            assert cell.ended
            texts += "".join(m.text for m in cell.outputs())
        for bad in ("RankStartError", "ipykernel works", "import torch"):
            assert bad not in texts + str(cell.reply.get("evalue")), texts
        assert cell.reply["status"] == "ok" and cell.stream() == "2.0\n", texts


# ------------------------------------------------------------------ 5: interrupt storms
@pytest.fixture(scope="module")
def stormed() -> Iterator[Kernel]:
    """One kernel for the storm's trials: each checks that the ranks it began with are kept and the
    group works, so the next one starts from a healthy kernel. Not ``steady``'s: once, in a full
    run of the suite, a completion on ``steady`` after the storms left rank 0 silent for minutes,
    not seen again in 40 runs of these tests; apart until that is understood (CHANGELOG, Known)."""
    with started() as k:
        yield k


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("trial", range(3))
def test_a_storm_of_interrupts_ends_the_cell_once_with_one_error_and_keeps_the_ranks(stormed, trial):
    k = stormed
    pids = pids_by_rank(k)
    cell = Cell(k, k.send("import torch, torch.distributed as dist\n"
                          "for i in range(10**6):\n    dist.all_reduce(torch.ones(1))"))
    k.pump(lambda: False, 1.5)
    for _ in range(50):
        k.km.interrupt_kernel()
        k.pump(lambda: False, 0.1)
    assert cell.finish(20), "the cell did not end after the interrupts"
    k.pump(lambda: False, 2)  # anything more for this cell would arrive now
    assert sorted(k.rank_pids()) == sorted(pids.values()), "a rank process was replaced or died"
    all_reduce_gives_two(k)
    errors = cell.errors()
    assert len(errors) == 1, f"{len(errors)} error outputs"
    assert errors[0].content["ename"] == "KeyboardInterrupt", errors[0].text
    assert "never entered" not in errors[0].text and "did not stop" not in errors[0].text, errors[0].text
    kinds = [m.type if m.type != "status" else m.content["execution_state"] for m in cell.seq]
    said = " ".join(k for i, k in enumerate(kinds) if k != "stream" or kinds[i - 1] != "stream")
    assert kinds[0] == "busy" and kinds[-1] == "idle" and kinds.count("busy") == kinds.count("idle") == 1, said
    assert kinds.index("error") < kinds.index("idle")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_each_stop_of_a_loop_of_collectives_is_one_keyboard_interrupt_and_the_next_collective_works():
    with started() as k:
        pids_by_rank(k)
        for trial in range(5):
            cell = Cell(k, k.send("import torch, torch.distributed as dist\n"
                                  "for i in range(10**6):\n    dist.all_reduce(torch.ones(1))"))
            k.pump(lambda: False, 1.0 + 0.1 * trial)  # the stop lands at different points of the loop
            k.km.interrupt_kernel()
            assert cell.finish(60), f"trial {trial}: the cell did not end after the stop"
            errors = cell.errors()
            assert len(errors) == 1, f"trial {trial}: {len(errors)} error outputs"
            assert errors[0].content["ename"] == "KeyboardInterrupt", errors[0].text
            assert "never entered" not in errors[0].text and "did not stop" not in errors[0].text, errors[0].text
            all_reduce_gives_two(k)


# ------------------------------------------------------------------ 6: odd requests
@pytest.mark.timeout(120)
@pytest.mark.parametrize("spec", ["0-100000000000", "0-10000000"])
def test_a_huge_rank_range_is_refused_at_once_without_using_memory(steady, spec):
    k = steady
    rss0 = psutil.Process(k.pid).memory_info().rss
    with memory_guard(k.pid) as peak:
        cell = k.run(f"%%rank {spec}\nprint(1)", timeout=2)
    assert cell.ended, "no reply within 2 s"
    assert cell.reply["status"] == "error" and cell.reply["ename"] == "RankSpecError"
    assert peak[0] - rss0 < 50 * 2**20, f"the parent grew by {(peak[0] - rss0) >> 20} MB"
    prints_ranks(k)


@pytest.mark.timeout(120)
def test_completion_after_a_huge_rank_range_answers_without_using_memory(steady):
    k = steady
    code = "%%rank 0-100000000000\npri"
    rss0 = psutil.Process(k.pid).memory_info().rss
    with memory_guard(k.pid) as peak:
        msg_id = k.kc.complete(code, len(code))
        # rank 0's completer answers: within a second on a quiet machine, but with two
        # copies of the suite on 2 cores (load 10-20) IPython's jedi alone took over 2 s
        assert k.pump(lambda: msg_id in k.replies, 30), "no complete_reply within 30 s"
    assert k.replies[msg_id]["msg_type"] == "complete_reply"
    assert peak[0] - rss0 < 50 * 2**20, f"the parent grew by {(peak[0] - rss0) >> 20} MB"
    prints_ranks(k)


@pytest.mark.timeout(120)
def test_a_malformed_request_still_gets_a_reply_and_the_kernel_runs_on(steady):
    k = steady
    msg = k.kc.session.msg("complete_request", {"code": "pri"})  # no cursor_pos
    k.kc.shell_channel.send(msg)
    msg_id = msg["header"]["msg_id"]
    assert k.pump(lambda: msg_id in k.replies, 5), "no reply within 5 s"
    assert k.replies[msg_id]["msg_type"] == "complete_reply"
    prints_ranks(k)


# ------------------------------------------------------------------ 7: exit()
@pytest.mark.timeout(150)
@pytest.mark.parametrize("call", ["exit()", "quit()"])
def test_exit_ends_the_kernel_as_a_plain_ipykernel_does_and_a_restart_brings_it_back(call):
    with started() as k:
        ranks = [psutil.Process(p) for p in pids_by_rank(k).values()]
        parent = psutil.Process(k.pid)
        msg_id = k.send(call)
        assert k.pump(lambda: msg_id in k.replies, 10), "no execute_reply"
        reply = k.replies[msg_id]["content"]
        assert reply["status"] == "ok"
        assert any(p.get("source") == "ask_exit" for p in reply.get("payload", [])), reply.get("payload")
        assert all_gone([parent], 10), "the kernel process did not exit within 10 s"
        assert all_gone(ranks, 10), "a rank outlived the kernel"
        k.km.restart_kernel(now=True)
        k.kc.wait_for_ready(timeout=60)
        prints_ranks(k, timeout=120)


# ------------------------------------------------------------------ 8: ipywidgets Output
def windows_of(k: Kernel) -> list[tuple[str, int, int]]:
    """(captured msg_id, index it was set at, index it was reset at) for every Output capture."""
    opened: dict[str, tuple[str, int]] = {}
    out = []
    for i, m in enumerate(k.log):
        state = m.content.get("data", {}).get("state", {}) if m.type == "comm_msg" else {}
        if "msg_id" not in state:
            continue
        cid = m.content["comm_id"]
        if cid in opened:
            x, start = opened.pop(cid)
            out.append((x, start, i))
        if state["msg_id"]:
            opened[cid] = (state["msg_id"], i)
    out += [(x, start, len(k.log)) for x, start in opened.values()]
    return out


def inside_a_window(k: Kernel, i: int) -> bool:
    return any(start < i < end and k.log[i].parent == x for x, start, end in windows_of(k))


@pytest.mark.timeout(150)
@pytest.mark.parametrize("ranks", [1, 2])
def test_output_widgets_capture_what_is_printed_inside_them(ranks):
    with started(ranks=ranks) as k:
        first = k.run("import ipywidgets as w\nout = w.Output()\ndisplay(out)\nwith out:\n    print('inside')\n"
                      "print('outside')", timeout=120)
        assert first.ended and first.reply["status"] == "ok"
        windows = windows_of(k)
        assert windows, "no Output model ever set its msg_id"
        if ranks == 1:
            assert {x for x, _, _ in windows} == {first.msg_id}, "the capture id is not the frontend's msg_id"
        idx = {id(m): i for i, m in enumerate(k.log)}
        inside = [m for m in k.log if m.type == "stream" and "inside" in m.text]
        outside = [m for m in k.log if m.type == "stream" and "outside" in m.text]
        assert inside and outside
        assert all(inside_a_window(k, idx[id(m)]) for m in inside), "'inside' is not routed into the widget"
        assert not any(inside_a_window(k, idx[id(m)]) for m in outside), "'outside' went into the widget"

        second = k.run("with out:\n    raise ValueError('shown in the widget')\nprint('after')", timeout=60)
        assert second.ended and second.reply["status"] == "ok"
        errs = [i for i, m in enumerate(k.log) if m.type == "error" and m.content["evalue"] == "shown in the widget"]
        assert errs and any(inside_a_window(k, i) for i in errs), "the error is not shown in the widget"
        assert "after" in second.stream()


# ------------------------------------------------------------------ 11, 13: like a plain kernel
@pytest.mark.timeout(120)
def test_a_warning_every_rank_gives_is_shown_once_without_a_rank_label(steady):
    cell = steady.run("import warnings\nwarnings.warn('careful')", timeout=120)
    assert cell.ended
    err = cell.stream("stderr")
    # a plain kernel: "<cell file>:2: UserWarning: careful\n  warnings.warn('careful')\n"
    assert err.count("UserWarning: careful") == 1 and err.count("warnings.warn('careful')") <= 1, err
    assert "[rank" not in err, err


@pytest.mark.timeout(120)
def test_kernel_arguments_from_the_frontend_reach_the_ranks():
    k = Kernel("--ranks", "2", extra_arguments=["--HistoryManager.hist_file=:memory:"])
    try:
        with contextlib.suppress(RuntimeError):
            k.kc.wait_for_ready(timeout=60)
        assert k.km.is_alive(), "the kernel died on the frontend's argument"
        cell = k.run("print(get_ipython().history_manager.hist_file)", timeout=120)
        assert cell.ended and cell.stream() == ":memory:\n", cell.stream()
    finally:
        k.dispose()
