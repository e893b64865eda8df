"""The fault policy, rule by rule: pure decisions, no processes (the real-kernel fault tests
in test_faults.py and test_wedges.py exercise the same rules end to end)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dist_kernel.parent.fault_policy import GIVE_UP_AFTER, Cell, Judge, after_cell, look_due, out_of_step
from dist_kernel.protocol import Operand, Place

WORLD = (0, 1)


def place(collective: str | None = None, group_ranks=(), peer: int | None = None, seq: int | None = None,
          line: str = "", **kw) -> Place:
    """A busy rank's ``where`` reply, with what the test does not care about left out."""
    return Place(collective=collective, group_ranks=list(group_ranks), peer=peer, seq=seq, stack=[], line=line,
                 busy=True, **kw)


def blocked(collective: str, group=(0, 1), seq: int | None = 5, peer: int | None = None) -> Place:
    return place(collective=collective, group_ranks=group, seq=seq, peer=peer, line="line 2: ...")


COMPUTING = place(collective=None, line="line 3: x = heavy()")


def cell(**kw) -> Cell:
    base = dict(ranks=WORLD, world=WORLD, busy=WORLD, started=0.0, hang_grace=10.0)
    return Cell(**{**base, **kw})


# ------------------------------------------------------------------- when to look
def test_nothing_is_looked_at_while_every_rank_is_busy_for_less_than_half_the_grace():
    assert not look_due(cell(), now=4.9, last_look=None)
    assert look_due(cell(), now=5.0, last_look=None)
    assert not look_due(cell(), now=6.0, last_look=5.0)


def test_a_finished_rank_starts_the_grace_and_a_failed_one_shortens_it():
    c = cell(busy=(0,), first_finished=2.0)
    assert not look_due(c, now=11.9, last_look=None)
    assert look_due(c, now=12.0, last_look=None)
    failed = cell(busy=(0,), first_finished=2.0, errored=True)
    assert look_due(failed, now=3.0, last_look=None)


def test_ranks_left_out_by_rank_magic_count_from_the_start_of_the_cell():
    c = cell(ranks=(0,), busy=(0,))
    assert look_due(c, now=10.0, last_look=None)


def test_an_interrupt_is_looked_at_one_second_later_and_every_second_after():
    c = cell(interrupted_at=20.0)
    assert not look_due(c, now=20.5, last_look=None)
    assert look_due(c, now=21.0, last_look=None)
    assert look_due(c, now=22.0, last_look=21.0)


def test_after_a_teardown_the_blocked_ranks_are_left_to_raise():
    assert not look_due(cell(torn_down=True, busy=(0,), first_finished=0.0), now=100.0, last_look=None)


# ------------------------------------------------------ rule 2: waiting for an idle rank
def test_a_rank_blocked_in_a_collective_that_a_finished_rank_never_entered_is_freed_by_a_teardown_on_every_rank():
    v = Judge().judge(cell(busy=(0,), first_finished=1.0), {0: blocked("all_reduce")}, now=12.0)
    assert v.action == "teardown" and v.teardown_on == (0, 1) and v.ename == "CollectiveHangError"
    assert "rank 0 was blocked in torch.distributed.all_reduce(), which rank 1 never entered" in v.stuck[0]


def test_a_collective_in_a_single_rank_cell_is_torn_down():
    c = cell(ranks=(0,), busy=(0,))
    v = Judge().judge(c, {0: blocked("barrier")}, now=10.0)
    assert v.action == "teardown" and v.teardown_on == (0, 1)


def test_a_long_computation_while_others_finished_is_left_alone():
    assert Judge().judge(cell(busy=(0,), first_finished=0.0), {0: COMPUTING}, now=60.0).action == "wait"


def in_backward(group_seq: int | None) -> Place:
    """A rank in ``loss.backward()`` of a DDP model: no torch.distributed call on its stack."""
    return place(collective=None, line="line 4: loss.backward()", group_seq=group_seq, in_backward=True)


