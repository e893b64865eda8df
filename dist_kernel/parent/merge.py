"""Merge the outputs of N ranks into the outputs of one cell.

Pure logic, no I/O: the parent feeds each rank's IOPub outputs in, with the time they
arrived, and takes back the messages to publish.

Each rank's outputs form an ordered queue of *items*: a stream line (text up to and
including ``\\n``), a rich output, a display update or a ``clear_output``. The merger aligns
the queues like a diff:

- an item that every participating rank produced identically is published once, unlabelled,
  so the saved notebook reads like a single-process run;
- an item that differs, or that only some ranks produced, is published labelled with the
  ranks that produced it (``[rank 1] ...``, or ``[rank 0,2] ...`` for a subset);
- items are aligned by sequence, not by the clock: the k-th item of a rank is the candidate
  twin of the k-th item of the others (after the insertions a diff finds), however late it
  arrives. An item waits for a rank that has not reached its place yet while that rank is
  running the cell, has been silent for less than :data:`LAG_BOUND` (in send times: what
  waited between the rank and the merger does not count), and has not kept giving
  different items (:data:`DIVERGE_AFTER`); it waits for no rank that finished, is past its
  place, or gave something else there; a rank alone is never delayed; memory bounds the wait
  too (``max_pending``, ``max_bytes``). Each rank's own order is always kept; nothing is dropped.
- an item the rank made inside a branch on the rank (``if rank == 0:``, marked by
  :mod:`dist_kernel.rank.branches`) waits only the window for its twins: the cell's code says
  the other ranks may never make it. It takes no place in the rank's sequence (an extra, as a
  diff sees it), so the ranks' later identical items still align.

In a cell run by several ranks, a rank that calls ``clear_output`` on its own (the others
have not reached the same point) or rewrites its line with ``\r`` (progress bars) would erase
or garble the other ranks' output. Instead, that output goes to an *area*: one display per group of ranks, updated in place with
``update_display_data`` (what ipyparallel does per engine).

Display ids: a display shows, for every rank, the newest content that rank gave it; ranks that
agree share one unlabelled rendering, ranks that differ are shown side by side, labelled, in
the same display, so updates still land in place (:class:`DisplayRegistry`).

An item waits longer for its twins the larger it is (:data:`SIZE_RATE`): a large output takes
each rank a while to serialise and send, and an identical one must still be sent once.

Errors: the cell's status and its one merged error come from the ranks' ``execute_reply``
(:meth:`CellMerger.rank_replied`); :func:`merge_errors` turns them into the one ``error`` output
a cell may have, published at the end. An IOPub ``error`` that is not the one its rank's
reply reports (an exception an ipywidgets ``Output`` swallowed, or ``showtraceback()``) is an
ordinary output. A rank publishes its cell error before its reply, so its ``error`` items are
held until the reply says which one it was, or :data:`ERROR_HOLD` after later output of the
rank shows it is still running.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import html
import json
import re
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from dist_kernel.exceptions import DistributedError
from dist_kernel.parent.magics import format_ranks
from dist_kernel.protocol import META, META_BRANCH, META_GROUPS, META_RANKS, META_SOLO, meta_of, with_meta

Emit = tuple[str, dict]  # (msg_type, content)

RICH_TYPES = ("display_data", "execute_result", "update_display_data")
#: the mime type of a widget's view (ipywidgets)
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
#: an item waits ``window`` plus its size over this for its twins (bytes per second): a 50 MB
#: result waits 5 s more, a line of 100 characters 10 microseconds
SIZE_RATE = 10e6
_SMALL = 65_536  # bytes: items up to this size wait exactly the window, as they always did
#: how long an ``error`` item that later output of its rank follows waits for the rank's
#: reply to say whether it is the cell's error (post-execute hooks, such as inline figures,
#: publish between the cell's error and its reply)
ERROR_HOLD = 1.0
#: how long an item waits for a rank that has not reached its place yet and has been silent
#: (no output in this cell) meanwhile: a rank that lags by less than this is merged, however far
#: behind it is in items; a rank that printed nothing for this long is not waited for
LAG_BOUND = 5.0
#: a rank whose items differed from the others' at the same place this many times in a row is
#: not waited for beyond the window, until its output matches again
DIVERGE_AFTER = 4
#: recently published items of each rank that had no twin, remembered by content so that a late
#: twin re-aligns its rank (a lagging rank that gave one extra item is matched again at once)
_RECENT = 4096
#: bytes an item costs beyond its content, for the memory bound
_ITEM_COST = 200
_DUE, _DIFFERS = 1, 2  # CellMerger._due's answers besides 0 (wait)
#: keys longer than this are kept as a digest (100,000 queued displays stay small)
_KEY_DIGEST_ABOVE = 512


@functools.lru_cache(maxsize=1024)
def _label(ranks: tuple[int, ...]) -> str:
    return f"[rank {format_ranks(ranks)}] "


def label(ranks: Sequence[int]) -> str:
    """The prefix that marks output as coming from these ranks only."""
    return _label(tuple(ranks))


def label_lines(text: str, ranks: Sequence[int]) -> str:
    """Every line of ``text`` marked as coming from these ranks."""
    prefix = label(ranks)
    return "".join(prefix + line for line in text.splitlines(keepends=True))


def unmarked(msg_type: str, content: dict) -> dict:
    """``content`` without the marks a rank puts on its output for the merger (``solo``,
    ``branch``): a stream's ``metadata`` (not a field of the Jupyter stream message), a rich
    output's ``metadata.dist_kernel``. For output shown without the merger (a comm callback's,
    output after its cell ended)."""
    if msg_type == "stream" and "metadata" in content:
        return {k: v for k, v in content.items() if k != "metadata"}
    meta = content.get("metadata")
    if isinstance(meta, dict) and META in meta:
        return {**content, "metadata": {k: v for k, v in meta.items() if k != META}}
    return content


def namespaced_display_id(display_id: str, rank: int) -> str:
    """Display ids are per rank, so two ranks showing id X never overwrite each other."""
    return f"{display_id}@rank{rank}"


@dataclass(slots=True, eq=False)
class _Item:
    kind: str  # "stream" or an IOPub msg_type
    key: Hashable
    content: dict
    t: float
    solo: bool = False  # shown unlabelled as soon as it is at the head (output policy rank0)
    size: int = 0  # bytes, roughly: large items wait longer for their twins
    held: bool = False  # an error item that may be the cell's own error: not published yet
    in_order: bool = False  # published as it is, in its place (see CellMerger.add_in_order)
    display_id: str | None = None
    cr: bool = False  # a piece of a line rewritten with '\r' (a progress bar)
    partial: bool = False  # the start of a line, published before its end came (it may be cut elsewhere)
    branch: bool = False  # made inside a branch on the rank (`if rank == 0:`): not held for silent ranks


@dataclass
class _Partial:
    text: str = ""
    t: float = 0.0
    branch: bool = False  # some of the text was written inside a branch on the rank


@dataclass
class _Area:
    """An updatable display holding one rank group's text or latest rich output."""

    display_id: str
    ranks: tuple[int, ...]
    kind: str  # "text" or "rich"
    text: str = ""
    shown: bool = False


