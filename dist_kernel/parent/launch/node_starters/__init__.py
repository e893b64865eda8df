"""Node starters: what starts one node agent per machine of a multi-node kernel.

``--launcher slurm`` or ``--launcher ssh`` picks one from :data:`NODE_STARTERS`: a
:class:`~dist_kernel.parent.launch.node_starters.base.NodeStarter` runs the starter processes
(one ``srun`` for every node, or one ``ssh`` per host) that start ``python -m dist_kernel.node``
on each machine; the node agents then start the ranks. The
:class:`~dist_kernel.parent.launch.remote.RemoteLauncher` is its only user.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping

from dist_kernel.options import KernelConfig
from dist_kernel.parent.launch.node_starters.base import NodeStarter
from dist_kernel.parent.launch.node_starters.slurm import SlurmNodeStarter, SrunEvent
from dist_kernel.parent.launch.node_starters.ssh import SshNodeStarter
from dist_kernel.parent.launch.node_starters.stub import StubNodeStarter

#: ``--launcher`` value -> the node starter that serves it (``local`` needs none)
NODE_STARTERS: dict[str, type[NodeStarter]] = {"slurm": SlurmNodeStarter, "ssh": SshNodeStarter,
                                               "stub": StubNodeStarter}


def node_starter_class(config: KernelConfig) -> type[NodeStarter]:
    """The node starter for ``config.launcher``; ValueError for one that needs none (local)."""
    try:
        return NODE_STARTERS[config.launcher]
    except KeyError:
        raise ValueError(f"no node starter for --launcher {config.launcher}") from None


def make_node_starter(config: KernelConfig, agent_argv: Callable[[int | None], list[str]], runtime_dir: str,
                      log: logging.Logger, on_note: Callable[[str], None],
                      on_failure: Callable[[str], None] | None = None,
                      environ: Mapping[str, str] | None = None,
                      on_queue: Callable[[SrunEvent], None] | None = None) -> NodeStarter:
    """The node starter for ``config.launcher``, once its :meth:`~NodeStarter.check` passed
    (Slurm: ``--nodes`` against the allocation's node count)."""
    cls = node_starter_class(config)
    cls.check(config, environ)
    starter = cls(config, agent_argv, runtime_dir, log, on_note, on_failure, environ)
    starter.on_queue = on_queue
    return starter


def default_listen(config: KernelConfig, environ: Mapping[str, str] | None = None) -> str:
    """The parent's address as the nodes should see it: ``--listen`` if given, else this
    machine's address on its route to the nodes, as the node starter finds it (ssh: the first
    host; Slurm: an allocated node or the controller). Raises ConfigError naming the host when
    the route is unknown or is loopback."""
    if config.listen:
        return config.listen
    return node_starter_class(config).listen_address(config, os.environ if environ is None else environ)