def test_a_rank_that_started_a_collective_in_cpp_which_a_failed_rank_never_entered_is_torn_down():
    # rank 1 raised before backward(); rank 0's DDP all_reduce (collective #4) waits for it
    c = cell(busy=(0,), first_finished=1.0, errored=True, idle_seqs={1: 3})
    v = Judge().judge(c, {0: in_backward(4)}, now=2.0)
    assert v.action == "teardown" and v.teardown_on == (0, 1) and v.ename == "CollectiveHangError"
    assert v.stuck[0] == ("rank 0 was blocked in a collective that torch started without a torch.distributed call "
                          "(DDP's gradient all_reduce in backward(), say), which rank 1 never entered (idle: "
                          "finished or not selected by %%rank)")


def test_a_computation_that_started_no_collective_beyond_the_idle_ranks_is_left_alone():
    c = cell(busy=(0,), first_finished=0.0, idle_seqs={1: 4})
    assert Judge().judge(c, {0: in_backward(4)}, now=60.0).action == "wait"  # level: a long backward
    assert Judge().judge(c, {0: in_backward(3)}, now=60.0).action == "wait"  # behind: it may yet catch up
    assert Judge().judge(c, {0: in_backward(None)}, now=60.0).action == "wait"  # torch did not say


def test_a_rank_ahead_of_an_idle_rank_whose_count_is_unknown_is_left_alone():
    assert Judge().judge(cell(busy=(0,), first_finished=0.0), {0: in_backward(9)}, now=60.0).action == "wait"


def test_a_rank_ahead_outside_backward_is_left_alone():
    # the count includes point-to-point calls: ranks 0 and 1 that sent to each other earlier
    # stay ahead of rank 2 for good, and may compute for long while it is idle
    c = Cell(ranks=(0, 1, 2), world=(0, 1, 2), busy=(0, 1), first_finished=0.0, idle_seqs={2: 3})
    computing = place(collective=None, line="line 3: x = heavy()", group_seq=9)
    assert Judge().judge(c, {0: computing, 1: computing}, now=60.0).action == "wait"


def test_a_rank_ahead_is_torn_down_only_when_every_busy_rank_is_blocked():
    c = Cell(ranks=(0, 1, 2), world=(0, 1, 2), busy=(0, 1), first_finished=0.0, idle_seqs={2: 3})
    assert Judge().judge(c, {0: in_backward(4), 1: COMPUTING}, now=60.0).action == "wait"
    v = Judge().judge(c, {0: in_backward(4), 1: in_backward(4)}, now=60.0)
    assert v.action == "teardown" and v.teardown_on == (0, 1, 2) and set(v.stuck) == {0, 1}


def test_an_interrupt_of_a_rank_ahead_of_an_idle_rank_is_one_keyboard_interrupt():
    c = cell(busy=(0,), first_finished=10.5, interrupted_at=10.0, idle_seqs={1: 3})
    v = Judge().judge(c, {0: in_backward(4)}, now=11.0)
    assert v.action == "teardown" and v.ename == "KeyboardInterrupt" and v.teardown_on == (0, 1)
    assert v.stuck == {0: "rank 0 was interrupted while blocked in a collective that torch started without a "
                          "torch.distributed call (DDP's gradient all_reduce in backward(), say)"}


DDP_INIT = "DistributedDataParallel(...) / _verify_param_shape_across_processes / _verify_params_across_processes"


def in_native(group_seq: int | None, group=(0, 1), call: str = DDP_INIT) -> Place:
    """A rank in ``DDP(model)``: its constructor's collective runs in C++, called from torch's
    distributed code, with no torch.distributed collective on the stack."""
    return place(collective=None, group_ranks=group, line="line 1: m = DDP(model)",
                group_seq=group_seq, native=call)


