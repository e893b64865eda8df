"""Alignment: which queued items are twins, and when an item may be published without the twins
it lacks. It hands each item to rendering with the ranks that gave it (``_emit(item, ranks)``).

The ranks' queues are aligned like a diff, by sequence, not by the clock: the k-th item of a rank
is the candidate twin of the k-th item of the others. An item waits for a rank that has not
reached its place yet while that rank runs the cell, has been silent for less than
:data:`LAG_BOUND` (in send times) and has not kept giving different items (:data:`DIVERGE_AFTER`).
A rank whose next item at that place was made in a branch on the rank, or is a line of the other
stream (stdout and stderr are sent apart: a library's flushed stderr line overtakes the prints
made before it), has not given something else there yet: it is waited for as a lagging rank is,
and a twinless line published beside the other stream's line takes no place (:meth:`_beside`).

What is decided per item does not grow with the number of ranks: a rank that has not printed yet
blocks every queued item at once (:meth:`Aligner._blocked`), and an item whose twins are all at
their ranks' heads is decided from the ranks counted by place and head (:meth:`Aligner._due`)."""

from __future__ import annotations

from collections.abc import Hashable

from dist_kernel.parent.merge.queues import RankQueues
from dist_kernel.parent.merge.rendering import Renderer
from dist_kernel.parent.merge.units import Item, stream_key, wait_for_size

#: how long an item waits for a rank that has not reached its place yet and has been silent
#: (no output in this cell) meanwhile: a rank that lags by less than this is merged, however far
#: behind it is in items; a rank that printed nothing for this long is not waited for
LAG_BOUND = 5.0
#: a rank whose items differed from the others' at the same place this many times in a row is
#: not waited for beyond the window, until its output matches again
DIVERGE_AFTER = 4
_DUE, _DIFFERS = 1, 2  # Aligner._due's answers besides 0 (wait)
_OTHER = {"stdout": "stderr", "stderr": "stdout"}


def _slowest(items: list[Item]) -> Item:
    """Which of twin items is published: the first, or of progress states that may differ in their
    rates and times (:func:`~.units.progress_key`), the one that came last: the slowest rank's."""
    return max(items, key=lambda i: i.t) if items[0].cr else items[0]


def _soft(head: Item, other: Item) -> bool:
    """Does a rank whose next item is ``other``, at ``head``'s place, not (yet) show that it gave
    something else than ``head`` there? ``other`` was made in a branch on the rank (it takes no
    place), or it is a line of the other stream: a rank's stdout and stderr are sent apart, so
    its stderr line (a library logging on rank 0 only) may overtake the stdout twin it printed
    first. ``head`` itself made in a branch waits for no one (it waits the window only)."""
    if head.branch:
        return False
    if other.branch:
        return True
    return (head.kind.lines and other.kind.lines
            and head.content["name"] != other.content["name"])


