"""One cell's run across its ranks, end to end: send, relay outputs live, look at the ranks
that do not finish, judge and act (the fault policy), decide when the cell is over, and re-form
the group it broke.

The run is given everything it acts through: a publish function for the cell's request, the
ranks' seam (:class:`~dist_kernel.parent.ranks.CellRanks`), a function that relays comm
messages, and the group's state between cells (:class:`GroupState`). It never calls the
kernel.

A rank is finished with a cell when its ``execute_reply`` (shell) has arrived and all of its
output has: the reply can overtake the last outputs, and frontends stop reading a cell at the
parent's ``idle``. All of its output is there once the rank's ``idle`` status for the request
(IOPub) has come, or once as many IOPub messages have come as the reply's metadata says the
cell published before it (``dist_kernel.iopub``): the idle follows the reply through the
rank's IOPub thread, a quarter of a millisecond later, so the count ends a cell sooner.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from dist_kernel import protocol
from dist_kernel.exceptions import ErrorName, RankDiedError, RankStoppedError, error_content
from dist_kernel.parent import fault_policy
from dist_kernel.parent.comms import COMM_TYPES, OUTPUT_TYPES
from dist_kernel.parent.magics import format_ranks
from dist_kernel.parent.merge import CellMerger, DisplayRegistry, merge_errors
from dist_kernel.parent.throttle import OutputBudget, StreamThrottle

if TYPE_CHECKING:
    from dist_kernel.parent.ranks import CellRanks
    from dist_kernel.protocol import Place

#: how often held output is looked at while a cell runs
TICK = 0.05
#: ready output is published at once, but at most once per MIN_FLUSH (keeps the message rate low)
MIN_FLUSH = 0.01

#: the merger's name for a comm message it keeps in order with the outputs
IN_ORDER = "dist_kernel.in_order"
#: a rank whose reply came but whose ``idle`` did not, and that sent nothing for this long,
#: is finished all the same: a lost message never leaves a cell waiting forever
IDLE_LOST_AFTER = 3.0

Publish = Callable[[str, dict], None]
#: a comm message of a rank, to the frontend (``CommRouter.relay`` bound to the cell's request)
RelayComm = Callable[[int, dict], None]

REFORMED = ("\x1b[1;33mdist_kernel:\x1b[0m the process group was re-formed; every rank's variables "
            "survived. Objects bound to the old group (DistributedDataParallel wrappers, new_group() "
            "handles) must be created again.")
RESTART_FOR_FRESH = "Restart the kernel to start fresh ranks; the group cannot continue without it."

log = logging.getLogger("dist_kernel")


@dataclass
class GroupState:
    """What the process group carries from one cell to the next."""

    left_running: set[int] = field(default_factory=set)  # ranks whose cell was given up on (abandoned)
    reform_pending: bool = False  # a re-formation waits for a rank that was left running

    async def reform_if_due(self, ranks: CellRanks, timeout: float) -> None:
        """Before a cell: re-form the group an earlier cell broke, once its ranks are back."""
        if self.reform_pending and not self.left_running:
            self.reform_pending = False
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ranks.form_group(), timeout)


class CellRun:
    """One request on ``ranks``: :meth:`start` sends it, :meth:`finish` relays and merges the
    outputs, acts on faults, and returns the cell's error (None when it succeeded)."""

    def __init__(self, ranks: Sequence[int], publish: Publish, execution_count: int,
                 window: float, world: Sequence[int] | None = None, clock: Callable[[], float] = time.monotonic,
                 via: CellRanks | None = None, hang_grace: float = 10.0,
                 rich_from: int | None = None, relay_comm: RelayComm | None = None,
                 budget: OutputBudget | None = None, displays: DisplayRegistry | None = None,
                 group: GroupState | None = None, parent: dict | None = None,
                 reform_timeout: float = 120.0) -> None:
        self.ranks = tuple(ranks)
        self.via = via  # the ranks' seam; None: relay and merge only (no sending, no looking)
        self.parent = parent or {}  # the frontend request
        self.group = group if group is not None else GroupState()
        self.reform_timeout = reform_timeout
        self._raw_publish = publish  # kernel notices bypass the output budget
        # budget and displays: the kernel's, so the output cap and display ids span its lifetime
        self.throttle = StreamThrottle(publish, budget=budget)
        self.publish = self.throttle.publish
        self.world = tuple(world) if world is not None else self.ranks
        self.started = clock()
        self.execution_count = execution_count
        self.clock = clock
        self.merger = CellMerger(self.ranks, window=window, rich_from=rich_from,
                                 displays=displays if displays is not None else DisplayRegistry())
        self.relay_comm = relay_comm
        self.hang_grace = hang_grace
        self.judge = fault_policy.Judge()
        self.finished_at: dict[int, float] = {}
        self.interrupted_at: float | None = None
        self.signalled: dict[int, float] = {}  # rank -> when it was last sent SIGINT
        self.group_broken = False  # the process group was torn down during this cell
        self.notes: list[str] = []  # lines appended to the cell's error, if any
        self.reply_metadata: dict[int, dict] = {}  # rank -> its execute_reply's metadata
        self.noticed: set[tuple] = set()  # kernel notices already shown in this cell
        self._last_look: float | None = None
        self._looking: asyncio.Task | None = None
        self._replied_at: dict[int, float] = {}
        self._heard: dict[int, float] = {}  # rank -> when it last sent anything for this cell
        self.replies: dict[int, dict] = {}
        self._expected: dict[int, int] = {}  # rank -> IOPub messages its reply says it published
        self._got: dict[int, int] = {}  # rank -> IOPub messages received for this cell
        self.idle: set[int] = set()
        self.finished: set[int] = set()
        self.closed = False
        self._last_flush = 0.0
        self._done: asyncio.Future | None = None  # resolved when every rank is finished
        self._all_finished = False

    # --------------------------------------------------------------- send
    def start(self, content: dict, metadata: dict) -> list[str]:
        """Send the execute request to every rank of the cell; the msg_ids sent."""
        assert self.via is not None
        sent = []
        for rank in self.ranks:
            try:
                msg_id, fut = self.via.send(rank, "execute_request", content, metadata=metadata)
            except RankDiedError as e:
                self.on_rank_lost(rank, RankDiedError, str(e))
                continue
            sent.append(msg_id)
            self.via.listen(rank, msg_id, functools.partial(self.on_iopub, rank))
            assert fut is not None
            fut.add_done_callback(functools.partial(self._replied, rank))
            if self.via.stopped(rank):
                self.notice_stopped(rank)
        return sent

    def _replied(self, rank: int, fut: asyncio.Future) -> None:
        """A rank's execute_reply message arrived (or its channel failed: it died)."""
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            self.on_rank_lost(rank, RankDiedError, str(exc),
                              "Restart the kernel to start fresh ranks (the group cannot continue without it).")
            return
        msg = fut.result()
        self.reply_metadata[rank] = msg.get("metadata") or {}
        self.on_reply(rank, msg["content"], self.reply_metadata[rank])
        self.group.left_running.discard(rank)

    # ------------------------------------------------------------ receive
    def on_iopub(self, rank: int, msg: dict) -> None:
        self._heard[rank] = self.clock()
        self._got[rank] = self._got.get(rank, 0) + 1
        self._on_iopub(rank, msg)
        if rank in self._expected:
            self._check(rank)

    def _on_iopub(self, rank: int, msg: dict) -> None:
        msg_type = msg["header"]["msg_type"]
        content = msg["content"]
        if msg_type in COMM_TYPES:
            if _capture_change(msg_type, content) and not self.closed:
                # an Output widget starts or stops capturing: what the rank printed before
                # must reach the frontend before the widget's state changes
                self.merger.add_in_order(rank, IN_ORDER, {"rank": rank, "msg": msg}, self.clock())
            elif self.relay_comm is not None:
                self.relay_comm(rank, msg)
            return
        if msg_type == "status":
            if content.get("execution_state") == "idle":
                self.idle.add(rank)
                self._check(rank)
        elif msg_type in OUTPUT_TYPES:
            if msg_type == "execute_result":
                content = dict(content, execution_count=self.execution_count)
            if self.closed:
                # printed after the cell ended (a background thread): publish it as it comes,
                # labelled with its rank, under the same output budget as the cells
                for late_type, late_content in self.merger.late(rank, msg_type, content, len(self.world) > 1):
                    self.publish(late_type, late_content)
                return
            self.merger.add(rank, msg_type, content, self.clock(), msg.get("sent"))
            if self.merger.ready and self.clock() - self._last_flush >= MIN_FLUSH:
                self.flush()  # publish at once, but not more often than MIN_FLUSH

    def on_reply(self, rank: int, content: dict, metadata: dict | None = None) -> None:
        published = protocol.meta_of(metadata).get(protocol.META_IOPUB)
        if isinstance(published, int) and not isinstance(published, bool):
            self._expected[rank] = published
        self.replies[rank] = content
        self._replied_at[rank] = self.clock()
        self.merger.rank_replied(rank, content, self.clock())
        self._check(rank)

    def on_rank_lost(self, rank: int, ename: ErrorName, evalue: str, hint: str = "") -> None:
        """A rank will never answer (it died): end its part of the cell with an error."""
        if rank in self.finished or rank not in self.ranks:
            return
        err = error_content(ename, evalue, [hint] if hint else [])
        self.merger.errors[rank] = err
        self.replies.setdefault(rank, {"status": "error", **err})
        self.idle.add(rank)
        self._check(rank)

    def _check(self, rank: int) -> None:
        if rank in self.finished or rank not in self.replies:
            return
        if rank in self.idle or self._got.get(rank, 0) >= self._expected.get(rank, 1 << 62):
            self.finished.add(rank)
            self.finished_at[rank] = self.clock()
            self.merger.rank_done(rank, self.clock())
            if len(self.finished) == len(self.ranks):
                self._all_finished = True
                if self._done is not None and not self._done.done():
                    self._done.set_result(None)

    # ------------------------------------------------------------- driving
    def flush(self, force: bool = False) -> None:
        """Publish what is due; ``force``: everything held, twins or not."""
        self._last_flush = self.clock()
        self.merger.poll(self._last_flush + (self.merger.window + 1.0 if force else 0.0))
        self._publish_merged()

    def _publish_merged(self) -> None:
        for msg_type, content in self.merger.take():
            if msg_type == IN_ORDER:
                if self.relay_comm is not None:
                    self.relay_comm(content["rank"], content["msg"])
            else:
                self.publish(msg_type, content)

    async def wait(self) -> dict | None:
        """Relay output until every rank is finished; returns the merged error or None.

        The cell ends the moment its last rank is finished (one future, resolved from the
        reader that saw it); held output is looked at every TICK meanwhile, from a timer."""
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()
        if self._all_finished:
            self._done.set_result(None)
        timer = loop.call_later(TICK, self._tick, loop)
        try:
            await self._done
        finally:
            self._timer_cancel()
            timer.cancel()
        if self._looking is not None and not self._looking.done():
            # a late look must not tear down the group that is about to be re-formed
            self._looking.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._looking
        self.merger.finish(self.clock())
        self._publish_merged()
        self.throttle.close()
        self.closed = True
        return merge_errors(self.merger.errors, self.ranks)

    _timer: asyncio.TimerHandle | None = None

    def _timer_cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _tick(self, loop: asyncio.AbstractEventLoop) -> None:
        """Every TICK while the cell runs: publish what is due, and look at the busy ranks."""
        done = self._done
        if done is None or done.done():
            return
        try:
            self.flush()
            self._idle_lost()
            self._maybe_look()
        except Exception as e:  # noqa: BLE001 - raised in wait(), as when it ran there
            if not done.done():
                done.set_exception(e)
            return
        if not done.done():
            self._timer = loop.call_later(TICK, self._tick, loop)

    def mark_stuck(self, rank: int, ename: ErrorName, evalue: str, lines: list[str]) -> None:
        """Record why a rank is being unblocked; this becomes its error for the cell."""
        self.merger.errors[rank] = error_content(ename, evalue, lines)

    def _idle_lost(self) -> None:
        """A rank that replied and then went quiet is done, even if its ``idle`` was lost."""
        now = self.clock()
        for rank in self.busy_ranks:
            if rank in self.replies and rank not in self.idle:
                quiet_since = max(self._replied_at.get(rank, now), self._heard.get(rank, 0.0))
                if now - quiet_since >= IDLE_LOST_AFTER or self.interrupted_at is not None:
                    self.idle.add(rank)
                    self._check(rank)

    def state(self) -> fault_policy.Cell:
        """This run, as the fault policy sees it."""
        errored = any(self.replies.get(r, {}).get("status") == "error" for r in self.finished)
        return fault_policy.Cell(
            ranks=self.ranks, world=self.world, busy=tuple(self.busy_ranks), dead=tuple(self.dead()),
            started=self.started, first_finished=min(self.finished_at.values(), default=None),
            errored=errored, interrupted_at=self.interrupted_at, hang_grace=self.hang_grace,
            torn_down=self.group_broken)

    def dead(self) -> list[int]:
        """The ranks of the group whose process is gone."""
        return [] if self.via is None else [r for r in self.world if not self.via.alive(r)]

    def _maybe_look(self) -> None:
        """Look at the busy ranks when the fault policy says it is time."""
        if self.via is None or (self._looking is not None and not self._looking.done()):
            return
        now = self.clock()
        if fault_policy.look_due(self.state(), now, self._last_look):
            self._last_look = now
            self._looking = asyncio.ensure_future(self._look())

    # -------------------------------------------------- look, judge, act
    async def _look(self) -> None:
        """Ask the busy ranks where they are, let the fault policy judge, and act on it."""
        via = self.via
        assert via is not None
        busy = [r for r in self.busy_ranks if via.alive(r)]
        places = dict(zip(busy, await asyncio.gather(*(via.where(r) for r in busy)), strict=True))
        idle_seqs: dict[int, int] = {}
        if any(p is not None and (p.in_backward or p.native) for p in places.values()):
            # how many collectives the idle ranks' group started: a busy rank in backward() or in
            # a C++ call of torch's distributed code ahead of them waits for them (DDP's
            # all_reduce or its constructor's broadcast, started in C++); asked only then
            idle = [r for r in self.state().idle if via.alive(r)]
            for r, p in zip(idle, await asyncio.gather(*(via.where(r) for r in idle)), strict=True):
                if p is not None and p.group_seq is not None:
                    idle_seqs[r] = p.group_seq
        seen = {r: _seen(p) for r, p in places.items()}
        for r in self.judge.silent(seen):
            if not via.stopped(r):
                self.notice(f"rank {r} ({via.describe(r)}) does not answer ({via.os_state(r)}): it may be stuck "
                            "in C code that holds the GIL. Press stop to end the cell, or restart the kernel.",
                            key=("silent", r))
        verdict = self.judge.judge(replace(self.state(), idle_seqs=idle_seqs), seen, self.clock())
        if verdict.action == "wait":
            return
        await self._act(verdict, places)

    async def _act(self, verdict: fault_policy.Verdict, places: dict[int, Place | None]) -> None:
        via = self.via
        assert via is not None
        for r, reason in verdict.stuck.items():
            place = places.get(r)
            lines = ["Where it was waiting:", *place.stack] if place is not None and place.stack else []
            if verdict.action == "abandon":
                self.on_rank_lost(r, verdict.ename, reason)
                self.group.left_running.add(r)
            else:
                self.mark_stuck(r, verdict.ename, reason, lines)
        if verdict.action == "stop":
            await via.interrupt(list(verdict.stuck))
            await asyncio.sleep(fault_policy.STOP_TIMEOUT)
            for r in self.busy_ranks:
                self.on_rank_lost(r, RankDiedError, verdict.stuck.get(r, f"rank {r} did not stop"))
        elif verdict.action == "teardown":
            log.warning("ranks %s stuck in collectives; tearing down the group", list(verdict.stuck))
            self.group_broken = True
            failed = await via.teardown(verdict.teardown_on)
            if failed:
                self.notice(f"rank {format_ranks(failed)} did not confirm tearing the process group down; "
                            "ranks blocked with it may stay blocked: press stop, or restart the kernel.",
                            key=("teardown",))

    async def stop(self) -> None:
        """The stop button during this cell: signal the busy ranks (the fault policy tears the
        group down for those a collective keeps from reacting). A stopped rank cannot react:
        the cell ends without it, and it is signalled all the same (the signal waits, and ends
        its cell once it is resumed)."""
        via = self.via
        assert via is not None
        stopped = [r for r in self.busy_ranks if via.stopped(r)]
        for r in stopped:
            pid = via.pid(r)
            self.on_rank_lost(r, RankStoppedError,
                              f"rank {r} (pid {pid}) is {via.stopped(r)}; resume it with "
                              f"`kill -CONT {pid}` (it then sees the interrupt) or restart the kernel")
            self.group.left_running.add(r)
        await via.interrupt(stopped + self.interrupt())

    def on_rank_died(self, rank: int, reason: str) -> None:
        """A rank's process is gone (the supervisor noticed): its part of the cell ends."""
        via = self.via
        tail = via.log_tail(rank, 15) if via is not None else ""
        where = via.describe(rank) if via is not None else "pid ?"
        self.on_rank_lost(rank, RankDiedError, f"rank {rank} ({where}) {reason}",
                          (f"Last output of the rank process:\n{tail}\n" if tail.strip() else "")
                          + RESTART_FOR_FRESH)

    def on_rank_stopped(self, rank: int) -> None:
        """A rank of the cell was stopped (SIGSTOP, a debugger): say so once."""
        if rank in self.busy_ranks:
            self.notice_stopped(rank)

    def notice_stopped(self, rank: int) -> None:
        via = self.via
        assert via is not None
        self.notice(f"rank {rank} ({via.describe(rank)}) is {via.stopped(rank) or 'stopped'} (SIGSTOP or a "
                    f"debugger): the cell waits for it. Resume it with `kill -CONT {via.pid(rank)}`, press stop "
                    "to end the cell without it, or restart the kernel.", key=("stopped", rank))

    def notice(self, text: str, key: tuple) -> None:
        """A kernel message in the cell's output, once per cell and key."""
        if key in self.noticed:
            return
        self.noticed.add(key)
        self.flush(force=True)
        self._raw_publish("stream", {"name": "stderr", "text": f"[dist_kernel] {text}\n"})

    # ------------------------------------------------------------ finish
    async def finish(self) -> dict | None:
        """Run the cell to its end (:meth:`wait`), re-form the group if it broke, and return
        the cell's error with the notes about the group, or None."""
        error = await self.wait()
        if self.via is not None and (self.group_broken or self.group_broke() or self.destroyed()):
            await self._recover_group()
        if error is not None:
            error = dict(error, traceback=error["traceback"] + self.notes)
        elif self.notes:  # a cell that succeeded but changed the group (destroyed it)
            self._raw_publish("stream", {"name": "stderr", "text": "\n".join(self.notes) + "\n"})
        return error

    def group_broke(self) -> bool:
        """Did a rank report that its process group broke during the cell, or are the ranks out
        of step after it (their collective sequence numbers differ)?"""
        said = {r: protocol.meta_of(meta) for r, meta in self.reply_metadata.items()}
        seqs = {r: m[protocol.META_SEQ] for r, m in said.items() if isinstance(m.get(protocol.META_SEQ), int)}
        return any(m.get(protocol.META_GROUP_BROKEN) for m in said.values()) or fault_policy.out_of_step(
            seqs, self.world)

    def destroyed(self) -> list[int]:
        """The ranks whose cell destroyed the process group (``dist.destroy_process_group()``)."""
        return [r for r, meta in self.reply_metadata.items() if protocol.meta_of(meta).get(protocol.META_GROUP_DESTROYED)]

    async def _recover_group(self) -> None:
        """After a torn-down or broken group, form a fresh one on every rank (policy: after_cell)."""
        via = self.via
        assert via is not None

        def decide() -> str:
            return fault_policy.after_cell(self.group_broken, self.group_broke(), self.dead(),
                                           self.group.left_running, destroyed=self.destroyed(), world=self.world)

        decision = decide()
        if decision == "reform":
            try:
                await asyncio.wait_for(via.form_group(), self.reform_timeout)
                self.notes.append(REFORMED)
                return
            except Exception as e:  # noqa: BLE001 - a rank died meanwhile, or a join failed
                decision = decide()
                if decision == "reform":
                    self.notes.append(f"Re-forming the process group failed ({e}); restart the kernel.")
                    return
        if decision == "down":
            self.notes.append(fault_policy.DOWN)
        elif decision == "restart":
            self.notes.append("A rank died, so the process group cannot be re-formed: restart the kernel.")
        elif decision == "later":
            self.group.reform_pending = True
            self.notes.append(f"rank {format_ranks(sorted(self.group.left_running))} is still running its cell; "
                              "the process group is re-formed before the next cell once it is back (restart "
                              "the kernel if it does not come back).")

    def interrupt(self) -> list[int]:
        """The stop button: the busy ranks to send SIGINT now. A rank is signalled at most
        once a second: a storm of interrupts must not hit a rank that is already unwinding."""
        now = self.clock()
        if self.interrupted_at is None:
            self.interrupted_at = now
        due = [r for r in self.busy_ranks if now - self.signalled.get(r, -1e9) >= 1.0]
        for r in due:
            self.signalled[r] = now
        self._last_look = None  # look again soon: ranks blocked in a collective need a teardown
        return due

    @property
    def busy_ranks(self) -> list[int]:
        return [r for r in self.ranks if r not in self.finished]


def _seen(place: Place | None) -> fault_policy.Seen:
    """A ``where`` reply as the fault policy sees it (None: the rank did not answer)."""
    if place is None:
        return fault_policy.Seen(answered=False)
    return fault_policy.Seen(answered=True, collective=place.collective, group_ranks=tuple(place.group_ranks),
                             peer=place.peer, seq=place.seq, line=place.line, store_wait=place.store_wait,
                             in_code=place.in_code, group_seq=place.group_seq,
                             in_backward=place.in_backward, native=place.native)


def _capture_change(msg_type: str, content: dict) -> bool:
    """Does this comm message start or stop an ipywidgets ``Output`` capture?"""
    data = content.get("data") or {}
    state = data.get("state") if isinstance(data, dict) else None
    return msg_type == "comm_msg" and isinstance(state, dict) and "msg_id" in state
