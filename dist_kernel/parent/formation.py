"""Forming the process group again over every rank, and what a formation that fails leaves:
nothing waiting in it.

Every rank joins a fresh group (a new meeting place per formation): after a fault tore the group
down, after ranks were started anew (``%dist_respawn``, ``--respawn on``) or the rank count
changed (``%dist_ranks``). A formation meets only when every rank of the world comes; so

- one with a dead rank is refused before any rank is asked (it would wait for it for good);
- when a rank fails to join (it died meanwhile, its join failed or timed out), the others are
  waiting in the meeting for it: their waits are ended (the teardown request, which ends a wait
  in the rendezvous store) until each has answered, so none is left blocked on its main thread,
  where the next cell would queue behind it with no word of why.

A rank started anew joins with the rank switches the kernel started with (it installs what the
others installed then), and is then switched as the others are now (``%dist_fastai off`` since):
the ranks never disagree.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Collection
from typing import TYPE_CHECKING

from dist_kernel import protocol
from dist_kernel.exceptions import RankStartError
from dist_kernel.parent import membership_words as words
from dist_kernel.parent.selection import format_ranks

if TYPE_CHECKING:
    from dist_kernel.parent.supervisor import RankSupervisor

#: how long the waits of the other ranks are ended, again and again, after one rank failed to join
RELEASE_FOR = 15.0
#: how often they are ended meanwhile (a rank may enter the wait after an earlier release)
RELEASE_EVERY = 0.5


async def form_group(sup: RankSupervisor, fresh: Collection[int] = ()) -> None:
    """Every rank joins a fresh process group (``fresh``: started anew, they join as at start,
    seeded and switched). Raises :class:`RankStartError` naming the rank that failed; no rank
    is left waiting in the formation, even when the caller gives up on it (a timeout)."""
    dead = sorted(r for r, rk in sup.ranks.items() if not rk.alive)
    if dead:
        reasons = "; ".join(f"rank {r} {sup.ranks[r].exit_reason}" for r in dead)
        raise RankStartError(words.dead_before_joining(dead, reasons))
    sup.generation += 1
    joins = {r: asyncio.ensure_future(sup.join(r, first=r in fresh)) for r in sup.ranks}
    failure: BaseException | None = None
    try:
        done, _ = await asyncio.wait(joins.values(), return_when=asyncio.FIRST_EXCEPTION)
        # the first to fail says why (the ranks released below fail after it, of the release)
        failure = next((t.exception() for t in done if not _joined(t)), None)
    finally:
        # failed, or given up on (cancelled): the ranks still joining wait for the others for good
        if not all(_joined(t) for t in joins.values()):
            await _release(sup, joins, set(fresh))
    if failure is not None:
        raise failure
    await _switch_as_the_others(sup, sorted(fresh))


async def _switch_as_the_others(sup: RankSupervisor, fresh: list[int]) -> None:
    """Flip on the ranks started anew each rank switch a magic flipped since the kernel started."""
    flipped = {name: on for name, on in sup.config.rank_switches().items() if on != sup.switches_at_start[name]}
    if not fresh:
        return
    for name, on in flipped.items():
        replies = await asyncio.gather(*(sup.ask(r, protocol.SetOption(name=name, on=on)) for r in fresh))
        missing = [r for r, reply in zip(fresh, replies, strict=True) if reply is None]
        if missing:  # the caller ends the ranks it started: none is left disagreeing
            raise RankStartError(f"rank {format_ranks(missing)} did not switch {name} {'on' if on else 'off'} as "
                                 "the other ranks are")


def _joined(task: asyncio.Task) -> bool:
    return task.done() and not task.cancelled() and task.exception() is None


async def _release(sup: RankSupervisor, joins: dict[int, asyncio.Task], fresh: set[int]) -> None:
    """End the waits of the ranks still joining, until each answered (or :data:`RELEASE_FOR`
    passed: those are named in the log). A rank started anew for this formation is neither asked
    nor waited for: it may still be importing torch, out of a release's reach (a teardown can
    then crash it), and its caller ends it (:mod:`.membership`). Shielded: it runs to its end
    even when the formation's caller gives up."""

    def alive(r: int) -> bool:
        return r in sup.ranks and sup.ranks[r].alive

    async def release() -> None:
        # first every rank that did not join (one whose join timed out may still wait), then
        # those still joining, until each answered: a rank may enter the wait after a release
        await sup.teardown([r for r, t in joins.items() if alive(r) and not _joined(t) and r not in fresh])
        deadline = time.monotonic() + RELEASE_FOR
        while True:
            waiting = [r for r, t in joins.items() if not t.done() and alive(r) and r not in fresh]
            if not waiting or time.monotonic() > deadline:
                break
            await asyncio.wait([joins[r] for r in waiting], timeout=RELEASE_EVERY)
            await sup.teardown([r for r in waiting if not joins[r].done()])
        for r, task in joins.items():
            if not task.done():
                if r not in fresh:
                    sup.log.warning("rank %d still joins an abandoned formation", r)
                task.cancel()
            with contextlib.suppress(BaseException):
                await task

    await asyncio.shield(asyncio.ensure_future(release()))
