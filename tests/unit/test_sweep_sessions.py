"""Issue 30, section 8: any kernel's start-up sweep ends all of a dead rank's leftovers, named or not,
so that none is left that nothing can find (the real processes: tests/kernel/test_cleanup.py)."""

from __future__ import annotations

from dist_kernel.cleanup import Proc, select, select_rank

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


# ------------------------------------------------------- a rank that dies while its kernel lives (issue 36)
LIVE_DIR = "/tmp/dist_kernel-5000200-abcdefgh"
NEW_RANK = 5_000_300  # the process that took the dead rank's place


def test_what_a_dead_rank_left_ends_with_it_and_only_that():
    mate = Proc(5_000_201, 1, DEAD_RANK, DEAD_RANK, None, ["sleep", "777"])  # its session, environment scrubbed
    setsid = Proc(5_000_202, 1, 5_000_202, 5_000_202, LIVE_DIR, ["sleep", "778"], rank="1")  # left its session
    setsid_mate = Proc(5_000_203, 5_000_202, 5_000_202, 5_000_202, None, ["sleep", "779"])
    rank0_child = Proc(5_000_204, 5_000_205, 5_000_205, 5_000_205, LIVE_DIR, ["sleep", "780"], rank="0")
    other_kernel = Proc(5_000_206, 1, 5_000_206, 5_000_206, DEAD_DIR, ["sleep", "781"], rank="1")
    new_rank = Proc(NEW_RANK, 5_000_207, NEW_RANK, NEW_RANK, LIVE_DIR, ["python", "-m", "dist_kernel.rank"], rank="1")
    new_child = Proc(5_000_301, NEW_RANK, NEW_RANK, NEW_RANK, LIVE_DIR, ["sleep", "782"], rank="1")
    everything = procs(mate, setsid, setsid_mate, rank0_child, other_kernel, new_rank, new_child)
    taken = {p.pid for p in select_rank(everything, LIVE_DIR, 1, DEAD_RANK, spare=[NEW_RANK])}
    assert taken == {mate.pid, setsid.pid, setsid_mate.pid}


def test_a_dead_ranks_pid_held_by_a_live_process_is_not_taken_for_its_session():
    # once no member holds it, Linux may give the pid to anyone: that process and its session stay
    reused = Proc(DEAD_RANK, 1, DEAD_RANK, DEAD_RANK, None, ["bash"])
    mate = Proc(5_000_210, DEAD_RANK, DEAD_RANK, DEAD_RANK, None, ["vim"])
    assert select_rank(procs(reused, mate), LIVE_DIR, 1, DEAD_RANK) == []
