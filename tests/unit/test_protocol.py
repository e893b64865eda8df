"""The parent-rank protocol: every request and reply round-trips, and bad input is refused."""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
from pathlib import Path

import pytest

from dist_kernel import options, protocol
from dist_kernel.protocol import ProtocolError

_JOIN = {"rank": 0, "world_size": 2, "local_rank": 0, "backend": "gloo", "store": "/tmp/x/store-1",
         "timeout": 1800.0, "use_cuda": False, "first": True}


def _examples() -> list[protocol.Request]:
    return [protocol.Join(rank=1, world_size=2, local_rank=1, backend="gloo", store="/tmp/x/store-1",
                          timeout=1800.0, use_cuda=False, first=True, seed=7,
                          switches={"fastai": True, "empty_cache": False}, local_world_size=2),
            protocol.Where(), protocol.Status(), protocol.Teardown(peer_pids=[12, 13]),
            protocol.SetOption(name="empty_cache", on=False), protocol.Sync(names=["model", "opt"], src=0)]


def test_every_request_survives_json_and_validation_unchanged():
    assert {r.op for r in _examples()} == set(protocol.REQUESTS)
    for req in _examples():
        wire = json.loads(json.dumps(protocol.request_content(req)))
        assert protocol.parse_request(wire) == req


def test_every_reply_survives_json_and_validation_unchanged():
    replies = {
        "join": protocol.Joined(device="cpu"),
        "where": protocol.Place(collective="all_reduce", group_ranks=[0, 1], peer=None, seq=3,
                                stack=['  File "cell", line 2'], line="line 2: dist.all_reduce(t)", busy=True),
        "status": protocol.RankStatus(pid=1, host="h", device="cpu", rss_mb=1.5, empty_cache=True, busy=False,
                                      line=""),
        "teardown": protocol.Done(outcome="destroyed"),
        "set_option": protocol.Done(outcome="fastai off"),
        "sync": protocol.Synced(copied={"model": "state_dict into this rank's module"},
                                failed={"gen": "a generator that cannot be pickled"}),
    }
    assert set(replies) == set(protocol.REPLIES)
    for op, reply in replies.items():
        wire = json.loads(json.dumps(protocol.reply_content(op, reply)))
        assert protocol.parse_reply(wire, op) == reply


def test_an_error_reply_carries_its_name_and_message():
    wire = protocol.reply_content("join", protocol.ErrorReply("ModuleNotFoundError", "No module named 'torch'"))
    assert protocol.parse_reply(wire, "join") == protocol.ErrorReply("ModuleNotFoundError", "No module named 'torch'")


V = protocol.VERSION


@pytest.mark.parametrize("content,words", [
    ({"version": V, "op": "format_disk", "args": {}}, "unknown op"),
    ({"version": 1, "op": "where", "args": {}}, "version"),
    ({"version": V, "op": "where"}, "fields"),
    ({"version": V, "op": "where", "args": {}, "code": "import os"}, "fields"),
    ({"version": V, "op": "where", "args": {"x": 1}}, "unknown field"),
    ({"version": V, "op": "set_option", "args": {"name": "empty_cache"}}, "missing field 'on'"),
    ({"version": V, "op": "set_option", "args": {"name": "empty_cache", "on": "yes"}}, "is not bool"),
    ({"version": V, "op": "set_option", "args": {"name": "rm_rf", "on": True}}, "unknown option"),
    ({"version": V, "op": "join", "args": {**_JOIN, "switches": {"rm_rf": True}}}, "join: unknown option 'rm_rf'"),
    ({"version": V, "op": "join", "args": {**_JOIN, "switches": {"fastai": "on"}}}, "is not dict"),
    ({"version": V, "op": "join", "args": {**dataclasses.asdict(_examples()[0]), "rank": True}}, "is not int"),
    ({"version": V, "op": "join", "args": {**dataclasses.asdict(_examples()[0]), "seed": "7"}}, "seed"),
    ("where", "JSON object"),
    (None, "JSON object"),
])
def test_a_malformed_request_is_refused_with_a_reason(content, words):
    with pytest.raises(ProtocolError, match=words):
        protocol.parse_request(content)


def test_a_reply_for_another_request_is_refused():
    wire = protocol.reply_content("status", protocol.Done(outcome="x"))
    with pytest.raises(ProtocolError):
        protocol.parse_reply(wire, "status")  # a Done is not a RankStatus
    with pytest.raises(ProtocolError, match="expected 'where'"):
        protocol.parse_reply(protocol.reply_content("teardown", protocol.Done(outcome="x")), "where")


def test_numbers_from_json_are_accepted_where_floats_are_expected():
    args = {**dataclasses.asdict(_examples()[0]), "timeout": 60}
    assert protocol.parse_request({"version": V, "op": "join", "args": args}).timeout == 60


# ------------------------------------------------------------------ the design page describes it
ARCHITECTURE = Path(__file__).parents[2] / "docs" / "architecture.md"


def _table_rows(words: str) -> list[list[str]]:
    """The cells of the first Markdown table after ``words``, past its header."""
    lines = ARCHITECTURE.read_text().split(words, 1)[1].splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    table = list(itertools.takewhile(lambda ln: ln.startswith("|"), lines[start:]))
    return [[c.strip() for c in ln.strip("|").split(" | ")] for ln in table[2:]]  # past the header and ---


def test_the_where_table_of_the_design_page_names_every_field_of_place():
    """The table of ``where`` fields in docs/architecture.md is the dataclass's: a field added to
    ``protocol.Place`` (which the fault policy reads as it is) must be described there."""
    rows = _table_rows("The `where` reply (`protocol.Place`)")
    described = [row[0].strip("`") for row in rows]
    assert described == [f.name for f in dataclasses.fields(protocol.Place)]
    assert all(row[1] for row in rows)  # each says what it means


def test_the_request_table_of_the_design_page_names_every_field_of_each_request():
    rows = {row[0].strip("`"): row for row in _table_rows("Everything else is a typed request")}
    assert set(rows) == set(protocol.REQUESTS)
    for op, cls in protocol.REQUESTS.items():
        fields = [f.name for f in dataclasses.fields(cls)]
        named = [] if rows[op][1] == "–" else [re.sub(r"\s*\(.*\)$", "", c.strip()) for c in
                                               re.split(r",\s*(?![^()]*\))", rows[op][1])]
        assert named == fields, op


# ------------------------------------------------------------------ rank switches: declared once
def test_every_rank_switch_is_an_option_that_each_rank_knows_how_to_set():
    """A rank switch is an option declared ``rank_switch``: the protocol's names, the parent's
    join and the rank's handlers all follow from it, and the rank has its behaviour."""
    from dist_kernel.rank import switches

    assert protocol.RANK_SWITCHES == options.RANK_SWITCHES == ("fastai", "lightning", "hf", "empty_cache")
    assert set(switches.SWITCHES) == set(options.RANK_SWITCHES)
    config = options.KernelConfig(world_size=2, backend="gloo", fastai=False)
    assert config.rank_switches() == {"fastai": False, "lightning": True, "hf": True, "empty_cache": True}


def test_a_switch_a_join_leaves_out_takes_its_options_default_on_the_rank(monkeypatch):
    from dist_kernel.rank import switches

    got: dict[str, bool] = {}
    for name in options.RANK_SWITCHES:
        monkeypatch.setitem(switches.SWITCHES, name,
                            switches.RankSwitch(start=lambda on, name=name: got.__setitem__(name, on), set=print))
    switches.start({"fastai": False})
    assert got == {"fastai": False, "lightning": True, "hf": True, "empty_cache": True}