def render_cr(text: str) -> str:
    """What a terminal shows for text with carriage returns: each line's last rewrite."""
    out = []
    for line in text.split("\n"):
        parts = [p for p in line.split("\r") if p]
        out.append(parts[-1] if parts else "")
    return "\n".join(out)


@dataclass
class _OpenLine:
    """A stream line left without its newline, and whose label it carries."""

    label: str | None
    after_cr: bool = False


def _split_lines(text: str) -> tuple[list[str], str]:
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


def _json_key(obj: object) -> str:
    return json.dumps(obj, sort_keys=True, default=str)


def _content_key(content: dict) -> tuple[Hashable, int]:
    """What makes two rich outputs identical (data and metadata), and their size in bytes."""
    text = _json_key([content.get("data"), content.get("metadata")])
    if len(text) > _KEY_DIGEST_ABOVE:
        return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=20).digest(), len(text)
    return text, len(text)


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
class CellMerger:
    """Merges one cell's outputs from ``ranks``; see the module docstring."""

    ranks: Sequence[int]
    window: float = 0.1
    max_pending: int = 250_000  # items per rank; beyond it the oldest item is published labelled
    max_bytes: int = 256 * 2**20  # bytes held for all ranks; beyond it the oldest items are published
    errors: dict[int, dict] = field(default_factory=dict)
    rich_from: int | None = None  # output policy "rank0": rich output from this rank only
    displays: DisplayRegistry = field(default_factory=DisplayRegistry)  # the kernel's, to span cells
    lag_bound: float = LAG_BOUND
    diverge_after: int = DIVERGE_AFTER

    def __post_init__(self) -> None:
        self.ranks = tuple(self.ranks)
        self._queues: dict[int, deque[_Item]] = {r: deque() for r in self.ranks}
        self._counts: dict[int, dict[Hashable, int]] = {r: {} for r in self.ranks}
        self._partials: dict[tuple[int, str], _Partial] = {}
        self._done: set[int] = set()
        self._out: list[Emit] = []
        self._open: dict[str, _OpenLine] = {}
        self._areas: dict[tuple[str | None, str], _Area] = {}
        self._area_ranks: set[int] = set()  # ranks that cleared: their output goes to areas
        self._pending_clear: set[int] = set()  # ranks whose areas empty at their next output
        self._area_serial = 0
        self._held: dict[int, list[_Item]] = {r: [] for r in self.ranks}  # error items held, in order
        self._reply_error: dict[int, Hashable | None] = {}  # rank -> its reply's error key (None: ok)
        self._joinable: dict[str, set[int]] = {}  # display id -> ranks in its newest output of this cell
        # rank -> a whole stream chunk (name, text, arrival) not split into lines yet: when every
        # rank sends the same chunk, it is published once as it is (see _add_chunk)
        self._chunks: dict[int, tuple[str, str, float]] = {}
        # alignment by sequence: the place of each rank's next item (items that were extras of the
        # rank, as a diff sees them, take no place), when the rank last gave output, how often in
        # a row its items differed from the others' at their place, and its recent twinless items
        self._place: dict[int, int] = dict.fromkeys(self.ranks, 0)
        self._heard: dict[int, float] = {}  # rank -> when it sent its newest output
        self._lag: dict[int, float] = {}  # rank -> how long its newest output took to reach the merger
        self._start: float | None = None
        self._streak: dict[int, int] = dict.fromkeys(self.ranks, 0)
        self._recent: dict[int, OrderedDict[Hashable, int]] = {r: OrderedDict() for r in self.ranks}
        self._bytes = 0

    # ----------------------------------------------------------------- input
    def add(self, rank: int, msg_type: str, content: dict, now: float, sent: float | None = None) -> None:
        """Feed one IOPub output of ``rank``, which arrived ``now`` and was sent at ``sent``
        (the parent's clock; default: now)."""
        self._hear(rank, now, sent)
        if msg_type == "stream" and "metadata" in content:
            self._add_marked_stream(rank, content, now)
            return
        if msg_type == "stream" and self._add_chunk(rank, content.get("name", "stdout"), content.get("text", ""), now):
            return
        if self._chunks:
            self._split_chunks(now)
        if msg_type == "stream":
            self._add_stream(rank, content.get("name", "stdout"), content.get("text", ""), now)
        elif msg_type == "error":
            self._add_error(rank, content, now)
        elif msg_type in RICH_TYPES:
            if self.rich_from is not None and rank != self.rich_from:
                return
            self._add_rich(rank, msg_type, content, now)
        elif msg_type == "clear_output":
            # an unfinished line belongs before the clear: held back, it would join the next line
            self._flush_partials(rank, now, force=True)
            self._push(rank, _Item("clear_output", ("clear_output", bool(content.get("wait"))), content, now))
        self._drain(now)

    def add_in_order(self, rank: int, msg_type: str, content: dict, now: float) -> None:
        """Feed a message that is never merged or labelled but must reach the frontend in its
        place among ``rank``'s outputs (an ipywidgets ``Output`` starting or stopping a
        capture: what the rank printed before must land before it). Errors the rank showed
        before it were survived: they are ordinary output."""
        self._hear(rank, now, None)
        self._split_chunks(now)
        self._flush_partials(rank, now, force=True)
        for item in self._held[rank]:
            item.held = False
        self._held[rank].clear()
        self._push(rank, _Item(msg_type, ("in_order", rank, id(content)), content, now, in_order=True))
        self._drain(now)

    def _hear(self, rank: int, now: float, sent: float | None) -> None:
        """Silence is measured in send times: what waited between the rank and the merger
        (the rank's IOPub thread, the sockets, a parent behind a flood) is not the rank's."""
        sent = now if sent is None else min(sent, now)
        self._heard[rank] = max(sent, self._heard.get(rank, sent))
        self._lag[rank] = now - sent
        if self._start is None:
            self._start = sent

    def _seen_until(self, now: float) -> float:
        """How far the merger's view of the ranks reaches: ``now`` less the delivery lag of the
        slowest rank's newest output (a rank's later output may still be on its way)."""
        return now - max(self._lag.values(), default=0.0)

    def rank_replied(self, rank: int, reply: dict, now: float) -> None:
        """``rank``'s ``execute_reply`` content arrived: it decides the rank's status and error."""
        failed = reply.get("status") == "error"
        if failed:
            self.errors.setdefault(rank, {k: reply.get(k) for k in ("ename", "evalue", "traceback")})
        self._reply_error[rank] = _error_key(reply) if failed else None
        self._resolve_errors(rank)
        self._drain(now)

    def rank_done(self, rank: int, now: float) -> None:
        """``rank`` will send nothing more for this cell."""
        if rank not in self._chunks:  # its chunk, if any, still waits for its twins
            self._split_chunks(now)
        self._drop_last_cr(rank)
        self._flush_partials(rank, now, force=True)
        self._resolve_errors(rank, final=True)
        self._done.add(rank)
        self._drain(now)

    def poll(self, now: float) -> None:
        """Let waiting items and unfinished lines time out."""
        if self._start is None:
            self._start = now
        if self._chunks and any(now - t >= self._wait_size(len(text)) for _, text, t in self._chunks.values()):
            self._split_chunks(now)
        for (rank, _name), part in list(self._partials.items()):
            # a lone '\r' waits for the text that follows it (a progress bar's next state)
            if part.text and part.text != "\r" and now - part.t >= self.window:
                self._flush_partials(rank, now, force=True)
        for rank, held in self._held.items():
            # the rank printed more and ERROR_HOLD passed without its reply: it is still
            # running, so this error was shown and survived (a swallowed exception)
            for item in [i for i in held if now - i.t >= ERROR_HOLD and i is not self._queues[rank][-1]]:
                item.held = False
                held.remove(item)
        self._drain(now)

    def finish(self, now: float) -> None:
        """The cell is over: publish everything still held."""
        self._split_chunks(now)
        for rank in self.ranks:
            self._drop_last_cr(rank)
            self._flush_partials(rank, now, force=True)
            self._resolve_errors(rank, final=True)
            self._done.add(rank)
        self._drain(now, final=True)

    def late(self, rank: int, msg_type: str, content: dict, labelled: bool) -> list[Emit]:
        """Output of ``rank`` that arrived after the cell ended (a background thread): the
        messages to publish, labelled with the rank when ``labelled``, display ids resolved
        as in the cell."""
        content = unmarked(msg_type, content)
        if msg_type == "stream":
            text = content.get("text", "")
            name = content.get("name", "stdout")
            self._out.append(("stream", {"name": name, "text": label_lines(text, [rank]) if labelled else text}))
        elif msg_type in RICH_TYPES and (content.get("transient") or {}).get("display_id") is not None:
            content = dict(content)
            display_id = content.pop("transient")["display_id"]
            self._emit_display(_Item(msg_type, None, content, 0.0, display_id=display_id), [rank])
        elif msg_type in RICH_TYPES and labelled:
            self._out.append((msg_type, _labelled_rich(content, [rank])))
        elif msg_type == "error" and labelled:
            self._out.append((msg_type, _labelled_error(content, [rank])))
        else:
            self._out.append((msg_type, content))
        return self.take()

    @property
    def ready(self) -> bool:
        """Is there output to publish?"""
        return bool(self._out)

    @property
    def pending(self) -> int:
        return sum(len(q) for q in self._queues.values()) + sum(
            1 for p in self._partials.values() if p.text) + len(self._chunks)

    def take(self) -> list[Emit]:
        """Messages to publish now, consecutive stream text of one name coalesced."""
        out: list[Emit] = []
        texts: list[str] = []  # pieces of the stream message being built (joined once: no O(n^2))
        for msg_type, content in self._out:
            if (msg_type == "stream" and out and out[-1][0] == "stream"
                    and out[-1][1]["name"] == content["name"]):
                texts.append(content["text"])
                continue
            if texts:
                out[-1][1]["text"] = "".join(texts)
            texts = [content["text"]] if msg_type == "stream" else []
            out.append((msg_type, dict(content) if msg_type == "stream" else content))
        if texts:
            out[-1][1]["text"] = "".join(texts)
        self._out = []
        return out

    # ------------------------------------------------------------ internals
    def _add_chunk(self, rank: int, name: str, text: str, now: float) -> bool:
        """Fast path for identical output (issue 14): a stream chunk of whole lines that arrives
        when nothing of any rank is queued before it waits whole for the same chunk from the
        other ranks; when every rank has sent it, it is published once, never split into
        lines. False: the chunk takes the line-by-line path (anything waiting is split first)."""
        place = self._place[rank]
        if (not text.endswith("\n") or rank in self._chunks or self._area_ranks or rank in self._done
                or any(p != place for p in self._place.values())  # the ranks are not at one place
                or any(self._queues[r] or self._partials_of(r) or (r in self._done and r not in self._chunks)
                       for r in self.ranks)):
            return False
        if self._chunks and next(iter(self._chunks.values()))[:2] != (name, text):
            return False
        self._chunks[rank] = (name, text, now)
        if len(self._chunks) == len(self.ranks):
            self._chunks.clear()
            self._emit(_Item("stream", None, {"name": name, "text": text}, now), None)
        return True

    def _drop_last_cr(self, rank: int) -> None:
        """A '\\r' that ends a rank's output, nothing written after it, changes nothing shown: it
        is not published (alone, it would be an empty output of its own)."""
        for (r, _), part in self._partials.items():
            if r == rank and part.text == "\r":
                part.text = ""

    def _partials_of(self, rank: int) -> bool:
        return any(p.text for (r, _), p in self._partials.items() if r == rank)

    def _split_chunks(self, now: float) -> None:
        """The waiting chunks take the line-by-line path after all, each at its arrival time."""
        chunks, self._chunks = self._chunks, {}
        for rank, (name, text, t) in chunks.items():
            self._add_stream(rank, name, text, t)
        if chunks:
            self._drain(now)

    def _wait_size(self, size: int) -> float:
        return self.window + max(size - _SMALL, 0) / SIZE_RATE

    def _add_stream(self, rank: int, name: str, text: str, now: float, branch: bool = False) -> None:
        # the other stream's unfinished line came first: it must not wait behind this text
        self._flush_partials(rank, now, force=True, names=("stderr" if name == "stdout" else "stdout",))
        part = self._partials.setdefault((rank, name), _Partial())
        if not part.text:
            part.t, part.branch = now, False
        text = part.text + text
        t0, first = part.t, part.branch or branch  # a line partly written in a branch is the rank's own
        if "\r" in text:
            units, rest = split_units(text)
            for unit, cr in units:
                self._push(rank, _Item("stream", ("stream", name, unit), {"name": name, "text": unit}, t0,
                                       size=len(unit), cr=cr, branch=first))
                t0, first = now, branch
        else:
            lines, rest = _split_lines(text)
            for line in lines:
                self._push(rank, _Item("stream", ("stream", name, line), {"name": name, "text": line}, t0,
                                       size=len(line), branch=first))
                t0, first = now, branch
            units = lines
        part.text, part.t = rest, (now if units else part.t)
        part.branch = bool(rest) and (branch or (part.branch and not units))

    def _add_marked_stream(self, rank: int, content: dict, now: float) -> None:
        """Text the rank marked as its alone (``agent.solo_output(streams=True)``: rank 0's log
        line that the other ranks never print) is shown unlabelled, in its place, as it is.
        Text it made inside a branch on the rank (``if rank == 0: print(...)``) is merged as
        usual, but not held for ranks that may merely lag (see :meth:`_due`)."""
        self._split_chunks(now)
        name, text = content.get("name", "stdout"), content.get("text", "")
        mark = meta_of(content.get("metadata") if isinstance(content.get("metadata"), dict) else None)
        marked = mark.get(META_SOLO)
        if not marked or len(self.ranks) == 1:
            self._add_stream(rank, name, text, now, branch=bool(mark.get(META_BRANCH)) and len(self.ranks) > 1)
        else:
            self._flush_partials(rank, now, force=True)
            self._push(rank, _Item("stream", ("solo", rank, id(content)), {"name": name, "text": text}, now,
                                   solo=True, size=len(text)))
        self._drain(now)

    def _flush_partials(self, rank: int, now: float, force: bool = False,
                        names: tuple[str, ...] = ("stdout", "stderr")) -> None:
        for name in names:
            part = self._partials.get((rank, name))
            if part and part.text and (force or now - part.t >= self.window):
                self._push(rank, _Item("stream", ("stream", name, part.text), {"name": name, "text": part.text},
                                       part.t, size=len(part.text), partial=True, branch=part.branch))
                part.text, part.branch = "", False

    def _add_error(self, rank: int, content: dict, now: float) -> None:
        self._flush_partials(rank, now, force=True)  # keep print-then-error order
        key = _error_key(content)
        item = _Item("error", ("error", key), content, now)
        if rank in self._reply_error:
            # the reply came first (it can overtake IOPub): its error is not shown inline
            if key == self._reply_error[rank]:
                self._reply_error[rank] = ()  # matched once: () equals no error key
                return
        else:
            item.held = True
            self._held[rank].append(item)
        self._push(rank, item)

    def _resolve_errors(self, rank: int, final: bool = False) -> None:
        """Decide the held error items of ``rank``: the last one that is its reply's error is
        dropped (the merged error is published at the end); the others are ordinary output."""
        held = self._held[rank]
        if not held:
            return
        if rank in self._reply_error:
            key = self._reply_error[rank]
        elif final:
            # no reply was passed in (the rank died, or rank_replied was not called): a failed
            # rank's last error is its cell error
            key = held[-1].key[1] if rank in self.errors else None
        else:
            return
        match = next((i for i in reversed(held) if i.key[1] == key), None) if key is not None else None
        for item in held:
            item.held = False
        held.clear()
        if match is not None:
            self._remove(rank, match)
            if rank in self._reply_error:
                self._reply_error[rank] = ()

    def _add_rich(self, rank: int, msg_type: str, content: dict, now: float) -> None:
        self._flush_partials(rank, now, force=True)  # keep print-then-display order
        mark = meta_of(content.get("metadata"))
        marked = mark.get(META_SOLO)  # the rank said this output is its alone (rank_agent.solo_output)
        branch = bool(mark.get(META_BRANCH)) and not marked and len(self.ranks) > 1
        content = dict(unmarked(msg_type, content))
        solo = (self.rich_from is not None or bool(marked)) and len(self.ranks) > 1
        display_id = (content.get("transient") or {}).get("display_id")
        if display_id is not None and solo:
            # shown as the rank's alone: its ids stay its own
            content["transient"] = dict(content["transient"], display_id=namespaced_display_id(display_id, rank))
            display_id = None
        elif display_id is not None:
            content.pop("transient")
        data_key, size = _content_key(content)
        key: Hashable = (msg_type, display_id, data_key)  # identical outputs with the same id collapse
        self._push(rank, _Item(msg_type, (key, rank) if solo else key, content, now, solo=solo, size=size,
                               display_id=display_id, branch=branch))

    def _push(self, rank: int, item: _Item) -> None:
        queue = self._queues[rank]
        if not queue and len(self.ranks) > 1 and not item.in_order and not item.solo and not item.branch:
            self._realign(rank, item.key)
        queue.append(item)
        self._count(rank, item)

    def _count(self, rank: int, item: _Item) -> None:
        c = self._counts[rank]
        c[item.key] = c.get(item.key, 0) + 1
        self._bytes += item.size + _ITEM_COST

    def _cut_at_partials(self, live: list[int]) -> None:
        """A line one rank published in two pieces (its end came after the window) is cut the
        same way on the ranks that gave it whole, so that the pieces are twins."""
        queues = self._queues
        cut = next((queues[r][0] for r in live if queues[r][0].partial), None)
        if cut is None:
            return
        name, text = cut.content["name"], cut.content["text"]
        place = self._place[next(r for r in live if queues[r][0] is cut)]
        for r in live:
            head = queues[r][0]
            whole = head.content.get("text", "") if head.kind == "stream" else ""
            if (head.kind == "stream" and head.content["name"] == name and len(whole) > len(text)
                    and whole.startswith(text) and self._place[r] == place):
                queues[r].popleft()
                self._uncount(r, head)
                for piece, partial in ((whole[len(text):], head.partial), (text, False)):
                    # the rest of a piece that was itself cut short may be cut again
                    item = _Item("stream", ("stream", name, piece), {"name": name, "text": piece}, head.t,
                                 size=len(piece), cr=head.cr, partial=partial)
                    queues[r].appendleft(item)
                    self._count(r, item)

    def _realign(self, rank: int, key: Hashable) -> None:
        """``rank``'s next item is the late twin of one another rank published without it: the
        rank is at that item's place (it lagged, or gave an extra item before), and its output
        matches again. Not when another rank has the same item queued: that is its twin."""
        if any(key in c for c in self._counts.values()):
            return
        for other, recent in self._recent.items():
            place = recent.get(key) if other != rank else None
            if place is not None:
                self._place[rank] = place
                self._streak[rank] = self._streak[other] = 0
                return

    def _remove(self, rank: int, item: _Item) -> None:
        queue = self._queues[rank]
        for i, queued in enumerate(queue):
            if queued is item:
                del queue[i]
                break
        else:
            return
        self._uncount(rank, item)

    def _wait(self, item: _Item) -> float:
        """How long ``item`` waits for its twins: the window, longer for large items."""
        return self.window + max(item.size - _SMALL, 0) / SIZE_RATE

    def _pop(self, rank: int, place: bool = True, shared: bool = False) -> _Item:
        """The head item of ``rank``. ``place``: it took its place in the rank's sequence (False
        for an extra item, as a diff sees it); ``shared``: published with a twin."""
        item = self._queues[rank].popleft()
        self._uncount(rank, item)
        if place:
            if shared:
                self._recent[rank].pop(item.key, None)  # no longer a twinless item to re-align by
            else:
                recent = self._recent[rank]
                recent[item.key] = self._place[rank]
                recent.move_to_end(item.key)
                if len(recent) > _RECENT:
                    recent.popitem(last=False)
            self._place[rank] += 1
        return item

    def _uncount(self, rank: int, item: _Item) -> None:
        c = self._counts[rank]
        n = c[item.key] - 1
        if n:
            c[item.key] = n
        else:
            del c[item.key]
        self._bytes -= item.size + _ITEM_COST

    def _shared(self, ranks: Iterable[int]) -> None:
        """These ranks' outputs matched: their divergence streaks end."""
        for r in ranks:
            self._streak[r] = 0

    def _pop_own_run(self, rank: int, now: float, final: bool) -> None:
        """Fast path for floods of rank-specific lines: publish, as one labelled piece, the due
        stream lines of ``rank`` that no other rank has queued."""
        queue = self._queues[rank]
        name = queue[0].content["name"]
        texts: list[str] = []
        cr = False
        while queue:
            item = queue[0]
            if item.kind != "stream" or item.content["name"] != name or item.held or (texts and any(
                    item.key in self._counts[q] for q in self.ranks if q != rank)):
                break  # an item with a twin queued is published with it, not in this run
            due = self._due(rank, now, final)
            if not due:
                break
            if due == _DIFFERS and not item.branch:
                self._differed(rank)
            cr = cr or item.cr
            texts.append(self._pop(rank, place=not item.branch).content["text"])
        self._emit(_Item("stream", None, {"name": name, "text": "".join(texts)}, now, cr=cr), [rank])

    def _pop_common_run(self) -> bool:
        """Fast path for floods: pop the run of items that every rank has, identical, at its head;
        consecutive stream lines of one name are published as one piece of text."""
        queues = [self._queues[r] for r in self.ranks]
        counts = [self._counts[r] for r in self.ranks]
        first, others = queues[0], queues[1:]
        n = min(len(q) for q in queues)
        texts: list[str] = []
        name = None
        done = 0
        freed = 0
        while done < n:
            item = first[0]
            key = item.key
            if any(q[0].key != key for q in others) or item.kind != "stream":
                break
            if name is not None and item.content["name"] != name:
                break
            name = item.content["name"]
            texts.append(item.content["text"])
            for q, c in zip(queues, counts, strict=True):
                freed += q.popleft().size + _ITEM_COST
                k = c[key] - 1
                if k:
                    c[key] = k
                else:
                    del c[key]
            done += 1
        if texts:
            self._bytes -= freed
            for r in self.ranks:
                self._place[r] += done
            self._shared(self.ranks)
            text = "".join(texts)
            self._emit(_Item("stream", None, {"name": name, "text": text}, 0.0), None)
        return done > 0

    def _due(self, rank: int, now: float, final: bool) -> int:
        """May ``rank``'s head item be published without the twins it lacks? 0: not yet (a rank
        that may still give its twin is waited for); :data:`_DUE`; :data:`_DIFFERS`: yes, and a
        rank gave a different item at its place."""
        queue = self._queues[rank]
        head = queue[0]
        if final or len(queue) > self.max_pending or self._bytes > self.max_bytes:
            return _DUE
        place = self._place[rank]
        differs = False
        window = False  # only the window is left to wait: a twin may still come by chance
        seen: float | None = None
        for q in self.ranks:
            if q == rank:
                continue
            qq = self._queues[q]
            if qq and qq[0].key == head.key and not qq[0].held:
                continue  # its twin is at q's head: they are published together
            if head.key in self._counts[q]:
                return 0  # q queued a twin deeper: a match (or a held error's fate) decides
            if q in self._done or self._place[q] > place:
                continue  # q finished, or is past this place: its twin is gone
            diverged = self._streak[q] >= self.diverge_after
            if qq and not qq[0].held and (self._place[q] == place or diverged):
                differs = True  # q gave something else here (or, diverged, gave something else now)
                continue
            if seen is None:
                seen = self._seen_until(now)
            silent = seen - self._heard.get(q, self._start if self._start is not None else now)
            if diverged or head.branch or silent >= self.lag_bound + self._wait(head) - self.window:
                window = True
                continue
            return 0  # q has not reached this place yet and may still give the twin
        if window and now - head.t < self._wait(head):
            return 0
        return _DIFFERS if differs else _DUE

    def _differed(self, rank: int) -> None:
        """``rank``'s head differs from what the ranks at its place gave: one more for each streak."""
        place, head = self._place[rank], self._queues[rank][0]
        for q in self.ranks:
            qq = self._queues[q]
            if q == rank or (qq and self._place[q] == place and qq[0].key != head.key):
                self._streak[q] += 1

    def _drain(self, now: float, final: bool = False) -> None:
        queues, parts = self._queues, self.ranks
        while True:
            # a rank whose head is a held error waits: its later items must not overtake it
            live = [r for r in parts if queues[r] and not queues[r][0].held]
            if not live:
                return
            # output a rank marked as its own (rich_from, solo) or that only keeps its place
            # among its outputs (in_order) is never matched: at once, taking no place
            lone = next((r for r in live if queues[r][0].solo or queues[r][0].in_order), None)
            if lone is not None:
                self._emit(self._pop(lone, place=False), None)
                continue
            if len(live) > 1:
                self._cut_at_partials(live)
            if len(live) == len(parts):
                if len(parts) > 1 and not self._area_ranks and self._pop_common_run():
                    continue
                key = queues[live[0]][0].key
                if all(queues[r][0].key == key for r in live):
                    extra = any(queues[r][0].branch for r in live)  # every rank or none takes a place
                    items = [self._pop(r, place=not extra, shared=True) for r in live]
                    self._shared(live)
                    self._emit(items[0], None)
                    continue
                if self._match_deeper(live):
                    continue
            due = {r: d for r in live if (d := self._due(r, now, final))}
            if not due:
                return
            # publish every due head, in rank order, twins among the live heads together
            popped: set[int] = set()
            for r in live:
                if r not in due or r in popped:
                    continue
                head = queues[r][0]
                group = [q for q in live if q not in popped and queues[q][0].key == head.key]
                if group == [r] and head.kind == "stream" and not self._area_ranks:
                    self._pop_own_run(r, now, final)
                    popped.add(r)
                    continue
                if len(group) == 1 and due[r] == _DIFFERS and not head.branch:
                    self._differed(r)
                for q in group:  # output made in a branch on the rank is extra, as a diff sees it
                    self._pop(q, place=not head.branch, shared=len(group) > 1)
                if len(group) > 1:
                    self._shared(group)
                popped.update(group)
                self._emit(head, group)

    def _match_deeper(self, live: list[int]) -> bool:
        """Find a head item that every rank has queued; publish what precedes it, labelled, as
        items the ranks gave in addition (they take no place in the ranks' sequences)."""
        queues = self._queues
        if any(self._held.values()):
            return False  # what precedes it could be a held error
        for r in sorted(live, key=lambda q: queues[q][0].t):
            key = queues[r][0].key
            if all(self._counts[q].get(key) for q in self.ranks):
                for q in self.ranks:
                    while queues[q][0].key != key:
                        self._emit(self._pop(q, place=False), [q])
                items = [self._pop(q, shared=True) for q in self.ranks]
                self._shared(self.ranks)
                self._emit(items[0], None)
                return True
        return False

    def _emit(self, item: _Item, ranks: list[int] | None) -> None:
        """Publish ``item``; ``ranks`` None means all participants produced it."""
        if ranks is not None and len(ranks) == len(self.ranks):
            ranks = None
        multi = len(self.ranks) > 1
        group = list(self.ranks) if ranks is None else ranks
        lab = None if ranks is None else label(ranks)
        if item.in_order:
            self._out.append((item.kind, item.content))
            return
        if item.kind == "clear_output":
            if not multi or (ranks is None and not self._area_ranks):
                # every rank cleared at the same point of its output: one clear, as one process
                self._open.clear()
                self._out.append(("clear_output", item.content))
                return
            # one rank clearing alone would wipe the other ranks' output: from now on this
            # group's output is shown in its own areas, which its clears empty
            self._area_ranks.update(group)
            self._pending_clear.update(group)
            if not item.content.get("wait"):
                self._clear_areas(group)
            return
        in_area = multi and all(r in self._area_ranks for r in group)
        if item.kind == "stream":
            text = item.content["text"]
            area = self._areas.get((lab, "text"))
            progress = lab is not None and (item.cr or "\r" in text.rstrip("\n") or (
                area is not None and area.text and not area.text.endswith("\n")))
            if in_area or progress:
                self._to_area(lab, group, "text", text)
            else:
                self._emit_stream(item.content["name"], text, lab)
            return
        self._open.clear()  # a rich output starts a new output area
        content = item.content
        if item.kind == "error":
            self._out.append(("error", content if ranks is None else _labelled_error(content, ranks)))
            return
        if item.display_id is not None:
            self._emit_display(item, group)
            return
        if in_area and item.kind in ("display_data", "execute_result"):
            self._to_area(lab, group, "rich", content)
            return
        if ranks is not None and item.kind in RICH_TYPES:
            if WIDGET_VIEW in (content.get("data") or {}):
                # a frontend draws the widget alone, never the text beside it: the label goes first
                self._out.append(("display_data", _labelled_rich({"data": {"text/plain": ""}, "metadata": {}}, ranks)))
            content = _labelled_rich(content, ranks)
        self._out.append((item.kind, content))

    def _emit_display(self, item: _Item, group: list[int]) -> None:
        """Publish a display with an id, or its update: one display shows what every rank gave it."""
        display_id = item.display_id
        assert display_id is not None
        states = self.displays.set(display_id, group, item.content)
        content = {**item.content, **_combined(states, self.ranks), "transient": {"display_id": display_id}}
        if item.kind == "update_display_data":
            self._out.append(("update_display_data", content))
            return
        joined = self._joinable.get(display_id)
        if joined is not None and not joined & set(group):
            # the same display from ranks that had not shown it yet (their twins came late, or
            # differed): they join the display already there, which now shows them too
            joined.update(group)
            self._out.append(("update_display_data", content))
            return
        self._joinable[display_id] = set(group)
        self._out.append((item.kind, content))

    def _clear_areas(self, ranks: list[int]) -> None:
        """Empty every area holding output of these ranks (a clear_output of theirs took effect)."""
        self._pending_clear.difference_update(ranks)
        for area in self._areas.values():
            if area.shown and set(area.ranks) & set(ranks) and (area.text or area.kind == "rich"):
                area.text = ""
                self._show_area(area, {"data": {"text/plain": ""}, "metadata": {}})

    def _to_area(self, lab: str | None, group: list[int], kind: str, payload: object) -> None:
        due = [r for r in group if r in self._pending_clear]
        if due:
            self._clear_areas(due)
        area = self._areas.get((lab, kind))
        if area is None:
            self._area_serial += 1
            area = _Area(f"dist-kernel-area-{id(self):x}-{self._area_serial}", tuple(group), kind)
            self._areas[(lab, kind)] = area
        if kind == "text":
            area.text += str(payload)
            content = {"data": {"text/plain": _prefix_lines(render_cr(area.text), lab)}, "metadata": {}}
        else:
            content = payload if lab is None else _labelled_rich(payload, group)  # type: ignore[arg-type]
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
        if last and last[0] == "update_display_data" and last[1]["transient"]["display_id"] == area.display_id:
            self._out[-1] = ("update_display_data", content)  # only the newest state matters
        else:
            self._out.append(("update_display_data", content))

    def _emit_stream(self, name: str, text: str, prefix: str | None) -> None:
        state = self._open.get(name)
        head = ""
        if state is not None and state.label != prefix:
            head = "\n"  # close the other ranks' unfinished line first
            state = None
        if prefix:
            if state is None or state.after_cr:
                head += prefix
            # a '\r' returns to the line start: re-label after it so progress text keeps its rank
            text = re.sub(r"\r(?!\n|$)", "\r" + prefix, text)
            text = re.sub(r"\n(?!$)", "\n" + prefix, text)
        text = head + text
        if text.endswith("\n"):
            self._open.pop(name, None)
        else:
            self._open[name] = _OpenLine(prefix, after_cr=text.endswith("\r"))
        self._out.append(("stream", {"name": name, "text": text}))


