"""A cell's outputs as plain text, in order: what ``python -m dist_kernel run`` shows on a terminal
and what the kernel's output log (:mod:`dist_kernel.parent.output_log`) records.

The outputs are the kernel's, already merged across ranks (``[rank 1] ...`` labels, identical
output once). Stream text is kept as is; a rich output shows its ``text/plain``; an error its
traceback without colours. Both readers append, and cannot take a line back, so what the notebook
redraws in place is written as lines:

- a display updated in place (``update_display_data``: the merged ``\\r`` progress bar of several
  ranks, tqdm, fastprogress) is written when it appears, then its newest frame at most once every
  :data:`REDRAW_EVERY` seconds while it changes, and its last frame when the cell ends or another
  display appears. A bar of hours is then a line every few seconds that ``tail -f`` follows and
  ``grep`` and ``less`` read, not thousands of frames, and its final state is always there;
- a stream line rewritten with ``\\r`` (a bar of one rank) is written the same way, as lines,
  unless ``keep_cr`` (a terminal, which draws ``\\r`` in place itself).

Frames whose text is the same as the last one written (an HTML bar's ``<IPython.core.display.HTML
object>``) are not written again. ``clear_output`` erases nothing: what was written stays.
``%dist_top``'s table (:func:`is_top`) is a status, not an output: it is left out.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from dist_kernel.output_kinds import KINDS, OutputKind, Text
from dist_kernel.parent.merge import render_cr, strip_ansi

#: seconds between two frames of a display or ``\\r`` line that is redrawn in place
REDRAW_EVERY = 10.0
#: display ids remembered (a display may be updated in a later cell)
DISPLAYS_KEPT = 256

#: text for one stream: ("stdout" or "stderr", text)
Out = tuple[str, str]
#: the values of the table's ``text`` column, as globals: faster than off the class
_STREAM, _PLAIN, _FRAME, _TRACEBACK, _NONE = Text.STREAM, Text.PLAIN, Text.FRAME, Text.TRACEBACK, Text.NONE


def is_top(msg: dict) -> bool:
    """Is this IOPub message ``%dist_top``'s table (see ``parent/top.py``: ``META``)?"""
    return _is_top(KINDS.get(msg.get("msg_type", "")), msg.get("content", {}))


def _is_top(kind: OutputKind | None, content: dict) -> bool:
    """%dist_top's table is a display (its text/plain), shown and then updated in place."""
    return kind is not None and (kind.text is _PLAIN or kind.text is _FRAME) and is_top_content(content)


def is_top_content(content: dict) -> bool:
    meta = content.get("metadata") or {}
    return bool(isinstance(meta, dict) and isinstance(meta.get("dist_kernel"), dict) and meta["dist_kernel"].get("top"))


def rule(text: str) -> str:
    """A line that marks a cell's start or end: ``── text ──``."""
    return f"── {text} ──\n"


@dataclass
class _Frames:
    """One thing redrawn in place: the frame written last, when, and the newest one."""

    written: str
    at: float
    latest: str

    @property
    def behind(self) -> bool:
        return bool(self.latest.strip()) and self.latest != self.written


@dataclass
class _OpenLine:
    """A stream's line without its ``\\n`` yet."""

    text: str = ""  # as received (with its ``\\r``)
    raw_shown: int = 0  # how much of it was written as is (no ``\\r`` in it so far)
    frames: _Frames | None = None  # once a ``\\r`` made it a redrawn line


