"""The kernel's own magics (issue 37): one table, held to the README's; a cell's magics run in the
cell's order, then its code, on the ranks they leave; every rank switch is a magic of the kernel,
sent to every rank and never under ``%%rank``. In-process against fake ranks; the real ranks'
side is in tests/kernel/test_respawn.py and tests/kernel/test_frontend.py."""

from __future__ import annotations

import functools
import itertools
import re
from pathlib import Path

import pytest
from fake_ranks import Act, stdout
from inprocess import on_fake_ranks

from dist_kernel.exceptions import UsageError
from dist_kernel.options import OPTION, RANK_SWITCHES
from dist_kernel.parent import magics
from dist_kernel.parent.option_magics import dist_switch

pytestmark = pytest.mark.timeout(60)

README = Path(__file__).parents[2] / "README.md"


def readme_magics() -> set[str]:
    """The magics the README's magics table names in its first column."""
    text = README.read_text()
    section = text.split("\n## Magics\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `%")]
    return {name for row in rows for name in re.findall(r"`(%%?\w+)", row.split(" | ")[0])}


# ------------------------------------------------------------------ the table
def test_the_table_and_the_readmes_magics_table_name_the_same_magics():
    assert readme_magics() == {f"%{name}" for name in magics.MAGICS} | {"%%rank"}


def test_each_magic_is_one_row_with_a_handler_and_one_line_of_help():
    for name, magic in magics.MAGICS.items():
        assert magic.name == name and name.startswith("dist_") and callable(magic.handler)
        assert magic.help and "\n" not in magic.help and len(magic.help) < 120, name


def test_every_rank_switch_is_a_row_made_from_its_option():
    for name in RANK_SWITCHES:
        magic = magics.MAGICS[f"dist_{name}"]
        assert isinstance(magic.handler, functools.partial) and magic.handler.func is dist_switch
        assert magic.handler.args == (name,) and OPTION[name].flag in magic.help


def test_a_cells_first_lines_are_its_magics_in_order_and_the_rest_keeps_its_lines():
    calls, rest = magics.split("%dist_ranks 3\n# a comment\n\n%dist_status\nx = 1\n%dist_top")
    assert calls == [("dist_ranks", "3"), ("dist_status", "")]
    assert rest == "\n# a comment\n\n\nx = 1\n%dist_top"  # below code: the ranks', as in IPython
    assert magics.split("%dist_statusx\n") == ([], "%dist_statusx\n")  # not a magic of the kernel


@pytest.mark.parametrize("cell", ["%%rank 1\n%dist_fastai off", "%%time\n%%rank 0\n  %dist_status",
                                  "%dist_status\n%%rank 1\n# why\n%dist_output rank0\nx = 1"])
def test_a_magic_of_the_kernel_below_a_rank_line_is_refused_before_anything_runs(cell):
    with pytest.raises(UsageError, match=r"the kernel's magics act for every rank, so a %%rank line cannot pick"):
        magics.read(cell)


def test_a_rank_line_below_the_magics_selects_the_ranks_of_the_rest():
    assert magics.read("%dist_ranks 3\n%%rank 2\nprint(rank)") == ([("dist_ranks", "3")], "\n%%rank 2\nprint(rank)")


def test_only_a_cell_of_status_alone_does_not_wait_for_a_rank_being_started_anew():
    assert not magics.waits("%dist_status") and not magics.waits("\n%dist_status\n")
    assert magics.waits("%dist_status\nx = 1") and magics.waits("%dist_status\n%dist_ranks 3")
    assert magics.waits("x = 1") and magics.waits("%dist_top")


# ------------------------------------------------------------------ in the kernel
def said(cell) -> list[str]:
    """What a cell showed, in order: each stream's text, a display's first line."""
    return [c["text"] if t == "stream" else c["data"]["text/plain"].splitlines()[0] for t, c in cell.outputs]


def executed(ranks) -> list[tuple[int, str]]:
    return [(r, c["code"].strip()) for r, t, c, _ in ranks.sent if t == "execute_request"]


def test_dist_ranks_then_dist_status_shows_the_new_ranks_and_the_reverse_the_old():
    async def test(fe, ranks):
        grown = await fe.execute("%dist_ranks 3\n%dist_status")
        assert grown.status == "ok" and ranks.events == ["resize 2 -> 3"]
        assert "now 3 ranks" in said(grown)[0] and said(grown)[1].startswith("3 ranks, backend gloo")
        shrunk = await fe.execute("%dist_status\n%dist_ranks 2")
        assert said(shrunk)[0].startswith("3 ranks, backend gloo") and "now 2 ranks" in said(shrunk)[1]
        assert executed(ranks) == []  # magics alone: nothing went to the ranks

    on_fake_ranks(test)


