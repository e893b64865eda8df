"""Which processes make up the group, changed while the kernel runs: a dead rank started anew
(``%dist_respawn``, ``--respawn on``) and the rank count changed in place (``%dist_ranks N``).

The survivors keep their processes, and with them every variable; the group is formed again
over all the ranks (a new formation, as after a hang), and the new ranks join as at start (the
kernel's seed, its rank switches). A new rank's namespace is empty: ``%dist_sync`` copies
variables into it (:mod:`dist_kernel.rank.sync`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from dist_kernel import capacity, protocol
from dist_kernel.exceptions import ConfigError
from dist_kernel.options import KernelConfig
from dist_kernel.parent import limits
from dist_kernel.parent.fault_policy import keeps_dying
from dist_kernel.parent.magics import format_ranks

if TYPE_CHECKING:
    from dist_kernel.parent.supervisor import RankSupervisor

EMPTY = ("its namespace is empty: run the cells that build what it needs (the model, the optimizer, "
         "the data), or copy variables from another rank with %dist_sync NAME [NAME ...] [--from R]")


def dead_ranks(sup: RankSupervisor) -> list[int]:
    # only a rank that died is not alive, and each death is recorded: no walk over every rank
    return sorted(r for r in sup.deaths if (rk := sup.ranks.get(r)) is not None and not rk.alive)


async def respawn(sup: RankSupervisor, ranks: Iterable[int] | None = None, auto: bool = False) -> list[int]:
    """Start each dead rank of ``ranks`` (default: every dead rank) anew, with the same rank
    number, device and environment, and form the group again; the ranks started. ``auto``
    (``--respawn on``): a rank that keeps dying is refused (:func:`keeps_dying`)."""
    dead = dead_ranks(sup)
    wanted = sorted(set(dead) if ranks is None else set(ranks))
    alive = [r for r in wanted if r not in dead]
    if alive:
        raise ConfigError(f"rank {format_ranks(alive)} is running; %dist_respawn starts only dead ranks "
                          f"(dead now: {format_ranks(dead) or 'none'}).")
    if auto:
        now = time.monotonic()
        looping = [r for r in wanted if keeps_dying(sup.deaths.get(r, []), now)]
        if looping:
            raise ConfigError(f"rank {format_ranks(looping)} died 3 times within a minute, so it is not started "
                              "again by itself (--respawn on). Find out why it dies (the out-of-memory killer, "
                              "a crash in an extension), then run %dist_respawn, or restart the kernel.")
    if not wanted:
        return []
    await _started(sup, wanted)
    await sup.form_group(fresh=wanted)
    return wanted


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
        raise ConfigError(f"rank {format_ranks(dead)} is dead: run %dist_respawn first, then %dist_ranks {n}.")
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
    except BaseException:
        await _ended(sup, started)
        _set_config(sup, cfg)
        await sup.form_group()
        raise
    await _ended(sup, ended)
    await sup.form_group(fresh=started)
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
        raise ConfigError(f"rank {format_ranks(dead)} is dead: run %dist_respawn first, then %dist_sync.")
    if src not in sup.ranks:
        raise ConfigError(f"%dist_sync --from {src}: this kernel has ranks 0-{len(sup.ranks) - 1}.")
    req = protocol.Sync(names=names, src=src)
    return {r: asyncio.ensure_future(sup.channel(r).request(req, timeout=sup.config.timeout)) for r in sorted(sup.ranks)}
