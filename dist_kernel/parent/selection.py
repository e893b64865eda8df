"""Which ranks run a cell: the ``%%rank`` line, and rank lists as users write and read them.

``%%rank SPEC`` on a cell's first line selects the ranks that run the rest of the cell.
SPEC is ``all``, a rank (``0``), a list (``0,2``), a range (``1-3``), a mix (``0,2-3``),
optionally in brackets (``[0,1]``), and may end in a ``# comment``. Ranks are ASCII digits
(``１``, a full-width digit, is refused: Python's ``int`` would take it, a reader would not).
Below other cell magics (``%%time`` then ``%%rank 0``) it selects the ranks the same way: the
ranks run the cell with the other magics, as if ``%%rank`` were first.

The kernel's own line magics (``%dist_status``, ...) are read off a cell before this, by
:mod:`dist_kernel.parent.magics`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dist_kernel.exceptions import RankSpecError

_RANK_LINE = re.compile(r"^\s*%%rank(?:\s+(?P<spec>.*?))?\s*$")
_PIECE = re.compile(r"^([0-9]+)(?:\s*-\s*([0-9]+))?$")  # not \d: it matches every script's digits
_CELL_MAGIC = re.compile(r"^\s*%%\w")


@dataclass(frozen=True)
class CellPlan:
    """Which ranks run which code."""

    ranks: tuple[int, ...]
    code: str
    selected: bool  # True when the cell named its ranks with %%rank


def parse_rank_spec(spec: str, world_size: int, magic: str = "%%rank") -> tuple[int, ...]:
    """Parse a rank selection into sorted rank ids, validating against the world size; errors
    name ``magic``, the magic that was given the selection (``%dist_respawn 7``)."""
    text = spec.split("#", 1)[0].strip()  # `%%rank 0  # the logger`: a comment, as in Python
    hint = (f"This kernel has ranks 0-{world_size - 1}; write e.g. `{magic} all`, `{magic} 0`, "
            f"`{magic} 0,{world_size - 1}` or `{magic} 0-{world_size - 1}`.")
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1].strip()
    if not text:
        raise RankSpecError(f"{magic} needs a rank selection. {hint}")
    if text.lower() == "all":
        return tuple(range(world_size))
    ranks: set[int] = set()
    for piece in text.split(","):
        m = _PIECE.match(piece.strip())
        if not m:
            raise RankSpecError(f"{magic} {spec.strip()!r}: cannot parse {piece.strip()!r}. {hint}")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise RankSpecError(f"{magic} {spec.strip()!r}: range {lo}-{hi} runs backwards. {hint}")
        if hi >= world_size:
            # checked before the range is built: `0-100000000000` must not allocate its ranks
            missing = f"{max(lo, world_size)}-{hi}" if hi > max(lo, world_size) else str(hi)
            raise RankSpecError(f"{magic} {spec.strip()!r}: rank {missing} does not exist; {hint}")
        ranks.update(range(lo, hi + 1))
    return tuple(sorted(ranks))


def rank_line(lines: list[str]) -> int | None:
    """The index of the ``%%rank`` line among a cell's leading cell magics (blank lines before
    them allowed), or None. Each cell magic's body starts with the next, so ``%%rank`` may be any
    of them (``%%time`` then ``%%rank 0``: rank 0 times the rest)."""
    i = next((i for i, line in enumerate(lines) if line.strip()), len(lines))
    while i < len(lines) and _CELL_MAGIC.match(lines[i]):
        if _RANK_LINE.match(lines[i]):
            return i
        i += 1
    return None


def plan_cell(code: str, world_size: int) -> CellPlan:
    """The ranks a cell's ``%%rank`` line selects (every rank without one), and the code they run."""
    lines = code.split("\n")
    i = rank_line(lines)
    if i is None:
        return CellPlan(ranks=tuple(range(world_size)), code=code, selected=False)
    m = _RANK_LINE.match(lines[i])
    assert m is not None  # rank_line found it
    ranks = parse_rank_spec(m.group("spec") or "", world_size)
    first = next(n for n, line in enumerate(lines) if line.strip())
    # keep line numbers and cursor offsets right: the magic line becomes a comment of the
    # same length. A blank line would be dropped by IPython's leading_empty_lines (every
    # line number one off), and with the debugger on, which keeps that line, IPython's
    # leading_indent would strip its width of spaces from the lines below it. Above
    # another cell magic it is blanked, as that magic must come first.
    above_magic = i + 1 < len(lines) and lines[i + 1].lstrip().startswith("%%")
    body = "\n".join(" " * len(line) if n < first or (n == i and above_magic)
                     else _as_comment(line) if n == i else line for n, line in enumerate(lines))
    return CellPlan(ranks=ranks, code=body, selected=True)


def _as_comment(line: str) -> str:
    """A ``%%rank`` line as a comment of the same length (``%%rank 0`` -> ``# rank 0``)."""
    return line.replace("%%", "# ", 1)


def format_ranks(ranks: list[int] | tuple[int, ...]) -> str:
    """Compact form of a rank list: ``[0, 1, 2, 5]`` -> ``0-2,5``."""
    out: list[str] = []
    ordered = sorted(set(ranks))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        if j - i >= 2:
            out.append(f"{ordered[i]}-{ordered[j]}")
        else:
            out.extend(str(r) for r in ordered[i:j + 1])
        i = j + 1
    return ",".join(out)
