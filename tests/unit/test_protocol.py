"""The parent-rank protocol: every request and reply round-trips, and bad input is refused."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dist_kernel import protocol
from dist_kernel.protocol import ProtocolError


def _examples() -> list[protocol.Request]:
    return [protocol.Join(rank=1, world_size=2, local_rank=1, backend="gloo", store="/tmp/x/store-1",
                          timeout=1800.0, use_cuda=False, first=True, seed=7, fastai=True),
            protocol.Where(), protocol.Status(), protocol.Teardown(peer_pids=[12, 13]),
            protocol.SetOption(name="empty_cache", on=False)]


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
    }
    assert set(replies) == set(protocol.REPLIES)
    for op, reply in replies.items():
        wire = json.loads(json.dumps(protocol.reply_content(op, reply)))
        assert protocol.parse_reply(wire, op) == reply


def test_an_error_reply_carries_its_name_and_message():
    wire = protocol.reply_content("join", protocol.ErrorReply("ModuleNotFoundError", "No module named 'torch'"))
    assert protocol.parse_reply(wire, "join") == protocol.ErrorReply("ModuleNotFoundError", "No module named 'torch'")


@pytest.mark.parametrize("content,words", [
    ({"version": 1, "op": "format_disk", "args": {}}, "unknown op"),
    ({"version": 2, "op": "where", "args": {}}, "version"),
    ({"version": 1, "op": "where"}, "fields"),
    ({"version": 1, "op": "where", "args": {}, "code": "import os"}, "fields"),
    ({"version": 1, "op": "where", "args": {"x": 1}}, "unknown field"),
    ({"version": 1, "op": "set_option", "args": {"name": "empty_cache"}}, "missing field 'on'"),
    ({"version": 1, "op": "set_option", "args": {"name": "empty_cache", "on": "yes"}}, "is not bool"),
    ({"version": 1, "op": "set_option", "args": {"name": "rm_rf", "on": True}}, "unknown option"),
    ({"version": 1, "op": "join", "args": {**dataclasses.asdict(_examples()[0]), "rank": True}}, "is not int"),
    ({"version": 1, "op": "join", "args": {**dataclasses.asdict(_examples()[0]), "seed": "7"}}, "seed"),
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
    assert protocol.parse_request({"version": 1, "op": "join", "args": args}).timeout == 60
