"""Launching: how the ranks of one kernel come to exist, on this machine or on others.

Three things were all once called "launcher"; here each has its own name:

- ``--launcher KIND`` (``KernelConfig.launcher``) is the user's choice of where the ranks run:
  a row of the table of kinds (:data:`dist_kernel.launchers.KINDS`: local, slurm, ssh, and stub,
  stand-in ranks behind local stub node agents for tests and benchmarks,
  :mod:`dist_kernel.testing`). Both pickers below read that table.
- A **gang launcher** (:class:`~dist_kernel.parent.launch.base.GangLauncher`, the seam the
  supervisor sees) starts, signals and ends the ranks: :class:`~.local.LocalLauncher` (each rank a
  child of the parent) for a kind without a node starter, else :class:`~.remote.RemoteLauncher`
  (ranks on other machines, run by a node agent per machine). :func:`gang_launcher_class`.
- A **node starter** (:class:`~dist_kernel.parent.launch.node_starters.base.NodeStarter`) is
  what the remote launcher uses to start those node agents (through a batch system, or one
  ``ssh`` per host), and what ends a start it recorded.
  :func:`~dist_kernel.parent.launch.node_starters.node_starter_class`.

Modules: ``base`` (the seam), ``local``, ``remote`` (with the :class:`~.remote.AgentListener`
the agents connect to) and ``node_starters`` (``base``, one module per kind, and ``routes``: the
parent's address as the nodes see it). The process helpers both sides share are in
:mod:`dist_kernel.processes`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from dist_kernel.launchers import kind_named
from dist_kernel.options import KernelConfig
from dist_kernel.parent.launch.base import GangLauncher, RankHandle
from dist_kernel.parent.launch.local import LocalLauncher
from dist_kernel.parent.launch.remote import RemoteLauncher

__all__ = ["GangLauncher", "RankHandle", "gang_launcher_class", "make_gang_launcher"]


def gang_launcher_class(kind: str) -> type[GangLauncher]:
    """The gang launcher of ``--launcher kind``: the remote one where the table names a node starter."""
    row = kind_named(kind)
    if row is None:
        raise ValueError(f"no launcher kind {kind!r}")
    return RemoteLauncher if row.remote else LocalLauncher


def make_gang_launcher(config: KernelConfig, runtime_dir: str, extra_argv: list[str], log: logging.Logger,
                       on_note: Callable[[str], None]) -> GangLauncher:
    """The gang launcher for ``config.launcher`` (options.py accepts only the table's kinds)."""
    return gang_launcher_class(config.launcher)(config, runtime_dir, extra_argv, log, on_note)
