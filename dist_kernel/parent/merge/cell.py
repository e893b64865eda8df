"""The merger of one cell: the ranks' IOPub outputs in, cut into items (stream lines, rich
outputs, errors held until their rank's reply), aligned (:mod:`.alignment`) and rendered
(:mod:`.rendering`) into the messages to publish."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

from dist_kernel.output_kinds import KINDS, STREAM, Merge, OutputKind
from dist_kernel.parent.merge.alignment import DIVERGE_AFTER, LAG_BOUND, Aligner
from dist_kernel.parent.merge.captures import capture_change
from dist_kernel.parent.merge.errors import error_key
from dist_kernel.parent.merge.labels import namespaced_display_id, unmarked_meta
from dist_kernel.parent.merge.queues import _dec
from dist_kernel.parent.merge.rendering import DisplayRegistry, Emit, Renderer
from dist_kernel.parent.merge.units import (
    Item,
    Partial,
    content_key,
    split_lines,
    split_units,
    stream_key,
    wait_for_size,
)
from dist_kernel.protocol import META_BRANCH, META_SOLO, meta_of

#: how long an ``error`` item that later output of its rank follows waits for the rank's
#: reply to say whether it is the cell's error (post-execute hooks, such as inline figures,
#: publish between the cell's error and its reply)
ERROR_HOLD = 1.0
_NAMES = ("stdout", "stderr")
_LINES, _RICH, _ERROR, _CLEAR = Merge.LINES, Merge.RICH, Merge.ERROR, Merge.CLEAR  # globals: fast to compare


def _error_of(item: Item) -> Hashable:
    """The error key of an ``error`` item (its key is ``("error", error_key)``: the kind's name first)."""
    assert isinstance(item.key, tuple)
    return item.key[1]


@dataclass
class CellMerger(Aligner):
    """Merges one cell's outputs from ``ranks``; see :mod:`dist_kernel.parent.merge`."""

    ranks: Sequence[int]  # a tuple once constructed
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
        self._init_queues(self.ranks)
        self._init_alignment()
        self._render = Renderer(self.ranks, self.displays)
        self._partials: dict[int, dict[str, Partial]] = {}  # rank -> stream name -> its unfinished line
        self._unfinished: set[int] = set()  # ranks with an unfinished line (text in a partial)
        self._partial_seq = 0
        self._reply_error: dict[int, Hashable | None] = {}  # rank -> its reply's error key (None: ok)
        # rank -> a whole stream chunk (name, text, arrival) not split into lines yet: when every
        # rank sends the same chunk, it is published once as it is (see _add_chunk)
        self._chunks: dict[int, tuple[str, str, float]] = {}
        self._chunks_since = 0.0  # when the first waiting chunk arrived
        self._done_chunked = 0  # finished ranks whose chunk waits
        self._capturing: dict[int, set[Hashable]] = {}  # rank -> the Output widgets it captures into now

    # ----------------------------------------------------------------- input
    def add(self, rank: int, msg_type: str, content: dict, now: float, sent: float | None = None,
            settle: bool = True) -> None:
        """Feed one IOPub output of ``rank`` (a kind whose route is output in
        :mod:`dist_kernel.output_kinds`), which arrived ``now`` and was sent at ``sent`` (the
        parent's clock; default: now). ``settle=False``: more follow at once (a node's turn),
        and :meth:`settle` after them publishes what they let go."""
        self._hear(rank, now, sent)
        kind = KINDS[msg_type]
        merge = kind.merge  # how its row says to merge it
        if merge is _LINES:
            if "metadata" in content:
                self._add_marked_stream(rank, content, now)
                return
            if self._add_chunk(rank, content.get("name", "stdout"), content.get("text", ""), now):
                return
        if self._chunks:
            self._split_chunks(now)
        if merge is _LINES:
            self._add_stream(rank, content.get("name", "stdout"), content.get("text", ""), now)
        elif merge is _ERROR:
            self._add_error(rank, kind, content, now)
        elif merge is _RICH:
            if self.rich_from is not None and rank != self.rich_from:
                return
            self._add_rich(rank, kind, content, now)
        elif merge is _CLEAR:
            self._add_clear(rank, kind, content, now)
        if settle:
            self._drain(now)

    def add_in_order(self, rank: int, msg_type: str, content: dict, now: float) -> None:
        """Feed a message that is never merged or labelled but must reach the frontend in its
        place among ``rank``'s outputs (an ipywidgets ``Output`` starting or stopping a
        capture: what the rank printed before must land before it). Errors the rank showed
        before it were survived: they are ordinary output."""
        self._hear(rank, now, None)
        self._split_chunks(now)
        self._flush_partials(rank, now, force=True)
        for item in self._held.pop(rank, ()):
            item.held = False
        change = capture_change(content)
        if change is not None:  # what the rank makes from now on goes inside the widget, or not
            widgets = self._capturing.setdefault(rank, set())
            (widgets.add if change[1] else widgets.discard)(change[0])
            if not widgets:
                del self._capturing[rank]
        self._push(rank, Item(KINDS[msg_type], ("in_order", rank, id(content)), content, now, in_order=True))
        self._drain(now)

    def rank_replied(self, rank: int, reply: dict, now: float, settle: bool = True) -> None:
        """``rank``'s ``execute_reply`` content arrived: it decides the rank's status and error.
        ``settle=False``: many ranks' at once, :meth:`settle` follows them."""
        failed = reply.get("status") == "error"
        if failed:
            self.errors.setdefault(rank, {k: reply.get(k) for k in ("ename", "evalue", "traceback")})
        self._reply_error[rank] = error_key(reply) if failed else None
        self._resolve_errors(rank)
        if settle:
            self._drain(now)

    def ranks_replied(self, ranks: list[int], reply: dict, now: float) -> None:
        """:meth:`rank_replied` for ranks that sent one same reply (a node's group), settled by
        the caller (:meth:`settle`); an ``ok`` reply costs a rank no more than a dict entry."""
        if reply.get("status") == "error" or self._held:
            for rank in ranks:
                self.rank_replied(rank, reply, now, settle=False)
            return
        self._reply_error.update(dict.fromkeys(ranks))  # None: no error

    def ranks_done(self, ranks: list[int], now: float, settle: bool = True) -> None:
        """:meth:`rank_done` for several ranks at once. A rank with nothing waiting in the merger
        (no queued item, unfinished line, held error or chunk: most ranks of a quiet cell) is
        only counted done; the others take the whole path."""
        chunks, unfinished, held, queued, done = self._chunks, self._unfinished, self._held, self._queued, self._done
        quiet = [r for r in ranks if not (r in chunks or r in unfinished or r in held or r in queued or r in done)]
        if quiet:
            if self._chunks:  # a rank that ends without the waiting chunk: the chunks differ
                self._split_chunks(now)
            for rank in quiet:
                _dec(self._undone_places, self._place[rank])
            self._done.update(quiet)
            self._idle.difference_update(quiet)
            self._quiet.difference_update(quiet)
        if len(quiet) < len(ranks):
            marked = set(quiet)
            for rank in ranks:
                if rank not in marked:
                    self.rank_done(rank, now, settle=False)
        if settle:
            self._drain(now)

    def settle(self, now: float) -> None:
        """Publish what the ranks' replies or ends let go (after calls with ``settle=False``)."""
        self._drain(now)

    def rank_done(self, rank: int, now: float, settle: bool = True) -> None:
        """``rank`` will send nothing more for this cell."""
        if rank not in self._chunks:  # its chunk, if any, still waits for its twins
            self._split_chunks(now)
        elif rank not in self._done:
            self._done_chunked += 1
        self._drop_last_cr(rank)
        self._flush_partials(rank, now, force=True)
        self._resolve_errors(rank, final=True)
        self._mark_done(rank)
        if settle:
            self._drain(now)

    def poll(self, now: float) -> None:
        """Let waiting items and unfinished lines time out."""
        if self._start is None:
            self._start = now
        # the chunks are one text: the first to arrive is the first to time out
        if self._chunks and now - self._chunks_since >= wait_for_size(self.window, len(next(iter(self._chunks.values()))[1])):
            self._split_chunks(now)
        due = []
        for rank in self._unfinished:
            # a lone '\r' waits for the text that follows it (a progress bar's next state)
            seqs = [p.seq for p in self._partials[rank].values()
                    if p.text and p.text != "\r" and now - p.t >= self.window]
            if seqs:
                due.append((min(seqs), rank))
        for _, rank in sorted(due):  # in the order the lines were first made, as ever
            self._flush_partials(rank, now, force=True)
        for rank, held in list(self._held.items()):
            # the rank printed more and ERROR_HOLD passed without its reply: it is still
            # running, so this error was shown and survived (a swallowed exception)
            for item in [i for i in held if now - i.t >= ERROR_HOLD and i is not self._queues[rank][-1]]:
                item.held = False
                held.remove(item)
            if not held:
                del self._held[rank]
        self._drain(now)

    def finish(self, now: float) -> None:
        """The cell is over: publish everything still held."""
        self._split_chunks(now)
        for rank in self.ranks:
            if rank in self._done and rank not in self._held and rank not in self._unfinished:
                continue  # rank_done did all this, and nothing came after
            self._drop_last_cr(rank)
            self._flush_partials(rank, now, force=True)
            self._resolve_errors(rank, final=True)
            self._mark_done(rank)
        self._drain(now, final=True)
        self._release()

    def late(self, rank: int, msg_type: str, content: dict, labelled: bool) -> list[Emit]:
        """Output of ``rank`` that arrived after the cell ended (a background thread): the
        messages to publish, labelled with the rank when ``labelled``, display ids resolved
        as in the cell."""
        self._render.late(rank, msg_type, content, labelled)
        return self.take()

    @property
    def ready(self) -> bool:
        """Is there output to publish?"""
        return self._render.ready

    @property
    def pending(self) -> int:
        """Items and unfinished lines not published yet."""
        return (sum(len(self._queues[r]) for r in self._queued) + len(self._chunks)
                + sum(1 for r in self._unfinished for p in self._partials[r].values() if p.text))

    def take(self) -> list[Emit]:
        """Messages to publish now, consecutive stream text of one name coalesced."""
        return self._render.take()

    def _push(self, rank: int, item: Item) -> None:
        if rank in self._capturing and not item.in_order:
            item.captured = True  # shown inside the widget (see :mod:`.captures`)
        super()._push(rank, item)

    # ----------------------------------------------------------------- chunks
    def _add_chunk(self, rank: int, name: str, text: str, now: float) -> bool:
        """Fast path for identical output (issue 14): a stream chunk of whole lines that arrives
        when nothing of any rank is queued before it waits whole for the same chunk from the
        other ranks; when every rank has sent it, it is published once, never split into
        lines. False: the chunk takes the line-by-line path (anything waiting is split first)."""
        if (not text.endswith("\n") or rank in self._chunks or self._render.area_ranks or rank in self._done
                or self._capturing or len(self._places) > 1  # a widget captures; the ranks are not at one place
                or self._queued or self._unfinished or len(self._done) > self._done_chunked):
            return False
        if self._chunks and next(iter(self._chunks.values()))[:2] != (name, text):
            return False
        self._chunks_since = min(self._chunks_since, now) if self._chunks else now
        self._chunks[rank] = (name, text, now)
        if len(self._chunks) == len(self.ranks):
            self._chunks.clear()
            self._done_chunked = 0
            self._emit(Item(STREAM, None, {"name": name, "text": text}, now), None)
        return True

    def _split_chunks(self, now: float) -> None:
        """The waiting chunks take the line-by-line path after all, each at its arrival time."""
        chunks, self._chunks = self._chunks, {}
        self._done_chunked = 0
        for rank, (name, text, t) in chunks.items():
            self._add_stream(rank, name, text, t)
        if chunks:
            self._drain(now)

    # ----------------------------------------------------------------- lines
    def _add_stream(self, rank: int, name: str, text: str, now: float, branch: bool = False) -> None:
        # the other stream's unfinished line came first: it must not wait behind this text
        self._flush_partials(rank, now, force=True, names=("stderr" if name == "stdout" else "stdout",))
        parts = self._partials.setdefault(rank, {})
        part = parts.get(name)
        if part is None:
            part = parts[name] = Partial(seq=self._partial_seq)
            self._partial_seq += 1
        if not part.text:
            part.t, part.branch = now, False
        text = part.text + text
        t0, first = part.t, part.branch or branch  # a line partly written in a branch is the rank's own
        if "\r" in text:
            units, rest = split_units(text)
            made = bool(units)
            for unit, cr in units:
                self._push(rank, Item(STREAM, stream_key(name, unit, cr), {"name": name, "text": unit}, t0,
                                      size=len(unit), cr=cr, branch=first))
                t0, first = now, branch
        else:
            lines, rest = split_lines(text)
            made = bool(lines)
            for line in lines:
                self._push(rank, Item(STREAM, ("stream", name, line), {"name": name, "text": line}, t0,
                                      size=len(line), branch=first))
                t0, first = now, branch
        part.text, part.t = rest, (now if made else part.t)
        part.branch = bool(rest) and (branch or (part.branch and not made))
        self._note_unfinished(rank)

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
            self._push(rank, Item(STREAM, ("solo", rank, id(content)), {"name": name, "text": text}, now,
                                  solo=True, size=len(text)))
        self._drain(now)

    def _flush_partials(self, rank: int, now: float, force: bool = False, names: tuple[str, ...] = _NAMES) -> None:
        parts = self._partials.get(rank)
        if not parts:
            return
        for name in names:
            part = parts.get(name)
            if part and part.text and (force or now - part.t >= self.window):
                self._push(rank, Item(STREAM, ("stream", name, part.text), {"name": name, "text": part.text},
                                      part.t, size=len(part.text), partial=True, branch=part.branch))
                part.text, part.branch = "", False
        self._note_unfinished(rank)

    def _drop_last_cr(self, rank: int) -> None:
        """A '\\r' that ends a rank's output, nothing written after it, changes nothing shown: it
        is not published (alone, it would be an empty output of its own)."""
        for part in self._partials.get(rank, {}).values():
            if part.text == "\r":
                part.text = ""
        self._note_unfinished(rank)

    def _note_unfinished(self, rank: int) -> None:
        if any(p.text for p in self._partials.get(rank, {}).values()):
            self._unfinished.add(rank)
        else:
            self._unfinished.discard(rank)

    # ---------------------------------------------------------- rich, errors
    def _add_error(self, rank: int, kind: OutputKind, content: dict, now: float) -> None:
        self._flush_partials(rank, now, force=True)  # keep print-then-error order
        key = error_key(content)
        item = Item(kind, (kind.name, key), content, now)
        if rank in self._reply_error:
            # the reply came first (it can overtake IOPub): its error is not shown inline
            if key == self._reply_error[rank]:
                self._reply_error[rank] = ()  # matched once: () equals no error key
                return
        else:
            item.held = True
            self._held.setdefault(rank, []).append(item)
        self._push(rank, item)

    def _resolve_errors(self, rank: int, final: bool = False) -> None:
        """Decide the held error items of ``rank``: the last one that is its reply's error is
        dropped (the merged error is published at the end); the others are ordinary output."""
        held = self._held.get(rank)
        if not held:
            return
        if rank in self._reply_error:
            key = self._reply_error[rank]
        elif final:
            # no reply was passed in (the rank died, or rank_replied was not called): a failed
            # rank's last error is its cell error
            key = _error_of(held[-1]) if rank in self.errors else None
        else:
            return
        match = next((i for i in reversed(held) if _error_of(i) == key), None) if key is not None else None
        for item in held:
            item.held = False
        del self._held[rank]
        if match is not None:
            self._remove(rank, match)
            if rank in self._reply_error:
                self._reply_error[rank] = ()

    def _add_clear(self, rank: int, kind: OutputKind, content: dict, now: float) -> None:
        # an unfinished line belongs before the clear: held back, it would join the next line
        self._flush_partials(rank, now, force=True)
        # a clear inside an Output widget (a progress widget that rank 0 alone redraws) is an
        # extra, as a branch's output is: it takes no place, so what the ranks print after
        # the widget's loop still meets its twins; its twins (every rank clearing) go out once
        self._push(rank, Item(kind, (kind.name, bool(content.get("wait"))), content, now,
                              branch=rank in self._capturing and len(self.ranks) > 1))

    def _add_rich(self, rank: int, kind: OutputKind, content: dict, now: float) -> None:
        self._flush_partials(rank, now, force=True)  # keep print-then-display order
        mark = meta_of(content.get("metadata"))
        marked = mark.get(META_SOLO)  # the rank said this output is its alone (rank_agent.solo_output)
        branch = bool(mark.get(META_BRANCH)) and not marked and len(self.ranks) > 1
        content = dict(unmarked_meta(content))
        solo = (self.rich_from is not None or bool(marked)) and len(self.ranks) > 1
        display_id = (content.get("transient") or {}).get("display_id")
        if display_id is not None and solo:
            # shown as the rank's alone: its ids stay its own
            content["transient"] = dict(content["transient"], display_id=namespaced_display_id(display_id, rank))
            display_id = None
        elif display_id is not None:
            content.pop("transient")
        data_key, size = content_key(content)
        key: Hashable = (kind.name, display_id, data_key)  # identical outputs with the same id collapse
        self._push(rank, Item(kind, (key, rank) if solo else key, content, now, solo=solo, size=size,
                              display_id=display_id, branch=branch))
