"""Long sessions survive their faults, as a specification (issue 29): a rank that dies is replaced
while the survivors keep their variables, variables are copied into the new rank, and the rank
count changes in place. Real ranks, a real gloo group, SIGKILL from outside as the OOM killer sends it.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from harness import GROUP_SETUP, DistKernel, error_of

pytestmark = pytest.mark.slow

REPLICAS_EQUAL = ("p = torch.cat([q.detach().flatten() for q in model.parameters()])\n"
                  "got = [torch.zeros_like(p) for _ in range(world_size)]\n"
                  "dist.all_gather(got, p)\n"
                  "print(all(torch.equal(got[0], g) for g in got))")
IMPORTS = "import torch, torch.distributed as dist, os, time\nfrom torch.nn.parallel import DistributedDataParallel as DDP"
SUM_OF_RANKS = "t = torch.tensor([float(rank)])\ndist.all_reduce(t)\nprint(int(t.item()))"


def pid_of(k: DistKernel, rank: int) -> int:
    return int(k.execute(f"%%rank {rank}\nprint(os.getpid())").stream())


def kill_while_running(k: DistKernel, code: str, pid: int, after: float, timeout: float = 60):
    """Run ``code`` on every rank and SIGKILL ``pid`` ``after`` seconds into it."""
    timer = threading.Timer(after, os.kill, (pid, signal.SIGKILL))
    timer.start()
    try:
        return k.execute(code, timeout=timeout)
    finally:
        timer.cancel()


def assert_back_with_rank_empty(k: DistKernel, rank: int, world: int) -> None:
    """``%dist_respawn`` brings the rank back, said plainly; its namespace is empty, the group works."""
    back = k.execute("%dist_respawn", timeout=120)
    assert back.status == "ok", back.explain()
    assert f"rank {rank} was started anew" in back.stream() and "namespace is empty" in back.stream()
    res = k.execute("print('kept' in dir(), 'torch' in dir())")
    assert res.stream() == "".join(f"[rank {r}] {r != rank} {r != rank}\n" for r in range(world)), res.explain()
    k.execute(f"%%rank {rank}\n{IMPORTS}")  # what the new rank needs, run there alone
    res = k.execute(SUM_OF_RANKS)
    assert res.stream() == f"{sum(range(world))}\n", res.explain()


@pytest.fixture(scope="module")
def two(group_kernel):
    """2 ranks (tests/conftest.py), DDP imported."""
    group_kernel.execute(IMPORTS)
    return group_kernel


def test_an_idle_rank_killed_leaves_the_survivor_its_variables_and_comes_back_empty(two):
    two.execute("kept = 100 + rank")
    os.kill(pid_of(two, 1), signal.SIGKILL)
    time.sleep(0.5)
    err = error_of(two.execute("print('anything')"))  # a cell on the dead rank does not run, and says so
    assert err["ename"] == "RankDiedError" and "killed by SIGKILL" in err["evalue"]
    assert "%dist_respawn" in "\n".join(err["traceback"])
    assert two.execute("%%rank 0\nprint(kept)").stream() == "100\n"  # the survivor runs, its variables intact
    assert_back_with_rank_empty(two, 1, 2)


def test_a_rank_killed_in_ddp_backward_frees_the_survivor_and_a_synced_model_trains_in_step(two):
    two.execute("kept = 100 + rank\ntorch.manual_seed(rank)\nnet = torch.nn.Linear(8, 1)\nmodel = DDP(net)\n"
                "opt = torch.optim.SGD(model.parameters(), lr=0.01)")
    pid = pid_of(two, 1)
    train = "for step in range(100000):\n    model(torch.randn(64, 8)).sum().backward()\n    opt.step()"
    res = kill_while_running(two, train, pid, after=2.0)
    err = error_of(res)
    assert "rank 1" in err["evalue"] and "killed by SIGKILL" in err["evalue"], res.explain()
    assert "keep their variables" in "\n".join(err["traceback"])
    alive = two.execute("%%rank 0\nprint(kept, step > 0, bool(torch.isfinite(net.weight).all()))")
    assert alive.stream() == "100 True True\n", alive.explain()
    assert_back_with_rank_empty(two, 1, 2)
    # rebuild the model on the new rank, copy rank 0's weights and optimizer into it, train on
    two.execute("%%rank 1\nnet = torch.nn.Linear(8, 1)\nopt = torch.optim.SGD(net.parameters(), lr=0.01)")
    synced = two.execute("%dist_sync net opt kept")
    assert synced.status == "ok", synced.explain()
    assert "net to rank 1: state_dict into this rank's module" in synced.stream()
    assert "kept to rank 1: a int" in synced.stream()
    assert two.execute("print(kept)").stream() == "100\n"  # the same on both ranks: merged into one line
    two.execute("model = DDP(net)\nopt = torch.optim.SGD(model.parameters(), lr=0.01)\n"
                "for step in range(5):\n    model(torch.randn(16, 8)).sum().backward()\n    opt.step()")
    assert two.execute(REPLICAS_EQUAL).stream() == "True\n"


def test_what_cannot_be_copied_is_named_with_its_reason(two):
    two.execute("gen = (i for i in range(3))\nt = torch.arange(6.0).reshape(2, 3) * (rank + 1)")
    res = two.execute("%dist_sync t gen nowhere --from 1")
    err = error_of(res)
    assert "gen: a generator, which cannot be copied" in err["evalue"]
    assert "nowhere: not defined on rank 1" in err["evalue"]
    assert "t to rank 0: tensor 2x3 float32" in err["evalue"]  # what could be copied, was
    assert two.execute("%%rank 0\nprint(t.sum().item())").stream() == "30.0\n"


def test_the_rank_count_grows_and_shrinks_in_place_keeping_the_survivors_variables(two):
    two.execute("kept = 100 + rank")
    assert "started with 2" in two.execute("%dist_ranks").stream()
    grown = two.execute("%dist_ranks 4", timeout=180)
    assert grown.status == "ok", grown.explain()
    assert "now 4 ranks" in grown.stream() and "Started rank 2,3" in grown.stream()
    two.execute(f"%%rank 2,3\n{IMPORTS}")
    assert two.execute(SUM_OF_RANKS).stream() == "6\n"
    res = two.execute("print(world_size, os.environ['WORLD_SIZE'], kept if 'kept' in dir() else None)")
    assert res.stream() == "[rank 0] 4 4 100\n[rank 1] 4 4 101\n[rank 2,3] 4 4 None\n"
    assert "4 ranks" in two.execute("%dist_status").of_type("display_data")[0].text
    shrunk = two.execute("%dist_ranks 2", timeout=120)
    assert shrunk.status == "ok" and "Ended rank 2,3" in shrunk.stream(), shrunk.explain()
    assert two.execute(SUM_OF_RANKS).stream() == "1\n"
    assert two.execute("print(world_size, kept)").stream() == "[rank 0] 2 100\n[rank 1] 2 101\n"
    assert len(two.rank_pids()) == 2  # the ended ranks are gone


def test_a_wrong_rank_count_is_refused_naming_the_fix(two):
    err = error_of(two.execute("%dist_ranks 0"))
    assert err["ename"] == "UsageError" and "%dist_ranks 4" in err["evalue"]
    err = error_of(two.execute("%dist_ranks 100000"))
    assert "more than this machine can hold" in err["evalue"] and "nothing was changed" in err["evalue"]
    assert two.execute(SUM_OF_RANKS).stream() == "1\n"


@pytest.fixture(scope="module")
def four():
    k = DistKernel("--ranks", "4", "--hang-grace", "2", "--respawn", "on")
    k.execute(GROUP_SETUP)
    yield k
    k.shutdown()


def test_two_of_4_ranks_failing_before_a_collective_free_the_two_waiting_in_it(four):
    # gloo's ring: rank 0 waits for rank 1, which a teardown on the idle ranks alone freed, and
    # rank 1 kept its connection to rank 0 open: rank 0 waited for good
    started = time.monotonic()
    res = four.execute("if rank >= 2:\n    raise ValueError(f'bad batch on rank {rank}')\n" + SUM_OF_RANKS, timeout=60)
    err = error_of(res)
    assert "rank 0: CollectiveHangError" in err["evalue"] and "rank 1: CollectiveHangError" in err["evalue"]
    assert "ValueError: bad batch on rank 2" in err["evalue"], res.explain()
    assert time.monotonic() - started < 30
    assert four.execute(SUM_OF_RANKS).stream() == "6\n"


def test_a_rank_killed_in_a_collective_at_4_ranks_frees_the_others_which_keep_their_variables(four):
    four.execute("kept = 100 + rank")
    pid = pid_of(four, 2)
    res = kill_while_running(four, "if rank != 2:\n    time.sleep(3)\ndist.barrier()", pid, after=1.0)
    err = error_of(res)
    assert "rank 2" in err["evalue"] and "killed by SIGKILL" in err["evalue"], res.explain()
    text = "\n".join(err["traceback"])
    assert "rank 2 was started anew" in text  # --respawn on: at once, and the cell still ends with the error
    res = four.execute("print('kept' in dir() and kept == 100 + rank)")
    assert res.stream() == "[rank 0,1,3] True\n[rank 2] False\n", res.explain()
    four.execute(f"%%rank 2\n{IMPORTS}")
    assert four.execute(SUM_OF_RANKS).stream() == "6\n"
    # between cells too: the next cell waits for the new rank and says so
    os.kill(pid_of(four, 3), signal.SIGKILL)
    time.sleep(0.3)
    res = four.execute("print(world_size, 'torch' in dir())", timeout=120)
    assert "rank 3 was started anew" in res.stream("stderr"), res.explain()
    assert res.stream() == "[rank 0-2] 4 True\n[rank 3] 4 False\n"
