"""Group creation, as a specification (issue 22): ``new_group`` and ``new_subgroups`` work when
every rank calls them, and when only some ranks do, the cell says within ``--hang-grace`` which
rank waits in group creation and which never entered it, ends by itself (or at the stop
button), and the group is re-formed with every rank's variables kept.

Group creation waits in torch's rendezvous store (C++), not in a collective: the ranks' store
is the kernel's own, so that wait can be ended. Real parent, real ipykernel ranks, real gloo.
"""

from __future__ import annotations

import threading

import pytest
from harness import DistKernel, assert_group_works_and_variables_survived, error_of

pytestmark = pytest.mark.slow


def assert_group_works_and_groups_can_be_created_again(k: DistKernel) -> None:
    assert_group_works_and_variables_survived(k)
    res = k.execute("g = dist.new_group([0, 1])\nt = torch.ones(1)\ndist.all_reduce(t, group=g)\n"
                    "print(int(t.item()))", timeout=30)
    assert res.status == "ok" and res.stream() == "2\n", res.outputs


def test_new_group_and_new_subgroups_on_every_rank_work(group_kernel):
    res = group_kernel.execute("g = dist.new_group([0, 1])\nmine, subs = dist.new_subgroups(1)\n"
                         "t = torch.ones(1)\ndist.all_reduce(t, group=g)\ns = torch.ones(1)\n"
                         "dist.all_reduce(s, group=mine)\nprint(int(t.item()), int(s.item()), len(subs))",
                         timeout=60)
    assert res.status == "ok" and res.stream() == "2 1 2\n", res.outputs


@pytest.mark.parametrize("call,shown", [("dist.new_group([0, 1])", "new_group"),
                                        ("dist.new_subgroups(2)", "new_subgroups")])
def test_group_creation_on_some_ranks_is_reported_within_the_grace_and_recovered(group_kernel, call, shown):
    res = group_kernel.execute(f"%%rank 0\nx = {call}", timeout=30)  # a wedge: the harness's read times out
    err = error_of(res)
    assert err["ename"] == "CollectiveHangError", err
    assert f"rank 0 was blocked in torch.distributed.{shown}()" in err["evalue"]
    assert "group creation" in err["evalue"] and "rank 1 never entered" in err["evalue"]
    text = "\n".join(err["traceback"])
    assert call in text  # where rank 0 waited
    assert "re-formed" in text
    assert "holds the GIL" not in res.stream("stderr")
    assert_group_works_and_groups_can_be_created_again(group_kernel)


def test_the_stop_button_ends_group_creation_that_a_busy_rank_never_enters(group_kernel):
    # rank 1 is busy, not idle: nothing but the stop button ends this cell
    timer = threading.Timer(1.0, group_kernel.km.interrupt_kernel)
    timer.start()
    res = group_kernel.execute("import time\nif rank == 0:\n    dist.new_group([0, 1])\nelse:\n    time.sleep(60)",
                         timeout=30)
    timer.join()
    err = error_of(res)
    assert err["ename"] == "KeyboardInterrupt", err
    assert "holds the GIL" not in res.stream("stderr")
    assert_group_works_and_groups_can_be_created_again(group_kernel)
