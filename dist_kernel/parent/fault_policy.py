"""Fault policy: what to do about ranks that have not finished a cell. Pure: no I/O, no clock.

The kernel feeds in what it knows (which ranks are busy, finished, dead or stopped, where
each busy rank waits, the time) and gets back a decision. The rules (the one copy: the
"Faults" section of docs/architecture.md lists their numbers and titles, held to these by
``tests/unit/test_docs.py``):

1. **Dead peer.** A rank of the group died while others are busy: tear the group down on
   the survivors, once, so that those blocked in a collective with the dead rank raise at
   once; the others are not stopped (a rank that computes finishes, or raises at its next
   collective), and every survivor keeps its variables. A survivor's error that is only gloo's
   word for a lost peer (``pair.cc``, "Connection closed by peer") is shown as the death
   (:func:`broken_by_a_death`). After the cell (:func:`after_cell`) the dead rank is started
   anew (``%dist_respawn``, or at once with ``--respawn on``: ``parent/membership.py``), unless
   it died three times within a minute (:func:`keeps_dying`). Across machines a rank that
   exited is one rank's death the same way (its agent starts it anew); a lost node, an ending
   agent or a cancelled job still take the gang (rule 6).
2. **Waiting for an idle rank.** A busy rank blocked in a collective whose group holds a rank
   that is idle (finished the cell, or not selected by ``%%rank``) waits for a rank that will
   never come. So does a busy rank in ``backward()`` whose default group has started more
   collectives than an idle rank's: it started one in C++ that the idle rank never entered
   (DDP's gradient all_reduce, where no torch.distributed call shows on the stack). So does a
   busy rank in a C++ call of torch's distributed code (its innermost Python frame is there:
   ``DDP(...)`` verifying and broadcasting the parameters, accelerate's ``prepare``) whose
   default group is ahead of an idle member's in the same way. The count is torch's,
   point-to-point calls included, so ranks that sent to each other in earlier cells are ahead
   of a third for good: only a rank in ``backward()`` or in such a call is judged by it (the
   count keeps a rank that only computes there, such as a checkpoint written by rank 0 alone
   with ``no_dist=True``, from being taken for a blocked one). Once every busy rank is blocked
   in one of these ways, and at least one of them waits for an idle rank, tear the group down
   on every rank: the blocked ones raise at once (on the idle ranks alone, at 4 ranks a rank
   freed by an idle one kept its connection to another busy one, which waited on it for good).
   Grace: ``hang_grace`` after the first rank finished (or after the start, when ``%%rank``
   left ranks out), 1 s when a finished rank failed.
3. **Mismatched collectives.** Every busy rank is blocked, none is idle, the calls cannot
   complete each other, and nothing changed for half the grace: a deadlock. Tear the group down
   on every rank. Reported within ``hang_grace``. They cannot complete each other
   (:mod:`dist_kernel.parent.mismatch`) when they are different calls (collectives, sequence
   numbers, two ranks each receiving from the other); when one collective that needs the same
   tensors on every rank holds different ones (``dist.all_reduce(torch.ones(rank + 1))``: each
   rank's shapes and dtypes named, as torch's ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` would, but
   compared only now); or when a rank blocked in a collective torch started in C++ (DDP's
   forward, ``backward()``) has started at least as many collectives on a group as the one
   another rank is blocked in from Python there (a ``barrier``: accelerate's
   ``join_uneven_inputs``). A C++ rank that started fewer may still be computing, and is
   waited for.
4. **Interrupt.** One second after the stop button, ranks still blocked in a collective, or in
   a C++ call of torch's distributed code, did not react to SIGINT (C++ does not return to
   Python): tear the group down on every rank.
   Five seconds after it, ranks still running the cell's code are left behind so that the cell
   ends; a rank whose code has stopped and that is still formatting its traceback (slow on a
   loaded machine) is waited for, up to half a minute.
5. **Stopped or silent ranks.** Ranks stopped (SIGSTOP, a debugger) or silent (C code holding
   the GIL) are named (a silent one once it missed two looks in a row: one miss is a loaded
   machine); the group is left alone, since resuming the rank may resume the cell.
6. **Ranks on other machines.** One fault there sets off others: a killed agent makes a Slurm
   step SIGTERM the agents on the other nodes; a cancelled job ends the step. The kernel
   (``parent/gang_fault.py``) collects what it hears for a moment (:func:`settle_for`) and
   names the most specific cause (:func:`remote_culprit`): a rank that exited by itself or was
   killed (the OOM killer), then a node that fell silent, then what the node starter said as it
   ended, then an agent's own word that it is ending (SIGTERM), then a rank that was terminated
   (cancelling a job signals every process of the step); the earliest within a kind. The ranks
   on every node are then stopped.
7. **A rank at a breakpoint.** While the rank that JupyterLab's debugger debugs
   (``%dist_debug``) is stopped there, the others wait for it as they would under a debugger in
   torchrun; the kernel does not look, judge or call anyone stuck until it goes on, a rank dies
   or stop is pressed.
8. **NCCL stalls.** NCCL starts each collective asynchronously: a rank whose peer never enters
   one does not block in it, but later, in a CUDA synchronisation (``loss.item()``), with no
   torch.distributed call on the stack. On NCCL ranks torch's flight recorder is on
   (``rank/nccl.py``, a 64-entry buffer); a rank's ``where`` then names that wait
   (``cuda_wait``, and in ``native``, so that the parent asks the idle ranks' ``group_seq`` as
   for DDP) and the collectives the recorder holds as pending (``pending``, read from its JSON
   dump). A pending collective of the default group whose sequence number is above an idle
   member's count (``group_seq``: on NCCL, collectives alone, as the recorder numbers them) is
   one that rank never entered: the busy rank is blocked as in rule 2, and judged with its
   grace. An idle rank that did enter it (its GPU still on its way there) is waited for. NCCL
   frees a waiting GPU only when the rank aborts its own communicators, so the group is torn
   down on every rank (``teardown`` on an NCCL rank: ``_abort_process_group``, then the cell
   stops with ``GroupAborted`` once its CUDA synchronisation returns); the error names each
   rank's pending collectives and the tensors that may hold a partial result (their outputs,
   by dtype and shape). A pending point-to-point call, or one on another group, is not
   judged (idle ranks report the default group's count alone); the stop button frees it all the
   same (rule 4: the CUDA wait counts as a C++ call of torch's distributed code).

A legitimate long collective that every rank is in, and a long computation, are never cut.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Literal, TypeAlias

from dist_kernel.exceptions import CollectiveHangError, RankDiedError
from dist_kernel.parent import mismatch
from dist_kernel.parent.selection import format_ranks
from dist_kernel.protocol import Pending, Place

#: after a finished rank failed, or after an interrupt, how long others may stay busy
FAST_GRACE = 1.0
#: after an interrupt, and after a teardown that followed it, how long a rank may stay busy
#: before the cell ends without it (counted from the later of the two: on a loaded machine the
#: teardown itself may take seconds, and the ranks it frees need a moment to raise; at 5 s, a
#: rank freed from a loop of collectives at a load of 12 on 2 cores was called "did not stop")
GIVE_UP_AFTER = 10.0
#: how long a rank whose code has stopped may take to report it (IPython formats the traceback:
#: about 0.2 s on an idle machine, seconds with a load of 4 on 2 cores)
REPORT_WITHIN = 30.0
#: how long a survivor of a dead peer may take to stop
STOP_TIMEOUT = 3.0

Action = Literal["wait", "stop", "teardown", "abandon"]


#: what a look found of one busy rank: its ``where`` reply (:class:`~dist_kernel.protocol.Place`,
#: the one description of where a rank is), None when it did not answer in time
Seen: TypeAlias = "Place | None"


def _judged(seen: Seen) -> Seen:
    """What the rules read of a look (its ``stack`` is only shown; ``busy`` is known otherwise):
    a rank is "steady" while this stays the same from look to look."""
    return None if seen is None else replace(seen, stack=[], busy=True)


@dataclass(frozen=True)
class Cell:
    """The state of one cell's run, as the kernel knows it."""

    ranks: tuple[int, ...]  # the ranks running the cell
    world: tuple[int, ...]  # every rank of the group
    busy: tuple[int, ...]  # cell ranks that have not finished
    dead: tuple[int, ...] = ()  # ranks whose process is gone
    started: float = 0.0
    first_finished: float | None = None
    errored: bool = False  # a finished rank's reply was an error
    interrupted_at: float | None = None
    hang_grace: float = 10.0
    torn_down: bool = False  # the group was torn down during this cell
    torn_down_at: float | None = None  # when that teardown was confirmed
    #: idle ranks' default-group collective counts, as a look found them
    idle_seqs: dict[int, int] = field(default_factory=dict)
    #: ranks stopped at a breakpoint of JupyterLab's debugger (rule 7)
    debug_stopped: tuple[int, ...] = ()
    #: what an idle rank is, in the words of rule 2's report (a cell's, or ``%dist_sync``'s)
    idle_means: str = "idle: finished or not selected by %%rank"

    @functools.cached_property
    def idle(self) -> tuple[int, ...]:
        gone = {*self.busy, *self.dead}  # a set, and once per Cell: this was O(ranks^2) per look
        return tuple(r for r in self.world if r not in gone)

    @property
    def at_breakpoint(self) -> bool:
        """A rank is stopped at a breakpoint, nothing died and nobody pressed stop (rule 7)."""
        return bool(self.debug_stopped) and not self.dead and self.interrupted_at is None