def test_a_cpp_collective_in_a_rank_magic_cell_is_torn_down_naming_the_call():
    # %%rank 0 around DDP(...): its constructor started collective #2, which rank 1 (not selected) never will
    c = cell(ranks=(0,), busy=(0,), idle_seqs={1: 1})
    v = Judge().judge(c, {0: in_native(2)}, now=10.0)
    assert v.action == "teardown" and v.teardown_on == (0, 1) and v.ename == "CollectiveHangError"
    assert v.stuck[0] == (f"rank 0 was blocked in {DDP_INIT} (a collective that torch started in C++), which "
                          "rank 1 never entered (idle: finished or not selected by %%rank)")


def test_a_rank_in_torchs_distributed_code_that_started_no_collective_beyond_the_idle_ranks_is_left_alone():
    # rank 0 alone writing a checkpoint with no_dist=True: in torch.distributed's code, calling into C++,
    # but its group started nothing the idle rank did not
    c = cell(ranks=(0,), busy=(0,), idle_seqs={1: 4})
    saving = "save(...) / write_data / save"
    assert Judge().judge(c, {0: in_native(4, call=saving)}, now=60.0).action == "wait"
    assert Judge().judge(c, {0: in_native(None, call=saving)}, now=60.0).action == "wait"  # torch did not say
    assert Judge().judge(cell(ranks=(0,), busy=(0,)), {0: in_native(9)}, now=60.0).action == "wait"  # unknown


def test_a_cpp_collective_on_a_sub_group_blames_only_the_idle_members_of_that_group():
    c = Cell(ranks=(0, 1), world=(0, 1, 2), busy=(0,), first_finished=0.0, idle_seqs={1: 3, 2: 3})
    v = Judge().judge(c, {0: in_native(4, group=(0, 2))}, now=60.0)
    assert v.action == "teardown" and "which rank 2 never entered" in v.stuck[0]
    assert Judge().judge(c, {0: in_native(4, group=(0,))}, now=60.0).action == "wait"  # a group of its own


def test_one_stop_of_a_cpp_collective_in_a_rank_magic_cell_tears_the_group_down():
    c = cell(ranks=(0,), busy=(0,), interrupted_at=10.0, idle_seqs={1: 1})
    v = Judge().judge(c, {0: in_native(2)}, now=11.0)
    assert v.action == "teardown" and v.ename == "KeyboardInterrupt" and v.teardown_on == (0, 1)
    assert v.stuck == {0: f"rank 0 was interrupted while blocked in {DDP_INIT} (a collective that torch started "
                          "in C++)"}


def test_a_rank_still_in_torchs_cpp_code_a_second_after_a_stop_is_torn_down_not_left_running():
    # no count to go by (a sub-group's collective): SIGINT cannot reach C++, so the group is torn down
    c = cell(interrupted_at=10.0)
    v = Judge().judge(c, {0: in_native(None), 1: in_native(None)}, now=11.0)
    assert v.action == "teardown" and v.teardown_on == (0, 1) and v.ename == "KeyboardInterrupt"


def test_a_sub_group_collective_whose_members_are_all_busy_is_left_alone():
    c = Cell(ranks=(0, 1, 2), world=(0, 1, 2), busy=(0, 1), first_finished=0.0)
    seen = {0: blocked("all_reduce", group=(0, 1)), 1: blocked("all_reduce", group=(0, 1))}
    assert Judge().judge(c, seen, now=60.0).action == "wait"


def test_a_sub_group_collective_missing_a_finished_member_is_torn_down():
    c = Cell(ranks=(0, 1, 2), world=(0, 1, 2), busy=(0, 1), first_finished=0.0)
    seen = {0: blocked("all_reduce", group=(0, 2)), 1: blocked("all_reduce", group=(1, 2))}
    v = Judge().judge(c, seen, now=60.0)
    assert v.action == "teardown" and v.teardown_on == (0, 1, 2)
    assert "which rank 2 never entered" in v.stuck[0]


