"""A rank on another machine, as the parent knows it: what its node's agent says of it, and
signals that go through that agent (:class:`~dist_kernel.parent.launch.remote.RemoteLauncher`
hands them out)."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Protocol

from dist_kernel.parent.wire import Wire
from dist_kernel.processes import describe_exit


class AgentListener(Protocol):
    """What a remote rank needs of :class:`~dist_kernel.parent.launch.remote.AgentListener`."""

    def attach(self, rank: int, deliver: Callable[[str, list[bytes]], None],
               checked: Callable[[str, dict], None]) -> None: ...
    def detach(self, rank: int) -> None: ...
    def send_parts(self, rank: int, channel: str, header: bytes, shared: list[bytes]) -> None: ...
    def send_to_nodes(self, nodes: list[tuple[int, bytes]], channel: str, header: bytes, shared: list[bytes]) -> None: ...
    def send_ctl(self, node: int, event: dict) -> None: ...


class Node(Protocol):
    """A node agent as the listener knows it (:class:`~dist_kernel.parent.launch.remote.Node`)."""

    index: int
    host: str
    address: str


class RemoteWire:
    """A remote rank's channels: its frames go straight into the listener, and come straight
    out of it, tagged with the rank and the channel (see :mod:`dist_kernel.tunnel`)."""

    def __init__(self, listener: AgentListener, rank: int) -> None:
        self.listener = listener
        self.rank = rank

    def connect(self, identity: bytes) -> None:
        """Nothing to connect: the agent's sockets on the node carry the identity it gives them."""

    def open(self, deliver: Callable[[str, list[bytes]], None], checked: Callable[[str, dict], None]) -> None:
        self.listener.attach(self.rank, deliver, checked)

    def send(self, channel: str, header: bytes, shared: list[bytes], sign: Callable[[list[bytes]], bytes]) -> None:
        """Unsigned: the rank's node agent signs it with the rank's key (``sign`` is not needed)."""
        self.listener.send_parts(self.rank, channel, header, shared)

    def close(self) -> None:
        self.listener.detach(self.rank)


class RemoteRank:
    """A rank on another machine: what its node's agent says about it; signals go through the
    agent (provisioner method names, as :class:`~dist_kernel.parent.launch.base.RankHandle`)."""

    def __init__(self, rank: int, node: Node, listener: AgentListener, key: str, pid: int) -> None:
        self.rank = rank
        self.node = node
        self.listener = listener
        self.key = key
        self._pid = pid
        self.returncode: int | None = None
        self.state = ""
        self.log = ""
        self.gone = ""  # why the rank is gone without an exit code (its node was lost)
        self.load: dict | None = None  # its agent's latest load sample (dist_kernel.load), while sampled

    @property
    def pid(self) -> int | None:
        return self._pid

    @property
    def host(self) -> str:
        return self.node.host

    @property
    def address(self) -> str:
        return self.node.address

    async def poll(self) -> int | None:
        return self.returncode

    async def send_signal(self, signum: int) -> None:
        self.listener.send_ctl(self.node.index, {"type": "signal", "rank": self.rank, "signum": int(signum)})

    async def kill(self) -> None:
        await self.send_signal(signal.SIGKILL)

    async def terminate(self) -> None:
        await self.send_signal(signal.SIGTERM)

    def exit_reason(self) -> str:
        if self.gone:
            return self.gone
        return describe_exit(self.returncode) if self.returncode is not None else ""

    def os_state(self) -> str:
        return self.state

    def log_tail(self, lines: int = 30) -> str:
        return "".join(self.log.splitlines(keepends=True)[-lines:])

    def wire(self) -> tuple[dict, Wire]:
        return {"key": self.key, "signature_scheme": "hmac-sha256"}, RemoteWire(self.listener, self.rank)