def _prefix_lines(text: str, prefix: str | None) -> str:
    if not prefix:
        return text
    return "\n".join(prefix + line if line else line for line in text.split("\n"))


def _labelled_error(content: dict, ranks: Sequence[int]) -> dict:
    tb = list(content.get("traceback") or [])
    return dict(content, traceback=[f"\x1b[1;31m{label(ranks).strip()}\x1b[0m", *tb])


def _html_of(data: dict) -> str:
    """An output's best rendering as HTML, to show several ranks' outputs in one display."""
    if "text/html" in data:
        return str(data["text/html"])
    for mime in ("image/png", "image/jpeg"):
        if mime in data:
            return f"<img src='data:{mime};base64,{str(data[mime]).strip()}'/>"
    if "image/svg+xml" in data:
        return str(data["image/svg+xml"])
    return f"<pre style='margin:0'>{html.escape(str(data.get('text/plain', '')))}</pre>"


def _combined(states: dict[int, dict], ranks: Sequence[int]) -> dict:
    """The content of a display that ranks gave ``states``: the content itself when every rank
    of the cell gave the same; otherwise each group of ranks' content, labelled, one after another."""
    groups: dict[Hashable, list[int]] = {}
    for r in sorted(states):
        groups.setdefault(_content_key(states[r])[0], []).append(r)
    if len(groups) == 1:
        (group,) = groups.values()
        content = states[group[0]]
        if set(group) >= set(ranks):
            return {"data": content.get("data", {}), "metadata": content.get("metadata", {})}
        return _labelled_rich({"data": content.get("data", {}), "metadata": content.get("metadata", {})}, group)
    datas = [(g, states[g[0]].get("data") or {}) for g in groups.values()]
    data = {"text/plain": "\n".join(label(g) + str(d.get("text/plain", "")) for g, d in datas)}
    if any(m in d for _, d in datas for m in ("text/html", "image/png", "image/jpeg", "image/svg+xml")):
        data["text/html"] = "".join(f"<div><pre style='margin:0'>{label(g).strip()}</pre>{_html_of(d)}</div>"
                                    for g, d in datas)
    return {"data": data, "metadata": with_meta({}, {META_RANKS: sorted(states), META_GROUPS: [g for g, _ in datas]})}


