"""``%dist_sync``, as a specification: the parent's reading of the magic and of the ranks'
replies. What travels how (the rank side) is in tests/kernel/test_sync_values.py; the copy over a
real group in tests/kernel/test_respawn.py."""

from __future__ import annotations

import pytest

from dist_kernel.exceptions import UsageError
from dist_kernel.parent.group_magics import parse_sync, sync_report
from dist_kernel.protocol import Synced


@pytest.mark.parametrize("arg,names,src", [("model", ["model"], 0), ("model opt --from 1", ["model", "opt"], 1),
                                          ("--from 1 x", ["x"], 1)])
def test_the_magic_takes_names_and_a_source_rank(arg, names, src):
    assert parse_sync(arg, world_size=2) == (names, src)


@pytest.mark.parametrize("arg,words", [("", "give the variables' names"), ("model --from 2", "name a rank, 0-1"),
                                       ("model.weight", "'model.weight' is not a name")])
def test_a_wrong_sync_is_refused_naming_the_fix(arg, words):
    with pytest.raises(UsageError, match=words.replace(".", r"\.").replace("(", r"\(")):
        parse_sync(arg, world_size=2)


def test_the_report_says_per_name_what_each_rank_got_and_names_every_failure_once():
    replies = {0: Synced(copied={"t": "sent from rank 0"}, failed={"gen": "a generator, which cannot be copied"}),
               1: Synced(copied={"t": "tensor 2x3 float32"}, failed={"gen": "a generator, which cannot be copied"}),
               2: Synced(copied={"t": "tensor 2x3 float32"}, failed={"gen": "a generator, which cannot be copied"})}
    fine = {r: Synced(copied={"t": reply.copied["t"]}, failed={}) for r, reply in replies.items()}
    assert sync_report(["t"], 0, fine) == "%dist_sync from rank 0: t to rank 1,2: tensor 2x3 float32"
    with pytest.raises(UsageError) as e:
        sync_report(["t", "gen"], 0, replies)
    assert "could not copy gen: a generator, which cannot be copied; copied: t to rank 1,2: tensor 2x3 float32" \
        in str(e.value)
    with pytest.raises(UsageError, match=r"rank 2 did not take part: no answer"):
        sync_report(["t"], 0, {**fine, 2: "no answer"})


def test_a_failure_on_one_receiving_rank_names_that_rank():
    replies = {0: Synced(copied={"m": "sent from rank 0"}, failed={}),
               1: Synced(copied={}, failed={"m": "RuntimeError: size mismatch for weight"})}
    with pytest.raises(UsageError, match=r"m: RuntimeError: size mismatch for weight \(rank 1\)"):
        sync_report(["m"], 0, replies)