def test_group_creation_that_a_left_out_rank_never_enters_is_ended_on_the_waiting_rank_too():
    waiting = place(collective="new_group", group_ranks=WORLD, store_wait=True, line="line 1: ...")
    v = Judge().judge(cell(ranks=(0,), busy=(0,)), {0: waiting}, now=10.0)
    # the idle rank's teardown cannot reach a wait in the rendezvous store: rank 0 ends its own
    assert v.action == "teardown" and v.teardown_on == (0, 1)
    assert v.stuck[0] == ("rank 0 was blocked in torch.distributed.new_group() (group creation, which every "
                          "rank must enter), which rank 1 never entered (idle: finished or not selected by %%rank)")


def test_a_rank_that_does_not_answer_is_never_torn_down_for():
    c = cell(busy=(0,), first_finished=0.0)
    assert Judge().judge(c, {0: None}, now=60.0).action == "wait"


# ------------------------------------------------------ rule 3: mismatched collectives
def test_every_rank_in_the_same_collective_is_never_cut_short():
    j = Judge()
    seen = {0: blocked("all_reduce", seq=9), 1: blocked("all_reduce", seq=9)}
    for t in (5.0, 10.0, 500.0):
        assert j.judge(cell(), seen, now=t).action == "wait"


def test_different_collectives_on_every_rank_are_a_deadlock_once_they_hold_for_half_the_grace():
    j = Judge()
    seen = {0: blocked("all_reduce", seq=1), 1: blocked("broadcast", seq=1)}
    assert j.judge(cell(), seen, now=5.0).action == "wait"  # first seen: confirm at the next look
    v = j.judge(cell(), seen, now=10.0)
    assert v.action == "teardown" and v.teardown_on == (0, 1)
    assert "rank 0 in all_reduce(#1), rank 1 in broadcast(#1)" in v.stuck[1]


def test_the_same_collective_at_different_sequence_numbers_is_a_deadlock():
    j = Judge()
    seen = {0: blocked("all_reduce", seq=4), 1: blocked("all_reduce", seq=5)}
    j.judge(cell(), seen, now=5.0)
    assert j.judge(cell(), seen, now=10.0).action == "teardown"


def test_ranks_that_merely_pass_through_different_collectives_are_not_a_deadlock():
    j = Judge()
    j.judge(cell(), {0: blocked("all_reduce", seq=4), 1: blocked("all_reduce", seq=5)}, now=5.0)
    moved = {0: blocked("all_reduce", seq=800), 1: blocked("all_reduce", seq=801)}
    assert j.judge(cell(), moved, now=10.0).action == "wait"


def test_two_ranks_each_receiving_from_the_other_are_a_deadlock():
    j = Judge()
    seen = {0: blocked("recv", peer=1, seq=None), 1: blocked("recv", peer=0, seq=None)}
    j.judge(cell(), seen, now=5.0)
    v = j.judge(cell(), seen, now=10.0)
    assert v.action == "teardown" and "rank 0 in recv(src=1)" in v.stuck[0]


def test_a_send_facing_its_recv_is_left_to_complete():
    j = Judge()
    seen = {0: blocked("send", peer=1, seq=None), 1: blocked("recv", peer=0, seq=None)}
    for t in (5.0, 10.0, 60.0):
        assert j.judge(cell(), seen, now=t).action == "wait"


def test_a_rank_still_computing_keeps_a_mismatch_from_being_called_a_deadlock():
    j = Judge()
    seen = {0: blocked("all_reduce"), 1: COMPUTING}
    for t in (5.0, 10.0, 60.0):
        assert j.judge(cell(), seen, now=t).action == "wait"


def holding(collective: str, *shapes: tuple[list[int], str], seq: int = 3, group=(0, 1)) -> Place:
    """A rank blocked in ``collective`` holding tensors of these (shape, dtype)."""
    return replace(blocked(collective, group=group, seq=seq),
                   operands=[Operand(name=f"t{i}", dtype=dtype, shape=shape) for i, (shape, dtype) in enumerate(shapes)])


