"""What a node's ranks say reaches the parent in few frames (issue 26): the agent checks each
message with its rank's key, joins IOPub messages into one frame per turn, summarises the cells'
replies by what they say, and never changes the order of one rank's messages."""

from __future__ import annotations

import json

import pytest
from jupyter_client.session import Session

from dist_kernel import tunnel
from dist_kernel.tunnel.turns import Signer, Turn, unpack_out, unpack_replies

HMAC = "tunnel-key"
KEYS = {str(r): f"key{r}" for r in range(4)}


def message(rank: int, msg_type: str, content: dict, parent: str = "cell-1", metadata: dict | None = None,
            key: str | None = None, buffers: tuple[bytes, ...] = ()) -> list[bytes]:
    """A rank's message as its socket hands it to the agent: signed with the rank's own key."""
    session = Session(key=(key or KEYS[str(rank)]).encode())
    header = json.dumps({"msg_id": f"{rank}-{msg_type}", "msg_type": msg_type, "date": "2026-11-27T10:00:00Z"})
    parts = [header.encode(), json.dumps({"msg_id": parent}).encode(), json.dumps(metadata or {}).encode(),
             json.dumps(content).encode()]
    return [tunnel.DELIM, session.sign(parts), *parts, *buffers]


def frames_of(turn: Turn) -> list[tuple[bytes, object]]:
    """The turn's frame sets, decoded as the parent decodes them."""
    out: list[tuple[bytes, object]] = []
    for frames in turn.pack(HMAC):
        kind, rest = frames[0], frames[1:]
        if kind == tunnel.OUT:
            out.append((kind, [(e[0], e[1]["msg_type"], e[3]) for e in unpack_out(HMAC, rest)]))
        elif kind == tunnel.SUMMARY:
            out.append((kind, unpack_replies(HMAC, rest)))
        else:
            out.append((kind, [(int(r), ch) for r, ch, _ in tunnel.unbatch(rest)]))
    return out


def test_outputs_are_joined_and_the_replies_of_ranks_that_agree_are_one_entry_after_them() -> None:
    turn = Turn(Signer(KEYS))
    ok = {"status": "ok", "execution_count": 3, "user_expressions": {}, "payload": []}
    for rank in range(4):
        turn.add(rank, b"iopub", [b"topic", *message(rank, "stream", {"name": "stdout", "text": f"{rank}\n"})])
        # ipykernel's own metadata differs per rank (engine, started): only dist_kernel's part counts
        meta = {"engine": f"e{rank}", "dist_kernel": {"iopub": 1}}
        turn.add(rank, b"shell", message(rank, "execute_reply", ok if rank != 2 else {**ok, "status": "error"},
                                         metadata=meta))
    assert frames_of(turn) == [
        (tunnel.OUT, [(r, "stream", {}) for r in range(4)]),
        (tunnel.SUMMARY, [("cell-1", ok, {"iopub": 1}, [0, 1, 3]),
                          ("cell-1", {**ok, "status": "error"}, {"iopub": 1}, [2])]),
    ]
    assert turn.pack(HMAC) == []  # a packed turn is empty


def test_a_ranks_messages_keep_their_order_across_what_travels_joined_and_what_travels_as_it_came() -> None:
    turn = Turn(Signer(KEYS))
    turn.add(0, b"iopub", [b"t", *message(0, "stream", {"name": "stdout", "text": "before\n"})])
    turn.add(0, b"iopub", [b"t", *message(0, "comm_msg", {"data": {}}, buffers=(b"binary",))])  # buffers: raw
    turn.add(0, b"stdin", message(0, "input_request", {"prompt": "?"}))
    turn.add(0, b"iopub", [b"t", *message(0, "stream", {"name": "stdout", "text": "after\n"})])
    assert [kind for kind, _ in frames_of(turn)] == [tunnel.OUT, tunnel.BATCH, tunnel.OUT]


