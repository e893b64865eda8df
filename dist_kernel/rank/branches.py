"""Runs inside each rank: is the output being made now inside a branch on the rank?

Output that a cell makes under ``if rank == 0:`` (or ``if accelerator.is_main_process:``,
``if trainer.is_global_zero:``, a ``@rank_zero_only`` function ...) is, by the code's own
word, the rank's alone: the other ranks never make its twin. The parent would otherwise hold
it for a while, in case the other ranks, still running the cell and silent, merely lag
(:data:`dist_kernel.parent.merge.LAG_BOUND`). Marked, it waits no longer than the merge
window, like output of a rank alone (issue 19).

The check reads the source of the cells on the stack (IPython keeps it in ``linecache``): a
frame of a cell's code whose current line lies in the body or ``else`` of an ``if`` whose
test names the rank, or in a function decorated as rank-only. Each cell's source is parsed
once. Library frames are skipped, so ``if rank == 0: learn.show_results()`` counts too.
"""

from __future__ import annotations

import ast
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

_NOTHING: frozenset[int] = frozenset()
#: cell file -> (the linecache lines it was parsed from, the lines inside a branch on the rank)
_parsed: dict[str, tuple[object, frozenset[int]]] = {}
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


def _span(nodes: list[ast.stmt] | ast.expr) -> range:
    if isinstance(nodes, ast.expr):
        return range(nodes.lineno, (nodes.end_lineno or nodes.lineno) + 1)
    if not nodes:
        return range(0)
    return range(nodes[0].lineno, (nodes[-1].end_lineno or nodes[-1].lineno) + 1)


def _decorator_name(node: ast.expr) -> str:
    node = node.func if isinstance(node, ast.Call) else node
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def branch_lines(source: str) -> frozenset[int]:
    """The lines of ``source`` that run only on some ranks, as its code says."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):  # IPython syntax the transformer left: nothing to say
        return _NOTHING
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While)) and _names(node.test):
            lines.update(_span(node.body))
            lines.update(_span(node.orelse))
        elif isinstance(node, ast.IfExp) and _names(node.test):
            lines.update(_span(node.body))
            lines.update(_span(node.orelse))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
                _decorator_name(d) in RANK_ONLY_DECORATORS for d in node.decorator_list):
            lines.update(_span(node.body))
    return frozenset(lines)


def _lines_of(filename: str) -> frozenset[int]:
    entry = linecache.cache.get(filename)
    if entry is None or len(entry) < 3:
        return _NOTHING
    source = entry[2]
    known = _parsed.get(filename)
    if known is not None and known[0] is source:
        return known[1]
    found = branch_lines("".join(source))
    _parsed[filename] = (source, found)
    return found


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
            lines = _lines_of(filename)
            if lines and frame.f_lineno in lines:
                return True
        frame = frame.f_back
        depth += 1
    return False
