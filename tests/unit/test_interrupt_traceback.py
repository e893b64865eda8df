"""Issue 30, section 6: a stopped cell's KeyboardInterrupt ends in the user's frame, not the kernel's."""

from __future__ import annotations

import traceback

import pytest

from dist_kernel.rank import agent
from dist_kernel.rank.kernel import _drop_interrupt_frame, _interrupt_cell


@pytest.fixture
def in_code(monkeypatch):
    monkeypatch.setitem(agent._state, "in_code", True)


def users_loop() -> None:
    _interrupt_cell(2, None)  # where SIGINT's handler runs: inside the user's code


def test_the_kernels_handler_frame_is_cut_off(in_code):
    with pytest.raises(KeyboardInterrupt) as e:
        users_loop()
    assert traceback.extract_tb(e.value.__traceback__)[-1].name == "_interrupt_cell"  # before
    _drop_interrupt_frame(e.value)
    assert traceback.extract_tb(e.value.__traceback__)[-1].name == "users_loop"


def test_other_errors_and_other_interrupts_keep_their_frames(in_code):
    def raises(error: BaseException) -> None:
        raise error

    for error in (ValueError("x"), KeyboardInterrupt()):
        with pytest.raises(type(error)) as e:
            raises(error)
        before = traceback.extract_tb(e.value.__traceback__)
        _drop_interrupt_frame(e.value)
        assert traceback.extract_tb(e.value.__traceback__) == before
    _drop_interrupt_frame(None)  # no error: nothing to do
