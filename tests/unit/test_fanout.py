"""A cell crosses a node's link once (issue 26): the parent's fan messages, the agent's signing
of each rank's copy, the agents' batches, and the rank list a cell's metadata carries only for
a selection."""

from __future__ import annotations

import pytest
from jupyter_client.session import Session

from dist_kernel import protocol, tunnel
from dist_kernel.parent.launch.outbox import Outbox


def test_a_cells_rank_list_is_read_only_when_well_formed() -> None:
    assert protocol.ranks_from([0, 2]) == (0, 2)
    for absent_or_bad in (None, "", "0-3", [], ["0"], 3):  # absent: every rank of the world
        assert protocol.ranks_from(absent_or_bad) is None


def test_a_fan_message_reads_back_and_each_rank_gets_its_own_signature() -> None:
    keys = {"0": "k0", "1": "k1"}
    shared = [b"{}", b'{"m": 1}', b'{"code": "x = 1"}', b"buffer"]
    frames = tunnel.fan(b"shell", [(0, b'{"msg_id": "a"}'), (1, b'{"msg_id": "b"}')], shared)
    assert frames[0] == tunnel.FAN
    channel, headers, got = tunnel.unfan(frames[1:])
    assert (channel, headers, got) == (b"shell", [(0, b'{"msg_id": "a"}'), (1, b'{"msg_id": "b"}')], shared)
    signer = tunnel.Signer(keys)
    for rank, header in headers:
        msg = signer.message(rank, header, got)
        assert msg[0] == tunnel.DELIM and msg[2:] == [header, *shared]
        # what the rank's own Session would sign: header, parent header, metadata, content
        session = Session(key=keys[str(rank)].encode())
        assert msg[1] == session.sign([header, *shared[:3]])
        assert msg[1] != Session(key=keys[str(1 - rank)].encode()).sign([header, *shared[:3]])


@pytest.mark.parametrize("frames", [[b"shell"], [b"shell", b"x"], [b"shell", b"2", b"0", b"h"],
                                    [b"iopub", b"1", b"0", b"h", b"{}", b"{}", b"{}"],
                                    [b"shell", b"1", b"0", b"h", b"{}"]])
def test_a_malformed_fan_message_is_refused(frames: list[bytes]) -> None:
    with pytest.raises(tunnel.TunnelError):
        tunnel.unfan(frames)


def test_a_batch_reads_back_in_order() -> None:
    messages = [(b"3", b"shell", [b"a", b"b"]), (b"4", b"iopub", [b"topic", b"c"]), (b"3", b"iopub", [])]
    frames = tunnel.batch(messages)
    assert frames[0] == tunnel.BATCH
    assert tunnel.unbatch(frames[1:]) == messages
    with pytest.raises(tunnel.TunnelError):
        tunnel.unbatch(frames[1:-1])


def test_the_outbox_sends_one_message_per_node_and_run_of_the_same_request() -> None:
    sent: list[tuple[int, list]] = []
    box = Outbox(lambda node, frames: sent.append((node, frames)))
    cell = [b"{}", b"{meta}", b"{cell}"]
    for rank in range(6):  # two nodes of three ranks
        box.put(rank // 3, rank, b"shell", f"h{rank}".encode(), cell)
    box.put(1, 5, b"stdin", b"h-input", [b"{}", b"{}", b"{value}"])
    assert box
    box.flush()
    assert not box
    assert [(node, tunnel.unfan(frames[1:])) for node, frames in sent] == [
        (0, (b"shell", [(0, b"h0"), (1, b"h1"), (2, b"h2")], cell)),
        (1, (b"shell", [(3, b"h3"), (4, b"h4"), (5, b"h5")], cell)),
        (1, (b"stdin", [(5, b"h-input")], [b"{}", b"{}", b"{value}"])),
    ]


def test_the_outbox_keeps_the_order_of_different_requests_to_a_node() -> None:
    sent: list[list] = []
    box = Outbox(lambda node, frames: sent.append(frames))
    box.put(0, 0, b"shell", b"h1", [b"{}", b"{}", b"{a}"])
    box.put(0, 1, b"shell", b"h2", [b"{}", b"{}", b"{b}"])
    box.put(0, 1, b"shell", b"h3", [b"{}", b"{}", b"{a}"])  # equal bytes, but after another request
    box.flush()
    assert [tunnel.unfan(f[1:])[1] for f in sent] == [[(0, b"h1")], [(1, b"h2")], [(1, b"h3")]]