@dataclass(frozen=True)
class Verdict:
    """What to do now. ``stuck`` names each rank the action ends, with the reason shown."""

    action: Action
    stuck: dict[int, str] = field(default_factory=dict)
    teardown_on: tuple[int, ...] = ()
    ename: str = CollectiveHangError.__name__


WAIT = Verdict("wait")


def look_due(cell: Cell, now: float, last_look: float | None) -> bool:
    """Is it time to ask the busy ranks where they are?"""
    if not cell.busy or cell.at_breakpoint:
        return False
    if cell.interrupted_at is not None:
        return now - cell.interrupted_at >= FAST_GRACE and _spaced(now, last_look, FAST_GRACE)
    if cell.torn_down:
        return False  # the blocked ranks raise by themselves
    if cell.dead:
        return _spaced(now, last_look, FAST_GRACE)  # free the survivors of a death at once (rule 1)
    if cell.idle:
        grace = FAST_GRACE if cell.errored else cell.hang_grace
        since = cell.started if len(cell.ranks) < len(cell.world) or cell.first_finished is None \
            else cell.first_finished
        return now - since >= grace and _spaced(now, last_look, grace)
    # every rank busy: look now and then, so a deadlock is confirmed within the grace
    every = max(0.5, cell.hang_grace / 2)
    return now - cell.started >= every and _spaced(now, last_look, every)


