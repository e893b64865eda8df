"""What the ranks print for one request, relayed to the frontend as it comes, and when each rank
is finished with the request.

An :class:`OutputRelay` merges the IOPub of one request on several ranks (the ``CellMerger``),
publishes it under the kernel's output budget (the ``StreamThrottle``), keeps an ``Output``
widget's capture changes in order with what was printed, and ends when every rank is finished.
It sends nothing and looks at no rank: a cell's run (:class:`~dist_kernel.parent.execution.CellRun`)
does that around one, and a shared widget's callback (:mod:`dist_kernel.parent.comms`) needs
only this.

A rank is finished with a request when its ``execute_reply`` (shell) has arrived and all of its
output has: the reply can overtake the last outputs, and frontends stop reading a cell at the
parent's ``idle``. All of its output is there once the rank's ``idle`` status for the request
(IOPub) has come, or once as many IOPub messages have come as the reply's metadata says the
cell published before it (``dist_kernel.iopub``): the idle follows the reply through the
rank's IOPub thread, a quarter of a millisecond later, so the count ends a cell sooner.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from dist_kernel import protocol
from dist_kernel.output_kinds import IN_ORDER, KINDS, Route
from dist_kernel.parent.merge import CellMerger, DisplayRegistry, merge_errors
from dist_kernel.parent.merge.captures import sets_capture
from dist_kernel.parent.throttle import OutputBudget, StreamThrottle

#: how often held output is looked at while a request runs
TICK = 0.05
#: ready output is published at once, but at most once per MIN_FLUSH (keeps the message rate low)
MIN_FLUSH = 0.01
#: a rank whose reply came but whose ``idle`` did not, and that sent nothing for this long,
#: is finished all the same: a lost message never leaves a cell waiting forever
IDLE_LOST_AFTER = 3.0
_OUTPUT, _COMM, _IN_ORDER = Route.OUTPUT, Route.COMM, Route.IN_ORDER  # globals: faster than off the class

Publish = Callable[[str, dict], None]
#: a comm message of a rank, to the frontend (``CommRouter.relay`` bound to the request)
RelayComm = Callable[[int, dict], None]


@dataclass(frozen=True)
class Outlet:
    """Where one request's output goes: the kernel's, bound to the frontend's request."""

    publish: Publish  # (msg_type, content) on the parent's IOPub, under the request
    relay_comm: RelayComm | None = None
    #: the kernel's, so that the output cap and display ids span its lifetime
    budget: OutputBudget | None = None
    displays: DisplayRegistry | None = None


