"""Rendering: what the frontend is sent for an item the alignment publishes, given the ranks
that gave it (all of them: once, unlabelled; some: labelled), and the state that spans items:
the unfinished stream line and its label, per-group areas, and display ids."""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dist_kernel.output_kinds import KINDS, Merge, Shows
from dist_kernel.parent.merge.bars import Bar
from dist_kernel.parent.merge.captures import FrontendCaptures
from dist_kernel.parent.merge.labels import (
    combined,
    label,
    label_lines,
    labelled_error,
    labelled_rich,
    prefix_lines,
    unmarked,
)
from dist_kernel.parent.merge.units import Item, render_cr, squash
from dist_kernel.protocol import META_RANKS, with_meta

Emit = tuple[str, dict]  # (msg_type, content)

_RICH, _ERROR, _CLEAR = Merge.RICH, Merge.ERROR, Merge.CLEAR  # globals: faster than off the class
_ADD, _UPDATE = Shows.ADD, Shows.UPDATE
#: the mime type of a widget's view (ipywidgets)
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
_CR_LABEL = re.compile(r"\r(?!\n|$)")
_NL_LABEL = re.compile(r"\n(?!$)")


def late_error_text(content: dict, rank: int, labelled: bool) -> str:
    """A rank's ``error`` output that came after its cell ended, as stderr text (labelled with the
    rank when ``labelled``)."""
    lines = list(content.get("traceback") or []) or [f"{content.get('ename', 'Error')}: {content.get('evalue', '')}"]
    text = f"after its cell had ended, rank {rank} raised:\n" + "\n".join(lines) + "\n"
    return label_lines(text, [rank]) if labelled else text


class DisplayRegistry:
    """For each display id the ranks used: the newest content each rank gave it.

    It outlives a cell when the kernel keeps one (an update in a later cell then still knows
    what the other ranks show); bounded to the ``limit`` most recently used ids.
    """

    def __init__(self, limit: int = 256) -> None:
        self.limit = limit
        self._states: OrderedDict[str, dict[int, dict]] = OrderedDict()

    def set(self, display_id: str, ranks: Iterable[int], content: dict) -> dict[int, dict]:
        states = self._states.setdefault(display_id, {})
        self._states.move_to_end(display_id)
        for r in ranks:
            states[r] = content
        while len(self._states) > self.limit:
            self._states.popitem(last=False)
        return states


@dataclass
class _Area:
    """An updatable display holding one rank group's text or latest rich output."""

    display_id: str
    ranks: tuple[int, ...]
    kind: str  # "text" or "rich"
    text: str = ""
    shown: bool = False


@dataclass
class _OpenLine:
    """A stream line left without its newline, and whose label it carries."""

    label: str | None
    after_cr: bool = False
    ranks: list[int] | None = None  # the ranks that wrote it (None: every rank)
    text: str = ""  # what it shows (squashed), label aside


