"""``dist.destroy_process_group()`` in a cell, as a specification (issue 20, item 4).

On every rank, it is the user's choice: the group stays down, the cell says how to get it
back, ``%dist_status`` says it is down, and ``dist.init_process_group("gloo")`` with the
environment the ranks were given (as torchrun gives it) brings it back. On some ranks only,
the group is broken for the others: it is re-formed, as after any broken group. Real parent,
real ipykernel ranks, real gloo.
"""

from __future__ import annotations

import pytest
from harness import DistKernel, assert_group_works_and_variables_survived

pytestmark = pytest.mark.slow

ALL_REDUCE = "t = torch.ones(1)\ndist.all_reduce(t)\nprint(int(t.item()), kept)"


def group_column(k: DistKernel) -> list[str]:
    (shown,) = k.execute("%dist_status", timeout=30).of_type("display_data")
    head, *rows = shown.text.splitlines()[1:]
    at = head.index("group")
    return [row[at:].split()[0] for row in rows if row[:1].isdigit()]  # the output log's line aside


def test_destroyed_on_every_rank_it_stays_down_says_how_to_get_it_back_and_init_by_hand_works(group_kernel):
    res = group_kernel.execute("dist.destroy_process_group()", timeout=30)
    assert res.status == "ok"
    said = res.stream("stderr")
    assert "process group is down" in said and "dist.init_process_group()" in said, said
    assert group_column(group_kernel) == ["down", "down"]
    res = group_kernel.execute(ALL_REDUCE, timeout=30)  # torch's own error, as in a plain script
    assert res.status == "error" and "ValueError" in res.of_type("error")[0].content["ename"]
    res = group_kernel.execute(f'dist.init_process_group("gloo")\n{ALL_REDUCE}', timeout=60)
    assert res.status == "ok" and res.stream() == "[rank 0] 2 100\n[rank 1] 2 101\n", res.outputs
    assert group_column(group_kernel) == ["up", "up"]


def test_a_group_initialised_by_hand_is_re_formed_after_a_fault_like_the_kernels_own(group_kernel):
    res = group_kernel.execute("%%rank 0\nt = torch.ones(1)\ndist.all_reduce(t)", timeout=30)
    assert res.of_type("error")[0].content["ename"] == "CollectiveHangError"
    assert_group_works_and_variables_survived(group_kernel)


def test_destroyed_on_some_ranks_the_group_is_re_formed(group_kernel):
    res = group_kernel.execute("%%rank 1\ndist.destroy_process_group()", timeout=30)
    assert "re-formed" in res.stream("stderr"), res.outputs
    assert group_column(group_kernel) == ["up", "up"]
    assert_group_works_and_variables_survived(group_kernel)
