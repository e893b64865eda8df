"""The ranks' queues of items, and the counters that let the alignment decide without looking
at every rank: which ranks have output queued, at which place, how many ranks queued each key.

Every change of a queue or of a rank's place goes through :meth:`RankQueues._before` and
:meth:`RankQueues._after`, which keep the counters true; the work per item does not grow with
the number of ranks (issue 26)."""

from __future__ import annotations

from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Hashable, Iterable, Sequence

from dist_kernel.parent.merge.units import ITEM_COST, Item

#: recently published items of each rank that had no twin, remembered by content so that a late
#: twin re-aligns its rank (a lagging rank that gave one extra item is matched again at once)
_RECENT = 4096


def _dec(counter: dict, key: Hashable) -> None:
    n = counter[key] - 1
    if n:
        counter[key] = n
    else:
        del counter[key]


def _soft_tag(item: Item) -> Hashable | None:
    """Why a rank whose head is ``item`` may still give, after it, the twin of another rank's item
    at the same place: ``"branch"`` (an item made in a branch on the rank takes no place), or the
    stream's name (a rank's stdout and stderr are buffered and sent apart, so their order between
    each other is not the order the rank wrote them in); None: neither."""
    if item.branch:
        return "branch"
    if item.kind.lines:
        return item.content["name"]
    return None


def _stream_name(item: Item) -> str | None:
    """The stream of a line that takes a place (not made in a branch); None for anything else."""
    return item.content["name"] if item.kind.lines and not item.branch else None


