"""Which processes make up the group, changed while the kernel runs: a dead rank started anew
(``%dist_respawn``, ``--respawn on``) and the rank count changed in place (``%dist_ranks N``).

The survivors keep their processes, and with them every variable; the group is formed again
over all the ranks (a new formation, as after a hang), and the new ranks join as at start (the
kernel's seed, its rank switches). A new rank's namespace is empty: ``%dist_sync`` copies
variables into it (:mod:`dist_kernel.rank.sync`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from dist_kernel import capacity, protocol
from dist_kernel.exceptions import ConfigError, RankStartError
from dist_kernel.options import KernelConfig
from dist_kernel.parent import formation, limits
from dist_kernel.parent import membership_words as words
from dist_kernel.parent.fault_policy import keeps_dying

if TYPE_CHECKING:
    from dist_kernel.parent.launch.base import RankHandle
    from dist_kernel.parent.supervisor import RankSupervisor


def dead_ranks(sup: RankSupervisor) -> list[int]:
    # only a rank that died is not alive, and each death is recorded: no walk over every rank
    return sorted(r for r in sup.deaths if (rk := sup.ranks.get(r)) is not None and not rk.alive)


async def respawn(sup: RankSupervisor, ranks: Iterable[int] | None = None, auto: bool = False) -> list[int]:
    """Start each dead rank of ``ranks`` (default: every dead rank) anew, with the same rank
    number, device and environment, and form the group again; the ranks started. ``auto``
    (``--respawn on``): a rank that keeps dying is refused (:func:`keeps_dying`). A selection
    that leaves other ranks dead is refused before anything starts: the group cannot form
    without them. When the start or the formation fails, the ranks started for it are ended
    again (dead, as before) and no rank waits in the formation (:mod:`.formation`)."""
    dead = dead_ranks(sup)
    wanted = sorted(set(dead) if ranks is None else set(ranks))
    alive = [r for r in wanted if r not in dead]
    if alive:
        raise ConfigError(words.refuse_running(alive, dead))
    others = [r for r in dead if r not in wanted]
    if others:
        raise ConfigError(words.refuse_partial(wanted, others))
    if auto:
        now = time.monotonic()
        looping = [r for r in wanted if keeps_dying(sup.deaths.get(r, []), now)]
        if looping:
            raise ConfigError(words.keeps_dying(looping))
    if not wanted:
        return []
    try:
        await _started(sup, wanted)
        await formation.form_group(sup, fresh=wanted)
    except ConfigError:
        await _abandon(sup, wanted)
        raise
    except BaseException as e:
        await _abandon(sup, wanted)
        if isinstance(e, asyncio.CancelledError):
            raise
        raise RankStartError(words.formation_failed(str(e) or type(e).__name__, wanted, "%dist_respawn")) from None
    return wanted


async def _abandon(sup: RankSupervisor, ranks: list[int]) -> None:
    """End the ranks a failed respawn started: each is dead again, as before it (no death the
    kernel acts on: ``--respawn on`` must not start it once more), and what it started ends too."""
    for r in ranks:
        rk = sup.ranks.get(r)
        if rk is None or not rk.alive:
            continue  # never started (the start failed before it): the old dead record
        rk.exit_reason = "was ended: starting it anew failed"
        if rk.channel is not None:
            rk.channel.close()
        with contextlib.suppress(Exception):
            await rk.process.kill()
        sup.launcher.died(rk.process)
        await _gone(rk.process)


async def _gone(process: RankHandle, timeout: float = 10.0) -> None:
    """Wait (bounded) until a killed rank process has exited: the error that says it was ended
    must be true when the user reads it, and a process paging in libtorch on a busy machine can
    take seconds to act on SIGKILL."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            if await process.poll() is not None:
                return
        await asyncio.sleep(0.05)