def _labelled_rich(content: dict, ranks: Sequence[int]) -> dict:
    content = copy.deepcopy(content)
    data = content.setdefault("data", {})
    prefix = label(ranks)
    if "text/plain" in data:
        data["text/plain"] = prefix + data["text/plain"]
    if "text/html" in data:
        data["text/html"] = f"<pre style='margin:0'>{prefix.strip()}</pre>" + data["text/html"]
    meta = content.get("metadata") or {}
    content["metadata"] = with_meta(meta, {META_RANKS: list(ranks)})
    return content


# ---------------------------------------------------------------------- errors
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_CELL_NO = re.compile(r"(In\s*\[|Cell In\[)\d+(\])")


def strip_ansi(text: str) -> str:
    return _ANSI.sub("", text)


def _error_key(err: dict) -> tuple:
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
        groups.setdefault(_error_key(errors[rank]), []).append(rank)
    first = errors[min(errors)]
    if len(groups) == 1:
        failing = next(iter(groups.values()))
        where = f"all {len(ranks)} ranks" if len(failing) == len(ranks) and len(ranks) > 1 else (
            f"rank {format_ranks(failing)}")
        said = "raised this error" if len(failing) == 1 else "raised the same error"
        note = f"\x1b[1;31m[{where}]\x1b[0m {said}" if len(ranks) > 1 else None
        tb = list(first.get("traceback", []))
        return {"ename": first.get("ename", "Error"), "evalue": first.get("evalue", ""),
                "traceback": ([note] if note else []) + tb}
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
