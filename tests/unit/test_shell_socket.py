"""The parent's replies go out on the raw shell and control sockets (issue 14's fast path). A ZMQ
socket's file descriptor signals edges, so such a send can swallow the edge of a request that
arrived meanwhile: on a loaded machine the next cell's execute_request (or the stop button's
interrupt_request) then sat unread until some other message came (issue 20, item 6: whole
notebooks hung after a cell). Sockets in one process, no kernel: the mechanism itself."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import zmq
from zmq.eventloop.zmqstream import ZMQStream

from dist_kernel.parent.replies import always_reply


@pytest.mark.parametrize("transport", ["inproc://shell", "ipc://{tmp}/shell"])
def test_a_request_that_arrives_while_a_reply_is_sent_raw_is_still_read(transport, tmp_path):
    async def scenario() -> list[bytes]:
        ctx = zmq.Context()
        router = ctx.socket(zmq.ROUTER)
        router.bind(transport.format(tmp=tmp_path))
        frontend = ctx.socket(zmq.DEALER)
        frontend.connect(transport.format(tmp=tmp_path))
        stream = ZMQStream(router)
        handled: list[bytes] = []

        async def execute_request(sock, ident, body) -> None:  # as the kernel's handlers get it
            handled.append(body)
            if body == b"first cell":
                await asyncio.sleep(0.02)  # the cell runs, over later turns of the loop
                frontend.send(b"next cell")  # the next request arrives while this turn runs...
                time.sleep(0.05)  # noqa: ASYNC251 - this turn must not yield: the request lands inside it
                sock.send_multipart([ident, b"execute_reply"])  # ...and the raw reply takes its edge

        kernel = SimpleNamespace(log=None, session=None)
        handle = always_reply(kernel, "execute_request", execute_request)
        stream.on_recv(lambda frames: handle(stream, frames[0], frames[-1]))
        frontend.send(b"first cell")
        for _ in range(100):
            await asyncio.sleep(0.02)
            if len(handled) == 2:
                break
        stream.close()
        frontend.close(linger=0)
        ctx.term()
        return handled

    assert asyncio.run(scenario()) == [b"first cell", b"next cell"]
