"""Magics the parent understands before a cell reaches the ranks.

``%%rank SPEC`` on a cell's first line selects the ranks that run the rest of the cell.
SPEC is ``all``, a rank (``0``), a list (``0,2``), a range (``1-3``), a mix (``0,2-3``),
optionally in brackets (``[0,1]``), and may end in a ``# comment``. Ranks are ASCII digits
(``１``, a full-width digit, is refused: Python's ``int`` would take it, a reader would not).
Below other cell magics (``%%time`` then ``%%rank 0``) it selects the ranks the same way: the
ranks run the cell with the other magics, as if ``%%rank`` were first.

Line magics the parent answers itself, on a cell's leading lines:

- ``%dist_status``: per rank its pid, host, device, busy/idle and memory;
- ``%dist_output all|rank0``: rich output from every rank (merged) or from rank 0 only
  (starts as the kernel's ``--rich-output``);
- ``%dist_empty_cache on|off``: free the CUDA cache after each cell (starts as ``--empty-cache``).
- ``%dist_debug N|off``: JupyterLab's debugger debugs rank N (rank 0 at start), or no rank;
  alone, it says which (:mod:`dist_kernel.parent.debugger`).
- ``%dist_top`` / ``%dist_top off``: a live table of each rank's state and load while cells run
  (:mod:`dist_kernel.parent.top`).
- ``%dist_respawn [SPEC]``, ``%dist_ranks [N]``, ``%dist_sync NAME [NAME ...] [--from R]``: start
  dead ranks anew, change the rank count in place, copy variables from one rank to the others
  (:mod:`dist_kernel.parent.group_magics`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from dist_kernel.exceptions import RankSpecError

_RANK_LINE = re.compile(r"^\s*%%rank(?:\s+(?P<spec>.*?))?\s*$")
_PIECE = re.compile(r"^([0-9]+)(?:\s*-\s*([0-9]+))?$")  # not \d: it matches every script's digits
_CELL_MAGIC = re.compile(r"^\s*%%\w")


PARENT_MAGICS = ("dist_status", "dist_output", "dist_empty_cache", "dist_debug", "dist_top", "dist_respawn",
                 "dist_ranks", "dist_sync")
_PARENT_LINE = re.compile(r"^\s*%(?P<name>" + "|".join(PARENT_MAGICS) + r")\b(?P<arg>.*)$")


@dataclass(frozen=True)
class CellPlan:
    """What the parent does with one cell: which ranks run which code."""

    ranks: tuple[int, ...]
    code: str
    selected: bool  # True when the cell named its ranks with %%rank
    magics: tuple[tuple[str, str], ...] = ()  # parent line magics, (name, argument)


def split_parent_magics(code: str) -> tuple[list[tuple[str, str]], str]:
    """Take the parent's line magics off the top of a cell (lines stay, blanked)."""
    lines = code.split("\n")
    found: list[tuple[str, str]] = []
    for i, line in enumerate(lines):
        m = _PARENT_LINE.match(line)
        if m:
            found.append((m.group("name"), m.group("arg").strip()))
            lines[i] = ""
        elif line.strip() and not line.lstrip().startswith("#"):
            break
    return found, "\n".join(lines) if found else code


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


def plan_cell(code: str, world_size: int) -> CellPlan:
    """Split off a leading ``%%rank`` line (blank lines before it allowed) or parent magics."""
    magics, rest = split_parent_magics(code)
    if magics:
        return CellPlan(ranks=tuple(range(world_size)), code=rest, selected=False, magics=tuple(magics))
    lines = code.split("\n")
    first = next((i for i, line in enumerate(lines) if line.strip()), None)
    if first is not None:
        # the cell's leading cell magics: each one's body starts with the next, so `%%rank` may
        # be any of them (`%%time` then `%%rank 0`: rank 0 times the rest)
        i = first
        while i < len(lines) and _CELL_MAGIC.match(lines[i]):
            m = _RANK_LINE.match(lines[i])
            if m:
                ranks = parse_rank_spec(m.group("spec") or "", world_size)
                # keep line numbers and cursor offsets right: the magic line becomes a comment of the
                # same length. A blank line would be dropped by IPython's leading_empty_lines (every
                # line number one off), and with the debugger on, which keeps that line, IPython's
                # leading_indent would strip its width of spaces from the lines below it. Above
                # another cell magic it is blanked, as that magic must come first.
                above_magic = i + 1 < len(lines) and lines[i + 1].lstrip().startswith("%%")
                body = "\n".join(" " * len(line) if n < first or (n == i and above_magic)
                                 else _as_comment(line) if n == i else line for n, line in enumerate(lines))
                return CellPlan(ranks=ranks, code=body, selected=True)
            i += 1
    return CellPlan(ranks=tuple(range(world_size)), code=code, selected=False)


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