def _spaced(now: float, last_look: float | None, every: float) -> bool:
    return last_look is None or now - last_look >= every


class Judge:
    """Applies the rules to one cell's looks; remembers what the previous looks saw."""

    def __init__(self) -> None:
        self._since: dict[int, tuple[Seen, float]] = {}  # rank -> (what it was seen doing, since when)

    def silent(self, seen: Mapping[int, Seen]) -> list[int]:
        """Ranks that answered neither this look nor the one before (call before :meth:`judge`):
        only those may be stuck holding the GIL. One missed answer is a loaded machine."""
        return [r for r, s in seen.items() if s is None and r in self._since and self._since[r][0] is None]

    def judge(self, cell: Cell, seen: Mapping[int, Seen], now: float) -> Verdict:
        for rank, s in seen.items():
            prev = self._since.get(rank)
            if prev is None or prev[0] != _judged(s):
                self._since[rank] = (_judged(s), now)
        # the rules read the ranks that answered; one that did not is never judged stuck
        found = {r: p for r, p in seen.items() if p is not None}
        busy = [r for r in cell.busy if r not in cell.dead]
        if cell.dead and busy and not cell.torn_down:
            return self._dead_peer(cell, busy, found)
        if cell.interrupted_at is not None:
            return self._after_interrupt(cell, busy, found, now)
        if cell.torn_down or cell.at_breakpoint:
            return WAIT
        if cell.idle:
            return self._waiting_for_idle(cell, busy, found)
        return self._mismatched(cell, busy, found, now)

    # ---------------------------------------------------------------- rules
    def _dead_peer(self, cell: Cell, busy: list[int], found: dict[int, Place]) -> Verdict:
        dead = format_ranks(cell.dead)
        # the ranks blocked now end with the death as their error; one that computes runs on
        stuck = {r: f"rank {r} was freed from {_blocked_in(found[r])}: rank {dead} died"
                 for r in busy if r in found and (_blocked(found[r]) or found[r].native or found[r].in_backward)}
        return Verdict("teardown", stuck, teardown_on=tuple(r for r in cell.world if r not in cell.dead),
                       ename=RankDiedError.__name__)

    def _after_interrupt(self, cell: Cell, busy: list[int], found: dict[int, Place], now: float) -> Verdict:
        assert cell.interrupted_at is not None
        if now - max(cell.interrupted_at, cell.torn_down_at or 0.0) >= GIVE_UP_AFTER:
            # a rank whose code stopped and that is only showing its traceback is waited for
            late = now - cell.interrupted_at >= REPORT_WITHIN
            running = [r for r in busy if late or not (r in found and not found[r].in_code)]
            if not running:
                return WAIT
            return Verdict("abandon", {r: f"rank {r} did not stop after the interrupt; it may still be "
                                          f"running (restart the kernel if it does not come back)"
                                       for r in running}, ename=KeyboardInterrupt.__name__)
        if cell.torn_down:
            return WAIT
        if cell.idle:  # the interrupt ended some ranks' cells: the others now wait for them
            verdict = self._waiting_for_idle(cell, busy, found)
            if verdict.action != "wait":  # one KeyboardInterrupt, not a hang the stop caused
                return Verdict("teardown", {r: f"rank {r} was interrupted while blocked in {_blocked_in(found[r])}"
                                            + _partial(found[r]) for r in verdict.stuck},
                               teardown_on=verdict.teardown_on,
                               ename="KeyboardInterrupt")
        # a rank still in a C++ call of torch's distributed code a second after SIGINT did not
        # react to it either (a collective on a group whose count says nothing, say a subgroup's)
        blocked = [r for r in busy if r in found and (_blocked(found[r]) or found[r].native)]
        if blocked:
            return Verdict("teardown", {r: f"rank {r} was interrupted while blocked in {_blocked_in(found[r])}"
                                       + _partial(found[r]) for r in blocked},
                           teardown_on=tuple(r for r in cell.world if r not in cell.dead),
                           ename=KeyboardInterrupt.__name__)
        return WAIT

    def _waiting_for_idle(self, cell: Cell, busy: list[int], found: dict[int, Place]) -> Verdict:
        idle = set(cell.idle)
        ahead = {r: _never_entered(cell, found[r]) if _on_gpu(found[r]) else _behind(cell, found[r])
                 for r in busy if r in found}
        if not busy or any(not (r in found and (_blocked(found[r]) or ahead[r])) for r in busy):
            return WAIT  # someone still computes (or did not answer): it may yet finish
        waiting = {r: sorted(idle & set(found[r].group_ranks or cell.world)) if _blocked(found[r]) else ahead[r]
                   for r in busy}
        if not any(waiting.values()):
            return WAIT
        stuck = {r: f"rank {r} was blocked in {_blocked_in(found[r])}, which rank "
                    f"{format_ranks(waiting[r] or sorted(idle))} never entered "
                    f"({cell.idle_means})" + _partial(found[r]) for r in busy}
        # on every rank: the idle ranks' teardown frees only ranks blocked *with them*. At 4
        # ranks, a rank freed that way may be the one another busy rank waits for (gloo's ring
        # all_reduce: rank 0 waits for rank 1, freed by idle rank 2), and it keeps its connections
        # open; a rank waiting in the rendezvous store (group creation) is freed only by its own;
        # and NCCL frees a rank only by its own abort (rule 8)
        return Verdict("teardown", stuck, teardown_on=tuple(r for r in cell.world if r not in cell.dead))

    def _mismatched(self, cell: Cell, busy: list[int], found: dict[int, Place], now: float) -> Verdict:
        if not busy or any(not (r in found and (_blocked(found[r]) or _in_cpp(found[r]))) for r in busy):
            return WAIT
        why = mismatch.unmatched({r: found[r] for r in busy}, cell.world)
        if not why:
            return WAIT
        steady = min(now - self._since[r][1] for r in busy)
        if steady < cell.hang_grace / 2 - 1e-9:
            return WAIT  # maybe a rank is just passing through; confirm at the next look
        stuck = {r: f"every rank is blocked in torch.distributed calls that cannot complete each other ({why})"
                 for r in busy}
        return Verdict("teardown", stuck, teardown_on=tuple(r for r in cell.world if r not in cell.dead))


