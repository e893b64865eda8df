"""Issue 30, section 8: any kernel's start-up sweep ends all of a dead rank's leftovers, named or not,
so that none is left that nothing can find (the real processes: tests/kernel/test_cleanup.py)."""

from __future__ import annotations

from dist_kernel.cleanup import Proc, select

DEAD_RANK = 5_000_000  # above Linux's largest pid_max: no process has it
DEAD_DIR = "/tmp/dist_kernel-5000001-abcdefgh"
LIVE_LEADER = 5_000_100


def procs(*ps: Proc) -> dict[int, Proc]:
    return {p.pid: p for p in ps}


def dead(runtime_dir: str) -> bool:
    return runtime_dir == DEAD_DIR


def test_a_dead_ranks_session_mates_go_with_the_member_that_names_the_kernel():
    named = Proc(5_000_010, 1, DEAD_RANK, DEAD_RANK, DEAD_DIR, ["sleep", "60"])
    unnamed = Proc(5_000_011, 1, DEAD_RANK, DEAD_RANK, None, ["sleep", "60"])  # environment scrubbed
    # no rank pids given: a sweep that does not know this kernel's runtime dir
    assert {p.pid for p in select(procs(named, unnamed), dead)} == {named.pid, unnamed.pid}


def test_a_session_whose_leader_lives_is_not_taken_for_a_dead_ranks():
    leader = Proc(LIVE_LEADER, 1, LIVE_LEADER, LIVE_LEADER, None, ["bash"])
    named = Proc(5_000_020, LIVE_LEADER, LIVE_LEADER, LIVE_LEADER, DEAD_DIR, ["sleep", "60"])
    mate = Proc(5_000_021, LIVE_LEADER, LIVE_LEADER, LIVE_LEADER, None, ["vim"])
    assert {p.pid for p in select(procs(leader, named, mate), dead)} == {named.pid}


def test_without_a_member_that_names_a_dead_kernel_nothing_is_taken():
    unnamed = Proc(5_000_030, 1, DEAD_RANK, DEAD_RANK, None, ["sleep", "60"])
    assert select(procs(unnamed), dead) == []


def test_a_rank_that_is_exiting_counts_as_gone():
    # its memory is freed first: /proc shows it without environment or command line
    exiting = Proc(5_000_040, 1, 5_000_040, 5_000_040, None, [])
    named = Proc(5_000_041, 5_000_040, 5_000_040, 5_000_040, DEAD_DIR, ["sleep", "60"])
    unnamed = Proc(5_000_042, 5_000_040, 5_000_040, 5_000_040, None, ["sleep", "60"])
    assert {p.pid for p in select(procs(exiting, named, unnamed), dead)} == {p.pid for p in (exiting, named, unnamed)}