def confirmed(seen: dict, c: Cell | None = None):
    """The verdict once the ranks held still for half the grace (two looks, 5 s apart)."""
    j = Judge()
    j.judge(c or cell(), seen, now=5.0)
    return j.judge(c or cell(), seen, now=10.0)


def test_one_all_reduce_with_a_different_shape_on_each_rank_is_a_deadlock_named_by_its_tensors():
    seen = {0: holding("all_reduce", ([1], "float32")), 1: holding("all_reduce", ([2], "float32"))}
    v = confirmed(seen)
    assert v.action == "teardown" and v.teardown_on == (0, 1) and v.ename == "CollectiveHangError"
    assert "(rank 0 all_reduce of [1] float32, rank 1 of [2] float32: all_reduce needs the same shape and dtype " \
           "on every rank)" in v.stuck[0]


def test_ranks_with_the_same_tensors_are_grouped_and_a_dtype_alone_differs_too():
    four = (0, 1, 2, 3)
    seen = {r: holding("broadcast", ([4, 4], "float32" if r % 2 == 0 else "float64"), group=four) for r in four}
    v = confirmed(seen, cell(ranks=four, world=four, busy=four))
    assert v.action == "teardown"
    assert "rank 0,2 broadcast of [4, 4] float32, rank 1,3 of [4, 4] float64" in v.stuck[3]


def test_one_collective_with_the_same_tensors_everywhere_is_never_cut_short():
    j = Judge()
    seen = {r: holding("all_gather_into_tensor", ([8], "float32"), ([4], "float32")) for r in WORLD}
    for t in (5.0, 10.0, 500.0):
        assert j.judge(cell(), seen, now=t).action == "wait"


def test_tensors_that_may_differ_between_ranks_or_are_not_told_are_no_deadlock():
    # all_gather's list and all_to_all's splits differ by design; a rank that does not report its
    # tensors (None known) says nothing either way
    assert confirmed({0: holding("all_gather", ([1], "float32")), 1: holding("all_gather", ([2], "float32"))}
                     ).action == "wait"
    assert confirmed({0: holding("all_reduce", ([1], "float32")), 1: blocked("all_reduce", seq=3)}).action == "wait"


def in_cpp(group_seq: int | None = 5, native: str = "DistributedDataParallel.forward / _pre_forward / "
           "_rebuild_buckets", seq: int | None = None, group=(0, 1), **kw) -> Place:
    """A rank in a collective torch started in C++ (``native``, or ``in_backward`` when native is "")."""
    return place(collective=None, group_ranks=group if native else (), seq=group_seq if seq is None else seq,
                 native=native, group_seq=group_seq, **kw)


def test_a_collective_started_in_cpp_against_a_barrier_called_from_python_is_a_deadlock_naming_both():
    v = confirmed({0: in_cpp(group_seq=5), 1: blocked("barrier", seq=5)})
    assert v.action == "teardown" and v.teardown_on == (0, 1)
    assert ("rank 0 in DistributedDataParallel.forward / _pre_forward / _rebuild_buckets, a collective that torch "
            "started in C++ (#5); rank 1 in barrier(#5)") in v.stuck[1]


def test_a_rank_in_backward_past_a_collective_another_rank_waits_in_from_python_is_a_deadlock():
    v = confirmed({0: in_cpp(group_seq=7, native="", in_backward=True), 1: blocked("all_reduce", seq=5)})
    assert v.action == "teardown"
    assert "rank 0 in backward(), DDP's gradient all_reduce, started in C++ (#7); rank 1 in all_reduce(#5)" \
        in v.stuck[0]