Reform = Literal["none", "reform", "respawn", "later", "down"]


def after_cell(torn_down: bool, broke: bool, dead: Iterable[int], left_running: Iterable[int],
               destroyed: Iterable[int] = (), world: Iterable[int] = ()) -> Reform:
    """Once a cell has ended: must the group be formed again, and can it be?

    ``none``: the group is fine. ``reform``: it was torn down, or a rank reported that the
    cell's error broke it, or the cell destroyed it (``dist.destroy_process_group()``) on some
    ranks only, which breaks it for the others: every rank joins a fresh group (variables
    survive). ``down``: the cell destroyed it on every rank of the ``world``: the user's choice,
    left as it is (the cell says how to bring it back). ``respawn``: a rank is dead (also when
    it died during a re-formation, or while the group was fine), so the group forms again once a
    new process takes its place. ``later``: a rank is still running the cell the kernel gave up
    on; the group is formed again once it is back.
    """
    if any(True for _ in dead):
        return "respawn"
    destroyed = set(destroyed)
    if destroyed and not (torn_down or broke) and destroyed >= set(world):
        return "down"
    broke = broke or bool(destroyed)
    if not (torn_down or broke):
        return "none"
    if any(True for _ in left_running):
        return "later"
    return "reform"


#: what gloo says when a peer of a collective is gone (its process died, its connection was cut)
GLOO_BROKEN = ("pair.cc", "Connection closed by peer", "Connection reset by peer", "Read error", "Broken pipe")