#: two magics' calls and the first words each says: every ordering of two runs in the cell's order
SAYS = {"%dist_top off": "dist_top: off", "%dist_output all": "rich output from: all",
        "%dist_empty_cache on": "empty_cache: on on every rank", "%dist_ranks": "2 ranks",
        "%dist_debug": "debugger: rank 0", "%dist_status": "2 ranks, backend gloo"}


def test_each_ordering_of_two_magics_in_a_cell_runs_in_the_cells_order():
    async def test(fe, ranks):
        for first, second in itertools.permutations(SAYS, 2):
            cell = await fe.execute(f"{first}\n{second}")
            shown = said(cell)
            assert cell.status == "ok" and len(shown) == 2, (first, second, shown)
            assert shown[0].startswith(SAYS[first]) and shown[1].startswith(SAYS[second]), (first, second, shown)

    on_fake_ranks(test)


def test_the_code_below_dist_ranks_runs_on_the_ranks_it_leaves():
    async def test(fe, ranks):
        cell = await fe.execute("%dist_ranks 3\nprint(rank)")
        assert [r for r, _ in executed(ranks)] == [0, 1, 2]
        resized, printed = cell.stream().split("\n", 1)
        assert "now 3 ranks" in resized and printed == "[rank 0] 0\n[rank 1] 1\n[rank 2] 2\n"
        ranks.sent.clear()
        one = await fe.execute("%dist_status\n%%rank 2\nprint(rank)")
        assert one.status == "ok" and [r for r, _ in executed(ranks)] == [2] and one.stream() == "2\n"

    on_fake_ranks(test, lambda rank, code: Act(out=[stdout(f"{rank}\n")]))


def test_the_first_magic_that_fails_ends_the_cell_before_the_next_and_the_code():
    async def test(fe, ranks):
        cell = await fe.execute("%dist_output maybe\n%dist_status\nprint(1)")
        assert cell.status == "error" and cell.errors[0]["ename"] == "UsageError"
        assert [t for t, _ in cell.outputs] == ["error"] and executed(ranks) == []

    on_fake_ranks(test)


# ------------------------------------------------------------------ the rank switches
def test_a_switch_goes_to_every_rank_and_stays_the_kernels_option():
    async def test(fe, ranks):
        off = await fe.execute("%dist_fastai off")
        assert off.status == "ok" and off.stream() == "fastai: off on every rank\n"
        assert ranks.options == [("fastai", False)] and not ranks.config.fastai
        assert (await fe.execute("%dist_fastai")).stream() == "fastai: off on every rank\n"
        assert (await fe.execute("%dist_fastai ON  # again")).stream() == "fastai: on on every rank\n"
        assert ranks.options == [("fastai", False), ("fastai", True)] and executed(ranks) == []

    on_fake_ranks(test)


def test_a_switch_under_a_rank_line_is_refused_and_no_rank_is_switched():
    async def test(fe, ranks):
        cell = await fe.execute("%%rank 1\n%dist_fastai off")
        assert cell.status == "error" and cell.errors[0]["ename"] == "UsageError"
        assert "%dist_fastai under `%%rank 1`" in cell.errors[0]["evalue"]
        assert ranks.options == [] and executed(ranks) == []

    on_fake_ranks(test)


def test_a_bad_word_names_the_two_good_ones():
    async def test(fe, ranks):
        cell = await fe.execute("%dist_hf maybe")
        assert cell.errors[0]["evalue"] == ("%dist_hf 'maybe': use `%dist_hf on` or `%dist_hf off` (Hugging Face "
                                            "integration inside the ranks).")
        assert ranks.options == []

    on_fake_ranks(test)


def test_an_integration_the_kernel_started_without_cannot_be_switched_on_but_cache_freeing_can():
    async def test(fe, ranks):
        cell = await fe.execute("%dist_lightning on")
        assert cell.status == "error" and "started with --lightning off" in cell.errors[0]["evalue"]
        assert "Restart the kernel with --lightning on (DIST_KERNEL_LIGHTNING=on)" in cell.errors[0]["evalue"]
        assert ranks.options == []
        assert (await fe.execute("%dist_lightning off")).status == "ok"
        assert (await fe.execute("%dist_empty_cache on")).stream() == "empty_cache: on on every rank\n"
        assert ranks.options == [("lightning", False), ("empty_cache", True)]

    on_fake_ranks(test, lightning=False, empty_cache=False)


def test_a_rank_that_does_not_confirm_is_named_with_the_fix():
    async def test(fe, ranks):
        async def one_silent(name, on):
            return [1]

        ranks.set_option = one_silent
        cell = await fe.execute("%dist_empty_cache off")
        assert cell.errors[0]["ename"] == "RankRequestError"
        assert cell.errors[0]["evalue"] == ("rank 1 did not confirm %dist_empty_cache off, so the ranks may disagree; "
                                            "run `%dist_empty_cache off` again, or restart the kernel.")

    on_fake_ranks(test)
