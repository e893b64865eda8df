"""Issue 30, sections 5-6: what notebook_launcher on the kernel's ranks decides before it runs
the function (the real-kernel tests are in tests/kernel/test_issue30_notices.py)."""

from __future__ import annotations

import pytest

from dist_kernel.rank.accelerate import check_processes, fresh_states


class Borg:
    """accelerate's shared-state pattern (AcceleratorState, GradientState), without accelerate."""

    _shared_state: dict = {}  # shared on purpose, as accelerate's

    def __init__(self, **values: object) -> None:
        self.__dict__ = self._shared_state
        self.__dict__.update(values)


class Descriptor:
    """accelerate's thread-local descriptor (used under torch_xla): a class attribute holding a dict."""

    def __init__(self) -> None:
        self._storage: dict = {}

    def __get__(self, obj: object, objtype: type | None = None) -> dict:
        return self._storage


class XlaBorg(Borg):
    _shared_state = Descriptor()  # type: ignore[assignment]


@pytest.mark.parametrize("cls", [Borg, XlaBorg])
def test_a_launch_starts_from_a_fresh_state_and_the_notebooks_state_comes_back(cls):
    cls._shared_state.clear()
    before = cls(mixed_precision="no")
    with fresh_states(cls):
        assert cls._shared_state == {}  # as in a new process: the launch decides its precision
        inside = cls(mixed_precision="bf16")
        assert before.mixed_precision == "no"  # an Accelerator made before keeps its own
    assert inside.mixed_precision == "bf16"
    assert cls().mixed_precision == "no" and before.mixed_precision == "no"  # later cells: as before


def test_the_state_comes_back_when_the_function_raises():
    Borg._shared_state.clear()
    Borg(mixed_precision="no")
    with pytest.raises(RuntimeError), fresh_states(Borg):
        Borg(mixed_precision="fp16")
        raise RuntimeError("training failed")
    assert Borg().mixed_precision == "no"


@pytest.mark.parametrize(("value", "named"), [("2", "str"), (2.0, "float"), (True, "bool")])
def test_a_process_count_that_is_not_an_int_is_refused_naming_its_type(value, named):
    with pytest.raises(TypeError, match=rf"num_processes must be an int, not {named}\. Fix: num_processes=") as e:
        check_processes(value, 1, 2)
    assert "ranks" not in str(e.value)  # not mistaken for a count that differs


def test_a_node_count_that_is_not_an_int_is_refused_too():
    with pytest.raises(TypeError, match=r"num_nodes must be an int, not str"):
        check_processes(2, "1", 2)
