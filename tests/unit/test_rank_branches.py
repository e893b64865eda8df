"""Which output a rank marks as made in a branch on the rank (issue 19: such output is not held
for ranks that may merely lag). Pure: real frames of code compiled under a cell prefix."""

from __future__ import annotations

import linecache
import sys
import textwrap

import pytest

from dist_kernel.rank import branches

PREFIX = "/tmp/ipykernel_test_branches/"


def lines_of(src: str) -> set[int]:
    return set(branches.branch_lines(textwrap.dedent(src)))


@pytest.mark.parametrize("test", [
    "rank == 0", "local_rank == 0", "dist.get_rank() == 0", "accelerator.is_main_process",
    "trainer.is_global_zero", "self.trainer.is_global_zero", "int(os.environ['RANK']) == 0",
    "rank_distrib() == 0", "args.local_rank in (-1, 0)", "rank % 2", "not state.is_local_main_process",
])
def test_an_if_whose_test_names_the_rank_is_a_branch_on_the_rank(test):
    assert lines_of(f"x = 1\nif {test}:\n    print('a')\n    print('b')\nprint('c')\n") == {3, 4}


@pytest.mark.parametrize("test", ["world_size > 1", "epoch % 10 == 0", "verbose", "device.type == 'cuda'"])
def test_an_if_on_anything_else_is_not(test):
    assert lines_of(f"if {test}:\n    print('a')\n") == set()


def test_the_else_and_elif_branches_of_such_an_if_are_branches_too():
    src = """\
    if rank == 0:
        print('a')
    elif verbose:
        print('b')
    else:
        print('c')
    print('d')
    """
    assert lines_of(src) == {2, 3, 4, 5, 6}


def test_a_conditional_expression_and_a_rank_only_decorator_count():
    assert lines_of("print('x') if rank == 0 else None\n") == {1}
    src = """\
    @rank_zero_only
    def log(msg):
        print(msg)
    log('hi')
    """
    assert lines_of(src) == {3}


def test_a_function_defined_in_a_cell_with_the_branch_inside_it():
    src = """\
    def log(msg):
        if dist.get_rank() == 0:
            print(msg)
    """
    assert lines_of(src) == {3}


def test_code_that_does_not_parse_says_nothing():
    assert lines_of("!ls\nif rank == 0:\n    print(1)\n") == set()


@pytest.fixture
def cells():
    """Compile cells as the rank kernel does: a file under the prefix, its source in linecache."""
    branches.configure(PREFIX, None)
    made: list[str] = []

    def cell(name: str, src: str, ns: dict) -> None:
        src = textwrap.dedent(src)
        filename = PREFIX + name
        linecache.cache[filename] = (len(src), None, src.splitlines(keepends=True), filename)
        made.append(filename)
        exec(compile(src, filename, "exec"), ns)

    yield cell
    for f in made:
        linecache.cache.pop(f, None)
    branches.configure("", None)


def where_called() -> bool:
    """What the rank's stdout asks when it is written to (the writer's frame and those above)."""
    return branches.in_rank_branch(sys._getframe(1))


def library_call(fn):
    """A frame that is not a cell's, between the cell and the output (fastai, matplotlib ...)."""
    return fn()


def test_a_write_from_inside_the_branch_is_marked_and_one_outside_is_not(cells):
    ns = {"where_called": where_called, "rank": 0, "seen": []}
    cells("a.py", """\
    seen.append(where_called())
    if rank == 0:
        seen.append(where_called())
    seen.append(where_called())
    """, ns)
    assert ns["seen"] == [False, True, False]


def test_the_branch_may_be_in_an_outer_cell_frame_past_library_frames(cells):
    ns = {"where_called": where_called, "library_call": library_call, "rank": 0, "seen": []}
    cells("b.py", "def report():\n    seen.append(where_called())\n", ns)
    cells("c.py", """\
    library_call(report)
    if rank == 0:
        library_call(report)
    """, ns)
    assert ns["seen"] == [False, True]


def test_the_walk_stops_at_the_kernels_own_frame(cells):
    ns = {"where_called": where_called, "rank": 0, "seen": []}
    cells("d.py", "def inner():\n    seen.append(where_called())\n", ns)

    def kernel_frame():  # stands for the shell's run_code: what is above it is not the cell's
        ns["inner"]()

    cells("e.py", "if rank == 0:\n    kernel_frame()\n", {**ns, "kernel_frame": kernel_frame})
    assert ns["seen"] == [True]
    branches.configure(PREFIX, kernel_frame.__code__)
    cells("f.py", "if rank == 0:\n    kernel_frame()\n", {**ns, "kernel_frame": kernel_frame})
    assert ns["seen"] == [True, False]


def test_a_branch_is_judged_by_columns_not_by_the_line_it_is_on(cells):
    """Issue 30: a rank conditional on the line must not make the rest of the line the rank's."""
    ns = {"where_called": where_called, "rank": 0, "seen": [], "pause": lambda s: None}
    cells("g.py", "seen.append(where_called()); pause(2 if rank == 3 else 0); seen.append(where_called())\n", ns)
    assert ns["seen"] == [False, False]
    cells("h.py", "seen.append(where_called()); seen.append(where_called()) if rank == 0 else None\n", ns)
    assert ns["seen"] == [False, False, False, True]
    cells("i.py", "if rank == 0: seen.append(where_called())\nseen.append(where_called())\n", ns)
    assert ns["seen"][-2:] == [True, False]


def test_a_call_in_the_branch_of_a_conditional_expression_is_the_ranks(cells):
    ns = {"where_called": where_called, "rank": 0, "seen": [], "log": lambda x: None}
    cells("j.py", "log(where_called() if rank == 0 else None); log(seen.append(where_called()))\n", ns)
    ns2 = {**ns, "log": lambda x: ns["seen"].append(x)}
    cells("k.py", "log(where_called() if rank == 0 else None)\n", ns2)
    assert ns["seen"] == [False, True]


def test_a_branch_spanning_lines_holds_what_is_on_them_and_only_that():
    found = branches.branch_spans("a(); b = (c() if rank == 0\n     else d()); e()\n")
    assert found.lines == {1, 2}
    assert found.holds(1, 10, 1, 13)  # c()
    assert found.holds(2, 10, 2, 13)  # d()
    assert not found.holds(1, 0, 1, 3)  # a()
    assert not found.holds(2, 16, 2, 19)  # e()
    assert not found.holds(1, 10, 2, 13)  # the whole conditional expression
