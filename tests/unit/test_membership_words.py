"""What the kernel says when ranks die, come back or are added (issue 36, item 9): the words agree
with the number of ranks, name the magic that helps, say each thing once, and are never empty.
Every such message is written in ``parent/membership_words.py``; these tests read them there, and
where the kernel builds them from a rank selection or an exception."""

from __future__ import annotations

import asyncio

import pytest

from dist_kernel.exceptions import RankSpecError
from dist_kernel.parent import membership_words as words
from dist_kernel.parent.selection import parse_rank_spec

ONE, TWO = [1], [1, 2]


def test_one_rank_or_several_the_words_agree():
    assert words.ranks_named(ONE) == "rank 1" and words.ranks_named(TWO) == "ranks 1,2"
    assert words.ranks_named([0, 1, 2, 5]) == "ranks 0-2,5"
    assert words.count(1) == "1 rank" and words.count(3) == "3 ranks"
    one, two = words.respawned(ONE), words.respawned(TWO)
    assert "rank 1 was started anew" in one and "Its namespace is empty: rebuild what it needs" in one
    assert "ranks 1,2 were started anew" in two and "Their namespaces are empty: rebuild what they need" in two
    for text in (one, two):
        assert "in its place" not in text and "Rank 1,2's" not in text and "rank 1,2 was" not in text
    assert "until rank 1 is back" in words.respawn_hint(ONE)
    assert "until ranks 1,2 are back" in words.respawn_hint(TWO) and "start ranks 1,2 anew" in words.respawn_hint(TWO)
    assert "ranks 1,2 anew (their namespaces are empty" in words.dead_cell(TWO)
    assert words.dead_first(TWO, "%dist_sync") == "ranks 1,2 are dead: run %dist_respawn first, then %dist_sync."
    assert words.resized(1, [], [1]).startswith("now 1 rank;") and "Ended rank 1." in words.resized(1, [], [1])
    assert "Started ranks 2,3; their namespaces are empty" in words.resized(4, [2, 3], [])
    assert "ranks 1,2 are running" in words.refuse_running(TWO, [3])
    assert words.count_now(1, 2).startswith("1 rank now;")


def test_dist_ranks_says_what_objects_built_on_the_old_group_need_as_the_respawn_does():
    for text in (words.resized(3, [2], []), words.resized(2, [], [2]), words.respawned(ONE)):
        assert words.REBUILD in text
    assert "DistributedSampler" in words.REBUILD and "num_replicas" in words.REBUILD
    assert "DistributedDataParallel" in words.REBUILD


def test_a_respawn_of_some_dead_ranks_names_the_others_and_both_ways_on():
    text = words.refuse_partial([1], [2])
    assert text.startswith("%dist_respawn 1: rank 2 is dead too")
    assert "cannot form without it; nothing was started" in text
    assert "Run %dist_respawn (every dead rank) or %dist_respawn 1,2." in text
    assert "ranks 2,3 are dead too" in words.refuse_partial([1], [2, 3]) and "without them" in \
        words.refuse_partial([1], [2, 3])


def test_the_three_deaths_notice_says_respawn_on_once_and_what_to_run():
    notice = words.auto_failed(words.keeps_dying(ONE), ONE)
    assert notice.count("--respawn on") == 1, notice
    assert notice.count("%dist_respawn") == 1 and "rank 1 died 3 times within a minute, so it is not" in notice
    assert "ranks 1,2 died 3 times within a minute, so they are not" in words.keeps_dying(TWO)
    other = words.auto_failed("rank 1 (pid 9) did not start: no memory", ONE)
    assert other.count("--respawn on") == 1 and other.count("%dist_respawn") == 1


def test_where_dist_respawn_works_it_is_named_instead_of_a_restart():
    for reason, crashed in (("exited with code 1", False), ("exited with code 1", True), ("", False)):
        during = words.start_fix(reason, crashed, respawn=True)
        assert "run %dist_respawn to try again" in during.lower() and "Restart the kernel to try again" not in during
        assert "restart the kernel to try again" in words.start_fix(reason, crashed, respawn=False).lower()
    assert "%dist_respawn" in words.not_joined(1, 120, respawn=True)
    assert "%dist_respawn" not in words.not_joined(1, 120, respawn=False)


def test_a_failed_formation_says_nothing_waits_and_what_was_ended_once():
    text = words.formation_failed("rank 1 (pid 9) was killed by SIGKILL while joining the process group.\n"
                                  "Run %dist_respawn to try again.", [3], "%dist_respawn")
    assert "No rank waits in the formation any more. Rank 3, started for it, was ended again." in text
    assert text.count("%dist_respawn") == 1
    grown = words.formation_failed("rank 2 did not join", [2, 3], "%dist_ranks 4")
    assert "Ranks 2,3, started for it, were ended again. Run %dist_ranks 4 to try again" in grown


def test_a_start_that_timed_out_names_each_ranks_state_and_many_ranks_in_one_line():
    few = words.rank_states({0: ("pid 10", "idle"), 1: ("pid 11 on n2", "exited with code 1")})
    assert few == "rank 0 (pid 10) idle; rank 1 (pid 11 on n2) exited with code 1. "
    many = words.rank_states({r: (f"pid {r}", "running" if r != 5 else "exited with code 1") for r in range(12)})
    assert many == "rank 0-4,6-11 running; rank 5 exited with code 1. " and words.rank_states({}) == ""


def test_a_refused_join_says_whether_torch_is_missing_or_the_options_do_not_suit():
    missing = words.join_failed(1, "gloo", "ModuleNotFoundError: No module named 'torch'", "/venv/bin/python")
    assert missing.startswith("rank 1 could not join the gloo process group:\n")
    assert "make sure `import torch` works in /venv/bin/python" in missing
    assert "--gpus, --backend" in words.join_failed(0, "nccl", "RuntimeError: no GPU", "/venv/bin/python")


@pytest.mark.parametrize("error", [asyncio.TimeoutError(), RuntimeError(""), KeyError("x")])
def test_a_group_magics_error_is_never_empty(error):
    text = words.magic_failed("dist_respawn", "", error)
    assert text.startswith("%dist_respawn: ") and len(text) > len("%dist_respawn: ")
    assert words.magic_failed("dist_ranks", "3", RuntimeError("no")) == "%dist_ranks 3: no"


def test_a_bad_rank_selection_names_the_magic_it_was_given_to():
    with pytest.raises(RankSpecError) as caught:
        parse_rank_spec("7", 4, magic="%dist_respawn")
    assert str(caught.value).startswith("%dist_respawn '7': rank 7 does not exist")
    assert "%%rank" not in str(caught.value) and "`%dist_respawn 0-3`" in str(caught.value)
    with pytest.raises(RankSpecError, match=r"^%%rank '7'"):
        parse_rank_spec("7", 4)
