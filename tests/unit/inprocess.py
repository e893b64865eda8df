"""The real parent kernel, in this process, on real in-process ZMQ sockets (``tests/unit``).

Requests go through ipykernel's own ``shell_main`` (the shell lock, busy/idle, aborting after
an error) and ``dispatch_control``; replies and IOPub messages come back signed by the
kernel's session, as a frontend would read them. Only the ranks are fake (:mod:`fake_ranks`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import zmq
from fake_ranks import FakeRanks, Script
from jupyter_client.session import Session
from zmq.eventloop.zmqstream import ZMQStream

from dist_kernel.parent.kernel import DistributedKernel


@dataclass
class Cell:
    """What a frontend got for one request."""

    reply: dict
    messages: list[dict] = field(default_factory=list)  # IOPub, in order, busy to idle

    @property
    def status(self) -> str:
        return self.reply["content"]["status"]

    @property
    def outputs(self) -> list[tuple[str, dict]]:
        return [(m["msg_type"], m["content"]) for m in self.messages if m["msg_type"] not in ("status", "execute_input")]

    def stream(self, name: str = "stdout") -> str:
        return "".join(c["text"] for t, c in self.outputs if t == "stream" and c["name"] == name)

    @property
    def errors(self) -> list[dict]:
        return [c for t, c in self.outputs if t == "error"]


class Frontend:
    """Sends requests to an in-process :class:`DistributedKernel` and reads what comes back."""

    def __init__(self) -> None:
        ctx = zmq.Context.instance()
        self.session = Session(key=b"unit")
        self._socks: list[zmq.Socket] = []
        self.iopub = self._pair(ctx, "iopub")
        self.shell = self._pair(ctx, "shell")
        self.control = self._pair(ctx, "control")
        self.kernel = DistributedKernel(session=self.session, iopub_socket=self.iopub[0],
                                        shell_stream=ZMQStream(self.shell[0]),
                                        control_stream=ZMQStream(self.control[0]),
                                        log=logging.getLogger("dist_kernel.unit"))
        self.kernel._main_loop = asyncio.get_running_loop()
        self.kernel._control_lock = asyncio.Lock()  # made by Kernel.start(), which needs a real app
        self._pending: dict[str, list[dict]] = {}
        self._replies: dict[str, dict] = {}

    def _pair(self, ctx: zmq.Context, name: str) -> tuple[zmq.Socket, zmq.Socket]:
        addr = f"inproc://{name}-{uuid.uuid4().hex}"
        pull = ctx.socket(zmq.PULL)
        pull.bind(addr)
        push = ctx.socket(zmq.PUSH)
        push.connect(addr)
        self._socks += [push, pull]
        return push, pull

    def close(self) -> None:
        self.kernel.shell_stream.close(linger=0)
        self.kernel.control_stream.close(linger=0)
        for s in self._socks:
            if not s.closed:
                s.close(linger=0)

    def request(self, msg_type: str, content: dict) -> dict:
        return self.session.msg(msg_type, content)

    def execute_request(self, code: str, **content) -> dict:
        return self.request("execute_request", {"code": code, "silent": False, "store_history": True,
                                                "user_expressions": {}, "allow_stdin": False,
                                                "stop_on_error": True, **content})

    async def send_shell(self, msg: dict) -> None:
        """As ipykernel's shell loop: one request at a time, under the shell lock; read from
        its socket on a later turn of the event loop than anything sent before it."""
        frames = [zmq.Frame(f) for f in self.session.serialize(msg, ident=[b"frontend"])]
        await asyncio.sleep(0)
        await self.kernel.shell_main(None, frames)

    async def send_control(self, msg: dict) -> dict:
        frames = [zmq.Frame(f) for f in self.session.serialize(msg, ident=[b"frontend"])]
        await self.kernel.dispatch_control(frames)
        return self._reply_to(msg, self.control[1])

    async def execute(self, code: str, **content) -> Cell:
        msg = self.execute_request(code, **content)
        await self.send_shell(msg)
        return self.collect(msg)

    def collect(self, msg: dict) -> Cell:
        """The reply to ``msg`` and its IOPub messages (all are there once its handler returned)."""
        reply = self._reply_to(msg, self.shell[1])
        self._drain()
        return Cell(reply, self._pending.pop(msg["header"]["msg_id"], []))

    def _reply_to(self, msg: dict, sock: zmq.Socket) -> dict:
        msg_id = msg["header"]["msg_id"]
        while msg_id not in self._replies:
            assert sock.poll(1000), f"no reply to {msg['header']['msg_type']}"
            reply = self._read(sock)
            self._replies[reply["parent_header"]["msg_id"]] = reply
        return self._replies.pop(msg_id)

    def _read(self, sock: zmq.Socket) -> dict:
        _, frames = self.session.feed_identities(sock.recv_multipart())
        return self.session.deserialize(frames)  # checks the signature

    def _drain(self) -> None:
        while self.iopub[1].poll(0):
            m = self._read(self.iopub[1])
            self._pending.setdefault(m["parent_header"].get("msg_id", ""), []).append(m)

    def published(self, msg: dict) -> list[dict]:
        """IOPub messages for ``msg`` so far (for requests still running)."""
        self._drain()
        return list(self._pending.get(msg["header"]["msg_id"], []))


def on_fake_ranks(test: Callable[[Frontend, FakeRanks], Awaitable], script: Script | None = None,
                  world_size: int = 2, ready: bool = True, **options) -> object:
    """Run ``test(frontend, ranks)`` against a kernel whose ranks are :class:`FakeRanks` (started,
    unless not ``ready``), with ``options`` (``KernelConfig`` fields: ``fastai=False``) as their
    kernelspec's."""
    async def main():
        fe = Frontend()
        ranks = FakeRanks(fe.kernel, world_size=world_size, script=script)
        ranks.config = dataclasses.replace(ranks.config, **options)
        fe.kernel.dist_config = ranks.config
        fe.kernel.attach(ranks)
        if ready:
            await ranks.start()
        try:
            return await test(fe, ranks)
        finally:
            fe.close()
    return asyncio.run(main())