def test_a_cpp_rank_that_has_not_yet_started_the_collective_the_other_waits_in_may_still_be_computing():
    # rank 0 in backward() under no_sync() (no collective yet), rank 1 already in the next all_reduce
    j = Judge()
    seen = {0: in_cpp(group_seq=4, native="", in_backward=True), 1: blocked("all_reduce", seq=5)}
    for t in (5.0, 10.0, 500.0):
        assert j.judge(cell(), seen, now=t).action == "wait"


def test_a_cpp_collective_on_another_group_or_of_an_unknown_count_is_not_compared():
    three = (0, 1, 2)
    c = cell(ranks=three, world=three, busy=three)
    sub = {0: in_cpp(group_seq=9, seq=9, group=(0, 1)), 1: blocked("barrier", group=three, seq=5),
           2: blocked("barrier", group=three, seq=5)}
    assert confirmed(sub, c).action == "wait"
    assert confirmed({0: in_cpp(group_seq=None), 1: blocked("barrier", seq=5)}).action == "wait"


def test_every_rank_in_a_collective_started_in_cpp_is_left_to_complete():
    j = Judge()
    seen = {r: in_cpp(group_seq=3) for r in WORLD}
    for t in (5.0, 10.0, 500.0):
        assert j.judge(cell(), seen, now=t).action == "wait"


def test_a_rank_that_answered_a_sync_is_named_as_such_when_another_waits_for_it():
    c = replace(cell(busy=(1,), first_finished=1.0), idle_means="it had finished its part of %dist_sync")
    v = Judge().judge(c, {1: blocked("broadcast")}, now=12.0)
    assert v.action == "teardown"
    assert v.stuck[1].endswith("which rank 0 never entered (it had finished its part of %dist_sync)")


# -------------------------------------------------------------- rule 4: interrupt
def test_an_interrupt_that_a_blocked_rank_cannot_see_tears_the_group_down_everywhere():
    c = cell(interrupted_at=10.0)
    seen = {0: blocked("all_reduce", seq=3), 1: blocked("all_reduce", seq=3)}
    v = Judge().judge(c, seen, now=11.0)
    assert v.action == "teardown" and v.teardown_on == (0, 1) and v.ename == "KeyboardInterrupt"


def test_an_interrupt_that_ends_one_rank_frees_the_other_and_both_report_the_interrupt():
    c = cell(busy=(0,), first_finished=10.5, interrupted_at=10.0)
    v = Judge().judge(c, {0: blocked("all_reduce")}, now=11.0)
    # the stop button caused the wait: one KeyboardInterrupt, not a hang "rank 1 never entered"
    assert v.action == "teardown" and v.ename == "KeyboardInterrupt" and v.teardown_on == (0, 1)
    assert v.stuck == {0: "rank 0 was interrupted while blocked in torch.distributed.all_reduce()"}


def test_a_rank_that_stopped_and_is_still_showing_its_traceback_is_waited_for_not_left_behind():
    c = cell(busy=(0, 1), interrupted_at=10.0)
    reporting = place(collective=None, in_code=False)
    v = Judge().judge(c, {0: reporting, 1: COMPUTING}, now=10.0 + GIVE_UP_AFTER)
    assert v.action == "abandon" and list(v.stuck) == [1]  # rank 1's code still runs
    assert Judge().judge(cell(busy=(0,), interrupted_at=10.0), {0: reporting}, now=10.0 + GIVE_UP_AFTER).action \
        == "wait"
    assert Judge().judge(cell(busy=(0,), interrupted_at=10.0), {0: reporting}, now=40.0).action == "abandon"


def test_a_rank_is_called_silent_only_when_it_missed_two_looks_in_a_row():
    judge, quiet = Judge(), {0: None}
    assert judge.silent(quiet) == []  # the first miss: a loaded machine answers late
    judge.judge(cell(), quiet, now=5.0)
    assert judge.silent(quiet) == [0]
    judge.judge(cell(), {0: COMPUTING}, now=10.0)
    assert judge.silent(quiet) == []


