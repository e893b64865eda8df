"""``%dist_sync`` over a real gloo group of 2 ipykernel ranks, as a specification (issue 36):

- a value a user would copy arrives equal (a reversed numpy view, a big-endian array, a sparse
  tensor), and one that cannot travel (a meta tensor, a list that holds itself) is refused by
  name, with why; none of them leaves a rank waiting in a broadcast, and the kernel stays usable;
- a copy that hangs or dies anyway (a module's own ``state_dict()`` that blocks, sleeps, or a
  rank killed meanwhile) is watched as a cell is: it ends within seconds with an error naming the
  rank and why, the stop button frees it, and the group works after;
- the names the kernel defines on each rank (``rank``, ``world_size``, ...) are refused.

Timings are printed (``-s``), never asserted: the bounds only keep a hang from passing.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from harness import GROUP_SETUP, DistKernel, Result, error_of

HANG_GRACE = 3.0
#: a module-like object whose state_dict runs what a test says (on the source rank only)
STATEFUL = ("class Stateful:\n"
            "    def __init__(self, then=None):\n"
            "        self.then, self.w = then, torch.full((2,), float(rank))\n"
            "    def state_dict(self):\n"
            "        if self.then is not None:\n"
            "            self.then()\n"
            "        return {'w': self.w}\n"
            "    def load_state_dict(self, state):\n"
            "        self.w = state['w']\n")
SUM_OF_RANKS = "t = torch.tensor([float(rank)])\ndist.all_reduce(t)\nprint(int(t.item()), kept)"


@pytest.fixture(scope="module")
def k() -> Iterator[DistKernel]:
    kernel = DistKernel("--ranks", "2", "--hang-grace", str(HANG_GRACE))
    try:
        assert kernel.execute(GROUP_SETUP + "\nimport numpy as np\n" + STATEFUL, timeout=180).status == "ok"
        yield kernel
    finally:
        kernel.shutdown()


def the_group_works(k: DistKernel) -> None:
    res = k.execute(SUM_OF_RANKS, timeout=60)
    assert res.stream() == "[rank 0] 1 100\n[rank 1] 1 101\n", res.explain()


def timed(k: DistKernel, code: str, timeout: float, **kw: object) -> tuple[Result, float]:
    t0 = time.monotonic()
    res = k.execute(code, timeout=timeout, **kw)
    return res, time.monotonic() - t0


def failed_with(k: DistKernel, code: str, after: float, act: Callable[[], object]) -> tuple[float, dict, str]:
    """Run ``code`` and ``act`` ``after`` seconds into it: how long the cell took, its one error,
    and that error's whole text (value and traceback)."""
    timer = threading.Timer(after, act)
    timer.start()
    try:
        res, took = timed(k, code, timeout=90)
    finally:
        timer.cancel()
    err = error_of(res)
    return took, err, err["evalue"] + "\n".join(err["traceback"])


@pytest.mark.timeout(300)
def test_views_foreign_byte_orders_and_sparse_tensors_arrive_equal_and_what_cannot_travel_is_named(k):
    # each value differs by rank, so that what rank 1 holds after the copy shows where it came from
    k.execute("rev = np.arange(5)[::-1] * (rank + 1)\nbig = np.arange(3, dtype='>f4') + rank\n"
              "sp = (torch.eye(3) * (rank + 1)).to_sparse()\nmeta = torch.empty(3, device='meta')\n"
              "loop = [rank]\nloop.append(loop)")
    # each of these hung for good before (rank 0 failed before its first broadcast, rank 1 waited in it)
    res, took = timed(k, "%dist_sync rev big sp", timeout=60)
    print(f"%dist_sync rev big sp: {took:.2f} s")
    assert res.status == "ok", res.explain()
    assert res.stream() == ("%dist_sync from rank 0: rev to rank 1: numpy array 5 int64; big to rank 1: numpy array 3 "
                            "float32; sp to rank 1: sparse tensor 3x3 float32\n"), res.explain()
    res = k.execute("print(rev.tolist(), big.tolist(), big.dtype, big.dtype.isnative, sp.to_dense().diag().tolist())")
    assert res.stream() == "[4, 3, 2, 1, 0] [0.0, 1.0, 2.0] float32 True [1.0, 1.0, 1.0]\n", res.explain()

    res, took = timed(k, "%dist_sync meta loop rev", timeout=60)
    print(f"%dist_sync meta loop rev: {took:.2f} s")
    err = error_of(res)
    assert err["ename"] == "UsageError", err
    assert "could not copy meta: a meta tensor, which cannot be copied: a tensor on the meta device has a shape " \
           "but no data" in err["evalue"], err["evalue"]
    assert "loop: a list that holds itself, which cannot be copied: copy the data without the cycle" in err["evalue"]
    assert "copied: rev to rank 1: numpy array 5 int64" in err["evalue"], err["evalue"]  # the rest was copied
    assert k.execute("print(loop[0])").stream() == "[rank 0] 0\n[rank 1] 1\n"  # rank 1's own, untouched
    the_group_works(k)


