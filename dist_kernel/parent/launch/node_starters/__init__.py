"""Node starters: what starts one node agent per machine of a multi-node kernel, and ends it.

``--launcher KIND`` picks a :class:`~dist_kernel.parent.launch.node_starters.base.NodeStarter`
from the table of kinds (:data:`dist_kernel.launchers.KINDS`, which names each class): it runs the
starter processes (one for every node through a batch system, or one ``ssh`` per host) that
start ``python -m dist_kernel.node`` on each machine; the node agents then start the ranks. The
:class:`~dist_kernel.parent.launch.remote.RemoteLauncher` is its only user while a kernel runs;
:func:`end_launch` is how the reaper, the sweep and ``python -m dist_kernel clean`` end what a
starter recorded, by its kind.
"""

from __future__ import annotations

import importlib
import logging
import os
from collections.abc import Callable, Mapping

from dist_kernel.cleanup import LaunchRecord, Proc
from dist_kernel.launchers import kind_named
from dist_kernel.options import KernelConfig
from dist_kernel.parent.launch.node_starters.base import NodeStarter, Phase


def node_starter_class(kind: str) -> type[NodeStarter]:
    """The node starter the table names for ``--launcher kind``, imported now; ValueError for a
    kind that needs none (local) or that the table does not know."""
    row = kind_named(kind)
    if row is None or not row.node_starter:
        raise ValueError(f"no node starter for --launcher {kind}")
    module, _, name = row.node_starter.partition(":")
    cls = getattr(importlib.import_module(module), name)
    if not (isinstance(cls, type) and issubclass(cls, NodeStarter)) or cls.kind != kind:
        raise TypeError(f"{row.node_starter} is not the NodeStarter of kind {kind!r}")
    return cls


def end_launch(record: LaunchRecord, term_wait: float = 2.0) -> tuple[list[Proc], list[str]]:
    """End what a node starter recorded (its kernel is gone), through the starter of the
    record's kind (``NodeStarter.end_recorded``). A kind this version does not know still has
    its processes ended, and says what it could not end."""
    if not record.kind:  # recorded its processes alone
        return NodeStarter.end_recorded(record, term_wait)
    try:
        cls = node_starter_class(record.kind)
    except (ValueError, TypeError, ImportError, AttributeError) as e:
        ended, _ = NodeStarter.end_recorded(record, term_wait)
        return ended, [f"ended the processes of a {record.kind!r} launch only: {e}"]
    return cls.end_recorded(record, term_wait)


def make_node_starter(config: KernelConfig, agent_argv: Callable[[int | None], list[str]], runtime_dir: str,
                      log: logging.Logger, on_note: Callable[[str], None],
                      on_failure: Callable[[str], None] | None = None,
                      environ: Mapping[str, str] | None = None,
                      on_phase: Callable[[Phase], None] | None = None) -> NodeStarter:
    """The node starter for ``config.launcher``, once its :meth:`~NodeStarter.check` passed
    (Slurm: ``--nodes`` against the allocation's node count)."""
    cls = node_starter_class(config.launcher)
    cls.check(config, environ)
    starter = cls(config, agent_argv, runtime_dir, log, on_note, on_failure, environ)
    starter.on_phase = on_phase
    return starter


def default_listen(config: KernelConfig, environ: Mapping[str, str] | None = None) -> str:
    """The parent's address as the nodes should see it: ``--listen`` if given, else this
    machine's address on its route to the nodes, as the node starter finds it (ssh: the first
    host; Slurm: an allocated node or the controller). Raises ConfigError naming the host when
    the route is unknown or is loopback."""
    if config.listen:
        return config.listen
    return node_starter_class(config.launcher).listen_address(config, os.environ if environ is None else environ)
