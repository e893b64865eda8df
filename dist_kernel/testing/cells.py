"""The cell language of a stub rank: a few Python-looking statements, read with :mod:`ast`,
never executed.

Each statement is one step:

- ``print(rank)``, ``print(world_size)``, ``print(1)``, ``print("text")``: one stdout line
  (``rank`` and ``world_size`` are the stub rank's own);
- ``sleep(0.5)`` or ``time.sleep(0.5)``: wait (the stop button ends the wait);
- ``fail_on(3)`` (or ``fail_on(3, 5)``): those ranks raise ``StubError`` naming themselves;
- ``die_on(7)``: those ranks' processes exit (code 1), as a crashed rank would;
- assignments of constants (``x = 1``), imports, ``pass``: nothing.

Anything else is a ``StubError`` on every rank, so a test that strays from the language says so.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

#: names a stub rank knows besides constants
_NAMES = ("rank", "world_size")


class CellError(ValueError):
    """A statement outside the stub's language."""


@dataclass(frozen=True)
class Step:
    """One step of a cell: ``kind`` is ``print`` (``text``), ``sleep`` (``seconds``),
    ``fail`` or ``die`` (on ``ranks``)."""

    kind: str
    text: str = ""
    seconds: float = 0.0
    ranks: tuple[int, ...] = ()


def parse(code: str) -> list[Step]:
    """The steps of a cell, for any rank; raises :class:`CellError` naming what is not understood."""
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        raise CellError(f"not Python: {e.msg} (line {e.lineno})") from None
    steps: list[Step] = []
    for stmt in tree.body:
        if isinstance(stmt, (ast.Import, ast.ImportFrom, ast.Pass)):
            continue
        if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant):
            continue
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
            steps.append(_call(stmt.value))
            continue
        raise CellError(f"a stub rank does not run {ast.unparse(stmt)!r}")
    return steps


def _call(call: ast.Call) -> Step:
    func = ast.unparse(call.func)
    args = [_value(a) for a in call.args]
    if func == "print":
        return Step("print", text=" ".join(str(a) for a in args))
    if func in ("sleep", "time.sleep") and len(args) == 1 and isinstance(args[0], (int, float)):
        return Step("sleep", seconds=float(args[0]))
    ranks = tuple(a for a in args if isinstance(a, int))
    if func in ("fail_on", "die_on") and args and len(ranks) == len(args):
        return Step(func.removesuffix("_on"), ranks=ranks)
    raise CellError(f"a stub rank does not run {ast.unparse(call)!r}")


def _value(node: ast.expr) -> object:
    """A constant, or a marker for a rank's own value (filled in per rank by :func:`text_for`:
    one parse serves every rank of a node)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _MARK + node.id
    raise CellError(f"a stub rank knows only constants, rank and world_size, not {ast.unparse(node)!r}")


#: starts a marker of a rank's own value in a print step's text
_MARK = "\0"


def text_for(step: Step, rank: int, world_size: int) -> str:
    """A print step's line on rank ``rank``."""
    return step.text.replace(_MARK + "rank", str(rank)).replace(_MARK + "world_size", str(world_size)) + "\n"