@pytest.mark.timeout(120)
def test_the_names_the_kernel_defines_on_each_rank_are_refused_saying_why(k):
    for name, holds in (("rank", "this rank's number"), ("device", "this rank's device")):
        err = error_of(k.execute(f"%dist_sync x {name}"))
        assert err["ename"] == "UsageError", err
        assert f"`{name}` is defined by the kernel on each rank ({holds})" in err["evalue"], err["evalue"]
        assert "nothing was copied" in err["evalue"], err["evalue"]
    assert k.execute("print(rank)").stream() == "[rank 0] 0\n[rank 1] 1\n"


@pytest.mark.timeout(300)
def test_a_copy_whose_state_dict_blocks_in_a_collective_is_reported_within_the_grace(k, busy_machine):
    # rank 0's state_dict waits in a barrier while rank 1 waits for the plan: neither can go on
    k.execute("m = Stateful(then=dist.barrier if rank == 0 else None)")
    res, took = timed(k, "%dist_sync m", timeout=HANG_GRACE * 4 + 60)
    print(f"%dist_sync m (barrier in state_dict): reported after {took:.2f} s (--hang-grace {HANG_GRACE})")
    err = error_of(res)
    text = err["evalue"] + "\n".join(err["traceback"])
    assert err["ename"] == "CollectiveHangError", err
    assert err["evalue"].startswith("%dist_sync m from rank 0: nothing was copied where it failed;"), err["evalue"]
    assert "rank 0 in barrier(" in err["evalue"] and "rank 1 in broadcast(" in err["evalue"], err["evalue"]
    assert "re-formed" in text, text
    the_group_works(k)


@pytest.mark.timeout(300)
def test_the_stop_button_frees_a_copy_whose_state_dict_does_not_return(k, busy_machine):
    k.execute("m = Stateful(then=(lambda: time.sleep(600)) if rank == 0 else None)")
    took, err, text = failed_with(k, "%dist_sync m", 3.0, k.km.interrupt_kernel)
    print(f"%dist_sync m (sleeping state_dict): ended {took:.2f} s after it started, by one stop")
    assert err["ename"] == "KeyboardInterrupt", err
    assert "rank 1 was interrupted while blocked in torch.distributed.broadcast()" in err["evalue"], err["evalue"]
    assert "%dist_sync: receiving the plan from rank 0" in text, text  # where rank 1 waited
    assert "did not stop" not in text, text
    assert "re-formed" in text, text
    the_group_works(k)


@pytest.mark.timeout(300)
def test_a_rank_killed_during_a_copy_ends_it_naming_the_rank_and_the_group_comes_back(k, busy_machine):
    k.execute("m = Stateful(then=(lambda: time.sleep(4)) if rank == 0 else None)")
    pid = int(k.execute("%%rank 1\nprint(os.getpid())").stream())
    took, err, text = failed_with(k, "%dist_sync m", 1.5, lambda: os.kill(pid, signal.SIGKILL))
    print(f"%dist_sync m, rank 1 killed: ended after {took:.2f} s")
    assert err["ename"] == "RankDiedError", err
    assert "rank 1" in err["evalue"] and "killed by SIGKILL" in err["evalue"], err["evalue"]
    assert "%dist_respawn" in text, text
    back = k.execute("%dist_respawn", timeout=120)
    assert back.status == "ok", back.explain()
    k.execute(f"%%rank 1\n{GROUP_SETUP}")
    the_group_works(k)