def broken_by_a_death(error: dict) -> bool:
    """Is a survivor's error only gloo's word that its collective lost a peer (which died)? It
    is then shown as the death it is, not as gloo's words (rule 1)."""
    return any(word in str(error.get("evalue", "")) for word in GLOO_BROKEN)


#: a rank that died this many times within RESPAWN_WINDOW seconds is not started again by itself
RESPAWN_LIMIT = 3
RESPAWN_WINDOW = 60.0


def keeps_dying(deaths: Iterable[float], now: float) -> bool:
    """``--respawn on``: has a rank died :data:`RESPAWN_LIMIT` times within the last
    :data:`RESPAWN_WINDOW` seconds (``deaths``: when it died)? Then it is not started again
    in a loop: the kernel says so and suggests a restart (``%dist_respawn`` still can)."""
    return sum(1 for t in deaths if now - t <= RESPAWN_WINDOW) >= RESPAWN_LIMIT


#: what a cell that destroyed the group on every rank says: how to bring it back
DOWN = ("\x1b[1;33mdist_kernel:\x1b[0m the process group is down on every rank (dist.destroy_process_group()); "
        "collectives fail until it is formed again. Bring it back with dist.init_process_group() run on every "
        "rank (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set, as torchrun sets them), or restart the "
        "kernel.")


def out_of_step(seqs: dict[int, int], world: Iterable[int]) -> bool:
    """After a failed cell that every rank ran (``seqs``: each rank's collective sequence
    number, from its reply): do they differ? An interrupt can land after a rank enqueued a
    collective and before it waited for it: the others never enter it, so every later
    collective pairs with the wrong one. The group must then be formed again."""
    world = tuple(world)
    return bool(world) and all(r in seqs for r in world) and len({seqs[r] for r in world}) > 1


RemoteKind = Literal["exited", "lost", "launcher", "ending", "terminated"]
_REMOTE_ORDER: tuple[RemoteKind, ...] = ("exited", "lost", "launcher", "ending", "terminated")


@dataclass(frozen=True)
class RemoteCause:
    """One thing heard about a fault on another machine."""

    kind: RemoteKind
    text: str
    ranks: tuple[int, ...] = ()  # the ranks it took with it


def settle_for(first: RemoteCause) -> float:
    """How long to hear more of a fault on other machines before naming its cause, from the first
    word of it. A rank terminated, or an agent ending, is what follows a fault elsewhere (a Slurm
    step SIGTERMs the other nodes' tasks when one is killed): the cause itself (a node lost, what
    the node starter said) comes a moment later, once the link's loss is confirmed (``tunnel.RECONNECT_GRACE``)."""
    return 3.0 if first.kind in ("terminated", "ending") else 1.0