class TextOutput:
    """Turns IOPub outputs into text to append (see the module doc). ``feed`` each output,
    ``tick`` now and then (a frame comes due with time), ``finish`` at the end of a cell."""

    def __init__(self, keep_cr: bool = False, redraw_every: float = REDRAW_EVERY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.keep_cr = keep_cr
        self.redraw_every = redraw_every
        self.clock = clock
        self.displays: OrderedDict[str, _Frames] = OrderedDict()
        #: the displays whose newest frame is not written yet (few: looked at for every output)
        self.waiting: dict[str, _Frames] = {}
        self.lines: dict[str, _OpenLine] = {}  # stream name -> its open line (keep_cr off)
        #: did the text given out so far end a line? (a rule, a rich output, a frame start one of their own)
        self.at_line_start = True

    # ------------------------------------------------------------------ input
    def feed(self, msg_type: str, content: dict) -> list[Out]:
        """The text of one output (and of frames that came due before it)."""
        out: list[Out] = []
        kind = KINDS.get(msg_type)
        how = kind.text if kind is not None else _NONE
        if _is_top(kind, content):
            return out
        if how is _FRAME:
            self._update(out, content)
        elif how is not _NONE:
            # shown after the last frame of what is redrawn: a bar that ended before a print
            # shows its end before the print, as in the notebook
            self._behind(out)
            self._output(out, how, content)
        self._due(out)  # after the output: its own newest frame is not due as an older one
        return out

    def _output(self, out: list[Out], how: Text, content: dict) -> None:
        if how is _STREAM:
            name = "stderr" if content.get("name") == "stderr" else "stdout"
            if self.keep_cr:
                self._add(out, name, content.get("text", ""))
            else:
                self._stream(out, name, content.get("text", ""))
        elif how is _TRACEBACK:
            self._add_lines(out, "stderr", strip_ansi("\n".join(content.get("traceback", []))))
        else:
            text = _plain(content)
            display_id = (content.get("transient") or {}).get("display_id")
            if display_id:
                self._remember(display_id, _Frames(text, self.clock(), text))
            if text:
                self._add_lines(out, "stdout", text)

    def tick(self) -> list[Out]:
        """Frames that came due: redrawn things whose newest frame waited long enough."""
        out: list[Out] = []
        self._due(out)
        return out

    def finish(self) -> list[Out]:
        """The cell ended: the last frame of everything redrawn."""
        out: list[Out] = []
        self._behind(out)
        for name, line in self.lines.items():
            if line.frames is not None and line.frames.behind:
                self._frame(out, name, line.frames)
        self.lines.clear()  # a line left open is ended by what follows (a rule starts a line of its own)
        return out

    def rule(self, text: str) -> str:
        """:func:`rule`, on a line of its own even when the output before did not end one."""
        line = ("" if self.at_line_start else "\n") + rule(text)
        self.at_line_start = True
        return line

    # --------------------------------------------------------------- helpers
    def _add(self, out: list[Out], name: str, text: str) -> None:
        if text:
            out.append((name, text))
            self.at_line_start = text.endswith("\n")

    def _add_lines(self, out: list[Out], name: str, text: str) -> None:
        """``text`` on lines of its own, after a line that was left open."""
        self._add(out, name, ("" if self.at_line_start else "\n") + text + "\n")

    def _frame(self, out: list[Out], name: str, frames: _Frames) -> None:
        frames.written, frames.at = frames.latest, self.clock()
        self._add_lines(out, name, frames.latest)

    @property
    def has_waiting(self) -> bool:
        """Is a frame waiting to come due?"""
        return bool(self.waiting) or any(line.frames is not None and line.frames.behind for line in self.lines.values())

    def _due(self, out: list[Out]) -> None:
        now = self.clock()
        for display_id, frames in list(self.waiting.items()):
            if now - frames.at >= self.redraw_every:
                self._frame(out, "stdout", frames)
                del self.waiting[display_id]
        for name, line in self.lines.items():
            if line.frames is not None and line.frames.behind and now - line.frames.at >= self.redraw_every:
                self._frame(out, name, line.frames)

    def _behind(self, out: list[Out]) -> None:
        for frames in self.waiting.values():
            self._frame(out, "stdout", frames)
        self.waiting.clear()

    def _remember(self, display_id: str, frames: _Frames) -> None:
        self.displays[display_id] = frames
        self.displays.move_to_end(display_id)
        self.waiting.pop(display_id, None)
        while len(self.displays) > DISPLAYS_KEPT:
            self.waiting.pop(self.displays.popitem(last=False)[0], None)

    def _update(self, out: list[Out], content: dict) -> None:
        display_id = (content.get("transient") or {}).get("display_id")
        if not display_id:
            return
        frames = self.displays.get(display_id)
        if frames is None:  # shown before this log or run began: its first update is a frame
            frames = _Frames("", float("-inf"), "")
            self._remember(display_id, frames)
        frames.latest = _plain(content)
        if not frames.behind:
            self.waiting.pop(display_id, None)
        elif self.clock() - frames.at >= self.redraw_every:
            self._frame(out, "stdout", frames)
            self.waiting.pop(display_id, None)
        else:
            self.waiting[display_id] = frames

    def _stream(self, out: list[Out], name: str, text: str) -> None:
        """Stream text with its ``\\r`` lines as lines (see the module doc)."""
        line = self.lines.setdefault(name, _OpenLine())
        if line.frames is None and "\r" not in text:  # plain text (nearly all of it): as it is
            self._add(out, name, text)
            line.text = text.rsplit("\n", 1)[1] if "\n" in text else line.text + text
            line.raw_shown = len(line.text)
            return
        *ended, rest = text.split("\n")
        for piece in ended:  # each ends the open line
            line.text += piece
            if line.frames is None and "\r" not in line.text:
                self._add(out, name, line.text[line.raw_shown:] + "\n")
            else:
                frames = _redrawn(line)
                frames.latest = render_cr(line.text)
                if frames.behind:  # its last frame, however soon after the one before
                    self._frame(out, name, frames)
            line = self.lines[name] = _OpenLine()
        if rest:
            line.text += rest
            if line.frames is None and "\r" not in line.text:
                self._add(out, name, rest)
                line.raw_shown = len(line.text)
            else:
                frames = _redrawn(line)
                frames.latest = render_cr(line.text)
                if frames.behind and self.clock() - frames.at >= self.redraw_every:
                    self._frame(out, name, frames)


def _redrawn(line: _OpenLine) -> _Frames:
    """The frames of an open line that is redrawn (it has a ``\\r``)."""
    if line.frames is None:
        line.frames = _Frames("", float("-inf"), "")
    return line.frames


def _plain(content: dict) -> str:
    data = content.get("data") or {}
    text = data.get("text/plain", "") if isinstance(data, dict) else ""
    return text if isinstance(text, str) else "".join(text)
