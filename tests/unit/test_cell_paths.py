"""The fast paths of issue 14, checked against the slow paths they shortcut (no timings).

- whole identical stream chunks are published once, and anything else falls back to the line
  merger with the same result as if every chunk had been split into lines;
- a rank is finished with a cell when its reply and the number of IOPub messages the reply says
  it published have arrived (no ``idle`` needed), or when its ``idle`` arrives;
- the raw rank channel decodes what routing needs and drops what fails its signature.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from dist_kernel.parent.merge import CellMerger
from dist_kernel.parent.relay import Outlet, OutputRelay

W = 0.1


def feed(merger: CellMerger, events, end: float = 10.0, split: bool = False):
    """(time, rank, text) stream events; with ``split`` each chunk arrives as single lines."""
    out = []
    for now, rank, text in sorted(events, key=lambda e: e[0]):
        merger.poll(now)
        pieces = text.splitlines(keepends=True) if split else [text]
        for piece in pieces:
            merger.add(rank, "stream", {"name": "stdout", "text": piece}, now)
        out += merger.take()
    merger.finish(end)
    return "".join(c["text"] for t, c in out + merger.take() if t == "stream")


CASES = [
    [(0, 0, "a\nb\n"), (0.01, 1, "a\nb\n")],  # identical: once
    [(0, 0, "a\nb\n"), (0.01, 1, "a\nc\n")],  # differ in the second line
    [(0, 0, "a\n"), (0.01, 1, "a\n"), (0.02, 0, "x\n"), (0.03, 1, "y\n")],
    [(0, 0, "a\n"), (0.5, 1, "a\n")],  # the twin comes after the window
    [(0, 0, "a\n"), (0.01, 0, "b\n"), (0.02, 1, "a\nb\n")],  # chunked differently
    [(0, 0, "no newline"), (0.01, 1, "no newline")],
]


@pytest.mark.parametrize("events", CASES)
def test_chunks_show_what_the_line_merger_shows(events):
    assert feed(CellMerger([0, 1], W), events) == feed(CellMerger([0, 1], W), events, split=True)


def test_an_identical_chunk_is_published_once_whole():
    m = CellMerger([0, 1, 2], W)
    text = "x" * 99 + "\n"
    chunk = text * 1000
    for rank in (0, 1):
        m.add(rank, "stream", {"name": "stdout", "text": chunk}, 0.0)
        assert not m.ready and m.pending == rank + 1
    m.add(2, "stream", {"name": "stdout", "text": chunk}, 0.0)
    assert m.take() == [("stream", {"name": "stdout", "text": chunk})]


def test_a_finished_rank_keeps_its_chunk_waiting_for_the_others():
    m = CellMerger([0, 1], W)
    m.add(1, "stream", {"name": "stdout", "text": "done\n"}, 0.0)
    m.rank_done(1, 0.0)
    m.add(0, "stream", {"name": "stdout", "text": "done\n"}, 0.01)
    assert m.take() == [("stream", {"name": "stdout", "text": "done\n"})]


def test_a_chunk_whose_twin_never_comes_is_labelled_when_its_rank_alone_is_left():
    m = CellMerger([0, 1], W)
    m.add(1, "stream", {"name": "stdout", "text": "only me\n"}, 0.0)
    m.rank_done(0, 0.0)
    m.finish(0.0)
    assert "".join(c["text"] for _, c in m.take()) == "[rank 1] only me\n"


def _reply(n):
    return {"status": "ok"}, {"dist_kernel": {"iopub": n}}


def _msg(msg_type, content):
    return {"header": {"msg_type": msg_type}, "msg_type": msg_type, "content": content, "parent_header": {}}


def test_a_rank_is_done_at_its_reply_and_counted_messages_without_idle():
    async def go():
        published = []
        run = OutputRelay([0, 1], Outlet(lambda t, c: published.append((t, c))), 1, window=W)
        waiter = asyncio.ensure_future(run.wait())
        run.on_reply(0, *_reply(1))  # the reply overtook the rank's one output
        run.on_reply(1, *_reply(0))
        await asyncio.sleep(0)
        assert run.finished == {1}
        run.on_iopub(0, _msg("stream", {"name": "stdout", "text": "hi\n"}))
        assert await asyncio.wait_for(waiter, 1) is None
        assert run.finished == {0, 1} and not run.idle

    asyncio.run(go())


def test_without_a_count_the_idle_still_ends_a_rank():
    async def go():
        run = OutputRelay([0], Outlet(lambda t, c: None), 1, window=W)
        waiter = asyncio.ensure_future(run.wait())
        run.on_reply(0, {"status": "ok"}, {})
        await asyncio.sleep(0)
        assert not run.finished
        run.on_iopub(0, _msg("status", {"execution_state": "idle"}))
        await asyncio.wait_for(waiter, 1)

    asyncio.run(go())


def test_the_rank_channel_checks_signatures_and_drops_what_routing_does_not_need():
    import logging

    from jupyter_client.session import Session

    from dist_kernel.parent.channels import BadMessage, RankChannel

    ch = RankChannel(0, {"transport": "ipc", "ip": "/tmp/none", "key": "k3y", "signature_scheme": "hmac-sha256"},
                     logging.getLogger("test"), lambda r, m: None, lambda r, m: None)
    rank_side = Session(key=b"k3y")
    ch.listen("cell", lambda m: None)

    def frames(session, msg_type, content, parent_id="cell"):
        msg = session.msg(msg_type, content, parent={"header": {"msg_id": parent_id}} if parent_id else None)
        return session.serialize(msg)

    got = ch._decode_iopub(frames(rank_side, "stream", {"name": "stdout", "text": "x\n"}))
    assert got["content"]["text"] == "x\n" and got["parent_header"]["msg_id"] == "cell"
    assert isinstance(got["header"]["date"], str)  # no date parsing
    assert ch._decode_iopub(frames(rank_side, "status", {"execution_state": "busy"})) is None
    assert ch._decode_iopub(frames(rank_side, "execute_input", {"code": "", "execution_count": 1})) is None
    assert ch._decode_iopub(frames(rank_side, "status", {"execution_state": "idle"}, "nobody")) is None
    assert ch._decode_iopub(frames(rank_side, "status", {"execution_state": "idle"}))["msg_type"] == "status"
    with pytest.raises(BadMessage):
        ch._decode_iopub(frames(Session(key=b"wrong"), "stream", {"name": "stdout", "text": "forged\n"}))
    replayed = frames(rank_side, "stream", {"name": "stdout", "text": "once\n"})
    ch._decode_iopub(replayed)
    with pytest.raises(BadMessage):
        ch._decode_iopub(replayed)
    assert json.loads(replayed[-1])["text"] == "once\n"


def _cell_through_relay(grouped: bool) -> tuple[list, set]:
    """Four ranks print "epoch 1" alike, then a line each, then reply; what is published, and
    the ranks finished. ``grouped``: the shared line comes as one node's entry for the ranks."""
    async def go():
        published: list = []
        run = OutputRelay([0, 1, 2, 3], Outlet(lambda t, c: published.append((t, c))), 1, window=W)
        waiter = asyncio.ensure_future(run.wait())
        shared = _msg("stream", {"name": "stdout", "text": "epoch 1\n"})
        if grouped:
            run.on_iopub_group([0, 1, 2, 3], shared)
        else:
            for rank in range(4):
                run.on_iopub(rank, shared)
        for rank in range(4):
            run.on_iopub(rank, _msg("stream", {"name": "stdout", "text": f"loss {rank}\n"}))
        run.on_replies([([0, 1, 2, 3], *_reply(2))])
        await asyncio.wait_for(waiter, 1)
        return published, run.finished

    return asyncio.run(go())


def test_a_line_that_a_nodes_ranks_sent_as_one_entry_shows_as_if_each_rank_had_sent_it():
    # issue 26: a node agent sends one entry for a message its ranks sent alike
    published, finished = _cell_through_relay(grouped=True)
    assert (published, finished) == _cell_through_relay(grouped=False)
    assert "".join(c["text"] for _, c in published) == "epoch 1\n" + "".join(f"[rank {r}] loss {r}\n" for r in range(4))
    assert finished == {0, 1, 2, 3}  # each rank's counted messages include its share of the entry