def test_ranks_out_of_step_after_a_failed_cell_are_formed_again():
    assert out_of_step({0: 7, 1: 6}, WORLD)
    assert not out_of_step({0: 7, 1: 7}, WORLD)
    assert not out_of_step({0: 7}, WORLD)  # a rank that did not run the cell says nothing


def test_an_interrupt_during_a_teardown_waits_for_the_ranks_to_raise_then_gives_up():
    c = cell(interrupted_at=10.0, torn_down=True)
    seen = {0: blocked("all_reduce"), 1: blocked("all_reduce")}
    assert Judge().judge(c, seen, now=11.0).action == "wait"
    v = Judge().judge(c, seen, now=10.0 + GIVE_UP_AFTER)
    assert v.action == "abandon" and set(v.stuck) == {0, 1}


def test_a_slow_teardown_after_an_interrupt_gives_the_freed_ranks_their_time_from_the_teardown():
    # CI, 2 cores under load: the teardown was confirmed 4 s after the stop; the rank it freed
    # was still raising a second later, and was called "did not stop"
    c = cell(busy=(0,), first_finished=10.5, interrupted_at=10.0, torn_down=True, torn_down_at=14.0)
    assert Judge().judge(c, {0: COMPUTING}, now=15.5).action == "wait"
    v = Judge().judge(c, {0: COMPUTING}, now=14.0 + GIVE_UP_AFTER)
    assert v.action == "abandon" and list(v.stuck) == [0] and "did not stop" in v.stuck[0]


def test_an_interrupted_rank_that_is_still_computing_is_given_time_then_left_behind():
    c = cell(busy=(1,), first_finished=10.2, interrupted_at=10.0)
    assert Judge().judge(c, {1: COMPUTING}, now=12.0).action == "wait"
    assert Judge().judge(c, {1: COMPUTING}, now=10.0 + GIVE_UP_AFTER).action == "abandon"


# -------------------------------------------------------------- rule 1: dead peer
def test_survivors_of_a_dead_rank_are_freed_from_their_collectives_and_the_computing_ones_run_on():
    c = Cell(ranks=(0, 1, 2), world=(0, 1, 2), busy=(0, 2), dead=(1,))
    v = Judge().judge(c, {0: blocked("all_reduce", group=(0, 1, 2)), 2: COMPUTING}, now=1.0)
    assert v.action == "teardown" and v.ename == "RankDiedError"
    assert v.teardown_on == (0, 2)  # every survivor: the group is down for all of them
    assert v.stuck == {0: "rank 0 was freed from torch.distributed.all_reduce(): rank 1 died"}


def test_a_dead_rank_is_looked_into_at_once_and_the_group_torn_down_only_once():
    c = Cell(ranks=(0, 1), world=(0, 1), busy=(0,), dead=(1,), started=0.0, hang_grace=10.0)
    assert look_due(c, now=0.1, last_look=None)
    assert not look_due(replace(c, torn_down=True), now=5.0, last_look=None)
    assert Judge().judge(replace(c, torn_down=True), {0: blocked("barrier")}, now=1.0).action == "wait"


def test_a_rank_that_keeps_dying_is_not_started_again_by_itself():
    from dist_kernel.parent.fault_policy import keeps_dying

    assert not keeps_dying([100.0, 130.0], now=140.0)  # twice: started again
    assert keeps_dying([100.0, 130.0, 139.0], now=140.0)  # three times within a minute: not
    assert not keeps_dying([10.0, 50.0, 139.0], now=140.0)  # three times, but over two minutes


# -------------------------------------------------------------- after the cell
def test_a_healthy_group_is_left_as_it_is():
    assert after_cell(torn_down=False, broke=False, dead=(), left_running=()) == "none"


def test_a_torn_down_or_broken_group_is_formed_again():
    assert after_cell(torn_down=True, broke=False, dead=(), left_running=()) == "reform"
    assert after_cell(torn_down=False, broke=True, dead=(), left_running=()) == "reform"