class Aligner(RankQueues):
    """Publishes queued items, twins together, in each rank's order; see the module docstring."""

    window: float
    max_bytes: int
    lag_bound: float
    diverge_after: int
    _render: Renderer

    def _init_alignment(self) -> None:
        self._heard: dict[int, float] = {}  # rank -> when it sent its newest output
        self._lag: dict[int, float] = {}  # rank -> how long its newest output took to reach the merger
        self._lag_max, self._lag_argmax = 0.0, -1
        self._start: float | None = None
        self._blocker: int | None = None  # the rank that last kept every queued item waiting
        self._quiet_seen = float("-inf")  # the view at which the quiet ranks were found silent

    def _emit(self, item: Item, ranks: list[int] | None) -> None:
        """Hand ``item`` to rendering; ``ranks`` None means every rank of the cell gave it."""
        self._render.emit(item, ranks)

    # --------------------------------------------------------------- silence
    def _hear(self, rank: int, now: float, sent: float | None) -> None:
        """Silence is measured in send times: what waited between the rank and the merger
        (the rank's IOPub thread, the sockets, a parent behind a flood) is not the rank's."""
        sent = now if sent is None else min(sent, now)
        self._heard[rank] = max(sent, self._heard.get(rank, sent))
        lag = self._lag[rank] = now - sent
        if lag >= self._lag_max:
            self._lag_max, self._lag_argmax = lag, rank
        elif rank == self._lag_argmax:  # the slowest rank got faster: once in its messages only
            self._lag_argmax = max(self._lag, key=self._lag.__getitem__)
            self._lag_max = self._lag[self._lag_argmax]
        if self._start is None:
            self._start = sent
        if rank in self._quiet:
            self._quiet.discard(rank)
            if rank not in self._queued:
                self._idle.add(rank)

    def _seen_until(self, now: float) -> float:
        """How far the merger's view of the ranks reaches: ``now`` less the delivery lag of the
        slowest rank's newest output (a rank's later output may still be on its way)."""
        return now - self._lag_max

    def _blocked(self, now: float) -> bool:
        """Is there a rank that keeps every queued item waiting: unfinished, nothing queued, at or
        before every queued rank's place, not diverged, and not silent? (Then no head is due, as
        :meth:`_due` would find rank by rank.) The last such rank is tried first."""
        if not self._idle:
            return False
        seen = self._seen_until(now)
        if seen < self._quiet_seen:  # the view reaches less far than when they fell quiet
            self._idle |= self._quiet - self._queued
            self._quiet.clear()
            self._quiet_seen = float("-inf")
        low = min(self._q_places)
        # silent as _due_scan reckons it for the smallest item (the shortest wait), to the last bit
        bound = self.lag_bound + self.window - self.window
        start = self._start if self._start is not None else now
        b = self._blocker
        if (b is not None and b in self._idle and seen - self._heard.get(b, start) < bound
                and self._place[b] <= low and self._streak[b] < self.diverge_after):
            return True
        quiet = []
        for q in self._idle:
            if seen - self._heard.get(q, start) >= bound:
                quiet.append(q)  # silent: it is not waited for until it is heard from again
            elif self._place[q] <= low and self._streak[q] < self.diverge_after:
                self._blocker = q
                break
        else:
            self._blocker = None
        if quiet:
            self._idle.difference_update(quiet)
            self._quiet.update(quiet)
            self._quiet_seen = max(self._quiet_seen, seen)
        return self._blocker is not None

    # ---------------------------------------------------------------- drain
    def _drain(self, now: float, final: bool = False) -> None:
        queues = self._queues
        while True:
            if not self._queued:
                return
            if (not final and not self._unusual and not self._over and self._bytes <= self.max_bytes
                    and self._blocked(now)):
                return  # a rank that has not printed yet may still give every head its twin
            # a rank whose head is a held error waits: its later items must not overtake it
            live = [r for r in sorted(self._queued, key=self._index.__getitem__) if not queues[r][0].held]
            if not live:
                return
            # output a rank marked as its own (rich_from, solo) or that only keeps its place
            # among its outputs (in_order) is never matched: at once, taking no place
            lone = next((r for r in live if queues[r][0].solo or queues[r][0].in_order), None) if self._unusual else None
            if lone is not None:
                self._emit(self._pop(lone, place=False), None)
                continue
            if len(live) > 1:
                self._cut_at_partials(live)
            if len(live) == len(self.ranks):
                if len(live) > 1 and not self._render.area_ranks and self._pop_common_run():
                    continue
                key = queues[live[0]][0].key
                if all(queues[r][0].key == key for r in live):
                    extra = any(queues[r][0].branch for r in live)  # every rank or none takes a place
                    items = [self._pop(r, place=not extra, shared=True) for r in live]
                    self._shared(live)
                    self._emit(_slowest(items), None)
                    continue
                if self._match_deeper(live):
                    continue
            due = {r: d for r in live if (d := self._due(r, now, final))}
            if not due:
                return
            self._publish_due(live, due, now, final)

    def _publish_due(self, live: list[int], due: dict[int, int], now: float, final: bool) -> None:
        """Publish every due head, in rank order, twins among the live heads together."""
        queues = self._queues
        by_key: dict[Hashable, list[int]] = {}
        for q in live:  # only popped ranks' heads change below: the grouping stays true
            by_key.setdefault(queues[q][0].key, []).append(q)
        popped: set[int] = set()
        for r in live:
            if r not in due or r in popped:
                continue
            group = [q for q in by_key[queues[r][0].key] if q not in popped]
            head = _slowest([queues[q][0] for q in group])
            if group == [r] and head.kind.lines and not self._render.area_ranks:
                self._pop_own_run(r, now, final)
                popped.add(r)
                continue
            extra = head.branch or (len(group) == 1 and self._beside(head, self._place[r]))
            if len(group) == 1 and due[r] == _DIFFERS and not extra:
                self._differed(r)
            for q in group:  # output made in a branch on the rank is extra, as a diff sees it
                self._pop(q, place=not extra, shared=len(group) > 1)
            if len(group) > 1:
                self._shared(group)
            popped.update(group)
            self._emit(head, group)

    def _due(self, rank: int, now: float, final: bool) -> int:
        """May ``rank``'s head item be published without the twins it lacks? 0: not yet (a rank
        that may still give its twin is waited for); :data:`_DUE`; :data:`_DIFFERS`: yes, and a
        rank gave a different item at its place."""
        queue = self._queues[rank]
        head = queue[0]
        if final or len(queue) > self.max_pending or self._bytes > self.max_bytes:
            return _DUE
        place = self._place[rank]
        if not self._held and self._heads[head.key] == self._holders[head.key]:
            # every rank that has this item has it next (its twins, published with it): where the
            # other unfinished ranks are decides, counted by place
            here = self._qu_places.get(place, 0)
            behind = sum(n for p, n in self._undone_places.items() if p <= place) - here
            if not behind and not self._soft_here(head, place):
                # every other unfinished rank at or before this place has an item here
                return _DIFFERS if here - self._heads_at.get((place, head.key), 0) else _DUE
        return self._due_scan(rank, head, now)

    def _due_scan(self, rank: int, head: Item, now: float) -> int:
        """:meth:`_due`, rank by rank: where some rank may still give this item's twin."""
        place = self._place[rank]
        differs = False
        window = False  # only the window is left to wait: a twin may still come by chance
        seen: float | None = None
        wait = wait_for_size(self.window, head.size)
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
            diverged = self.streak(q) >= self.diverge_after
            if qq and not qq[0].held and not diverged and self._place[q] == place and _soft(head, qq[0]):
                # q's head does not show that q gave something else here: q may still give the
                # twin after it, as a lagging rank would (a branch item is published within the
                # window; the other stream's line waits at most the lag bound)
                if qq[0].branch or now - head.t < self.lag_bound:
                    return 0
            if qq and not qq[0].held and (self._place[q] == place or diverged):
                differs = True  # q gave something else here (or, diverged, gave something else now)
                continue
            if seen is None:
                seen = self._seen_until(now)
            silent = seen - self._heard.get(q, self._start if self._start is not None else now)
            if diverged or head.branch or silent >= self.lag_bound + wait - self.window:
                window = True
                continue
            return 0  # q has not reached this place yet and may still give the twin
        if window and now - head.t < wait:
            return 0
        return _DIFFERS if differs else _DUE

    def _soft_here(self, head: Item, place: int) -> bool:
        """Is a rank queued at ``place`` whose head may not be the place's item but what it gave
        besides (:func:`_soft`)? Then the ranks are looked at one by one."""
        if head.branch or not self._soft_at:
            return False
        if self._soft_at.get((place, "branch")):
            return True
        return head.kind.lines and bool(self._soft_at.get((place, _OTHER.get(head.content["name"]))))

    def _beside(self, head: Item, place: int) -> bool:
        """Is ``head``, published without twins, a line given beside another rank's line of the
        other stream at its place? Then it is an extra, as a diff sees it, not what the rank gave
        instead of that line (a rank's stdout and stderr are sent apart: their order between
        each other is not the one they were written in), and takes no place."""
        other = _OTHER.get(head.content["name"]) if head.kind.lines else None
        return other is not None and bool(self._streams_at.get((place, other)))

    def _differed(self, rank: int) -> None:
        """``rank``'s head differs from what the ranks at its place gave: one more for each streak
        (the ranks queued at its place with another head owe it: see :meth:`RankQueues.streak`)."""
        place, key = self._place[rank], self._queues[rank][0].key
        self._bumps[place] = self._bumps.get(place, 0) + 1
        self._bumps_key[(place, key)] = self._bumps_key.get((place, key), 0) + 1
        self._streak[rank] += 1

    # ------------------------------------------------------------ fast paths
    def _pop_own_run(self, rank: int, now: float, final: bool) -> None:
        """Fast path for floods of rank-specific lines: publish, as one labelled piece, the due
        stream lines of ``rank`` that no other rank has queued."""
        queue = self._queues[rank]
        name = queue[0].content["name"]
        texts: list[str] = []
        kind, cr, captured = queue[0].kind, queue[0].cr, queue[0].captured
        while queue:
            item = queue[0]
            if not item.kind.lines or item.content["name"] != name or item.held or (texts and (
                    self._holders[item.key] > 1 or item.cr != cr or item.captured != captured)):
                # an item with a twin queued is published with it, not in this run; a progress
                # state is drawn on its bar, and what a widget captured goes inside it, apart
                break
            due = self._due(rank, now, final)
            if not due:
                break
            extra = item.branch or self._beside(item, self._place[rank])
            if due == _DIFFERS and not extra:
                self._differed(rank)
            texts.append(self._pop(rank, place=not extra).content["text"])
        self._emit(Item(kind, None, {"name": name, "text": "".join(texts)}, now, cr=cr, captured=captured), [rank])

    def _pop_common_run(self) -> bool:
        """Fast path for floods: pop the run of items that every rank has, identical, at its head;
        consecutive stream lines of one name are published as one piece of text."""
        queues = [self._queues[r] for r in self.ranks]
        first, others = queues[0], queues[1:]
        item = first[0]
        if not item.kind.lines or any(q[0].key != item.key for q in others):
            return False
        n = min(len(q) for q in queues)
        for r in self.ranks:
            self._before(r)
        texts: list[str] = []
        kind, name, cr, captured = item.kind, item.content["name"], item.cr, item.captured
        done = 0
        while done < n:
            item = first[0]
            key = item.key
            if (not item.kind.lines or item.content["name"] != name or item.cr != cr
                    or item.captured != captured or any(q[0].key != key for q in others)):
                break
            texts.append((_slowest([q[0] for q in queues]) if cr else item).content["text"])
            for r, q in zip(self.ranks, queues, strict=True):
                self._uncount(r, q.popleft())
            done += 1
        for r in self.ranks:
            self._move(r, self._place[r] + done)
            self._after(r)
        self._shared(self.ranks)
        self._emit(Item(kind, None, {"name": name, "text": "".join(texts)}, 0.0, cr=cr, captured=captured), None)
        return True

    def _match_deeper(self, live: list[int]) -> bool:
        """Find a head item that every rank has queued; publish what precedes it, labelled, as
        items the ranks gave in addition (they take no place in the ranks' sequences)."""
        queues = self._queues
        if self._held:
            return False  # what precedes it could be a held error
        for r in sorted(live, key=lambda q: queues[q][0].t):
            key = queues[r][0].key
            if self._holders[key] == len(self.ranks):
                for q in self.ranks:
                    while queues[q][0].key != key:
                        item = self._pop(q, place=False)
                        # output a rank marked as its alone is shown unlabelled, as at the head
                        self._emit(item, None if item.solo or item.in_order else [q])
                items = [self._pop(q, shared=True) for q in self.ranks]
                self._shared(self.ranks)
                self._emit(_slowest(items), None)
                return True
        return False

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
            whole = head.content.get("text", "") if head.kind.lines else ""
            if (head.kind.lines and head.content["name"] == name and len(whole) > len(text)
                    and whole.startswith(text) and self._place[r] == place):
                self._before(r)
                queues[r].popleft()
                self._uncount(r, head)
                for piece, partial in ((whole[len(text):], head.partial), (text, False)):
                    # the rest of a piece that was itself cut short may be cut again
                    item = Item(head.kind, stream_key(name, piece, head.cr), {"name": name, "text": piece}, head.t,
                                size=len(piece), cr=head.cr, partial=partial, captured=head.captured)
                    queues[r].appendleft(item)
                    self._count(r, item)
                self._after(r)

