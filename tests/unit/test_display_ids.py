"""Display ids in the ranks (issue 30): ``display(x, display_id=True)`` made by the same code on
every rank gets the same id, so the parent shows one display; in another cell, another id."""

from __future__ import annotations

import os
import sys

import pytest
from IPython.core import display_functions
from IPython.display import DisplayHandle

from dist_kernel.protocol import META, META_CELL
from dist_kernel.rank import display_ids
from dist_kernel.rank.display_ids import DisplayIds


@pytest.fixture
def installed(monkeypatch):
    """IPython's id maker replaced as a rank does; put back after the test."""
    monkeypatch.setattr(display_functions, "_new_id", display_functions._new_id)
    request: dict = {"metadata": {META: {META_CELL: "cell-1"}}}
    ids = display_ids.install(lambda: request, as_a_rank.__code__)
    return ids, request


def as_a_rank(ids: DisplayIds, run, *args):
    """Run ``run`` as a freshly started rank would: no ids made before. This frame stands for
    the shell's ``run_code``: what called it is the kernel's, not part of a call path."""
    ids._counts.clear()
    return run(*args)


def show(n: int = 1) -> list[str]:
    return [DisplayHandle().display_id for _ in range(n)]


def test_every_rank_running_the_same_code_makes_the_same_ids(installed):
    ids, _ = installed
    ranks = [as_a_rank(ids, show, 3) for _ in range(4)]
    assert ranks[0] == ranks[1] == ranks[2] == ranks[3]
    assert len(set(ranks[0])) == 3  # three displays are three displays
    assert all(len(i) == 32 and int(i, 16) >= 0 for i in ranks[0])  # shaped like the id it replaces


def test_display_with_display_id_true_uses_them(installed, monkeypatch):
    ids, _ = installed
    published: list[dict] = []

    class Pub:
        def publish(self, data, metadata=None, **kwargs):
            published.append(kwargs.get("transient", {}))

    class Shell:
        display_pub = Pub()
        display_formatter = type("F", (), {"format": staticmethod(lambda obj, **kw: ({"text/plain": "x"}, {}))})()

    from IPython.core.interactiveshell import InteractiveShell
    monkeypatch.setattr(InteractiveShell, "initialized", classmethod(lambda cls: True))
    monkeypatch.setattr(InteractiveShell, "instance", classmethod(lambda cls, *a, **k: Shell()))

    def cell() -> str:
        handle = display_functions.display("x", display_id=True)
        handle.update("y")
        return handle.display_id

    first, second = as_a_rank(ids, cell), as_a_rank(ids, cell)
    assert first == second
    assert [p["display_id"] for p in published] == [first] * 4  # the displays and their updates


def test_a_display_made_on_one_rank_only_does_not_shift_the_others(installed):
    ids, _ = installed

    def cell(rank: int) -> list[str]:
        if rank == 0:
            show()  # rank 0's own display (a progress bar fastai shows on rank 0 only)
        return show(2)

    assert as_a_rank(ids, cell, 0) == as_a_rank(ids, cell, 1)


def test_the_same_display_in_another_cell_has_another_id(installed):
    ids, request = installed
    first = as_a_rank(ids, show)
    request["metadata"][META][META_CELL] = "cell-2"
    assert as_a_rank(ids, show) != first
    assert show() != show()  # and running on in the same cell still gives new ids


def test_outside_a_request_the_id_stays_random(monkeypatch):
    monkeypatch.setattr(display_functions, "_new_id", display_functions._new_id)
    display_ids.install(lambda: None)
    a, b = show(2)
    assert a != b and len(a) == 32


def test_the_call_path_names_code_and_place_not_the_files_path():
    def here() -> str:
        return display_ids.call_path(sys._getframe(), here.__code__)

    def caller() -> list[str]:
        return [display_ids.call_path(sys._getframe()) for _ in range(2)]

    assert here() == ""  # the walk ends at the stop frame
    loop = caller()
    assert loop[0] == loop[1]  # one place, however often it runs
    assert display_ids.call_path(sys._getframe()) != loop[0]
    assert os.sep not in loop[0]  # file names, not paths: nodes may install elsewhere
    assert os.path.basename(__file__) in loop[0]
