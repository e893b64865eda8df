"""Progress bars: a stream line that the ranks rewrite with ``\\r``, shown as one display that is
redrawn in place (issue 30).

A frontend applies ``\\r`` only within one stream output, and a stream output cannot be taken
back: a bar drawn as stream text by every rank alike, then differently per rank, would leave its
shared frame behind the ranks' own lines. So in a cell of several ranks a rewritten line is a
display from its first state on: it shows each rank's current line; ranks whose lines agree
(rates and times aside, :func:`~.units.progress_key`) share one line, unlabelled, drawn as the
slowest of them drew it (the rank that reached it last); ranks whose lines differ get a line
each, labelled, in the same display, and give way to the shared line once they agree again.
The display is final once every rank has ended its line (its ``\\n``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from dist_kernel.parent.merge.labels import label
from dist_kernel.parent.merge.units import progress_key, squash


@dataclass
class Bar:
    """One rewritten line of one stream, per rank: its ended lines and the line being drawn."""

    name: str  # the stream
    display_id: str
    ranks: tuple[int, ...]  # the cell's ranks
    done: dict[int, list[str]] = field(default_factory=dict)  # rank -> lines it ended, as shown
    line: dict[int, str] = field(default_factory=dict)  # rank -> its open line (squashed: its last state)
    changed: dict[int, int] = field(default_factory=dict)  # rank -> when its text last changed (a counter)
    shown: bool = False
    _clock: int = 0

    def open_for(self, ranks: Iterable[int]) -> bool:
        """Does one of these ranks have a line of this bar still being drawn?"""
        return any(self.line.get(r) for r in ranks)

    @property
    def finished(self) -> bool:
        """Has every rank ended its line?"""
        return not any(self.line.values())

    def write(self, ranks: Sequence[int], text: str) -> None:
        """``ranks`` wrote ``text`` (the same for each) on this bar's line."""
        self._clock += 1
        first, *rest = text.split("\n")
        for r in ranks:
            line = squash(self.line.get(r, "") + first)
            for nxt in rest:  # every '\n' ends the line drawn so far
                self.done.setdefault(r, []).append(line.rstrip("\r"))
                line = squash(nxt)
            self.line[r] = line
            self.changed[r] = self._clock

    def text(self) -> str:
        """What the display shows: line by line, one unlabelled line where every rank agrees,
        else each group of agreeing ranks' line after its label."""
        rows: dict[int, list[str]] = {}
        for r in self.ranks:
            lines = list(self.done.get(r, ()))
            if self.line.get(r):
                lines.append(self.line[r].rstrip("\r"))
            rows[r] = lines
        out: list[str] = []
        for i in range(max((len(v) for v in rows.values()), default=0)):
            groups: dict[str, list[int]] = {}
            for r in self.ranks:
                if i < len(rows[r]):
                    groups.setdefault(progress_key(rows[r][i]), []).append(r)
            for group in groups.values():
                slowest = max(group, key=lambda r: self.changed.get(r, 0))  # reached this state last
                shown = rows[slowest][i]
                out.append(shown if len(group) == len(self.ranks) else label(group) + shown)
        return "\n".join(out)

    def content(self) -> dict:
        """The display's content now (a fresh dict each time: a message sent is never changed)."""
        return {"data": {"text/plain": self.text()}, "metadata": {}, "transient": {"display_id": self.display_id}}