def test_a_message_that_does_not_verify_travels_as_it_came_for_the_parent_to_drop() -> None:
    turn = Turn(Signer(KEYS))
    forged = message(1, "stream", {"name": "stdout", "text": "x\n"}, key="not-rank-1s-key")
    turn.add(1, b"iopub", [b"t", *forged])
    turn.add(1, b"shell", message(1, "execute_reply", {"status": "ok"}, key="not-rank-1s-key"))
    assert frames_of(turn) == [(tunnel.BATCH, [(1, b"iopub"), (1, b"shell")])]


@pytest.mark.parametrize("unpack", [unpack_out, unpack_replies])
def test_joined_frames_signed_with_another_key_are_refused(unpack) -> None:
    turn = Turn(Signer(KEYS))
    turn.add(0, b"iopub", [b"t", *message(0, "stream", {"name": "stdout", "text": "x\n"})])
    turn.add(0, b"shell", message(0, "execute_reply", {"status": "ok"}))
    packed = {f[0]: f[1:] for f in turn.pack("another kernel's key")}
    with pytest.raises(tunnel.TunnelError):
        unpack(HMAC, packed[tunnel.OUT if unpack is unpack_out else tunnel.SUMMARY])


def test_a_cell_with_one_header_for_all_its_ranks_sends_that_header_once() -> None:
    shared = [b"{}", b"{}", b'{"code": "x = 1"}']
    header = b'{"msg_id": "cell"}'
    frames = tunnel.fan(b"shell", [(r, header) for r in range(64)], shared)
    assert frames.count(header) == 1 and len(frames) == 5 + len(shared)
    assert tunnel.unfan(frames[1:]) == (b"shell", [(r, header) for r in range(64)], shared)


def test_ranks_that_print_the_same_line_share_one_entry_and_a_line_of_their_own_stays_theirs() -> None:
    turn = Turn(Signer(KEYS))
    for rank in range(4):
        turn.add(rank, b"iopub", [b"topic", *message(rank, "stream", {"name": "stdout", "text": "epoch 1\n"})])
        turn.add(rank, b"iopub", [b"topic", *message(rank, "stream", {"name": "stdout", "text": f"rank {rank}\n"})])
        turn.add(rank, b"iopub", [b"topic", *message(rank, "status", {"execution_state": "idle"})])
    # each rank's idle follows its own line: the shared idle entry moves after them, once per rank
    assert frames_of(turn) == [(tunnel.OUT, [
        ([0, 1, 2, 3], "stream", {}), (0, "stream", {}), (1, "stream", {}), (2, "stream", {}), (3, "stream", {}),
        ([0, 1, 2, 3], "status", {})])]


def test_a_rank_joins_an_entry_of_the_same_message_only_where_its_own_order_is_kept() -> None:
    # rank 1 printed "a" before its "x"; rank 0 printed "x" first and then "b": rank 0's "x" entry
    # cannot move after rank 1's "a" (rank 0's "b" follows it), so rank 1's "x" has its own
    turn = Turn(Signer(KEYS))
    for rank, text in ((0, "x\n"), (1, "a\n"), (0, "b\n"), (1, "x\n"), (2, "x\n")):
        turn.add(rank, b"iopub", [b"topic", *message(rank, "stream", {"name": "stdout", "text": text})])
    ((_, entries),) = frames_of_texts(turn)
    assert entries == [(0, "x\n"), (1, "a\n"), (0, "b\n"), ([1, 2], "x\n")]
    for rank in (0, 1, 2):  # each rank's own messages, in the order it sent them
        own = [text for ranks, text in entries if rank in (ranks if isinstance(ranks, list) else [ranks])]
        assert own == {0: ["x\n", "b\n"], 1: ["a\n", "x\n"], 2: ["x\n"]}[rank]


def frames_of_texts(turn: Turn) -> list[tuple[bytes, list]]:
    """The turn's ``out`` entries as (rank or ranks, text)."""
    return [(frames[0], [(e[0], e[4]["text"]) for e in unpack_out(HMAC, frames[1:])]) for frames in turn.pack(HMAC)]