async def resize(sup: RankSupervisor, n: int) -> tuple[list[int], list[int]]:
    """Grow or shrink the ranks on this machine to ``n``: new ranks start empty, the highest
    ones end; the group is formed again at the new size. Returns (started, ended)."""
    cfg = sup.config
    if cfg.remote:
        raise ConfigError(f"%dist_ranks changes the rank count on this machine only (--launcher local); this "
                          f"kernel runs {cfg.world_size} ranks through --launcher {cfg.launcher}. Restart the "
                          "kernel with other --nodes / --ranks-per-node instead.")
    dead = dead_ranks(sup)
    if dead:
        raise ConfigError(words.dead_first(dead, f"%dist_ranks {n}"))
    old = cfg.world_size
    if n == old:
        return [], []
    new = dataclasses.replace(cfg, world_size=n, ranks_per_node=n)
    _check_room(new)
    _set_config(sup, new)
    started = list(range(old, n))
    ended = list(range(n, old))
    try:
        await _started(sup, started)
        await _ended(sup, ended)
        await formation.form_group(sup, fresh=started)
    except BaseException as e:
        if started:  # growing: back to the old count, without the new ranks
            await _ended(sup, started)
            _set_config(sup, cfg)
            with contextlib.suppress(Exception):
                await formation.form_group(sup)
        if isinstance(e, (asyncio.CancelledError, ConfigError)):
            raise
        raise RankStartError(words.formation_failed(str(e) or type(e).__name__, started, f"%dist_ranks {n}")) \
            from None
    return started, ended


def _check_room(cfg: KernelConfig) -> None:
    """The checks of a start, for the new count: NCCL's one rank per GPU, memory and cores,
    open files; each error says how to go on from here."""
    n = cfg.world_size
    if cfg.backend == "nccl" and n > len(cfg.gpus):
        raise ConfigError(f"%dist_ranks {n}: with nccl each rank needs a GPU of its own, and {len(cfg.gpus)} are "
                          f"selected (NCCL cannot put two ranks on one GPU). Use %dist_ranks {len(cfg.gpus)} or "
                          "fewer, or restart the kernel with --backend gloo.")
    try:
        capacity.check(cfg, capacity.this_machine())
        limits.make_room(n)
    except ConfigError as e:
        raise ConfigError(f"%dist_ranks {n}: {str(e).split(' Fix:')[0]} Use fewer ranks; nothing was changed.") \
            from None


def _set_config(sup: RankSupervisor, cfg: KernelConfig) -> None:
    sup.config = cfg
    sup.launcher.config = cfg  # the environment of the ranks it starts (WORLD_SIZE, ...)


async def _started(sup: RankSupervisor, ranks: list[int]) -> None:
    """Launch and connect ``ranks`` (a dead one's channel is closed first)."""
    for r in ranks:
        old = sup.ranks.get(r)
        if old is not None and old.channel is not None:
            old.channel.close()
    handles = [await sup.launcher.launch(r) for r in ranks]
    await asyncio.gather(*(sup.connect(h) for h in handles))


async def _ended(sup: RankSupervisor, ranks: list[int]) -> None:
    """End ``ranks`` on purpose: forgotten first, so their exits are no news."""
    for r in ranks:
        rk = sup.ranks.pop(r, None)
        if rk is not None and rk.channel is not None:
            rk.channel.close()
    await asyncio.gather(*(sup.launcher.end(r) for r in ranks))


def sync(sup: RankSupervisor, names: list[str], src: int) -> dict[int, asyncio.Future]:
    """``%dist_sync``: ask every rank at once to copy ``names`` from rank ``src`` (a collective);
    each rank's reply to come (a :class:`~dist_kernel.protocol.Synced`; it raises why the rank gave
    none). The ranks must be idle, and the group up. Whoever awaits them watches the ranks
    meanwhile, as a cell's run does (:mod:`dist_kernel.parent.sync_run`); ``--timeout`` is the last bound."""
    dead = dead_ranks(sup)
    if dead:
        raise ConfigError(words.dead_first(dead, "%dist_sync"))
    if src not in sup.ranks:
        raise ConfigError(f"%dist_sync --from {src}: this kernel has ranks 0-{len(sup.ranks) - 1}.")
    req = protocol.Sync(names=names, src=src)
    return {r: asyncio.ensure_future(sup.channel(r).request(req, timeout=sup.config.timeout)) for r in sorted(sup.ranks)}