def remote_culprit(causes: Iterable[RemoteCause]) -> RemoteCause:
    """The cause to report, of all heard in the settling moment (rule 6)."""
    heard = list(causes)
    if not heard:
        raise ValueError("no cause heard")
    return min(heard, key=lambda c: (_REMOTE_ORDER.index(c.kind), heard.index(c)))


def _blocked(s: Place) -> bool:
    """Is the rank in a torch.distributed call?"""
    return s.collective is not None


def _behind(cell: Cell, s: Place) -> list[int]:
    """The idle ranks whose default group started fewer collectives than this busy rank's, which
    is in ``backward()`` or in a C++ call of torch's distributed code (of those, the members of
    the call's group): it started one they never entered, and cannot finish it while they are
    idle."""
    if s.group_seq is None or not (s.in_backward or s.native):
        return []
    members = set(s.group_ranks) if s.native and not s.in_backward and s.group_ranks else set(cell.idle)
    return sorted(r for r, seq in cell.idle_seqs.items() if r in cell.idle and r in members and seq < s.group_seq)


def _in_cpp(s: Place) -> bool:
    """Is the rank in a collective that torch started in C++, with none called from Python on its
    stack (DDP's forward or constructor, ``backward()``), not an NCCL wait on the GPU (rule 8)?"""
    return s.collective is None and not _on_gpu(s) and bool(s.native or s.in_backward)


def _on_gpu(s: Place) -> bool:
    """Is the rank waiting for the GPU while NCCL collectives it started are pending (rule 8)?"""
    return bool(s.cuda_wait and s.pending and s.collective is None)


def _never_entered(cell: Cell, s: Place) -> list[int]:
    """The idle ranks that never entered a collective pending on this rank (rule 8): members of
    its group (the default one) whose count of collectives is below its sequence number."""
    return sorted(r for r, seq in cell.idle_seqs.items() if r in cell.idle and any(
        p.default and not p.p2p and (not p.group_ranks or r in p.group_ranks) and seq < p.seq for p in s.pending))


def _pending(p: Pending) -> str:
    """A pending collective in words: ``all_reduce #3 of the default group``."""
    group = "the default group" if p.default else f"group {p.group}" + (
        f" (ranks {format_ranks(p.group_ranks)})" if p.group_ranks else "")
    return f"{p.op} #{p.seq} of {group}"


#: the flight recorder's dtype names (c10's), as torch spells them
_DTYPES = {"Float": "float32", "Double": "float64", "Half": "float16", "BFloat16": "bfloat16", "Long": "int64",
           "Int": "int32", "Short": "int16", "Char": "int8", "Byte": "uint8", "Bool": "bool"}


def _partial(s: Place) -> str:
    """What a rank's NCCL abort leaves behind (rule 8): the outputs of its pending collectives,
    which may hold partial results, and what to do."""
    if not _on_gpu(s):
        return ""
    outputs = []
    for p in s.pending:
        tensors = [f"{_DTYPES.get(d, d)}{list(z)}" for d, z in zip(p.output_dtypes, p.output_sizes, strict=False)]
        outputs.append(f"{_pending(p)}: {', '.join(tensors) or 'no tensor'}")
    return (". Its NCCL communicators were aborted to free it; CUDA tensors survive, but the output of each "
            f"pending collective may hold a partial result ({'; '.join(outputs)}): compute it again, and run "
            "collectives on every rank")


def _blocked_in(s: Place) -> str:
    """Where a blocked rank waits, in words."""
    if _on_gpu(s):  # rule 8: NCCL's collectives, started before the wait
        return f"{s.cuda_wait}, a CUDA synchronisation behind NCCL {', '.join(_pending(p) for p in s.pending)}"
    if s.collective is None and s.native and not s.in_backward:  # ahead of an idle rank (rule 2)
        return f"{s.native} (a collective that torch started in C++)"
    if s.collective is None:  # ahead of an idle rank (rule 2): nothing on the stack names it
        return "a collective that torch started without a torch.distributed call (DDP's gradient all_reduce " \
               "in backward(), say)"
    if s.store_wait:
        return f"torch.distributed.{s.collective}() (group creation, which every rank must enter)"
    return f"torch.distributed.{s.collective}()"
