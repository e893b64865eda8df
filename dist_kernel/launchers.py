"""Where the ranks can run: the one table of ``--launcher`` kinds, as data.

Each row is a kind: its name (the ``--launcher`` value), where it puts the ranks in a few words
(``--launcher``'s help is made of these), and the node starter that starts and ends its node
agents, named ``module:Class`` (none: the ranks run on this machine, as the parent's children).
The class is imported only where it is used
(:func:`dist_kernel.parent.launch.node_starters.node_starter_class`): options.py, which the ranks
import too, reads this table without importing the parent; the reaper and ``python -m
dist_kernel clean`` find through it the starter that ends a recorded start. jupyter_client finds
its kernel provisioners, and ipyparallel its launchers, the same way: a name that maps to
``module:Class`` (an entry point there, a row here).

A new kind is one row and one module under ``dist_kernel/parent/launch/node_starters/``
(docs/architecture.md, "Adding a node starter").
"""

from __future__ import annotations

from dataclasses import dataclass

_STARTERS = "dist_kernel.parent.launch.node_starters"


@dataclass(frozen=True)
class LauncherKind:
    """One ``--launcher`` value."""

    name: str
    #: where the ranks run, for ``--launcher``'s help
    where: str
    #: ``module:Class`` of its :class:`~dist_kernel.parent.launch.node_starters.base.NodeStarter`;
    #: "" for ranks on this machine
    node_starter: str = ""
    #: for tests and benchmarks: left out of the help's short list of values
    for_tests: bool = False

    @property
    def remote(self) -> bool:
        """Its ranks run on other machines (a node agent each machine, started by its node starter)."""
        return bool(self.node_starter)


#: every ``--launcher`` value, the default first
KINDS: tuple[LauncherKind, ...] = (
    LauncherKind("local", "this machine"),
    LauncherKind("slurm", "nodes a Slurm job gives", f"{_STARTERS}.slurm:SlurmNodeStarter"),
    LauncherKind("ssh", "hosts reached by ssh", f"{_STARTERS}.ssh:SshNodeStarter"),
    LauncherKind("stub", "stand-in ranks on local stub nodes, for tests and benchmarks",
                 f"{_STARTERS}.stub:StubNodeStarter", for_tests=True),
)


def kind_named(name: str) -> LauncherKind | None:
    """The row of ``--launcher name``, or None."""
    return next((k for k in KINDS if k.name == name), None)


def is_remote(name: str) -> bool:
    """``--launcher name`` puts the ranks on other machines."""
    kind = kind_named(name)
    return kind is not None and kind.remote