class OutputRelay:
    """The output of one request on ``ranks``, merged and published as it comes (see the module
    doc). :meth:`on_iopub` and :meth:`on_reply` feed it; :meth:`wait` returns the merged error."""

    def __init__(self, ranks: Sequence[int], outlet: Outlet, execution_count: int, window: float,
                 world: Sequence[int] | None = None, rich_from: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ranks = tuple(ranks)
        self.world = tuple(world) if world is not None else self.ranks
        self.execution_count = execution_count
        self.clock = clock
        self.publish_raw = outlet.publish  # kernel notices bypass the output budget
        self.throttle = StreamThrottle(outlet.publish, budget=outlet.budget)
        self.publish = self.throttle.publish
        self.merger = CellMerger(self.ranks, window=window, rich_from=rich_from,
                                 displays=outlet.displays if outlet.displays is not None else DisplayRegistry())
        self.relay_comm = outlet.relay_comm
        #: the stop button was pressed: a rank that replied is finished without its ``idle``
        self.stopping = False
        self.replies: dict[int, dict] = {}  # rank -> its execute_reply content
        self.finished: set[int] = set()
        self.finished_at: dict[int, float] = {}
        self.idle: set[int] = set()
        self.closed = False
        self._replied_at: dict[int, float] = {}
        self._heard: dict[int, float] = {}  # rank -> when it last sent anything for this request
        self._expected: dict[int, int] = {}  # rank -> IOPub messages its reply says it published
        self._got: dict[int, int] = {}  # rank -> IOPub messages received for this request
        self._last_flush = 0.0
        self._settle_soon = False  # a settle of the merger is scheduled for the end of this turn
        self._done: asyncio.Future | None = None  # resolved when every rank is finished
        self._all_finished = False
        self._timer: asyncio.TimerHandle | None = None

    @property
    def busy_ranks(self) -> list[int]:
        return [r for r in self.ranks if r not in self.finished]

    # ------------------------------------------------------------ receive
    def on_iopub(self, rank: int, msg: dict) -> None:
        self._heard[rank] = self.clock()
        self._got[rank] = self._got.get(rank, 0) + 1
        self._on_iopub(rank, msg)
        if rank in self._expected:
            self._check(rank)

    def on_iopub_group(self, ranks: list[int], msg: dict) -> None:
        """One IOPub message that these ranks sent alike (a node agent's entry for them), as
        :meth:`on_iopub` of each: decoded and checked once on its way here; an output goes to
        the merger for each rank, which settles once for them."""
        msg_type = msg["header"]["msg_type"]
        kind = KINDS[msg_type] if msg_type in KINDS else None  # no method call: cheaper than .get
        if kind is None or kind.route is not _OUTPUT or self.closed:
            for rank in ranks:  # status, comms, late output: as they come one by one
                self.on_iopub(rank, msg)
            return
        now, content, sent = self.clock(), msg["content"], msg.get("sent")
        if kind.numbered:
            content = dict(content, execution_count=self.execution_count)
        for rank in ranks:
            self._heard[rank] = now
            self._got[rank] = self._got.get(rank, 0) + 1
            self.merger.add(rank, msg_type, content, now, sent, settle=False)
        for rank in ranks:
            if rank in self._expected:
                self._check(rank)
        self._settle_later(asyncio.get_running_loop())

    def _on_iopub(self, rank: int, msg: dict) -> None:
        msg_type = msg["header"]["msg_type"]
        content = msg["content"]
        kind = KINDS[msg_type] if msg_type in KINDS else None  # its row: where it goes (``route``)
        if kind is None:
            if msg_type == "status" and content.get("execution_state") == "idle":
                self.idle.add(rank)
                self._check(rank)
        elif kind.route is _OUTPUT:
            if kind.numbered:
                content = dict(content, execution_count=self.execution_count)
            if self.closed:
                # printed after the cell ended (a background thread): publish it as it comes,
                # labelled with its rank, under the same output budget as the cells
                for late_type, late_content in self.merger.late(rank, msg_type, content, len(self.world) > 1):
                    self.publish(late_type, late_content)
                return
            try:
                loop: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
            self.merger.add(rank, msg_type, content, self.clock(), msg.get("sent"), settle=loop is None)
            if loop is None:
                self._settled()
            else:
                self._settle_later(loop)
        elif kind.route is _COMM:
            if sets_capture(kind, content) and not self.closed:
                # an Output widget starts or stops capturing: what the rank printed before
                # must reach the frontend before the widget's state changes
                self.merger.add_in_order(rank, IN_ORDER, {"rank": rank, "msg": msg}, self.clock())
            elif self.relay_comm is not None:
                self.relay_comm(rank, msg)

    def _settle_later(self, loop: asyncio.AbstractEventLoop) -> None:
        """Settle the merger at the end of this turn of the loop: what else arrives in it (a
        node's turn: its ranks' outputs) is added first, and the merger settles once for all."""
        if not self._settle_soon:
            self._settle_soon = True
            loop.call_soon(self._settle)

    def _settle(self) -> None:
        self._settle_soon = False
        if not self.closed:
            self.merger.settle(self.clock())
            self._settled()

    def _settled(self) -> None:
        if self.merger.ready and self.clock() - self._last_flush >= MIN_FLUSH:
            self.flush()  # publish at once, but not more often than MIN_FLUSH

    def on_reply(self, rank: int, content: dict, metadata: dict | None = None) -> None:
        self.on_replies([([rank], content, metadata)])

    def on_replies(self, groups: list[tuple[list[int], dict, dict | None]]) -> None:
        """Replies that arrived together, each group of ranks with one same reply (content,
        metadata): a node's summary. Its metadata is read once per group, the ranks it
        finishes are finished together, and the merger settles once for them all."""
        now = self.clock()
        for ranks, content, metadata in groups:
            published = protocol.meta_of(metadata).get(protocol.META_IOPUB)
            if isinstance(published, int) and not isinstance(published, bool):
                self._expected.update(dict.fromkeys(ranks, published))
            else:
                published = None  # not counted: each rank's idle ends it
            self.replies.update(dict.fromkeys(ranks, content))
            self._replied_at.update(dict.fromkeys(ranks, now))
            self.merger.ranks_replied(ranks, content, now)
            if published == 0:  # nothing to wait for (a quiet cell): every rank is complete
                finished = self.finished
                complete = [r for r in ranks if r not in finished]
            else:
                complete = [r for r in ranks if self._complete(r)]
            self._finish(complete, now, settle=False)
        self.merger.settle(now)

    def set_error(self, rank: int, error: dict) -> None:
        """``error`` (an ``error`` content) is ``rank``'s part of the request's error, whatever
        its reply says: why the kernel ended or unblocked it."""
        self.merger.errors[rank] = error

    def end_rank(self, rank: int, error: dict) -> None:
        """A rank will never answer (it died, or it was given up on): its part ends with ``error``."""
        if rank in self.finished or rank not in self.ranks:
            return
        self.set_error(rank, error)
        self.replies.setdefault(rank, {"status": "error", **error})
        self.idle.add(rank)
        self._check(rank)

    def _complete(self, rank: int) -> bool:
        """Has the rank replied and sent all its output, and is not marked finished yet?"""
        return rank not in self.finished and rank in self.replies and (
            rank in self.idle or self._got.get(rank, 0) >= self._expected.get(rank, 1 << 62))

    def _check(self, rank: int, settle: bool = True) -> None:
        if self._complete(rank):
            self._finish([rank], self.clock(), settle)

    def _finish(self, ranks: list[int], now: float, settle: bool) -> None:
        """These ranks are finished with the request (each complete)."""
        if not ranks:
            return
        self.finished.update(ranks)
        self.finished_at.update(dict.fromkeys(ranks, now))
        self.merger.ranks_done(ranks, now, settle=settle)
        if len(self.finished) == len(self.ranks):
            self._all_finished = True
            if self._done is not None and not self._done.done():
                self._done.set_result(None)

    # ------------------------------------------------------------- publish
    def flush(self, force: bool = False) -> None:
        """Publish what is due; ``force``: everything held, twins or not."""
        self._last_flush = self.clock()
        self.merger.poll(self._last_flush + (self.merger.window + 1.0 if force else 0.0))
        self._publish_merged()

    def _publish_merged(self) -> None:
        for msg_type, content in self.merger.take():
            if KINDS[msg_type].route is _IN_ORDER:  # {"rank": r, "msg": a comm message}, in its place
                if self.relay_comm is not None:
                    self.relay_comm(content["rank"], content["msg"])
            else:
                self.publish(msg_type, content)

    def say(self, text: str) -> None:
        """A kernel message in the request's output (stderr), after everything held so far."""
        self.flush(force=True)
        self.publish_raw("stream", {"name": "stderr", "text": text})

    # ------------------------------------------------------------- driving
    async def wait(self) -> dict | None:
        """Relay output until every rank is finished; the merged error or None."""
        await self.until_finished()
        return self.close()

    async def until_finished(self, on_tick: Callable[[], None] | None = None) -> None:
        """Relay output until every rank is finished.

        The request ends the moment its last rank is finished (one future, resolved from the
        reader that saw it); held output is looked at every TICK meanwhile, from a timer, which
        also calls ``on_tick`` (the cell run looks at its busy ranks there)."""
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        if self._all_finished:
            self._done.set_result(None)
        timer = loop.call_later(TICK, self._tick, loop, on_tick)
        try:
            await self._done
        finally:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None
            timer.cancel()

    def close(self) -> dict | None:
        """Publish the rest; later output is published as it comes (:meth:`on_iopub`). The
        merged error of the ranks, or None."""
        self.merger.finish(self.clock())
        self._publish_merged()
        self.throttle.close()
        self.closed = True
        return merge_errors(self.merger.errors, self.ranks)

    def _tick(self, loop: asyncio.AbstractEventLoop, on_tick: Callable[[], None] | None) -> None:
        """Every TICK while the request runs: publish what is due, end ranks whose idle was lost."""
        done = self._done
        if done is None or done.done():
            return
        try:
            self.flush()
            self._idle_lost()
            if on_tick is not None:
                on_tick()
        except Exception as e:  # noqa: BLE001 - raised in until_finished(), as when it ran there
            if not done.done():
                done.set_exception(e)
            return
        if not done.done():
            self._timer = loop.call_later(TICK, self._tick, loop, on_tick)

    def _idle_lost(self) -> None:
        """A rank that replied and then went quiet is done, even if its ``idle`` was lost."""
        now = self.clock()
        for rank in self.busy_ranks:
            if rank in self.replies and rank not in self.idle:
                quiet_since = max(self._replied_at.get(rank, now), self._heard.get(rank, 0.0))
                if now - quiet_since >= IDLE_LOST_AFTER or self.stopping:
                    self.idle.add(rank)
                    self._check(rank)

