"""One cell's run across its ranks, end to end: send, relay outputs live, look at the ranks
that do not finish, judge and act (the fault policy), decide when the cell is over, and re-form
the group it broke.

The kernel decides what the cell is (:class:`CellSpec`) and gives the run everything it acts
through: where its output goes (:class:`~dist_kernel.parent.relay.Outlet`), the ranks' seam
(:class:`~dist_kernel.parent.ranks.CellRanks`) and the group's state between cells
(:class:`GroupState`). It never calls the kernel; :meth:`CellRun.finish` returns what the
kernel replies with (:class:`CellResult`). The output itself, and when a rank is finished with
the cell, is the :class:`~dist_kernel.parent.relay.OutputRelay`'s, which the run drives.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from dist_kernel import protocol
from dist_kernel.exceptions import ErrorName, RankDiedError, RankStoppedError, error_content
from dist_kernel.parent import fault_policy
from dist_kernel.parent import membership_words as words
from dist_kernel.parent.relay import Outlet, OutputRelay
from dist_kernel.parent.selection import format_ranks

if TYPE_CHECKING:
    from dist_kernel.options import KernelConfig
    from dist_kernel.parent.ranks import CellRanks
    from dist_kernel.protocol import Place

REFORMED = ("\x1b[1;33mdist_kernel:\x1b[0m the process group was re-formed; every rank's variables "
            "survived. Objects bound to the old group (DistributedDataParallel wrappers, new_group() "
            "handles) must be created again.")

log = logging.getLogger("dist_kernel")


@dataclass
class GroupState:
    """What the process group carries from one cell to the next."""

    left_running: set[int] = field(default_factory=set)  # ranks whose cell was given up on (abandoned)
    reform_pending: bool = False  # a re-formation waits for a rank that was left running

    async def reform_if_due(self, ranks: CellRanks, timeout: float, first: Callable[[], None] = lambda: None) -> None:
        """Before a cell: re-form the group an earlier cell broke, once its ranks are back
        (``first``: what to do before, when it is due: the cell shows it is busy meanwhile)."""
        if self.reform_pending and not self.left_running:
            first()
            self.reform_pending = False
            with contextlib.suppress(Exception):
                await asyncio.wait_for(ranks.form_group(), timeout)


@dataclass(frozen=True)
class CellSpec:
    """What the kernel decided about one cell before it runs."""

    ranks: tuple[int, ...]  # the ranks that run it (``%%rank``), in order
    world: tuple[int, ...]  # every rank of the group
    execution_count: int
    window: float  # the merge window, seconds
    hang_grace: float = 10.0
    rich_from: int | None = None  # rich output from this rank only (``%dist_output rank0``)
    reform_timeout: float = 120.0  # for re-forming a group the cell broke
    respawn: bool = False  # --respawn on: a rank that died is started anew once the cell ends
    parent: dict = field(default_factory=dict)  # the frontend's request

    @classmethod
    def of(cls, cfg: KernelConfig, ranks: tuple[int, ...] | None, execution_count: int, parent: dict,
           rank0_rich: bool = False) -> CellSpec:
        """A run of the frontend's request ``parent`` on ``ranks`` (None: every rank), by the
        kernel's options; ``rank0_rich``: rich output from the first of them only (``%dist_output rank0``)."""
        world = tuple(range(cfg.world_size))
        ranks = world if ranks is None else ranks
        return cls(ranks, world, execution_count, cfg.merge_window, hang_grace=cfg.hang_grace,
                   rich_from=ranks[0] if rank0_rich else None, reform_timeout=cfg.startup_timeout,
                   respawn=cfg.respawn, parent=parent)


@dataclass(frozen=True)
class CellResult:
    """What a cell's run comes to, for the kernel's ``execute_reply``."""

    error: dict | None  # the cell's one error, with the notes about the group; None: it succeeded
    #: the cell's first rank's reply: its payloads (pager, set_next_input, exit) and
    #: user_expressions speak for the cell, or the frontend would act on them once per rank
    reply: dict


