"""What the parent sends to remote ranks in one turn of the event loop, as few messages as it can.

A cell goes to every rank in one turn (``CellRun.start`` sends it rank by rank). Each remote
rank's message is put here unsigned, and at the end of the turn each node gets one
:func:`~dist_kernel.tunnel.fan` message per run of messages that share their parent header,
metadata, content and buffers on one channel: the code crosses the link once per node, and
its agent signs each rank's copy with that rank's key. So the parent packs, signs and hands to
ZMQ per node, not per rank (issue 26).
"""

from __future__ import annotations

from collections.abc import Callable

from dist_kernel import tunnel


class _Run:
    """Consecutive messages to one node on one channel with the same shared frames."""

    __slots__ = ("channel", "shared", "headers")

    def __init__(self, channel: bytes, shared: list[bytes]) -> None:
        self.channel = channel
        self.shared = shared
        self.headers: list[tuple[int, bytes]] = []

    def takes(self, channel: bytes, shared: list[bytes]) -> bool:
        if shared is self.shared:  # one cell's frames, packed once for all its ranks
            return channel == self.channel
        if channel != self.channel or len(shared) != len(self.shared):
            return False
        # the same objects when one request went to many ranks (packed once): no comparison
        return all(a is b or a == b for a, b in zip(shared, self.shared, strict=True))


class _Made:
    """A fan message made by the caller (:meth:`Outbox.put_fan`): nothing joins it."""

    __slots__ = ("frames",)

    def __init__(self, frames: list[bytes]) -> None:
        self.frames = frames


class Outbox:
    """Messages for remote ranks, held until :meth:`flush` (once per turn of the loop, and
    before any control event, so a signal never overtakes the cell it is meant for).
    ``send(node, frames)``: one message to a node's agent."""

    def __init__(self, send: Callable[[int, list], None]) -> None:
        self._send = send
        self._runs: dict[int, list[_Run | _Made]] = {}

    def __bool__(self) -> bool:
        return bool(self._runs)

    def put(self, node: int, rank: int, channel: bytes, header: bytes, shared: list[bytes]) -> None:
        """One message to ``rank`` on ``node``: its header, and its other frames (parent header,
        metadata, content, buffers), which may be shared with the ranks around it."""
        runs = self._runs.setdefault(node, [])
        last = runs[-1] if runs else None
        if not isinstance(last, _Run) or not last.takes(channel, shared):
            last = _Run(channel, shared)
            runs.append(last)
        last.headers.append((rank, header))

    def put_fan(self, node: int, frames: list[bytes]) -> None:
        """A :func:`~dist_kernel.tunnel.fan` message to ``node`` made by the caller, sent in its
        place among what is held for the node."""
        self._runs.setdefault(node, []).append(_Made(frames))

    def flush(self) -> None:
        """Send what is held: one message per node and run."""
        runs, self._runs = self._runs, {}
        for node, node_runs in runs.items():
            for run in node_runs:
                self._send(node, run.frames if isinstance(run, _Made) else tunnel.fan(run.channel, run.headers, run.shared))
