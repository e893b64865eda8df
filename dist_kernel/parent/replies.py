"""Every request the parent handles gets its reply, sent on the socket itself.

ipykernel's handlers get a tornado ``ZMQStream``, whose sends are queued for a later turn of the
loop (or the flush after the request), at a cost in CPU per request (issue 14). The parent's
handlers get the stream's socket instead (:func:`always_reply`), and a handler that raises still
answers its request with an error reply. Since those replies bypass the stream, the stream
looks for a request they may have hidden from it once the handler is done (:func:`rearm`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
from zmq.eventloop.zmqstream import ZMQStream

from dist_kernel.parent.channels import pending

#: ipykernel's handler signature, with the stream's socket: (socket, ident, request) -> None
Handler = Callable[[Any, Any, dict], Any]


def always_reply(kernel: Any, msg_type: str, handler: Handler) -> Callable[[Any, Any, dict], Awaitable[None]]:
    """Wrap ``handler`` so that a request it fails on still gets an error reply (sent with
    ``kernel.session``, logged on ``kernel.log``). It runs on the stream's own thread."""
    async def handle(stream: Any, ident: Any, parent: dict) -> None:
        sock = getattr(stream, "socket", stream)
        try:
            result = handler(sock, ident, parent)
            if asyncio.iscoroutine(result):
                await result
        except Exception as e:  # answered, logged, and the kernel goes on
            kernel.log.exception("handler for %s failed", msg_type)
            if msg_type.endswith("_request"):
                reply = {"status": "error", "ename": type(e).__name__, "evalue": str(e), "traceback": []}
                kernel.session.send(sock, msg_type.replace("_request", "_reply"), reply, parent, ident=ident)
        finally:
            rearm(stream)
    return handle


def rearm(stream: Any) -> None:
    """Look for requests a raw send may have hidden from ``stream`` (a ZMQStream).

    A ZMQ socket's file descriptor signals edges: a send on the socket can swallow the edge
    of a request that arrived meanwhile, which would then wait unread until the next message
    (under load: the next cell never starts, or the stop button's interrupt_request is not
    read). ZMQStream checks the socket after its own sends; replies here bypass it, so the
    same check runs once their handler is done."""
    if not isinstance(stream, ZMQStream) or stream.closed():
        return

    def check() -> None:
        if not stream.closed() and pending(stream.socket):
            stream.flush(zmq.POLLIN, limit=1)  # the stream's own callback, as a turn of its loop would

    stream.io_loop.add_callback(check)
