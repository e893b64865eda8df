"""The gang-launcher seam: how the ranks of one kernel come to exist, are signalled and end.

The supervisor sees only this interface. A :class:`GangLauncher` starts the ranks
(:meth:`~GangLauncher.start`, in waves of at most :attr:`~GangLauncher.wave` ranks that are
starting at once), signals them, stops them, and says what an outsider needs to end them
(:meth:`~GangLauncher.state`). Each rank is a :class:`RankHandle` whose methods carry
jupyter_client's provisioner names (``poll``, ``send_signal``, ``kill``, ``terminate``), and
a :class:`~dist_kernel.parent.wire.Wire` the rank's channel talks over.

The implementations: :class:`~dist_kernel.parent.launch.local.LocalLauncher` (this machine) and
:class:`~dist_kernel.parent.launch.remote.RemoteLauncher` (other machines, through node agents
that a :class:`~dist_kernel.parent.launch.node_starters.base.NodeStarter` starts).
"""

from __future__ import annotations

import abc
import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from dist_kernel.exceptions import ConfigError
from dist_kernel.options import KernelConfig
from dist_kernel.parent.fault_policy import RemoteCause
from dist_kernel.parent.wire import Wire


class RankHandle(Protocol):
    """One launched rank, as a gang launcher hands it out; provisioner method names."""

    rank: int
    #: what ``poll()`` last saw: the exit code (negative: the signal), None while it runs
    returncode: int | None

    @property
    def pid(self) -> int | None: ...
    @property
    def host(self) -> str:
        """The machine of a rank on another machine ("" on this one)."""
    @property
    def address(self) -> str:
        """That machine's cluster address ("" on this one): how its peers are named."""

    async def poll(self) -> int | None: ...
    async def send_signal(self, signum: int) -> None: ...
    async def kill(self) -> None: ...
    async def terminate(self) -> None: ...
    def exit_reason(self) -> str:
        """Why it is gone, in words, as of the last ``poll()``; "" while it runs."""
    def os_state(self) -> str:
        """The process state letter (``T`` when stopped); "" when unknown."""
    def log_tail(self, lines: int = 30) -> str: ...
    def wire(self) -> tuple[dict, Wire]:
        """The rank's Jupyter connection info (its HMAC key) and the wire to its channels."""


class GangLauncher(abc.ABC):
    """Starts, signals and ends the ranks of one kernel.

    Every implementation takes the same arguments (``config, runtime_dir, extra_argv, log,
    on_note``), so :func:`dist_kernel.parent.launch.gang_launcher_class` can pick one by kind:
    ``extra_argv`` goes to each rank kernel's command line, ``on_note`` gets progress for the
    first cell (waiting in a batch queue, ...)."""

    #: how many ranks may be starting at once
    wave: int
    #: the kernel's settings; ``%dist_ranks`` replaces them (the ranks it starts then see the new size)
    config: KernelConfig

    #: told of a fault that takes the whole gang (a node lost, the node starter gone): the
    #: supervisor hears for a moment, names the cause and stops every rank
    on_fault: Callable[[RemoteCause], None] = staticmethod(lambda cause: None)

    #: told when one rank's process may have changed (exited, stopped, continued): the supervisor
    #: looks at that rank alone, so an idle parent costs nothing per rank (issue 26)
    on_change: Callable[[RankHandle], None] = staticmethod(lambda handle: None)

    #: whether :attr:`on_change` hears every change; if not, the supervisor polls every rank
    watches = False

    #: given a node agent's summary: the ranks that sent one same reply message, at once. Set by
    #: the supervisor to its hook (``RankSupervisor.grouped_reply``): a cell's run takes it whole
    #: and says True; False hands the message to each rank's channel instead (issue 26)
    on_replies: Callable[[list[int], dict], bool] = staticmethod(lambda ranks, msg: False)
    #: likewise, the ranks that sent one same IOPub message (``print(1)`` on every rank)
    on_outputs: Callable[[list[int], dict], bool] = staticmethod(lambda ranks, msg: False)

    @abc.abstractmethod
    def __init__(self, config: KernelConfig, runtime_dir: str, extra_argv: list[str], log: logging.Logger,
                 on_note: Callable[[str], None]) -> None: ...

    @abc.abstractmethod
    def start(self, ranks: int) -> AsyncIterator[RankHandle]:
        """Start ``ranks`` ranks, yielding each handle once its process exists. The caller
        takes the next one only when a wave slot is free: taking it launches it."""

    async def launch(self, rank: int) -> RankHandle:
        """Start rank ``rank`` alone, in place of a dead one or as a new one; returns once its
        process exists. Called by :mod:`dist_kernel.parent.membership` (``%dist_respawn``,
        ``--respawn on``, ``%dist_ranks``), never while :meth:`start` runs."""
        raise ConfigError(f"--launcher {self.name} cannot start a rank on its own yet; restart the kernel "
                          "to start fresh ranks.")

    async def end(self, rank: int) -> None:
        """End rank ``rank`` alone (``%dist_ranks`` shrinking); it is forgotten first, so its exit
        is no news. Called by :mod:`dist_kernel.parent.membership`."""
        raise ConfigError(f"--launcher {self.name} cannot end a rank on its own yet; restart the kernel "
                          "with fewer ranks.")

    def died(self, handle: RankHandle) -> None:
        """Rank ``handle`` died while the kernel runs: end what it started (its process group,
        what left its session), as shutdown ends every rank's. On this machine; a node agent
        does it for its own ranks when it starts one anew."""
        return None

    @property
    def name(self) -> str:
        """The launcher's name, as ``--launcher`` gives it."""
        return self.config.launcher

    @abc.abstractmethod
    async def stop(self, now: bool = False) -> None:
        """End every rank (``now``: no shutdown request first); idempotent."""

    @abc.abstractmethod
    def stop_now(self) -> None:
        """Last resort from any thread (atexit, SIGTERM): end what can be ended without waiting."""

    async def signal(self, ranks: list[RankHandle], signum: int) -> None:
        """Send ``signum`` to these ranks (their process groups: workers too)."""
        for handle in ranks:
            await handle.send_signal(signum)

    @abc.abstractmethod
    def store(self, generation: int) -> str:
        """Where formation number ``generation`` of the group meets (``Join.store``)."""

    def failure(self) -> str | None:
        """How the launching itself failed (the node starter's processes ended, or its job), or None."""
        return None

    def sample(self, on: bool) -> None:
        """Whether the ranks' load is sampled where they run (``%dist_top``): remote launchers ask
        their node agents; on this machine the parent samples them itself, so nothing to do."""
        return None

    @abc.abstractmethod
    def state(self) -> dict:
        """What an outsider (the reaper, the next kernel's sweep) needs to end this gang."""

    @abc.abstractmethod
    def record(self) -> None:
        """Write :meth:`state` where the reaper reads it."""
