"""Comm ids in the ranks (issue 19): the same widget made the same way on every rank gets the
same id, so the frontend shows one; anything that differs gets another id."""

from __future__ import annotations

from dist_kernel.protocol import META, META_CELL
from dist_kernel.rank.widgets import CommIds, cell_of

SLIDER = {"state": {"_model_name": "IntSliderModel", "value": 0}, "buffer_paths": []}


def ranks(n: int, cell: str | None = "cell-1") -> list[CommIds]:
    return [CommIds(lambda: cell) for _ in range(n)]


def test_identical_widgets_made_in_the_same_order_get_the_same_id_on_every_rank():
    r0, r1 = ranks(2)
    first = [r.next_id("jupyter.widget", SLIDER, {"version": "2.1.0"}, None) for r in (r0, r1)]
    second = [r.next_id("jupyter.widget", SLIDER, {"version": "2.1.0"}, None) for r in (r0, r1)]
    assert first[0] == first[1] and second[0] == second[1]
    assert first[0] != second[0]  # a second identical widget is another widget
    assert len(first[0]) == 32 and int(first[0], 16) >= 0  # shaped like the uuid4().hex it replaces


def test_a_widget_that_differs_between_ranks_gets_a_different_id():
    r0, r1 = ranks(2)
    a = r0.next_id("jupyter.widget", {"state": {"value": 0}}, None, None)
    b = r1.next_id("jupyter.widget", {"state": {"value": 1}}, None, None)
    assert a != b
    assert r0.next_id("jupyter.widget", {}, None, [b"\x00"]) != r1.next_id("jupyter.widget", {}, None, [b"\x01"])


def test_a_rank_that_makes_an_extra_widget_first_still_shares_the_ones_after_it():
    r0, r1 = ranks(2)
    r1.next_id("jupyter.widget", {"state": {"extra": True}}, None, None)
    assert r0.next_id("jupyter.widget", SLIDER, None, None) == r1.next_id("jupyter.widget", SLIDER, None, None)


def test_the_same_widget_in_another_cell_is_another_widget():
    (a,) = ranks(1, "cell-1")
    (b,) = ranks(1, "cell-2")
    assert a.next_id("jupyter.widget", SLIDER, None, None) != b.next_id("jupyter.widget", SLIDER, None, None)


def test_outside_a_request_there_is_no_id_to_share():
    (r,) = ranks(1, None)
    assert r.next_id("jupyter.widget", SLIDER, None, None) is None


def test_the_cell_is_read_from_the_requests_dist_kernel_metadata():
    assert cell_of({"metadata": {META: {META_CELL: "abc"}}}) == "abc"
    assert cell_of({"metadata": {}}) is None and cell_of(None) is None and cell_of({}) is None
    assert cell_of({"metadata": {META: {META_CELL: 3}}}) is None
