"""The parent's connection to one rank: its Jupyter channels, read by one pump each.

Replies (shell and control) resolve the future of the request they answer. IOPub messages
go to the listener registered for the request that caused them (a cell's run, a frontend's
comm message); what no listener claims goes to one fallback (late output of a finished
cell, comm messages). Typed requests of :mod:`dist_kernel.protocol` travel on the control
channel, which the rank answers from its own thread while its shell is busy.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from dist_kernel import protocol
from dist_kernel.exceptions import RankDiedError, RankRequestError

IOPubHandler = Callable[[dict], None]


class RankChannel:
    """Talks to one rank kernel through a jupyter_client AsyncKernelClient."""

    def __init__(self, rank: int, client: Any, log: logging.Logger,
                 on_unrouted: Callable[[int, dict], None], on_stdin: Callable[[int, dict], None]) -> None:
        self.rank = rank
        self.kc = client
        self.log = log
        self._on_unrouted = on_unrouted
        self._on_stdin = on_stdin
        self._listeners: dict[str, IOPubHandler] = {}
        self._pending: dict[str, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []
        self.closing = False
        self.dead: Exception | None = None

    def start(self) -> None:
        """Connect. No high-water mark on any socket: ZMQ's default of 1000
        queued messages drops a burst of outputs, and with it a cell's final ``idle``."""
        self.kc.context.rcvhwm = 0
        self.kc.context.sndhwm = 0
        self.kc.start_channels()

    async def wait_for_ready(self, timeout: float) -> None:
        """Wait for the rank kernel to answer, then start reading (jupyter_client's wait reads
        the shell channel itself, so the pumps start only after it)."""
        await self.kc.wait_for_ready(timeout=timeout)
        self._tasks = [
            asyncio.ensure_future(self._pump("IOPub", self.kc.get_iopub_msg, self._route_iopub)),
            asyncio.ensure_future(self._pump("shell", self.kc.get_shell_msg, self._resolve)),
            asyncio.ensure_future(self._pump("control", self.kc.get_control_msg, self._resolve)),
            asyncio.ensure_future(self._pump("stdin", self.kc.get_stdin_msg, self._route_stdin)),
        ]

    # ------------------------------------------------------------- sending
    def listen(self, msg_id: str, handler: IOPubHandler) -> None:
        """IOPub messages caused by request ``msg_id`` go to ``handler``."""
        self._listeners[msg_id] = handler

    def unlisten(self, msg_id: str) -> None:
        self._listeners.pop(msg_id, None)

    def send(self, msg_type: str, content: dict, metadata: dict | None = None, buffers: list | None = None,
             expect_reply: bool = True, channel: str = "shell") -> tuple[str, asyncio.Future | None]:
        """Send one request; its msg_id, and a future for its reply (None if none is expected)."""
        if self.dead is not None:
            raise self.dead
        if self.closing:
            raise RankDiedError(f"rank {self.rank}: the kernel is shutting down")
        msg = self.kc.session.msg(msg_type, content, metadata=metadata or {})
        if buffers:
            msg["buffers"] = list(buffers)
        fut = None
        if expect_reply:
            fut = asyncio.get_running_loop().create_future()
            self._pending[msg["header"]["msg_id"]] = fut
        (self.kc.control_channel if channel == "control" else self.kc.shell_channel).send(msg)
        return msg["header"]["msg_id"], fut

    async def shell_request(self, msg_type: str, content: dict, timeout: float = 10.0) -> dict:
        """Round trip of one shell request (completion, inspection, ...); the reply content."""
        msg_id, fut = self.send(msg_type, content)
        try:
            return (await asyncio.wait_for(fut, timeout))["content"]
        finally:
            self._pending.pop(msg_id, None)

    async def request(self, req: protocol.Request, timeout: float = 5.0) -> Any:
        """One typed request on the control channel; the validated reply.

        Raises :class:`RankRequestError` when the rank answers with an error, and
        ``asyncio.TimeoutError`` when it does not answer in time (stopped, or stuck in C code
        that holds the GIL).
        """
        msg_id, fut = self.send(protocol.REQUEST, protocol.request_content(req), channel="control")
        try:
            msg = await asyncio.wait_for(fut, timeout)
        finally:
            self._pending.pop(msg_id, None)
        reply = protocol.parse_reply(msg["content"], req.op)
        if isinstance(reply, protocol.ErrorReply):
            raise RankRequestError(f"rank {self.rank}: {req.op} failed: {reply.ename}: {reply.evalue}")
        return reply

    def input(self, value: str) -> None:
        if self.dead is None:
            self.kc.input(value)

    # ------------------------------------------------------------- reading
    def _route_iopub(self, msg: dict) -> None:
        handler = self._listeners.get(msg.get("parent_header", {}).get("msg_id"))
        if handler is not None:
            handler(msg)
        else:
            self._on_unrouted(self.rank, msg)

    def _resolve(self, msg: dict) -> None:
        fut = self._pending.pop(msg.get("parent_header", {}).get("msg_id"), None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def _route_stdin(self, msg: dict) -> None:
        if msg["msg_type"] == "input_request":
            self._on_stdin(self.rank, msg)

    async def _pump(self, channel: str, receive: Callable, handle: Callable[[dict], None]) -> None:
        """Read one channel until closed; a message with a bad HMAC signature (or malformed) is
        dropped, and one bad message never stops the pump."""
        while True:
            try:
                msg = await receive()
            except asyncio.CancelledError:
                raise
            except ValueError as e:
                self.log.warning("rank %d: dropped a %s message: %s", self.rank, channel, e)
                continue
            except Exception:  # noqa: BLE001 - the socket closes at shutdown
                if self.closing:
                    return
                self.log.exception("rank %d: %s reader failed", self.rank, channel)
                await asyncio.sleep(0.05)
                continue
            try:
                handle(msg)
            except Exception:  # noqa: BLE001
                self.log.exception("rank %d: error handling %s %s", self.rank, channel, msg.get("msg_type"))

    # ------------------------------------------------------------- ending
    def fail_pending(self, reason: str) -> None:
        """The rank is gone: every request still waiting fails now, naming it."""
        self.dead = RankDiedError(reason)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(self.dead)
        self._pending.clear()

    def close(self) -> None:
        self.closing = True
        for task in self._tasks:
            task.cancel()
        try:
            self.kc.stop_channels()
        except Exception:  # noqa: BLE001 - already closed
            pass
        if getattr(self.kc, "_created_context", False):
            self.kc.context.destroy(linger=0)

