"""The rank kernel: a stock ipykernel that also answers the parent's typed requests.

Each rank runs :class:`RankKernel`, an ``IPythonKernel`` subclass: the same shell,
completion, display and comms as the plain Python kernel. What it adds:

- a ``dist_request`` handler on the **control** channel (see :mod:`dist_kernel.protocol`),
  so the parent gets answers while the shell runs a long cell or is blocked in a C++
  collective; nothing the kernel needs lives in the user's namespace;
- cell file names shared by every rank (``/tmp/ipykernel_<parent pid>/<hash>.py``), so a
  warning or traceback that every rank prints the same way merges into one;
- no IOPub high-water mark (:mod:`dist_kernel.iopub`): a burst of outputs is queued, never
  dropped;
- Linux ends the rank with the parent (PR_SET_PDEATHSIG), even when it is stuck in C code.
"""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import threading
from collections.abc import Callable
from typing import Any

from ipykernel.compiler import XCachingCompiler, get_tmp_hash_seed, murmur2_x86
from ipykernel.ipkernel import IPythonKernel

from dist_kernel import protocol
from dist_kernel.iopub import UnboundedIOPubApp
from dist_kernel.rank import agent

PARENT_PID_ENV = "JPY_PARENT_PID"


def cell_dir() -> str:
    """Where cells are compiled to: named after the parent kernel, so every rank agrees."""
    return os.path.join(tempfile.gettempdir(), f"ipykernel_{os.environ.get(PARENT_PID_ENV, os.getppid())}")


class SharedNameCompiler(XCachingCompiler):
    """ipykernel's compiler names a cell's file after the process's own pid: ranks would
    each report the same warning from a different file, and nothing would merge."""

    def get_code_name(self, raw_code: str, code: str, number: int) -> str:
        return os.path.join(cell_dir(), f"{murmur2_x86(raw_code, get_tmp_hash_seed())}.py")


