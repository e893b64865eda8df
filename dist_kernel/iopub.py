"""An IPKernelApp whose IOPub socket never drops a message: used by the parent and the ranks.

ZMQ's default high-water mark is 1000 queued messages, past which a PUB socket silently
drops what a slow reader has not taken: a burst of ``display()`` calls would lose outputs,
and with them a cell's final ``idle``, which every reader waits for. With no mark the queue
grows instead; the parent reads its ranks as fast as it can, and its throttle keeps what
reaches the frontend within what a notebook can show.
"""

from __future__ import annotations

from typing import Any

import zmq
from ipykernel.iostream import IOPubThread
from ipykernel.kernelapp import IPKernelApp


class UnboundedIOPubApp(IPKernelApp):
    """IPKernelApp with ``SNDHWM = 0`` on its IOPub socket."""

    def initialize(self, argv: Any = None) -> None:
        super().initialize(argv)
        # traitlets leaves the logger at DEBUG and filters in its handler: ipykernel's half a
        # dozen debug calls per request would each build a record only to drop it (issue 14)
        levels = [h.level for h in self.log.handlers]
        if levels and self.log.level < min(levels):
            self.log.setLevel(min(levels))

    # a copy of IPKernelApp.init_iopub using its private _apply_curve_server_options and _bind_socket:
    # written for ipykernel 7.4 (pyproject caps it below 8)
    def init_iopub(self, context: zmq.Context) -> None:
        # ipykernel's own init_iopub (7.x), with the mark set before the socket binds
        self.iopub_socket = context.socket(zmq.XPUB)
        self.iopub_socket.sndhwm = 0
        self.iopub_socket.linger = 1000
        self._apply_curve_server_options(self.iopub_socket)
        self.iopub_port = self._bind_socket(self.iopub_socket, self.iopub_port)
        self.configure_tornado_logger()
        self.iopub_thread = IOPubThread(self.iopub_socket, pipe=True, session=self.session)
        self.iopub_thread.start()
        self.iopub_socket = self.iopub_thread.background_socket