class CellRun:
    """One cell on its ranks: :meth:`start` sends it, :meth:`finish` relays and merges the
    outputs, acts on faults, and returns the :class:`CellResult`."""

    def __init__(self, spec: CellSpec, outlet: Outlet, via: CellRanks, group: GroupState | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 debug_stopped: Callable[[], tuple[int, ...]] | None = None) -> None:
        self.spec = spec
        self.ranks = spec.ranks
        self.world = spec.world
        self.via = via  # the ranks' seam
        self.group = group if group is not None else GroupState()
        self.debug_stopped = debug_stopped  # the ranks stopped at a breakpoint of the debugger, now
        self.clock = clock
        self.relay = OutputRelay(spec.ranks, outlet, spec.execution_count, spec.window, world=spec.world,
                                 rich_from=spec.rich_from, clock=clock)
        self.started = clock()
        self.judge = fault_policy.Judge()
        self.interrupted_at: float | None = None
        self.signalled: dict[int, float] = {}  # rank -> when it was last sent SIGINT
        self.group_broken = False  # the process group was torn down during this cell
        self.torn_down_at: float | None = None  # when that teardown was confirmed (or given up on)
        self.notes: list[str] = []  # lines appended to the cell's error, if any
        #: what the ranks' execute_replies said (dist_kernel's metadata), a group of ranks with one
        #: same reply at a time (a node's summary): read once per group, not once per rank
        self.said: list[tuple[list[int], dict]] = []
        self._arrived: list[tuple[list[int], dict]] = []  # replies not yet handed to the relay, with their ranks
        self.noticed: set[tuple] = set()  # kernel notices already shown in this cell
        self._last_look: float | None = None
        self._looking: asyncio.Task | None = None

    @property
    def parent(self) -> dict:
        """The frontend's request."""
        return self.spec.parent

    # --------------------------------------------------------------- send
    def start(self, content: dict, metadata: dict) -> list[str]:
        """Send the execute request to every rank of the cell (one header for all: each node's
        agent then groups its ranks' replies, which arrive here a group at a time); the msg_ids
        sent, each once. A rank that dies before it replies ends through :meth:`on_rank_died`."""
        sent, lost = self.via.send_cell(self.ranks, content, metadata, self._replied)
        for rank, why in lost.items():
            self.on_rank_lost(rank, RankDiedError, why)
        for rank in self.via.stopped_ranks():
            if rank in self.ranks and rank not in lost:
                self.notice_stopped(rank)
        for msg_id in sent:
            self.via.listen_all(msg_id, self.relay.on_iopub, self.relay.on_iopub_group)
        return sent

    def _replied(self, ranks: list[int], msg: dict) -> None:
        """The ranks' execute_reply message arrived (the same one for each: a node's group)."""
        self._arrived.append((ranks, msg))
        if len(self._arrived) == 1:  # the replies that arrive in this turn (each node's summary), taken together
            asyncio.get_running_loop().call_soon(self._take_replies)

    def _take_replies(self) -> None:
        arrived, self._arrived = self._arrived, []
        groups: list[tuple[list[int], dict, dict | None]] = []
        left_running = self.group.left_running
        for ranks, msg in arrived:
            metadata = msg.get("metadata") or {}
            self.said.append((ranks, protocol.meta_of(metadata)))
            groups.append((ranks, msg["content"], metadata))
            if left_running:
                left_running.difference_update(ranks)
        self.relay.on_replies(groups)

    def on_rank_lost(self, rank: int, ename: ErrorName, evalue: str, hint: str = "") -> None:
        """A rank will never answer (it died): end its part of the cell with an error."""
        self.relay.end_rank(rank, error_content(ename, evalue, [hint] if hint else []))

    # ------------------------------------------------------------- driving
    async def wait(self) -> dict | None:
        """Relay output until every rank is finished, looking at the busy ranks meanwhile;
        returns the merged error or None."""
        await self.relay.until_finished(self._maybe_look)
        if self._looking is not None and not self._looking.done():
            if not (self.group_broken and self.torn_down_at is None):
                # a late look must not tear down the group that is about to be re-formed
                self._looking.cancel()
            # but a teardown under way ends first (each rank answers it within seconds): the ranks
            # it freed may finish before their own teardown ran, which, coming after the group was
            # formed again, would destroy the new one
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._looking
        dead = self.dead()
        for r, err in list(self.relay.merger.errors.items()):
            if dead and r not in dead and fault_policy.broken_by_a_death(err):
                self.relay.set_error(r, error_content(RankDiedError, f"rank {r}'s collective lost its peer: rank "
                                                      f"{format_ranks(dead)} died"))
        return self.relay.close()

    def mark_stuck(self, rank: int, ename: ErrorName, evalue: str, lines: list[str]) -> None:
        """Record why a rank is being unblocked; this becomes its error for the cell."""
        self.relay.set_error(rank, error_content(ename, evalue, lines))

    def state(self) -> fault_policy.Cell:
        """This run, as the fault policy sees it."""
        relay = self.relay
        errored = any(relay.replies.get(r, {}).get("status") == "error" for r in relay.finished)
        return fault_policy.Cell(
            ranks=self.ranks, world=self.world, busy=tuple(self.busy_ranks), dead=tuple(self.dead()),
            started=self.started, first_finished=min(relay.finished_at.values(), default=None),
            errored=errored, interrupted_at=self.interrupted_at, hang_grace=self.spec.hang_grace,
            torn_down=self.group_broken, torn_down_at=self.torn_down_at,
            debug_stopped=self.debug_stopped() if self.debug_stopped else ())

    def dead(self) -> list[int]:
        """The ranks of the group whose process is gone."""
        return [r for r in self.via.gone() if r in self.world]

    def _maybe_look(self) -> None:
        """Look at the busy ranks when the fault policy says it is time."""
        if self._looking is not None and not self._looking.done():
            return
        now = self.clock()
        state = self.state()
        gone = set(state.busy).intersection(state.dead)
        for rank in sorted(gone):
            # gone without the kernel hearing of it in this cell (it was exiting): never waited for
            self.on_rank_lost(rank, RankDiedError, f"rank {rank} ({self.via.describe(rank)}) is gone",
                              words.respawn_hint([rank]))
        if gone:
            state = self.state()
        if fault_policy.look_due(state, now, self._last_look):
            self._last_look = now
            self._looking = asyncio.ensure_future(self._look())

    # -------------------------------------------------- look, judge, act
    async def _look(self) -> None:
        """Ask the busy ranks where they are, let the fault policy judge, and act on it."""
        via = self.via
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
        for r in self.judge.silent(places):
            if not via.stopped(r):
                self.notice(f"rank {r} ({via.describe(r)}) does not answer ({via.os_state(r)}): it may be stuck "
                            "in C code that holds the GIL. Press stop to end the cell, or restart the kernel.",
                            key=("silent", r))
        verdict = self.judge.judge(replace(self.state(), idle_seqs=idle_seqs), places, self.clock())
        if verdict.action == "wait":
            return
        await self._act(verdict, places)

    async def _act(self, verdict: fault_policy.Verdict, places: dict[int, Place | None]) -> None:
        via = self.via
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
            log.warning("tearing down the group on ranks %s (%s; stuck: %s)", list(verdict.teardown_on), verdict.ename,
                        list(verdict.stuck))
            self.group_broken = True
            failed = await via.teardown(verdict.teardown_on)
            self.torn_down_at = self.clock()
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
        tail = self.via.log_tail(rank, 15)
        self.on_rank_lost(rank, RankDiedError, f"rank {rank} ({self.via.describe(rank)}) {reason}",
                          f"Last output of the rank process:\n{tail}\n" if tail.strip() else "")

    def on_rank_stopped(self, rank: int) -> None:
        """A rank of the cell was stopped (SIGSTOP, a debugger): say so once."""
        if rank in self.busy_ranks:
            self.notice_stopped(rank)

    def notice_stopped(self, rank: int) -> None:
        via = self.via
        self.notice(f"rank {rank} ({via.describe(rank)}) is {via.stopped(rank) or 'stopped'} (SIGSTOP or a "
                    f"debugger): the cell waits for it. Resume it with `kill -CONT {via.pid(rank)}`, press stop "
                    "to end the cell without it, or restart the kernel.", key=("stopped", rank))

    def notice(self, text: str, key: tuple) -> None:
        """A kernel message in the cell's output, once per cell and key."""
        if key in self.noticed:
            return
        self.noticed.add(key)
        self.relay.say(f"[dist_kernel] {text}\n")

    # ------------------------------------------------------------ finish
    async def finish(self) -> CellResult:
        """Run the cell to its end (:meth:`wait`), re-form the group if it broke, and return
        its result: the cell's error with the notes about the group (or None), and its reply."""
        error = await self.wait()
        if self.group_broken or self.group_broke() or self.destroyed() or self.dead():
            await self._recover_group()
        if error is not None:
            error = dict(error, traceback=error["traceback"] + self.notes)
        elif self.notes:  # a cell that succeeded but changed the group (destroyed it)
            self.relay.publish_raw("stream", {"name": "stderr", "text": "\n".join(self.notes) + "\n"})
        return CellResult(error=error, reply=self.relay.replies.get(self.ranks[0], {}))

    def group_broke(self) -> bool:
        """Did a rank report that its process group broke during the cell, or are the ranks out
        of step after it (their collective sequence numbers differ)?"""
        if any(m.get(protocol.META_GROUP_BROKEN) for _, m in self.said):
            return True
        counted = [(ranks, m[protocol.META_SEQ]) for ranks, m in self.said if isinstance(m.get(protocol.META_SEQ), int)]
        if len({seq for _, seq in counted}) < 2:
            return False  # one sequence number (the common case): in step, whoever replied
        return fault_policy.out_of_step({r: seq for ranks, seq in counted for r in ranks}, self.world)

    def destroyed(self) -> list[int]:
        """The ranks whose cell destroyed the process group (``dist.destroy_process_group()``)."""
        return [r for ranks, m in self.said if m.get(protocol.META_GROUP_DESTROYED) for r in ranks]

    async def _recover_group(self) -> None:
        """After a torn-down or broken group, form a fresh one on every rank (policy: after_cell)."""
        via = self.via

        def decide() -> str:
            return fault_policy.after_cell(self.group_broken, self.group_broke(), self.dead(),
                                           self.group.left_running, destroyed=self.destroyed(), world=self.world)

        decision = decide()
        if decision == "reform":
            try:
                await asyncio.wait_for(via.form_group(), self.spec.reform_timeout)
                self.notes.append(REFORMED)
                return
            except Exception as e:  # noqa: BLE001 - a rank died meanwhile, or a join failed
                decision = decide()
                if decision == "reform":
                    self.notes.append(f"Re-forming the process group failed ({e}); restart the kernel.")
                    return
        if decision == "down":
            self.notes.append(fault_policy.DOWN)
        elif decision == "respawn":
            await self._respawn()
        elif decision == "later":
            self.group.reform_pending = True
            self.notes.append(f"rank {format_ranks(sorted(self.group.left_running))} is still running its cell; "
                              "the process group is re-formed before the next cell once it is back (restart "
                              "the kernel if it does not come back).")

    async def _respawn(self) -> None:
        """Rank(s) died: start them anew now (``--respawn on``), or say how to."""
        dead = self.dead()
        if len(dead) == len(self.world):  # nothing survived (a lost node, a cancelled job): nothing kept
            self.notes.append(words.ALL_GONE)
            return
        if not self.spec.respawn:
            self.notes.append(words.respawn_hint(dead))
            return
        try:
            started = await asyncio.wait_for(self.via.respawn(dead, auto=True), self.spec.reform_timeout)
        except Exception as e:  # noqa: BLE001 - it keeps dying, or could not start: say so, once
            self.notes.append(words.auto_failed(str(e) or type(e).__name__, self.dead()))
            return
        self.notes.append(words.respawned(started))

    def interrupt(self) -> list[int]:
        """The stop button: the busy ranks to send SIGINT now. A rank is signalled at most
        once a second: a storm of interrupts must not hit a rank that is already unwinding."""
        now = self.clock()
        if self.interrupted_at is None:
            self.interrupted_at = now
        due = [r for r in self.busy_ranks if now - self.signalled.get(r, -1e9) >= 1.0]
        for r in due:
            self.signalled[r] = now
        self.relay.stopping = True  # a rank that replied is finished without waiting for its idle
        self._last_look = None  # look again soon: ranks blocked in a collective need a teardown
        return due

    @property
    def busy_ranks(self) -> list[int]:
        return self.relay.busy_ranks
