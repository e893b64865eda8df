"""Issue 30, on a real kernel (real ipykernel ranks, real gloo): displays whose id IPython makes
up (``display(x, display_id=True)``) are one display however many ranks make them, and a rank
conditional inside a line does not make the rest of the line one rank's."""

from __future__ import annotations

import pytest
from harness import Result, kernel_for_module, visible

pytestmark = pytest.mark.slow

PROGRESS = "h = display('step 0', display_id=True)\nfor i in range(1, 4):\n    h.update(f'step {i}')"


@pytest.fixture(scope="module")
def k4():
    yield from kernel_for_module("--ranks", "4")  # the default merge window: nothing hides a split


@pytest.fixture(scope="module")
def k2():
    yield from kernel_for_module("--ranks", "2")


def shown(res: Result) -> str:
    return visible([(o.msg_type, o.content) for o in res.outputs])


def ids_of(res: Result) -> set[str]:
    return {o.content["transient"]["display_id"] for o in res.outputs if o.msg_type.endswith("display_data")}


def test_a_display_with_a_generated_id_and_its_updates_show_once_unlabelled_at_4_ranks(k4):
    res = k4.execute(PROGRESS)
    assert res.status == "ok"
    assert len(res.of_type("display_data")) == 1
    updates = res.of_type("update_display_data")
    assert 1 <= len(updates) <= 3 and {o.msg_type for o in res.outputs} == {"display_data", "update_display_data"}
    assert not [o.text for o in res.outputs if "[rank" in o.text]
    assert shown(res) == "'step 3'\n"
    (display_id,) = ids_of(res)
    # every rank's handle names the display the frontend has (the parent kept the ranks' own id)
    assert k4.execute("print(h.display_id)").stream() == display_id + "\n"
    later = k4.execute("h.update('done')")  # a later cell updates it in place, once
    assert [(o.msg_type, o.text) for o in later.outputs] == [("update_display_data", "'done'")]
    assert ids_of(later) == {display_id}


def test_the_same_cell_again_makes_another_display(k4):
    first, second = k4.execute(PROGRESS), k4.execute(PROGRESS)
    assert len(ids_of(first)) == len(ids_of(second)) == 1 and ids_of(first) != ids_of(second)
    assert shown(second) == "'step 3'\n"


def test_a_display_made_on_rank_0_only_does_not_split_the_ones_every_rank_makes(k4):
    res = k4.execute("if rank == 0:\n    display('mine', display_id=True)\n" + PROGRESS)
    assert res.status == "ok"
    shared = [o for o in res.outputs if "step" in o.text]
    # one display for every rank's progress: rank 0's extra display did not shift its id
    assert len([o for o in shared if o.msg_type == "display_data"]) == 1 and len(ids_of(Result({}, shared))) == 1
    assert not [o.text for o in shared if o.msg_type == "update_display_data" and "[rank" in o.text]
    assert shown(res).splitlines()[-1] == "'step 3'"


def test_a_rank_conditional_inside_a_line_leaves_the_rest_of_the_line_merged(k2):
    res = k2.execute('import time\nprint("a"); time.sleep(2 if rank == 1 else 0); print("b")')
    assert res.status == "ok"
    assert res.stream() == "a\nb\n"
