"""``python -m dist_kernel run``'s live status under a cell's output, on a terminal: the text form
of ``%dist_top``'s table (:mod:`dist_kernel.parent.top_table`), redrawn in place as the kernel
updates it, erased before any output is written and drawn again after it, and gone when the cell
ends. Drawn only below a complete line: under a ``\\r`` progress bar it waits for the line's end.
"""

from __future__ import annotations

import shutil
from typing import TextIO

#: control sequences: start of the line N lines up, erase from the cursor to the end of the screen
UP = "\x1b[{n}F"
ERASE = "\x1b[J"


def fit(text: str, width: int) -> list[str]:
    """The table's lines, each cut to the terminal's width (a wrapped line would break the erase)."""
    return [line[:max(1, width - 1)] for line in text.splitlines()]


class StatusLine:
    """The table drawn under the output on ``stream`` (a terminal)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.text = ""  # the latest table
        self.shown = 0  # lines on screen now

    def update(self, text: str, at_line_start: bool) -> None:
        """A new table: redrawn now when the cursor is at the start of a line."""
        self.text = text
        if at_line_start:
            self.clear()
            self.draw()

    def draw(self) -> None:
        if not self.text or self.shown:
            return
        lines = fit(self.text, shutil.get_terminal_size().columns)
        self.stream.write("".join(f"{line}\n" for line in lines))
        self.stream.flush()
        self.shown = len(lines)

    def clear(self) -> None:
        """Erase the table from the screen (the cursor goes back where it was drawn)."""
        if self.shown:
            self.stream.write(UP.format(n=self.shown) + ERASE)
            self.stream.flush()
            self.shown = 0

    def reset(self) -> None:
        """The cell ended: erase it and forget it."""
        self.clear()
        self.text = ""
