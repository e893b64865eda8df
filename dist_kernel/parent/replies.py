"""Every request the parent handles gets its reply, sent on the socket itself.

ipykernel's handlers get a tornado ``ZMQStream``, whose sends are queued for a later turn of the
loop (or the flush after the request), at a cost in CPU per request (issue 14). The parent's
handlers get the stream's socket instead (:func:`always_reply`), and a handler that raises still
answers its request with an error reply. Since those replies bypass the stream, the stream
looks for a request they may have hidden from it once the handler is done (:func:`rearm`).
Which requests an error aborts (the ones that had arrived before it): :class:`AbortsAfterError`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import zmq
from ipykernel.kernelbase import Kernel
from zmq.eventloop.zmqstream import ZMQStream

from dist_kernel.parent.wire import pending

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


class AbortsAfterError(Kernel):
    """The kernel's ``_abort_queues``, for replies sent on the raw socket."""

    # private ipykernel API, written for ipykernel 7.4 (pyproject caps it below 8)
    def _abort_queues(self, subshell_id: str | None = None) -> None:
        """After an error, abort the execute requests that had already arrived (Run All), and no
        other. ipykernel clears its flag two turns of the loop later; since replies go out at
        once on the raw socket, a request the frontend sent after it saw the error could land in
        between and be aborted. So the flag is cleared by a task that queues for the shell lock
        behind every request read so far: those are aborted, later ones run."""
        self._aborting = True
        if self.shell_stream is not None:
            self.shell_stream.flush()  # what has arrived now queues for the lock, ahead of the task

        async def stop_aborting() -> None:
            async with self._main_asyncio_lock:
                self._aborting = False

        asyncio.ensure_future(stop_aborting())
