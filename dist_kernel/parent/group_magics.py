"""The magics that change which ranks make up the group, or bring a new rank in step, run:

- ``%dist_respawn [SPEC]``: start dead ranks anew (all of them, or those SPEC names, as
  ``%%rank`` writes them), and form the group again; the survivors keep their variables;
- ``%dist_ranks [N]``: alone, the rank count and where it comes from; with N, grow or shrink the
  ranks on this machine to N;
- ``%dist_sync NAME [NAME ...] [--from R]``: copy variables from rank R (0) to every other rank,
  watched as a cell is (:mod:`dist_kernel.parent.sync_run`).

The work is the supervisor's (:mod:`dist_kernel.parent.membership`) and the ranks'
(:mod:`dist_kernel.rank.sync`); this module reads the arguments and says what happened. Each
magic is a row of :data:`dist_kernel.parent.magics.MAGICS`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Protocol

from dist_kernel.exceptions import UsageError
from dist_kernel.parent import membership_words as words
from dist_kernel.parent.selection import format_ranks, parse_rank_spec

if TYPE_CHECKING:
    from dist_kernel.options import KernelConfig
    from dist_kernel.parent.ranks import Ranks
    from dist_kernel.protocol import Synced

Publish = Callable[[str, dict], None]
#: ``%dist_sync``'s copy, watched (the kernel's: :class:`~dist_kernel.parent.sync_run.SyncRun`):
#: (names, source rank) -> what was copied, in words
Copy = Callable[[list[str], int], Awaitable[str]]

#: the names the kernel defines on each rank (``join``), with what each holds there: rank 0's
#: copied to every rank would tell each one it is rank 0
KERNEL_NAMES = {"rank": "this rank's number", "world_size": "the number of ranks",
                "local_rank": "this rank's number on its machine", "device": "this rank's device"}


class MagicFailed(Exception):
    """A magic failed with this ``error`` content: its name, its message and the notes after it
    (the process group re-formed, how to bring a dead rank back)."""

    def __init__(self, error: dict) -> None:
        super().__init__(error.get("evalue", ""))
        self.error = error


class GroupCall(Protocol):
    """What these magics are given (:class:`~dist_kernel.parent.magics.MagicContext` is one)."""

    @property
    def ranks(self) -> Ranks: ...
    @property
    def launched(self) -> KernelConfig:
        """The kernel's options as it started (its kernelspec's rank count)."""
    @property
    def copy(self) -> Copy: ...
    def say(self, text: str) -> None: ...


async def dist_respawn(call: GroupCall, arg: str) -> None:
    """``%dist_respawn [SPEC]``: start the dead ranks (SPEC: those) anew; the group forms again."""
    ranks = call.ranks
    wanted = list(parse_rank_spec(arg, ranks.config.world_size, magic="%dist_respawn")) if arg else None
    if wanted is None and not ranks.gone():
        call.say(words.nothing_dead())
        return
    started = await ranks.respawn(wanted)
    pids = ", ".join(f"rank {r}: {ranks.describe(r)}" for r in started)
    call.say(f"{words.respawned(started)} ({pids})")


async def dist_ranks(call: GroupCall, arg: str) -> None:
    """``%dist_ranks [N]``: alone, the rank count and where it comes from; with N, grow or shrink to N."""
    ranks = call.ranks
    n_now = ranks.config.world_size
    if not arg:
        call.say(words.count_now(n_now, call.launched.world_size))
        return
    if not arg.isdigit() or int(arg) < 1:
        raise UsageError(f"%dist_ranks {arg!r}: give a whole number of ranks, at least 1, e.g. %dist_ranks 4.")
    started, ended = await ranks.resize(int(arg))
    if not started and not ended:
        call.say(f"%dist_ranks: already {words.count(n_now)}; nothing changed.")
    else:
        call.say(words.resized(ranks.config.world_size, started, ended))


async def dist_sync(call: GroupCall, arg: str) -> None:
    """``%dist_sync NAME [NAME ...] [--from R]``: copy variables from rank R to the others."""
    names, src = parse_sync(arg, call.ranks.config.world_size)
    call.say(await call.copy(names, src))


def parse_sync(arg: str, world_size: int) -> tuple[list[str], int]:
    """``NAME [NAME ...] [--from R]``: the names and the source rank."""
    words = arg.split()
    src = 0
    if "--from" in words:
        i = words.index("--from")
        value = words[i + 1] if i + 1 < len(words) else ""
        if not value.isdigit() or int(value) >= world_size:
            raise UsageError(f"%dist_sync --from {value!r}: name a rank, 0-{world_size - 1}.")
        src = int(value)
        del words[i:i + 2]
    bad = [w for w in words if not w.isidentifier()]
    if bad or not words:
        raise UsageError(f"%dist_sync {arg!r}: give the variables' names, e.g. `%dist_sync model opt --from 0`"
                         + (f" ({bad[0]!r} is not a name)" if bad else "") + ".")
    own = [w for w in words if w in KERNEL_NAMES]
    if own:
        name = own[0]
        raise UsageError(f"%dist_sync {name}: `{name}` is defined by the kernel on each rank ({KERNEL_NAMES[name]}), "
                         f"so every rank already has its own; copying rank {src}'s would give every rank rank "
                         f"{src}'s value. Copy a variable of your own (nothing was copied).")
    return words, src


def copied_lines(names: list[str], src: int, replies: dict[int, Synced | str]) -> list[str]:
    """What arrived where, per name: ``t to rank 1,2: tensor 2x3 float32``."""
    copied: dict[str, dict[str, list[int]]] = {}
    for r, reply in sorted(replies.items()):
        if not isinstance(reply, str) and r != src:
            for name, how in reply.copied.items():
                copied.setdefault(name, {}).setdefault(how, []).append(r)
    return [f"{name} to rank {format_ranks(rs)}: {how}" for name in names for how, rs in copied.get(name, {}).items()]


def sync_report(names: list[str], src: int, replies: dict[int, Synced | str]) -> str:
    """What ``%dist_sync`` did, per name; raises :class:`UsageError` naming what could not be copied."""
    lost = {r: why for r, why in replies.items() if isinstance(why, str)}
    failed: dict[str, dict[str, list[int]]] = {}
    for r, reply in sorted(replies.items()):
        if isinstance(reply, str) or r == src:
            continue
        for name, why in reply.failed.items():
            failed.setdefault(name, {}).setdefault(why, []).append(r)
    source = replies.get(src)
    if not isinstance(source, str) and source is not None:
        for name, why in source.failed.items():  # not on the source, or cannot travel: said once, for all
            failed[name] = {why: []}
    lines = copied_lines(names, src, replies)
    if failed or lost:
        problems = [f"{name}: {why}" + (f" (rank {format_ranks(rs)})" if rs else "")
                    for name in names for why, rs in failed.get(name, {}).items()]
        problems += [f"rank {r} did not take part: {why}" for r, why in sorted(lost.items())]
        done = ("; copied: " + "; ".join(lines)) if lines else ""
        raise UsageError(f"%dist_sync from rank {src}: could not copy " + "; ".join(problems) + done)
    return f"%dist_sync from rank {src}: " + "; ".join(lines)


class IdleRespawn:
    """``--respawn on`` for a rank that died between cells: it is started anew at once; the next
    cell waits for that (:meth:`settle`), and says what came of it. A cell of ``%dist_status``
    alone does not wait (:func:`dist_kernel.parent.magics.waits`): it shows the rank being
    started (:attr:`starting`)."""

    def __init__(self) -> None:
        self._task: asyncio.Future | None = None
        #: the ranks that died between cells and are being started anew now
        self.starting: set[int] = set()

    @property
    def pending(self) -> bool:
        return self._task is not None

    def died(self, ranks: Ranks, rank: int, reason: str) -> None:
        if ranks.config.respawn:
            if self._task is None or not self._task.done():
                self.starting.add(rank)
            if self._task is None:
                self._task = asyncio.ensure_future(self._respawn(ranks, rank, reason))

    async def settle(self, publish: Publish) -> None:
        task, self._task = self._task, None
        if task is not None:
            try:
                said = await task
            finally:
                self.starting.clear()
            publish("stream", {"name": "stderr", "text": f"[dist_kernel] {said}\n"})

    async def _respawn(self, ranks: Ranks, rank: int, reason: str) -> str:
        await asyncio.sleep(0.5)  # a death seldom comes alone (the out-of-memory killer): take them together
        try:
            started = await ranks.respawn(None, auto=True)
        except Exception as e:  # noqa: BLE001 - said in the next cell, which then fails on the dead rank
            return words.idle_death(rank, reason, words.auto_failed(str(e) or type(e).__name__, ranks.gone()))
        finally:
            self.starting.clear()
        return words.idle_death(rank, reason, words.respawned(started))