class RankQueues:
    """Per rank: its queue, its place in the cell's sequence of items, when it was last heard
    from, and how often in a row its items differed from the others' (its streak)."""

    ranks: Sequence[int]  # a tuple, set by CellMerger
    max_pending: int

    def _init_queues(self, ranks: Sequence[int]) -> None:
        # made on a rank's first item: most cells leave most ranks' queues empty, and a cell's
        # merger outlives it a while (late output): no per-rank objects for the collector to walk
        self._queues: dict[int, deque[Item]] = defaultdict(deque)
        self._counts: dict[int, dict[Hashable, int]] = defaultdict(dict)
        self._holders: dict[Hashable, int] = {}  # key -> ranks that have it queued
        self._heads: dict[Hashable, int] = {}  # key -> ranks whose next item it is
        self._heads_at: dict[tuple[int, Hashable], int] = {}  # (place, key) -> unfinished ranks, likewise
        # (place, tag) -> unfinished ranks queued there whose head is not comparable with every
        # item at that place (see :func:`_soft_tag`): the alignment looks closer where there are any
        self._soft_at: dict[tuple[int, Hashable], int] = {}
        self._streams_at: dict[tuple[int, str], int] = {}  # (place, name) -> ranks queued there with a line of it next
        self._queued: set[int] = set()  # ranks with output queued
        # queued items the alignment must look at even while a rank keeps every head waiting:
        # special ones (Item.special) and pieces of a line (Item.partial: twins are cut to match)
        self._unusual = 0
        self._over: set[int] = set()  # ranks with more than max_pending items queued
        self._bytes = 0
        self._done: set[int] = set()
        self._held: dict[int, list[Item]] = {}  # rank -> its held error items, in order (never empty)
        # alignment by sequence: the place of each rank's next item (items that were extras of the
        # rank, as a diff sees them, take no place), and where the ranks are, counted by place
        self._place: dict[int, int] = dict.fromkeys(ranks, 0)
        self._places: Counter[int] = Counter({0: len(ranks)})  # place -> ranks there
        self._q_places: Counter[int] = Counter()  # place -> ranks with output queued there
        self._qu_places: Counter[int] = Counter()  # place -> unfinished ranks with output queued there
        self._undone_places: Counter[int] = Counter({0: len(ranks)})  # place -> unfinished ranks there
        self._idle: set[int] = set(ranks)  # unfinished ranks with nothing queued, not known silent
        self._quiet: set[int] = set()  # unfinished ranks silent past the lag bound (see Aligner._blocked)
        # divergence streaks, bumped lazily: a rank with output queued at place p and head key k
        # owes the _differed calls at p by ranks whose head was not k since its mark
        self._streak: dict[int, int] = dict.fromkeys(ranks, 0)
        self._mark: dict[int, int] = {}
        self._bumps: dict[int, int] = {}
        self._bumps_key: dict[tuple[int, Hashable], int] = {}
        self._recent: dict[int, OrderedDict[Hashable, int]] = defaultdict(OrderedDict)
        self._recent_by_key: dict[Hashable, dict[int, int]] = {}  # key -> {rank: place} of _recent
        self._index: dict[int, int] = {r: i for i, r in enumerate(ranks)}  # rank -> its place in self.ranks

    def _release(self) -> None:
        """The cell is over and nothing is queued: give back the tables that its output grew.

        A dict keeps its size after its keys are deleted, and a finished cell's merger stays
        routed for the output its threads print late (the last ``ranks.RECENT`` cells): before
        this, each cell of 300,000 lines per rank left 30-45 MB in the parent for 64 cells. The
        per-place and per-key counts are empty or moot once nothing is queued, and the recent
        items serve only to re-align a rank's next item, which never comes now."""
        if any(self._queues.values()):
            return
        self._queues, self._counts = defaultdict(deque), defaultdict(dict)
        self._holders, self._heads, self._heads_at, self._soft_at, self._streams_at = {}, {}, {}, {}, {}
        self._bumps, self._bumps_key = {}, {}
        self._recent, self._recent_by_key = defaultdict(OrderedDict), {}
        self._places, self._undone_places = Counter(self._places), Counter(self._undone_places)
        self._q_places, self._qu_places = Counter(), Counter()

    # ------------------------------------------------------------- counters
    def _owed(self, rank: int) -> int:
        place, key = self._place[rank], self._queues[rank][0].key
        return self._bumps.get(place, 0) - self._bumps_key.get((place, key), 0)

    def streak(self, rank: int) -> int:
        """How often in a row ``rank``'s items differed from the others' at their place."""
        if rank in self._queued:
            return self._streak[rank] + self._owed(rank) - self._mark[rank]
        return self._streak[rank]

    def _set_streak(self, rank: int, value: int) -> None:
        self._streak[rank] = value
        if rank in self._queued:
            self._mark[rank] = self._owed(rank)

    def _before(self, rank: int) -> None:
        """``rank``'s head or place is about to change: settle what depends on them."""
        if rank in self._queued:
            self._streak[rank] += self._owed(rank) - self._mark[rank]
            place, key = self._place[rank], self._queues[rank][0].key
            _dec(self._q_places, place)
            _dec(self._heads, key)
            if (name := _stream_name(self._queues[rank][0])) is not None:
                _dec(self._streams_at, (place, name))
            if rank not in self._done:
                _dec(self._qu_places, place)
                _dec(self._heads_at, (place, key))
                if (tag := _soft_tag(self._queues[rank][0])) is not None:
                    _dec(self._soft_at, (place, tag))

    def _after(self, rank: int) -> None:
        """``rank``'s head or place changed: count it again where it is now."""
        queue, place = self._queues.get(rank), self._place[rank]
        if queue:
            self._queued.add(rank)
            self._idle.discard(rank)
            key = queue[0].key
            self._q_places[place] += 1
            self._heads[key] = self._heads.get(key, 0) + 1
            if (name := _stream_name(queue[0])) is not None:
                self._streams_at[(place, name)] = self._streams_at.get((place, name), 0) + 1
            if rank not in self._done:
                self._qu_places[place] += 1
                self._heads_at[(place, key)] = self._heads_at.get((place, key), 0) + 1
                if (tag := _soft_tag(queue[0])) is not None:
                    self._soft_at[(place, tag)] = self._soft_at.get((place, tag), 0) + 1
            self._mark[rank] = self._owed(rank)
        else:
            self._queued.discard(rank)
            if rank not in self._done and rank not in self._quiet:
                self._idle.add(rank)

    def _set_place(self, rank: int, place: int) -> None:
        self._before(rank)
        self._move(rank, place)
        self._after(rank)

    def _move(self, rank: int, place: int) -> None:
        """Set ``rank``'s place, counted by place (inside _before/_after)."""
        old = self._place[rank]
        _dec(self._places, old)
        self._places[place] += 1
        if rank not in self._done:
            _dec(self._undone_places, old)
            self._undone_places[place] += 1
        self._place[rank] = place

    def _mark_done(self, rank: int) -> None:
        """``rank`` will send nothing more."""
        if rank in self._done:
            return
        self._before(rank)
        _dec(self._undone_places, self._place[rank])
        self._done.add(rank)
        self._idle.discard(rank)
        self._quiet.discard(rank)
        self._after(rank)

    def _count(self, rank: int, item: Item) -> None:
        c = self._counts[rank]
        n = c.get(item.key, 0)
        c[item.key] = n + 1
        if not n:
            self._holders[item.key] = self._holders.get(item.key, 0) + 1
        self._bytes += item.size + ITEM_COST
        self._unusual += item.special or item.partial
        if len(self._queues[rank]) > self.max_pending:
            self._over.add(rank)

    def _uncount(self, rank: int, item: Item) -> None:
        c = self._counts[rank]
        _dec(c, item.key)
        if item.key not in c:
            _dec(self._holders, item.key)
        self._bytes -= item.size + ITEM_COST
        self._unusual -= item.special or item.partial
        if len(self._queues[rank]) <= self.max_pending:
            self._over.discard(rank)

    # -------------------------------------------------------------- changes
    def _push(self, rank: int, item: Item) -> None:
        queue = self._queues[rank]
        if not queue and len(self.ranks) > 1 and not item.special:
            self._realign(rank, item.key)
        self._before(rank)
        queue.append(item)
        self._count(rank, item)
        self._after(rank)

    def _pop(self, rank: int, place: bool = True, shared: bool = False) -> Item:
        """The head item of ``rank``. ``place``: it took its place in the rank's sequence (False
        for an extra item, as a diff sees it); ``shared``: published with a twin."""
        self._before(rank)
        item = self._queues[rank].popleft()
        self._uncount(rank, item)
        if place:
            if shared:
                self._forget_recent(rank, item.key)  # no longer a twinless item to re-align by
            else:
                self._remember(rank, item.key)
            self._move(rank, self._place[rank] + 1)
        self._after(rank)
        return item

    def _remove(self, rank: int, item: Item) -> None:
        queue = self._queues[rank]
        for i, queued in enumerate(queue):
            if queued is item:
                self._before(rank)
                del queue[i]
                self._uncount(rank, item)
                self._after(rank)
                return

    def _shared(self, ranks: Iterable[int]) -> None:
        """These ranks' outputs matched: their divergence streaks end."""
        for r in ranks:
            self._set_streak(r, 0)

    # --------------------------------------------------------------- recent
    def _remember(self, rank: int, key: Hashable) -> None:
        recent = self._recent[rank]
        recent[key] = self._place[rank]
        recent.move_to_end(key)
        self._recent_by_key.setdefault(key, {})[rank] = self._place[rank]
        if len(recent) > _RECENT:
            old, _ = recent.popitem(last=False)
            self._drop_recent_index(rank, old)

    def _forget_recent(self, rank: int, key: Hashable) -> None:
        if self._recent[rank].pop(key, None) is not None:
            self._drop_recent_index(rank, key)

    def _drop_recent_index(self, rank: int, key: Hashable) -> None:
        by_rank = self._recent_by_key[key]
        del by_rank[rank]
        if not by_rank:
            del self._recent_by_key[key]

    def _realign(self, rank: int, key: Hashable) -> None:
        """``rank``'s next item is the late twin of one another rank published without it: the
        rank is at that item's place (it lagged, or gave an extra item before), and its output
        matches again. Not when another rank has the same item queued: that is its twin."""
        if key in self._holders:
            return
        by_rank = self._recent_by_key.get(key, {})
        others = [r for r in by_rank if r != rank]
        if others:
            other = min(others, key=self._index.__getitem__)  # the first in the cell's rank order, as ever
            self._set_place(rank, by_rank[other])
            self._set_streak(rank, 0)
            self._set_streak(other, 0)
