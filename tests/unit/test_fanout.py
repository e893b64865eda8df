"""A cell crosses a node's link once (issue 26): the parent's fan messages, the agent's signing
of each rank's copy, the agents' batches, and the rank list a cell's metadata carries only for
a selection."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
from jupyter_client.session import Session

from dist_kernel import protocol, tunnel
from dist_kernel.options import KernelConfig
from dist_kernel.parent.channels import RankChannel, Routes
from dist_kernel.parent.gang_fault import GangFault
from dist_kernel.parent.launch.outbox import Outbox
from dist_kernel.parent.launch.remote_rank import RemoteWire
from dist_kernel.parent.ranks import RECENT, SupervisedRanks
from dist_kernel.tunnel.turns import Signer


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
    signer = Signer(keys)
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


def test_a_fan_message_made_once_for_a_nodes_ranks_travels_as_put_rank_by_rank() -> None:
    # issue 26: a cell's fan message made once by the caller (put_fan) travels as put rank by rank
    def flushed(fill) -> list[tuple[int, list]]:
        sent: list[tuple[int, list]] = []
        box = Outbox(lambda node, frames: sent.append((node, frames)))
        fill(box)
        box.flush()
        return sent

    cell, header = [b"{}", b"{meta}", b"{cell}"], b"h-cell"

    def one_by_one(box: Outbox) -> None:
        for rank in range(8):
            box.put(rank // 4, rank, b"shell", header, cell)

    def made(box: Outbox) -> None:
        for node in (0, 1):
            box.put_fan(node, tunnel.fan_one_header(b"shell", tunnel.rank_list(list(range(node * 4, node * 4 + 4))),
                                                    header, cell))

    sent = flushed(made)
    assert sent == flushed(one_by_one)
    # one header for all: it travels once per node, after the node's rank list
    assert [frames[:5] for _, frames in sent] == [[tunnel.FAN, b"shell", b"*", b"0,1,2,3", header],
                                                   [tunnel.FAN, b"shell", b"*", b"4,5,6,7", header]]


class _Listener:
    """A node listener as a remote rank's wire sees it; records the cells handed to it."""

    def __init__(self) -> None:
        self.cells: list[list[int]] = []  # each cell's ranks, node by node

    def send_to_nodes(self, nodes: list[tuple[int, bytes]], channel: str, header: bytes, shared: list[bytes]) -> None:
        self.cells.append([rank for _, ranks in nodes
                           for rank, _ in tunnel.unfan([b"shell", b"*", ranks, header, *shared])[1]])

    def attach(self, *args) -> None: ...
    def detach(self, rank: int) -> None: ...
    def send_parts(self, *args) -> None: ...
    def send_ctl(self, *args) -> None: ...


def _remote_ranks(n: int) -> tuple[SupervisedRanks, _Listener]:
    """``n`` remote ranks' real channels behind one listener, in a supervisor's state without its
    processes (no reaper, no launcher: what routing a cell reads)."""
    listener = _Listener()
    log = logging.getLogger("test")
    ranks = object.__new__(SupervisedRanks)
    vars(ranks).update(
        ranks={r: SimpleNamespace(channel=RankChannel(r, {"key": f"k{r}"}, log, lambda *a: None, lambda *a: None,
                                                      wire=RemoteWire(listener, r)), exit_reason=None, alive=True)
               for r in range(n)},
        generation=1, deaths={}, routes=Routes(), fault=GangFault(lambda: None, lambda cause: None),
        config=KernelConfig(world_size=n, backend="gloo", nodes=2, ranks_per_node=n // 2))
    return ranks, listener


def test_a_cell_goes_to_a_nodes_ranks_in_one_call_and_their_agreeing_replies_come_back_as_one_group() -> None:
    ranks, listener = _remote_ranks(4)
    groups: list[list[int]] = []
    sent, lost = ranks.send_cell((0, 1, 2, 3), {"code": "x = 1"}, {}, lambda rs, msg: groups.append(rs))
    assert listener.cells == [[0, 1, 2, 3]] and lost == {} and len(sent) == 1
    reply = {"parent_header": {"msg_id": sent[0]}, "content": {"status": "ok"}, "metadata": {}}
    assert ranks.grouped_reply([0, 1, 3], reply) is True and groups == [[0, 1, 3]]
    # a reply to nothing routed (a finished cell's, long ago) goes to the ranks' channels instead
    assert ranks.grouped_reply([2], {**reply, "parent_header": {"msg_id": "other"}}) is False


def test_a_rank_that_died_is_left_out_of_the_next_cells_send_and_named() -> None:
    ranks, listener = _remote_ranks(4)
    ranks.send_cell((0, 1, 2, 3), {"code": "x = 1"}, {}, lambda rs, msg: None)
    ranks.ranks[2].channel.fail_pending("rank 2 (pid 12 on n1) exited with code 1")  # as the supervisor's _died
    ranks.ranks[2].exit_reason, ranks.ranks[2].alive, ranks.deaths[2] = "exited with code 1", False, [0.0]
    sent, lost = ranks.send_cell((0, 1, 2, 3), {"code": "x = 2"}, {}, lambda rs, msg: None)
    assert listener.cells[-1] == [0, 1, 3] and lost == {2: "rank 2 (pid 12 on n1) exited with code 1"}
    assert ranks.gone() == [2]


def test_a_cell_that_waits_on_a_rank_left_running_still_hears_its_reply_after_many_later_cells() -> None:
    # the late reply is how the group learns the rank is back (GroupState.left_running)
    ranks, listener = _remote_ranks(4)

    def reply(msg_id: str) -> dict:
        return {"parent_header": {"msg_id": msg_id}, "content": {"status": "ok"}, "metadata": {}}

    heard: list[list[int]] = []
    (stuck,), _ = ranks.send_cell((0, 1, 2, 3), {"code": "train()"}, {}, lambda rs, msg: heard.append(rs))
    ranks.grouped_reply([0, 1, 2], reply(stuck))  # rank 3 was given up on, still running
    later = []
    for i in range(3 * RECENT):  # cells on the others (%%rank 0-2), each answered
        (msg_id,), _ = ranks.send_cell((0, 1, 2), {"code": f"x = {i}"}, {}, lambda rs, msg: None)
        assert ranks.grouped_reply([0, 1, 2], reply(msg_id))
        later.append(msg_id)
    assert ranks.grouped_reply([3], reply(stuck)) is True and heard == [[0, 1, 2], [3]]
    assert ranks.grouped_reply([0], reply(later[0])) is False  # an answered cell's route is not kept for ever
