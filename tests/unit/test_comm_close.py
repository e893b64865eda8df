"""Issue 30, section 6: a widget every rank shares is closed once in the frontend."""

from __future__ import annotations

import itertools

import pytest

from dist_kernel.parent.comms import CommRouter


def relayed(order: list[tuple[str, int]], owners: int = 3) -> list[str]:
    """What the frontend gets when ``owners`` ranks open comm "w" and then send ``order``."""
    router = CommRouter()
    out = []
    for rank in range(owners):
        if router.from_rank("comm_open", {"comm_id": "w", "data": {}}, rank) is not None:
            out.append("comm_open")
    for msg_type, rank in order:
        if router.from_rank(msg_type, {"comm_id": "w", "data": {}}, rank) is not None:
            out.append(msg_type)
    return out


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_a_shared_widget_closed_on_every_rank_is_closed_once_whatever_the_order(order):
    assert relayed([("comm_close", r) for r in order]) == ["comm_open", "comm_close"]


def test_what_other_owners_send_after_the_leaders_close_is_dropped():
    assert relayed([("comm_close", 0), ("comm_msg", 1), ("comm_close", 1), ("comm_close", 2)]) == [
        "comm_open", "comm_close"]


def test_a_comm_only_one_rank_opened_is_closed_as_it_says():
    assert relayed([("comm_close", 0)], owners=1) == ["comm_open", "comm_close"]


def test_a_comm_id_opened_again_after_its_close_is_a_new_comm():
    router = CommRouter()
    for rank in (0, 1):
        router.from_rank("comm_open", {"comm_id": "w", "data": {}}, rank)
    assert router.from_rank("comm_close", {"comm_id": "w", "data": {}}, 0) is not None
    assert router.from_rank("comm_open", {"comm_id": "w", "data": {}}, 1) is not None  # rank 1 opens it anew
    assert router.from_rank("comm_close", {"comm_id": "w", "data": {}}, 1) is not None
