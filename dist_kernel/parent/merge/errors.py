"""The cell's one error: the ranks' errors, merged into the single ``error`` output a cell may have."""

from __future__ import annotations

import re
from collections.abc import Iterable

from dist_kernel.exceptions import DistributedError
from dist_kernel.parent.selection import format_ranks

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_CELL_NO = re.compile(r"(In\s*\[|Cell In\[)\d+(\])")


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def error_key(err: dict) -> tuple:
    """What makes two errors the same: name, value and traceback, colours and cell numbers aside."""
    tb = [_CELL_NO.sub(r"\1*\2", strip_ansi(line)) for line in err.get("traceback", [])]
    return (err.get("ename"), err.get("evalue"), tuple(tb))


def merge_errors(errors: dict[int, dict], ranks: Iterable[int]) -> dict | None:
    """Combine the ranks' errors into the content of one ``error`` output (None if none).

    The same error on several ranks shows once, saying on which; different errors show
    each rank's traceback under a header naming the rank.
    """
    if not errors:
        return None
    ranks = tuple(ranks)
    groups: dict[tuple, list[int]] = {}
    for rank in sorted(errors):
        groups.setdefault(error_key(errors[rank]), []).append(rank)
    first = errors[min(errors)]
    if len(groups) == 1:
        failing = next(iter(groups.values()))
        where = f"all {len(ranks)} ranks" if len(failing) == len(ranks) and len(ranks) > 1 else (
            f"rank {format_ranks(failing)}")
        said = "raised this error" if len(failing) == 1 else "raised the same error"
        note = f"\x1b[1;31m[{where}]\x1b[0m {said}" if len(ranks) > 1 else None
        return {"ename": first.get("ename", "Error"), "evalue": first.get("evalue", ""),
                "traceback": ([note] if note else []) + list(first.get("traceback", []))}
    tb: list[str] = []
    summary: list[str] = []
    for group in groups.values():
        err = errors[group[0]]
        head = f"rank {format_ranks(group)}: {err.get('ename')}: {err.get('evalue')}"
        summary.append(f"[{head}]")
        tb.append(f"\x1b[1;31m━━━━ {head} ━━━━\x1b[0m")
        tb.extend(err.get("traceback", []))
    enames = {errors[g[0]].get("ename") for g in groups.values()}
    ename = first.get("ename") if len(enames) == 1 else DistributedError.__name__
    return {"ename": ename, "evalue": "; ".join(summary), "traceback": tb}
