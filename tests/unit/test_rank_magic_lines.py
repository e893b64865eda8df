"""Issue 30, section 6: where ``%%rank`` may stand, comments after it, and which digits it takes."""

from __future__ import annotations

import pytest

from dist_kernel.exceptions import RankSpecError
from dist_kernel.parent.selection import parse_rank_spec, plan_cell


@pytest.mark.parametrize("line", ["%%rank 0 # the logger", "%%rank 0# the logger", "%%rank [0, 1]  # both",
                                  "%%rank all # every rank"])
def test_a_comment_after_the_selection_is_a_comment(line):
    plan = plan_cell(line + "\nx = 1", 2)
    assert plan.selected and plan.ranks == ((0,) if "0 #" in line or "0#" in line else (0, 1))


def test_a_comment_alone_is_no_selection():
    with pytest.raises(RankSpecError, match="needs a rank selection"):
        plan_cell("%%rank # which?\nx = 1", 2)


@pytest.mark.parametrize("spec", ["１", "0-１", "٠", "0,１"])
def test_digits_of_other_scripts_are_refused(spec):
    with pytest.raises(RankSpecError, match="cannot parse"):
        parse_rank_spec(spec, 2)


def test_rank_below_another_cell_magic_selects_the_ranks_and_keeps_the_magic_first():
    plan = plan_cell("%%time\n%%rank 1\nx = 1", 2)
    assert plan.selected and plan.ranks == (1,)
    lines = plan.code.split("\n")
    assert lines[0] == "%%time" and lines[1] == "# rank 1" and lines[2] == "x = 1"
    assert len(plan.code) == len("%%time\n%%rank 1\nx = 1")  # cursor offsets stay right


def test_rank_among_several_cell_magics_and_after_blank_lines():
    plan = plan_cell("\n%%capture out\n%%time\n%%rank 0-1\nprint(1)", 3)
    assert plan.ranks == (0, 1)
    assert [line.strip() for line in plan.code.split("\n")] == ["", "%%capture out", "%%time", "# rank 0-1",
                                                                  "print(1)"]


def test_the_rank_line_becomes_a_comment_so_no_transform_drops_it_or_dedents_the_code():
    # a blank line would be dropped (line numbers one off) or, with the debugger on, taken as the
    # indentation to strip from the lines below it
    plan = plan_cell("%%rank 0\nfor i in range(2):\n    if i:\n        print(i)", 2)
    assert plan.code == "# rank 0\nfor i in range(2):\n    if i:\n        print(i)"


def test_a_rank_line_inside_the_code_is_the_codes():
    plan = plan_cell("%%time\nx = 1\n%%rank 0", 2)
    assert not plan.selected and plan.code == "%%time\nx = 1\n%%rank 0"


def test_a_rank_line_above_another_cell_magic_is_blanked_so_that_magic_comes_first():
    plan = plan_cell("%%rank 0 # the logger\n%%time\nx = 1", 2)
    assert plan.ranks == (0,)
    assert plan.code.split("\n")[1:] == ["%%time", "x = 1"] and not plan.code.split("\n")[0].strip()
