"""The units the merger aligns: one rank's output cut into items (a stream line, a rich output,
a display update, a ``clear_output``), and what makes two items twins (their key)."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Hashable
from dataclasses import dataclass

from dist_kernel.output_kinds import OutputKind

#: an item waits ``window`` plus its size over this for its twins (bytes per second): a 50 MB
#: result waits 5 s more, a line of 100 characters 10 microseconds
SIZE_RATE = 10e6
_SMALL = 65_536  # bytes: items up to this size wait exactly the window, as they always did
#: bytes an item costs beyond its content, for the memory bound
ITEM_COST = 200
#: keys longer than this are kept as a digest (100,000 queued displays stay small)
_KEY_DIGEST_ABOVE = 512


@dataclass(slots=True, eq=False)
class Item:
    """One unit of a rank's output, queued until it is published."""

    kind: OutputKind  # its row of the table: how it is merged and rendered (``kind.merge``)
    key: Hashable
    content: dict
    t: float
    solo: bool = False  # shown unlabelled as soon as it is at the head (output policy rank0)
    size: int = 0  # bytes, roughly: large items wait longer for their twins
    held: bool = False  # an error item that may be the cell's own error: not published yet
    in_order: bool = False  # published as it is, in its place (see CellMerger.add_in_order)
    display_id: str | None = None
    cr: bool = False  # a piece of a line rewritten with '\r' (a progress bar)
    captured: bool = False  # made while its rank captured into an ipywidgets ``Output`` (shown inside it)
    partial: bool = False  # the start of a line, published before its end came (it may be cut elsewhere)
    branch: bool = False  # made inside a branch on the rank (`if rank == 0:`): not held for silent ranks

    @property
    def special(self) -> bool:
        """Published without waiting for every rank's place (solo, in order, or made in a branch)."""
        return self.solo or self.in_order or self.branch


@dataclass
class Partial:
    """A rank's unfinished stream line, waiting for its end."""

    text: str = ""
    t: float = 0.0
    branch: bool = False  # some of the text was written inside a branch on the rank
    seq: int = 0  # the order in which the ranks' unfinished lines were first made (poll keeps it)


def wait_for_size(window: float, size: int) -> float:
    """How long an item of ``size`` bytes waits for its twins: the window, longer when large."""
    return window + max(size - _SMALL, 0) / SIZE_RATE


def render_cr(text: str) -> str:
    """What a terminal shows for text with carriage returns: each line's last rewrite."""
    out = []
    for line in text.split("\n"):
        parts = [p for p in line.split("\r") if p]
        out.append(parts[-1] if parts else "")
    return "\n".join(out)


def squash(text: str) -> str:
    """``text`` as :func:`render_cr` shows it, keeping a final ``\\r``: what follows rewrites the line."""
    return render_cr(text) + ("\r" if text.endswith("\r") else "")


#: the fields of a progress state that change with the clock, not with the progress: rates
#: (``8.02it/s``, ``1.25s/it``, ``12ms/step``, ``?it/s``), clock times (``00:01``, ``1:02:03``),
#: durations (``0.5s``); each with the spaces that pad it
_CLOCK_FIELDS = re.compile(
    r"\s*(?:(?:\d+(?:\.\d+)?|\?)\s?[kMGTPEZYmµu]?[A-Za-z]*/[A-Za-z]+"
    r"|\d+:\d{2}(?::\d{2})?(?:\.\d+)?"
    r"|\d+(?:\.\d+)?(?:ms|us|µs|s)\b)")
_SPACES = re.compile(r"\s+")


def progress_key(text: str) -> str:
    """What two progress states (``\\r`` units) must share to be twins: ranks draw the same bar
    at their own speed, so rates and times are left out, and the spaces that pad them."""
    return _SPACES.sub(" ", _CLOCK_FIELDS.sub(" ~", text)).strip()


def stream_key(name: str, text: str, cr: bool) -> Hashable:
    """The key of a stream item: its text, or for a progress state its :func:`progress_key`."""
    return ("stream", name, progress_key(text) if cr and text.strip() else text)


def split_lines(text: str) -> tuple[list[str], str]:
    """Split into complete lines (keeping ``\\n``) and the unfinished rest."""
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]], parts[-1]


_SEP = re.compile(r"\r\n|\r|\n")


def split_units(text: str) -> tuple[list[tuple[str, bool]], str]:
    """Split stream text with carriage returns into the units that ranks' twins are matched by,
    each with whether it belongs to a rewritten line, and the unfinished rest.

    The units do not depend on how the text was cut into messages (that depends on timing): a
    ``\\r`` starts a unit (``\\r 34%``, as progress bars write it), the text before it is one, a
    newline ending a rewritten line is one, and a ``\\r`` unit with text is complete where a
    message ends (a bar writes each state in one write). Other lines end at their newline."""
    units: list[tuple[str, bool]] = []
    start = 0
    for m in _SEP.finditer(text):
        s, e = m.span()
        if m.group() == "\r":
            if s > start:
                units.append((text[start:s], True))
            start = s
        elif text.startswith("\r", start):  # the newline that ends a rewritten line: its own unit
            if s > start:
                units.append((text[start:s], True))
            units.append((m.group(), True))
            start = e
        else:
            units.append((text[start:e], False))
            start = e
    rest = text[start:]
    if len(rest) > 1 and rest.startswith("\r"):
        units.append((rest, True))
        rest = ""
    return units, rest


def content_key(content: dict) -> tuple[Hashable, int]:
    """What makes two rich outputs identical (data and metadata), and their size in bytes."""
    text = json.dumps([content.get("data"), content.get("metadata")], sort_keys=True, default=str)
    if len(text) > _KEY_DIGEST_ABOVE:
        return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=20).digest(), len(text)
    return text, len(text)
