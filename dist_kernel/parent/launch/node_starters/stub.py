"""Stub nodes: ``--launcher stub`` runs each node agent as a local process hosting stub ranks.

For tests and benchmarks of the parent at many ranks (issue 26): the parent runs its real
remote launcher, listener, channels and cells; only what answers on the far side of the
node link is a stand-in (:mod:`dist_kernel.testing.stub_node`, whose ranks run a tiny cell
language, not Python). Started as ssh would start the real agent, with the same argv and the
same key line on stdin, but on this machine and without ssh; the nodes are named
``stub-node0``, ``stub-node1``, ...
"""

from __future__ import annotations

from collections.abc import Mapping

from dist_kernel.options import KernelConfig
from dist_kernel.parent.launch.node_starters.base import NodeStarter

#: the module the stub node starter runs instead of ``dist_kernel.node``
STUB_AGENT = "dist_kernel.testing.stub_node"


class StubNodeStarter(NodeStarter):
    """One local ``python -m dist_kernel.testing.stub_node`` per node."""

    kind = "stub"

    @classmethod
    def listen_address(cls, config: KernelConfig, environ: Mapping[str, str]) -> str:
        return "127.0.0.1"  # the stub nodes are processes of this machine

    def hosts(self) -> list[str] | None:
        return [f"stub-node{i}" for i in range(self.config.nodes)]

    def commands(self) -> list[tuple[str, str | None, list[str]]]:
        out: list[tuple[str, str | None, list[str]]] = []
        for i in range(self.config.nodes):
            argv = self.agent_argv(i)
            argv[argv.index("dist_kernel.node")] = STUB_AGENT
            out.append((f"stub node {i}", None, argv))
        return out