class Renderer:
    """Turns published items into the messages of one cell, in order (see :meth:`emit`)."""

    def __init__(self, ranks: Sequence[int], displays: DisplayRegistry) -> None:
        self.ranks = tuple(ranks)
        self.displays = displays
        self.area_ranks: set[int] = set()  # ranks that cleared alone: their output goes to areas
        self._out: list[tuple[str, dict | Bar]] = []  # a Bar: its display's content when taken
        self._open: dict[str, _OpenLine] = {}
        self._bars: dict[str, Bar] = {}  # stream name -> its rewritten line being drawn
        self._captures = FrontendCaptures()
        self._areas: dict[tuple[str | None, str], _Area] = {}
        self._pending_clear: set[int] = set()  # ranks whose areas empty at their next output
        self._area_serial = 0
        self._joinable: dict[str, set[int]] = {}  # display id -> ranks in its newest output of this cell

    @property
    def ready(self) -> bool:
        """Is there output to publish?"""
        return bool(self._out)

    def take(self) -> list[Emit]:
        """Messages to publish now, consecutive stream text of one name coalesced."""
        out: list[Emit] = []
        texts: list[str] = []  # pieces of the stream message being built (joined once: no O(n^2))
        last_type, lines = "", False
        for msg_type, queued in self._out:
            content = queued.content() if isinstance(queued, Bar) else queued
            if msg_type is not last_type:  # looked up once for a run of one kind (a flood of lines)
                last_type, lines = msg_type, KINDS[msg_type].lines
            if lines and out and out[-1][0] == msg_type and out[-1][1]["name"] == content["name"]:
                texts.append(content["text"])
                continue
            if texts:
                out[-1][1]["text"] = "".join(texts)
            texts = [content["text"]] if lines else []
            out.append((msg_type, dict(content) if lines else content))
        if texts:
            out[-1][1]["text"] = "".join(texts)
        self._out = []
        return out

    def late(self, rank: int, msg_type: str, content: dict, labelled: bool) -> None:
        """Output of ``rank`` after its cell ended, labelled with the rank when ``labelled``,
        display ids resolved as in the cell."""
        kind = KINDS[msg_type]
        content = unmarked(msg_type, content)
        if kind.lines:
            text = content.get("text", "")
            name = content.get("name", "stdout")
            self._out.append((msg_type, {"name": name, "text": label_lines(text, [rank]) if labelled else text}))
        elif kind.merge is _RICH and (content.get("transient") or {}).get("display_id") is not None:
            content = dict(content)
            display_id = content.pop("transient")["display_id"]
            self._emit_display(Item(kind, None, content, 0.0, display_id=display_id), [rank])
        elif kind.merge is _RICH and labelled:
            self._out.append((msg_type, labelled_rich(content, [rank])))
        elif kind.merge is _ERROR:
            # the cell's one error was merged when the cell ended: a rank it gave up on that raises
            # at last (a cell that catches the interrupt) is told as text, never a second error output
            self._out.append(("stream", {"name": "stderr", "text": late_error_text(content, rank, labelled)}))
        else:
            self._out.append((msg_type, content))

    def emit(self, item: Item, ranks: list[int] | None) -> None:
        """Publish ``item``, which ``ranks`` gave (None: every rank of the cell)."""
        if ranks is not None and len(ranks) == len(self.ranks):
            ranks = None
        kind = item.kind
        if item.in_order:
            self._out.extend(self._captures.change(kind.name, item.content))
            self._open.clear()  # the widget and the cell are different output areas
            self._bars.clear()
            return
        around = self._captures.around(item.captured)
        if around:
            self._out.extend(around)
            self._open.clear()
            self._bars.clear()
        multi = len(self.ranks) > 1
        if kind.merge is _CLEAR:
            if not multi or item.captured or (ranks is None and not self.area_ranks):
                # every rank cleared at the same point of its output: one clear, as one process;
                # a clear inside an Output widget clears only the widget, never the other ranks' output
                self._open.clear()
                self._bars.clear()
                self._out.append((kind.name, item.content))
                return
            # one rank clearing alone would wipe the other ranks' output: from now on this
            # group's output is shown in its own areas, which its clears empty
            group = self._group(ranks)
            self.area_ranks.update(group)
            self._pending_clear.update(group)
            if not item.content.get("wait"):
                self._clear_areas(group)
            return
        lab = None if ranks is None else label(ranks)
        # the group is built only where areas are in use: an item of every rank is O(1) otherwise
        # output inside an Output widget goes out plainly: a widget shows no display updates
        in_area = (multi and not item.captured and bool(self.area_ranks)
                   and all(r in self.area_ranks for r in self._group(ranks)))
        if kind.lines:
            text = item.content["text"]
            if in_area:
                self._to_area(lab, self._group(ranks), "text", text)
            elif not (multi and not item.captured and self._to_bar(item, ranks)):
                self._emit_stream(item.content["name"], text, lab, ranks)
            return
        self._open.clear()  # a rich output starts a new output area
        self._bars.clear()
        content = item.content
        if kind.merge is _ERROR:
            self._out.append((kind.name, content if ranks is None else labelled_error(content, ranks)))
            return
        if item.display_id is not None:
            self._emit_display(item, self._group(ranks))
            return
        if in_area and kind.merge is _RICH and kind.shows is _ADD:  # an area shows the newest output
            self._to_area(lab, self._group(ranks), "rich", content)
            return
        if ranks is not None and kind.merge is _RICH:
            if WIDGET_VIEW in (content.get("data") or {}):
                # a frontend draws the widget alone, never the text beside it: the label goes first
                self._out.append(("display_data", labelled_rich({"data": {"text/plain": ""}, "metadata": {}}, ranks)))
            content = labelled_rich(content, ranks)
        self._out.append((kind.name, content))

    def _group(self, ranks: list[int] | None) -> list[int]:
        return list(self.ranks) if ranks is None else ranks

    def _to_bar(self, item: Item, ranks: list[int] | None) -> bool:
        """Draw a stream item on its stream's progress bar (:mod:`.bars`); False: it is no bar's.
        A line rewritten with '\\r' is a bar from its first state on; text of ranks whose line
        on the bar is still being drawn joins it. A shared line the stream started without '\\r'
        stays stream text, as in one process, until a rank rewrites it alone: its text is then
        blanked in the stream and drawn on the bar."""
        name, text = item.content["name"], item.content["text"]
        bar = self._bars.get(name)
        progress = item.cr or "\r" in text.rstrip("\n")
        if bar is None and not progress:
            return False  # the common case, in O(1) for an item of every rank
        group = self._group(ranks)
        if bar is None or not (progress or bar.open_for(group)):
            if not progress:
                return False
            state = self._open.get(name)
            if state is not None and ranks is None and state.label is None:
                return False  # every rank rewrites the line the stream shows: as one process
            bar = self._new_bar(name, state)
        bar.write(group, text)
        self._show_bar(bar)
        if bar.finished:
            del self._bars[name]
        return True

    def _new_bar(self, name: str, state: _OpenLine | None) -> Bar:
        """A bar for ``name``, taking over the stream's unfinished line (blanked there)."""
        self._area_serial += 1
        bar = Bar(name, f"dist-kernel-bar-{id(self):x}-{self._area_serial}", self.ranks)
        if state is not None and state.text:
            self._out.append(("stream", {"name": name, "text": "\r" + " " * (len(state.label or "") + len(
                state.text.rstrip("\r")))}))
            bar.write(self._group(state.ranks), state.text)
        self._open.pop(name, None)
        self._bars[name] = bar
        return bar

    def _show_bar(self, bar: Bar) -> None:
        """Show ``bar`` as it will be when the output is taken (consecutive updates are one)."""
        if not bar.shown:
            bar.shown = True
            self._open.clear()
            self._out.append(("display_data", bar))
        elif not (self._out and self._out[-1][1] is bar):
            self._out.append(("update_display_data", bar))

    def _emit_display(self, item: Item, group: list[int]) -> None:
        """Publish a display with an id, or its update: one display shows what every rank gave it."""
        display_id = item.display_id
        assert display_id is not None
        states = self.displays.set(display_id, group, item.content)
        content = {**item.content, **combined(states, self.ranks), "transient": {"display_id": display_id}}
        if item.kind.shows is _UPDATE:
            self._out.append((item.kind.name, content))
            return
        joined = self._joinable.get(display_id)
        if joined is not None and not joined & set(group):
            # the same display from ranks that had not shown it yet (their twins came late, or
            # differed): they join the display already there, which now shows them too
            joined.update(group)
            self._out.append(("update_display_data", content))
            return
        self._joinable[display_id] = set(group)
        self._out.append((item.kind.name, content))

    def _clear_areas(self, ranks: list[int]) -> None:
        """Empty every area holding output of these ranks (a clear_output of theirs took effect)."""
        self._pending_clear.difference_update(ranks)
        for area in self._areas.values():
            if area.shown and set(area.ranks) & set(ranks) and (area.text or area.kind == "rich"):
                area.text = ""
                self._show_area(area, {"data": {"text/plain": ""}, "metadata": {}})

    def _to_area(self, lab: str | None, group: list[int], kind: str, payload: str | dict) -> None:
        """Show ``payload`` in the area of ``group`` (text is added to its text, rich output replaces it)."""
        due = [r for r in group if r in self._pending_clear]
        if due:
            self._clear_areas(due)
        area = self._areas.get((lab, kind))
        if area is None:
            self._area_serial += 1
            area = _Area(f"dist-kernel-area-{id(self):x}-{self._area_serial}", tuple(group), kind)
            self._areas[(lab, kind)] = area
        content: dict
        if isinstance(payload, str):
            area.text += payload
            content = {"data": {"text/plain": prefix_lines(render_cr(area.text), lab)}, "metadata": {}}
        else:
            content = payload if lab is None else labelled_rich(payload, group)
        if lab is not None:
            content = dict(content, metadata=with_meta(content.get("metadata"), {META_RANKS: group}))
        self._show_area(area, content)

    def _show_area(self, area: _Area, content: dict) -> None:
        content = {"data": content.get("data", {}), "metadata": content.get("metadata", {}),
                   "transient": {"display_id": area.display_id}}
        if not area.shown:
            area.shown = True
            self._open.clear()
            self._out.append(("display_data", content))
            return
        last = self._out[-1] if self._out else None
        if (last and KINDS[last[0]].shows is _UPDATE and isinstance(last[1], dict)
                and last[1]["transient"]["display_id"] == area.display_id):
            self._out[-1] = ("update_display_data", content)  # only the newest state matters
        else:
            self._out.append(("update_display_data", content))

    def _emit_stream(self, name: str, text: str, prefix: str | None, ranks: list[int] | None = None) -> None:
        state = self._open.get(name)
        head = ""
        if state is not None and state.label != prefix:
            head = "\n"  # close the other ranks' unfinished line first
            state = None
        raw = text
        if prefix:
            if state is None or state.after_cr:
                head += prefix
            # a '\r' returns to the line start: re-label after it so progress text keeps its rank
            text = _CR_LABEL.sub("\r" + prefix, text)
            text = _NL_LABEL.sub("\n" + prefix, text)
        text = head + text
        if text.endswith("\n"):
            self._open.pop(name, None)
        else:
            # what the line shows so far, label aside: a bar that takes the line over starts from it
            _, nl, last = raw.rpartition("\n")
            line = squash(last if nl or state is None else state.text + last)
            self._open[name] = _OpenLine(prefix, text.endswith("\r"), ranks, line)
        self._out.append(("stream", {"name": name, "text": text}))
