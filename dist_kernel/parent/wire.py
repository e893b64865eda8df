"""How one rank's channel frames travel: a :class:`Wire`.

On this machine a rank's channels are ZMQ sockets of its own (:class:`SocketWire`), read from
the event loop (``add_reader`` on each socket's ZMQ file descriptor); on another machine they
travel over its node agent's connection (:class:`~dist_kernel.parent.launch.remote_rank.RemoteWire`).
The parent's other sockets on the loop (the node listener, the shell stream's re-arm) read
ZMQ's edge-triggered descriptors the same way (:func:`zmq_fd`, :func:`pending`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

import zmq
from jupyter_client.session import DELIM

#: messages handled per wakeup of one socket before the loop gets a turn (a flood must not
#: starve the cell's ticks, interrupts or the other ranks)
_BATCH = 200


def zmq_fd(sock: zmq.Socket) -> int:
    """The socket's ZMQ file descriptor, for the event loop (an int on every platform we run on)."""
    return int(sock.getsockopt(zmq.FD))


def pending(sock: zmq.Socket) -> bool:
    """Whether a message waits on ``sock`` (its EVENTS say POLLIN; the fd signals only edges)."""
    return bool(int(sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)


_CONTEXT: zmq.Context | None = None


def _context() -> zmq.Context:
    """One ZMQ context (one IO thread) for every rank's sockets."""
    global _CONTEXT
    if _CONTEXT is None or _CONTEXT.closed:
        _CONTEXT = zmq.Context()
        # four sockets a rank: ZMQ's default of 1,023 sockets would hold 255 ranks. Set before
        # the first socket, as ZMQ requires; open files are limits.make_room's to provide
        _CONTEXT.set(zmq.MAX_SOCKETS, _CONTEXT.get(zmq.SOCKET_LIMIT))
    return _CONTEXT


class Wire(Protocol):
    """How one rank's channel frames travel: sockets of its own on this machine
    (:class:`SocketWire`), or its node agent's connection for a rank elsewhere (remote.py)."""

    def connect(self, identity: bytes) -> None:
        """Reach the rank as ``identity`` (the rank answers ``input()`` to the shell sender's)."""

    def open(self, deliver: Callable[[str, list[bytes]], None], checked: Callable[[str, dict], None]) -> None:
        """From now on, hand every incoming message (its channel's name, its frames) to
        ``deliver``, on the running event loop; a message that its node agent checked already
        and sends decoded (an IOPub message in a joined ``out`` frame, a cell's reply in a ``sum``
        of its node's replies: dist_kernel.tunnel) to ``checked``."""

    def send(self, channel: str, header: bytes, shared: list[bytes], sign: Callable[[list[bytes]], bytes]) -> None:
        """One message to the rank on ``channel`` (shell, control or stdin): its packed header,
        and its parent header, metadata, content and buffers (``shared``: the same objects for
        every rank a request went to). Signed here (``sign``), or by the rank's node agent, which
        holds its key (remote.py: the agent fans one message out to the node's ranks)."""

    def close(self) -> None: ...


class SocketWire:
    """A rank's four channels on raw ZMQ sockets of its own, read from the event loop
    (``add_reader`` on each socket's ZMQ file descriptor). No high-water mark on any socket:
    ZMQ's default of 1000 queued messages drops a burst of outputs, and with it a cell's
    final ``idle``."""

    def __init__(self, info: dict) -> None:
        self.info = info
        self._sockets: dict[str, zmq.Socket] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._deliver: Callable[[str, list[bytes]], None] | None = None
        self.closing = False

    def _url(self, channel: str) -> str:
        transport, ip, port = self.info.get("transport", "tcp"), self.info["ip"], self.info[f"{channel}_port"]
        return f"tcp://{ip}:{port}" if transport == "tcp" else f"{transport}://{ip}-{port}"

    def connect(self, identity: bytes) -> None:
        """Connect; what arrives waits in the sockets until :meth:`open`."""
        ctx = _context()
        for channel, kind in (("shell", zmq.DEALER), ("control", zmq.DEALER), ("stdin", zmq.DEALER),
                              ("iopub", zmq.SUB)):
            sock = ctx.socket(kind)
            sock.linger = 1000
            sock.rcvhwm = 0
            sock.sndhwm = 0
            if kind == zmq.DEALER:
                # the rank answers input() on the stdin socket of the shell request's sender
                sock.identity = identity
            else:
                sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(self._url(channel))
            self._sockets[channel] = sock

    def open(self, deliver: Callable[[str, list[bytes]], None], checked: Callable[[str, dict], None]) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._deliver = deliver
        for channel, sock in self._sockets.items():
            loop.add_reader(zmq_fd(sock), self._drain, channel, sock)
            loop.call_soon(self._drain, channel, sock)

    def send(self, channel: str, header: bytes, shared: list[bytes], sign: Callable[[list[bytes]], bytes]) -> None:
        sock = self._sockets[channel]
        sock.send_multipart([DELIM, sign([header, *shared[:3]]), header, *shared])
        if self._loop is not None:
            # a send can swallow the edge of ZMQ's file descriptor: look for replies now too
            self._loop.call_soon(self._drain, channel, sock)

    def _drain(self, channel: str, sock: zmq.Socket) -> None:
        """Hand on what the socket holds, at most ``_BATCH`` messages per turn of the loop
        (a flood must not starve the cell's ticks, interrupts or the other ranks)."""
        if self.closing or sock.closed or self._deliver is None:
            return
        try:
            for _ in range(_BATCH):
                if not pending(sock):
                    return
                self._deliver(channel, sock.recv_multipart(zmq.NOBLOCK))
        except zmq.ZMQError:
            return  # closed meanwhile, or nothing after all (EAGAIN)
        # more may be waiting: ZMQ's descriptor signals edges, so come back after a turn
        if self._loop is not None:
            self._loop.call_soon(self._drain, channel, sock)

    def close(self) -> None:
        self.closing = True
        for sock in self._sockets.values():
            if sock.closed:
                continue
            if self._loop is not None and not self._loop.is_closed():
                try:
                    self._loop.remove_reader(zmq_fd(sock))
                except Exception:  # noqa: BLE001 - already removed, or the loop is gone
                    pass
            try:
                sock.close(linger=0)
            except Exception:  # noqa: BLE001 - already closed
                pass
