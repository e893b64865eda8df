"""Runs inside each rank: is the output being made now inside a branch on the rank?

Output that a cell makes under ``if rank == 0:`` (or ``if accelerator.is_main_process:``,
``if trainer.is_global_zero:``, a ``@rank_zero_only`` function ...) is, by the code's own
word, the rank's alone: the other ranks never make its twin. The parent would otherwise hold
it for a while, in case the other ranks, still running the cell and silent, merely lag
(:data:`dist_kernel.parent.merge.LAG_BOUND`). Marked, it waits no longer than the merge
window, like output of a rank alone (issue 19).

The check reads the source of the cells on the stack (IPython keeps it in ``linecache``): a
frame of a cell's code whose current instruction lies in the body or ``else`` of an ``if`` whose
test names the rank, in a branch of a conditional expression that does, or in a function
decorated as rank-only. Where the instruction is comes from its columns (``co_positions`` at
the frame's ``f_lasti``), not only its line: in ``print("a"); time.sleep(2 if rank == 3 else 0)``
the ``print`` is every rank's, although its line holds a branch on the rank (issue 30). Each
cell's source is parsed once. Library frames are skipped, so ``if rank == 0:
learn.show_results()`` counts too.
"""

from __future__ import annotations

import ast
import itertools
import linecache
from types import CodeType, FrameType

#: names that say "which rank": in a test, they make an ``if`` a branch on the rank
RANK_NAMES = frozenset({
    "rank", "local_rank", "global_rank", "node_rank", "get_rank", "get_local_rank", "get_global_rank",
    "rank_distrib", "process_index", "local_process_index", "is_main_process", "is_local_main_process",
    "is_global_zero", "is_local_zero", "is_world_process_zero", "is_local_process_zero", "is_rank_zero",
    "is_main", "is_master", "main_process", "master_process", "RANK", "LOCAL_RANK",
})
#: decorators that run a function on one rank only (Lightning, accelerate, our users' own)
RANK_ONLY_DECORATORS = frozenset({"rank_zero_only", "main_process_only", "on_main_process",
                                  "on_local_main_process", "on_process", "on_local_process"})

#: a stretch of a cell's source: (first line, its column, last line, the column after its end),
#: lines from 1 and columns in UTF-8 bytes, as both ``ast`` and ``co_positions`` count them
Span = tuple[int, int, int, int]


class Branches:
    """The stretches of a cell's source that run only on some ranks, as its code says."""

    __slots__ = ("lines", "spans")

    def __init__(self, spans: tuple[Span, ...] = ()) -> None:
        self.spans = spans
        #: every line a span touches: most lines touch none, and need no columns
        self.lines = frozenset(line for s in spans for line in range(s[0], s[2] + 1))

    def holds(self, lineno: int, col: int, end_lineno: int, end_col: int) -> bool:
        """Does a span hold the whole stretch (an instruction's position)?"""
        return any((s[0], s[1]) <= (lineno, col) and (end_lineno, end_col) <= (s[2], s[3]) for s in self.spans)


_NOTHING = Branches()
#: cell file -> (the linecache lines it was parsed from, its branches on the rank)
_parsed: dict[str, tuple[object, Branches]] = {}
_state: dict[str, object] = {"prefix": None, "stop": None}


def configure(cell_prefix: str, stop: CodeType | None) -> None:
    """Cells are compiled to files under ``cell_prefix``; the walk up the stack ends at the
    frame running ``stop`` (the shell's ``run_code``: what is above it is the kernel's)."""
    _state["prefix"] = cell_prefix
    _state["stop"] = stop


def _names(node: ast.AST) -> bool:
    """Does ``node`` name the rank (a name, attribute, call or ``os.environ["RANK"]``)?"""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id in RANK_NAMES:
            return True
        if isinstance(sub, ast.Attribute) and sub.attr in RANK_NAMES:
            return True
        if isinstance(sub, ast.Constant) and sub.value in ("RANK", "LOCAL_RANK"):
            return True
    return False


def _span(nodes: list[ast.stmt] | ast.expr) -> list[Span]:
    """The stretch a branch's statements (or expression) cover; none for an empty one."""
    if isinstance(nodes, ast.expr):
        nodes = [nodes]  # type: ignore[list-item]
    if not nodes:
        return []
    first, last = nodes[0], nodes[-1]
    end_line = last.end_lineno if last.end_lineno is not None else last.lineno
    end_col = last.end_col_offset if last.end_col_offset is not None else 1 << 30
    return [(first.lineno, first.col_offset, end_line, end_col)]


def _decorator_name(node: ast.expr) -> str:
    node = node.func if isinstance(node, ast.Call) else node
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def branch_spans(source: str) -> Branches:
    """The stretches of ``source`` that run only on some ranks, as its code says."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # IPython syntax the transformer left: nothing to say
        return _NOTHING
    spans: list[Span] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.IfExp)) and _names(node.test):
            spans += _span(node.body)
            spans += _span(node.orelse)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                _decorator_name(d) in RANK_ONLY_DECORATORS for d in node.decorator_list):
            spans += _span(node.body)
    return Branches(tuple(spans)) if spans else _NOTHING


def branch_lines(source: str) -> frozenset[int]:
    """The lines of ``source`` that hold code which runs only on some ranks."""
    return branch_spans(source).lines


def _branches_of(filename: str) -> Branches:
    entry = linecache.cache.get(filename)
    if entry is None or len(entry) < 3:
        return _NOTHING
    source = entry[2]
    known = _parsed.get(filename)
    if known is not None and known[0] is source:
        return known[1]
    found = branch_spans("".join(source))
    _parsed[filename] = (source, found)
    return found


def _in_branch(frame: FrameType, found: Branches) -> bool:
    """Is the instruction ``frame`` runs (or the call it waits in) inside one of ``found``?"""
    co_positions = getattr(frame.f_code, "co_positions", None)  # Python 3.11+
    if co_positions is None or frame.f_lasti < 0:  # no columns to judge by: its line says
        return True
    # one entry per 2-byte code unit; f_lasti is the byte offset of the instruction running
    positions = next(itertools.islice(co_positions(), frame.f_lasti // 2, None), None)
    if positions is None or None in positions:
        return True
    lineno, end_lineno, col, end_col = positions
    return found.holds(lineno, col, end_lineno, end_col)


def in_rank_branch(frame: FrameType | None) -> bool:
    """Is ``frame``, or a frame of a cell's code that called it, inside a branch on the rank?"""
    prefix, stop = _state["prefix"], _state["stop"]
    if not prefix:
        return False
    depth = 0
    while frame is not None and depth < 200:  # deep recursion: give up rather than walk it all
        code = frame.f_code
        if code is stop:
            return False
        filename = code.co_filename
        if filename.startswith(prefix):  # type: ignore[arg-type]
            found = _branches_of(filename)
            if frame.f_lineno in found.lines and _in_branch(frame, found):
                return True
        frame = frame.f_back
        depth += 1
    return False