def test_a_dead_rank_means_the_group_waits_for_a_new_process_in_its_place():
    assert after_cell(torn_down=True, broke=False, dead=(1,), left_running=()) == "respawn"
    assert after_cell(torn_down=False, broke=False, dead=(1,), left_running=()) == "respawn"  # died idle


def test_a_reformation_waits_for_a_rank_left_running():
    assert after_cell(torn_down=True, broke=False, dead=(), left_running=(1,)) == "later"


def test_a_group_the_cell_destroyed_on_every_rank_is_left_down_for_the_user():
    assert after_cell(torn_down=False, broke=False, dead=(), left_running=(), destroyed=(0, 1), world=WORLD) == "down"


def test_a_group_destroyed_on_some_ranks_only_is_broken_for_the_others_and_formed_again():
    assert after_cell(torn_down=False, broke=False, dead=(), left_running=(), destroyed=(1,), world=WORLD) == "reform"
    assert after_cell(torn_down=False, broke=False, dead=(0,), left_running=(), destroyed=(1,),
                      world=WORLD) == "respawn"


# ------------------------------------------------------------ rule 6: ranks on other machines
def test_a_fault_first_heard_as_its_consequence_is_heard_longer_for_its_cause():
    from dist_kernel.parent.fault_policy import RemoteCause, settle_for

    # a killed agent on n2: srun SIGTERMs n1's ranks at once, n2's loss is confirmed a second later
    assert settle_for(RemoteCause("terminated", "rank 0 on n1 was killed by SIGTERM", (0,))) == 3.0
    assert settle_for(RemoteCause("ending", "the agent on n1 got SIGTERM")) == 3.0
    assert settle_for(RemoteCause("lost", "node 1 (n2) stopped answering", (2, 3))) == 1.0


def test_a_rank_that_exited_on_a_node_outranks_what_followed_from_it():
    from dist_kernel.parent.fault_policy import RemoteCause, remote_culprit

    heard = [RemoteCause("ending", "the agent on n1 got SIGTERM"), RemoteCause("launcher", "srun exited"),
             RemoteCause("exited", "rank 3 on n2 was killed by SIGKILL", (3,))]
    assert remote_culprit(heard).ranks == (3,)


def test_a_silent_node_outranks_the_launcher_and_an_agents_own_word():
    from dist_kernel.parent.fault_policy import RemoteCause, remote_culprit

    heard = [RemoteCause("ending", "n1 ending"), RemoteCause("launcher", "srun: error: n2: task 1: Killed"),
             RemoteCause("lost", "node 1 (n2) stopped answering", (2, 3))]
    assert remote_culprit(heard).kind == "lost"


def test_a_killed_agent_is_named_by_the_launcher_not_by_the_agents_srun_then_terminated():
    from dist_kernel.parent.fault_policy import RemoteCause, remote_culprit

    heard = [RemoteCause("ending", "the node agent on node 0 (n1) is ending its ranks: it got SIGTERM"),
             RemoteCause("launcher", "srun exited with code 137: srun: error: n2: task 1: Killed")]
    assert "n2" in remote_culprit(heard).text


def test_a_rank_terminated_by_scancel_yields_to_the_agents_word():
    from dist_kernel.parent.fault_policy import RemoteCause, remote_culprit

    heard = [RemoteCause("terminated", "rank 1 on n2 was killed by SIGTERM", (1,)),
             RemoteCause("ending", "the node agent on node 0 (n1) is ending its ranks: it got SIGTERM (scancel, ...)")]
    assert remote_culprit(heard).kind == "ending"


def test_within_a_kind_the_first_heard_is_named():
    from dist_kernel.parent.fault_policy import RemoteCause, remote_culprit

    heard = [RemoteCause("ending", "first"), RemoteCause("ending", "second")]
    assert remote_culprit(heard).text == "first"
    with pytest.raises(ValueError):
        remote_culprit([])
