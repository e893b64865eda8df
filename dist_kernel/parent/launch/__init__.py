"""Launching: how the ranks of one kernel come to exist, on this machine or on others.

Three things were all once called "launcher"; here each has its own name:

- ``--launcher local|slurm|ssh`` (``KernelConfig.launcher``) is the user's choice of where the
  ranks run. It is the key of both tables below. ``stub`` (tests and benchmarks: stand-in ranks
  behind local stub node agents, :mod:`dist_kernel.testing`) runs the real remote launcher.
- A **gang launcher** (:class:`~dist_kernel.parent.launch.base.GangLauncher`, the seam the
  supervisor sees) starts, signals and ends the ranks: :class:`~.local.LocalLauncher` (each rank a
  child of the parent) or :class:`~.remote.RemoteLauncher` (ranks on other machines, run by a node
  agent per machine). Picked from :data:`GANG_LAUNCHERS`.
- A **node starter** (:class:`~dist_kernel.parent.launch.node_starters.base.NodeStarter`) is
  what the remote launcher uses to start those node agents: ``srun`` or one ``ssh`` per host.
  Picked from :data:`~dist_kernel.parent.launch.node_starters.NODE_STARTERS`.

Modules: ``base`` (the seam), ``local``, ``remote`` (with the :class:`~.remote.AgentListener`
the agents connect to) and ``node_starters`` (``base``, ``slurm``, ``ssh``, and ``routes``: the
parent's address as the nodes see it). The process helpers both sides share are in
:mod:`dist_kernel.processes`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from dist_kernel.options import KernelConfig
from dist_kernel.parent.launch.base import GangLauncher, RankHandle
from dist_kernel.parent.launch.local import LocalLauncher
from dist_kernel.parent.launch.remote import RemoteLauncher

#: ``--launcher`` value -> the gang launcher that starts the ranks
GANG_LAUNCHERS: dict[str, type[GangLauncher]] = {"local": LocalLauncher, "slurm": RemoteLauncher,
                                                  "ssh": RemoteLauncher, "stub": RemoteLauncher}

__all__ = ["GANG_LAUNCHERS", "GangLauncher", "RankHandle", "make_gang_launcher"]


def make_gang_launcher(config: KernelConfig, runtime_dir: str, extra_argv: list[str], log: logging.Logger,
                       on_note: Callable[[str], None]) -> GangLauncher:
    """The gang launcher for ``config.launcher`` (options.py accepts only the table's keys)."""
    return GANG_LAUNCHERS[config.launcher](config, runtime_dir, extra_argv, log, on_note)