class RankKernel(IPythonKernel):
    """One rank; see the module docstring."""

    implementation = "dist_kernel.rank"
    compiler_class = SharedNameCompiler
    control_msg_types = [*IPythonKernel.control_msg_types, protocol.REQUEST]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._main_loop: asyncio.AbstractEventLoop | None = None
        self.shell.events.register("pre_run_cell", agent.before_cell)
        self.shell.events.register("post_run_cell", agent.after_cell)

    def start(self) -> None:
        super().start()
        self._main_loop = asyncio.get_event_loop()  # the shell's loop, on the main thread

    def finish_metadata(self, parent: dict, metadata: dict, reply_content: dict) -> dict:
        """Tell the parent, in the execute_reply, when the cell's error broke the process group
        (it then re-forms the group on every rank)."""
        metadata = super().finish_metadata(parent, metadata, reply_content)
        result = getattr(self.shell, "last_execution_result", None)
        error = getattr(result, "error_in_exec", None) if result is not None else None
        if reply_content.get("status") == "error" and agent.group_broke(error):
            metadata["dist_kernel"] = {"group_broken": True}
        return metadata

    # ------------------------------------------------------------ dist_request
    async def dist_request(self, stream: Any, ident: Any, parent: dict) -> None:
        """Answer one typed request (named after its message type, as ipykernel's handlers are).

        Quick requests are answered here, on the control thread. ``join`` must run on the
        main thread and can take seconds (importing torch): it is answered from a task, so
        the control channel stays free for ``where`` and ``status`` meanwhile.
        """
        content = parent.get("content")
        op = str(content.get("op", "?")) if isinstance(content, dict) else "?"
        try:
            req = protocol.parse_request(content)
        except protocol.ProtocolError as e:
            self._dist_reply(stream, ident, parent, op, protocol.ErrorReply("ProtocolError", str(e)))
            return
        if isinstance(req, protocol.Join):
            asyncio.ensure_future(self._answer(stream, ident, parent, req.op, self._on_main(_join, req)))
        elif isinstance(req, protocol.Teardown):
            # destroying a group can wait on its work threads: never on the control loop itself
            loop = asyncio.get_running_loop()
            asyncio.ensure_future(self._answer(stream, ident, parent, req.op,
                                               loop.run_in_executor(None, agent.teardown_group, req.peer_pids,
                                                                   req.peer_hosts)))
        else:
            try:
                result = _QUICK[type(req)](req)
            except Exception as e:  # noqa: BLE001 - a failed request is an error reply, never a dead thread
                result = protocol.ErrorReply(type(e).__name__, str(e))
            self._dist_reply(stream, ident, parent, req.op, result)

    async def _answer(self, stream: Any, ident: Any, parent: dict, op: str, pending: Any) -> None:
        try:
            result = await pending
        except BaseException as e:  # noqa: BLE001 - KeyboardInterrupt included: report, don't die
            result = protocol.ErrorReply(type(e).__name__, str(e))
        self._dist_reply(stream, ident, parent, op, result)

    def _dist_reply(self, stream: Any, ident: Any, parent: dict, op: str, result: Any) -> None:
        self.session.send(stream, protocol.REPLY, protocol.reply_content(op, result), parent, ident=ident)

    def _on_main(self, fn: Callable[[Any], Any], arg: Any) -> asyncio.Future:
        """Run ``fn(arg)`` on the main thread's loop; a future for its result on this loop."""
        assert self._main_loop is not None
        done: asyncio.Future = asyncio.get_running_loop().create_future()
        here = asyncio.get_running_loop()

        def call() -> None:
            try:
                value, exc = fn(arg), None
            except BaseException as e:  # noqa: BLE001
                value, exc = None, e
            here.call_soon_threadsafe(_settle, done, value, exc)

        self._main_loop.call_soon_threadsafe(call)
        return done

    # Only the parent reads a rank's IOPub, and it needs neither the echo of the code it sent
    # nor "busy": not sending them halves the messages a cell costs (issue 14). "idle" stays:
    # it tells the parent a request's output is complete.
    def _publish_execute_input(self, code: str, parent: dict, execution_count: int) -> None:
        return

    def _publish_status(self, status: str, channel: str, parent: dict | None = None) -> None:
        if status == "busy":
            return
        # nor an idle for the parent's own typed requests, which are answered by their reply
        if channel == "control" and self.get_parent("control").get("header", {}).get("msg_type") == protocol.REQUEST:
            return
        super()._publish_status(status, channel, parent)


def _settle(fut: asyncio.Future, value: Any, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)


def _join(req: protocol.Join) -> protocol.Joined:
    """Form the group on the main thread. An interrupt meant for a cell must not kill a rank
    that is joining: SIGINT is held off until the group has formed."""
    from dist_kernel.rank import rendezvous

    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held.append(signum))
    try:
        device = rendezvous.join(req)
    finally:
        signal.signal(signal.SIGINT, previous)
    return protocol.Joined(device=device)


def _set_option(req: protocol.SetOption) -> protocol.Done:
    """``empty_cache`` or ``fastai``, switched at run time (the protocol validated the name)."""
    if req.name == "empty_cache":
        agent.set_empty_cache(req.on)
    else:
        from dist_kernel.rank.fastai import state

        state.set_enabled(req.on)
    return protocol.Done(outcome=f"{req.name} {'on' if req.on else 'off'}")


_QUICK: dict[type, Callable[[Any], Any]] = {
    protocol.Where: lambda req: agent.where(),
    protocol.Status: lambda req: agent.status(),
    protocol.SetOption: _set_option,
}


class RankKernelApp(UnboundedIOPubApp):
    """IPKernelApp for :class:`RankKernel`, with no IOPub high-water mark."""

    name = "dist-kernel-rank"
    kernel_class = RankKernel


def main() -> None:
    """``python -m dist_kernel.rank -f CONNECTION_FILE [ipykernel options]``."""
    parent = os.environ.get(PARENT_PID_ENV)
    if parent and parent.isdigit():
        agent.die_with_parent(int(parent))
    assert threading.current_thread() is threading.main_thread()
    RankKernelApp.launch_instance()
