"""Whole-notebook runs through nbclient, without installing a kernelspec first.

``python -m dist_kernel run`` shows each cell's output live, as it arrives (already merged
across ranks by the kernel), as text (:mod:`dist_kernel.text_output`, which the kernel's output
log shares: stream text as is, rich outputs as their text/plain, a display updated in place as a
line every few seconds and its last frame), on stdout and stderr as the notebook has them; the
cell's place and time go to stderr, so stdout holds only the notebook's output. On a terminal,
``%dist_top``'s table of the ranks (state, load, line) is a live status under the running cell's
output (:mod:`dist_kernel.statusline`); it is never saved in the notebook.

With ``--output``, the notebook is saved after every cell (and every :data:`SAVE_EVERY` seconds
of a long cell), as papermill does, each time to a temporary file then renamed over the output:
a run killed half way leaves the cells it ran, and never a half-written notebook.

SIGINT (Ctrl-C) or SIGTERM (``timeout``, a batch system ending the job) stops the run: the
running cell is abandoned, the kernel and its ranks are shut down, and the exit status is
128 + the signal's number. nbclient's own handler only schedules the kernel's shutdown, and
with a blocking kernel client its event loop did not even run it until the cell ended.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any, TextIO, TypeVar

import nbformat
from jupyter_client import AsyncKernelManager, KernelManager
from jupyter_client.asynchronous import AsyncKernelClient
from jupyter_client.channels import AsyncZMQSocketChannel
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_core.paths import jupyter_runtime_dir
from jupyter_core.utils import ensure_async, run_sync
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
from traitlets import Type

from dist_kernel.cleanup import SOCKET_PATH_MAX, make_runtime_dir, owner_pid
from dist_kernel.kernelspec import kernel_json
from dist_kernel.output_kinds import KINDS, Text
from dist_kernel.parent.merge import strip_ansi
from dist_kernel.protocol import META_LIVE, meta_of, with_meta
from dist_kernel.statusline import StatusLine
from dist_kernel.text_output import TextOutput, is_top

KM = TypeVar("KM", KernelManager, AsyncKernelManager)
#: seconds between two saves of the output notebook while one cell runs
SAVE_EVERY = 30.0


class _SpecManager(KernelSpecManager):
    """Gives nbclient the Distributed Python spec with the chosen options."""

    options: list[str] = []

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        return KernelSpec(**kernel_json(self.options))


def spec_manager(options: list[str]) -> KernelSpecManager:
    """A spec manager whose every spec is Distributed Python with ``options``."""
    ksm = _SpecManager()
    ksm.options = list(options)
    return ksm


class _ShellChannel(AsyncZMQSocketChannel):
    """The shell channel, sending through its asyncio socket.

    ``Session.send`` writes through a blocking shadow of an asyncio socket. That send can
    consume the socket's edge-triggered wakeup while nbclient awaits the execute_reply on the
    same socket, and nbclient then waits forever for a reply that has arrived
    (jupyter/nbclient#312). nbclient sends on this socket in the middle of a cell whenever an
    ``ipywidgets.Output`` captures output (Lightning's and rich's progress bars do). The
    asyncio socket's own send wakes the pending receive.
    """

    #: the run shows ``%dist_top``'s table as a status line: said in each cell's request, whose
    #: ``allow_stdin`` (off: nobody answers ``input()`` here) would keep the kernel from sending it
    live = False

    def send(self, msg: dict[str, Any]) -> None:
        if self.live and msg["header"]["msg_type"] == "execute_request":
            msg["metadata"] = with_meta(msg.get("metadata"), {**meta_of(msg.get("metadata")), META_LIVE: True})
        frames: list[Any] = self.session.serialize(msg)
        frames.extend(msg.get("buffers") or [])
        self.socket.send_multipart(frames)  # sent at once, or queued on the loop: never blocks


class _AsyncClient(AsyncKernelClient):
    shell_channel_class = Type(_ShellChannel)


def kernel_manager(options: list[str], cls: type[KM] = KernelManager) -> KM:  # type: ignore[assignment]  # mypy cannot tie a default to a TypeVar
    """A kernel manager (``cls``) that starts the distributed kernel with ``options``, over IPC sockets."""
    km = cls(kernel_name="distributed-python", kernel_spec_manager=spec_manager(options))
    if isinstance(km, AsyncKernelManager):
        km.client_factory = _AsyncClient
    km.transport = "ipc"  # nothing on TCP at all, and no warning about unencrypted TCP
    runtime = jupyter_runtime_dir()
    name = f"dist-kernel-{uuid.uuid4().hex[:12]}-ipc"
    if len(os.fsencode(os.path.join(runtime, name))) + len("-99999") > SOCKET_PATH_MAX:
        # a unix socket path is limited to 107 bytes: a long home or JUPYTER_RUNTIME_DIR
        # would fail with a bare "ZMQError: File name too long"
        runtime = make_runtime_dir()  # ours (its name says so): run_notebook removes it
    os.makedirs(runtime, mode=0o700, exist_ok=True)
    km.ip = os.path.join(runtime, name)
    return km


def _write(stream: TextIO, text: str) -> None:
    stream.write(text)
    stream.flush()  # a pipe is block-buffered: show it now, not when the buffer fills


class _LiveClient(NotebookClient):
    """A NotebookClient that shows every output as it arrives, between per-cell headers."""

    def __init__(self, nb: nbformat.NotebookNode, live: bool = False, output: str | None = None, **kw: Any) -> None:
        super().__init__(nb, on_cell_execute=self._cell_starts, on_cell_executed=self._cell_ends, **kw)
        self.current: int | None = None  # the index of the cell running now
        self.stopped_by: int | None = None  # the signal that stopped the run
        self._t0 = 0.0
        # a terminal draws \r lines in place itself; a file or a pipe gets them as lines
        self.text = TextOutput(keep_cr=live)
        self.save_to = output  # where the notebook is saved, after every cell
        self._saved_at = time.monotonic()
        #: the ranks' live status under the output (stdout is a terminal); %dist_top is turned on
        #: before the first cell
        self.status = StatusLine(sys.stdout) if live else None
        self._top_asked = False

    def _arm_signals(self) -> None:
        """Make SIGINT and SIGTERM stop the run, in place of the handler nbclient sets up when
        it starts the kernel: that one only schedules the kernel's shutdown and lets the cell
        go on waiting."""
        loop, task = asyncio.get_running_loop(), asyncio.current_task()
        if task is None:
            return
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._stop, sig, task)
            except (RuntimeError, ValueError):  # not the main thread: the caller's signals stay theirs
                return

    def _stop(self, sig: int, task: asyncio.Task) -> None:
        if self.stopped_by is None:  # a second signal changes nothing: the shutdown is under way
            self.stopped_by = sig
            task.cancel()

    def _place(self, cell_index: int) -> str:
        return f"cell {cell_index + 1}/{len(self.nb.cells)}"

    def _rule(self, text: str) -> None:
        if self.status is not None:
            self.status.reset()  # a rule starts or ends a cell: the status is the running cell's
        sys.stdout.flush()
        _write(sys.stderr, self.text.rule(text))  # on a line of its own, even after a line left open

    async def _cell_starts(self, cell: nbformat.NotebookNode, cell_index: int) -> None:
        self._arm_signals()
        self.current, self._t0 = cell_index, time.monotonic()
        self._rule(self._place(cell_index))
        if self.status is not None and not self._top_asked:
            self._top_asked = True
            shell = getattr(self.kc, "shell_channel", None)
            if isinstance(shell, _ShellChannel):
                shell.live = True
            await self._ask_top()

    async def _ask_top(self) -> None:
        """``%dist_top``, as a silent request before the first cell. It waits for the ranks to
        start, so what the kernel says meanwhile (a Slurm queue) is shown as the cell's would be."""
        assert self.kc is not None
        msg_id = self.kc.execute("%dist_top", silent=True, store_history=False)
        while True:
            try:
                msg = await ensure_async(self.kc.iopub_channel.get_msg(timeout=1))
            except Exception:  # noqa: BLE001 - queue.Empty: nothing yet; give up if the kernel died
                if self.km is None or not await ensure_async(self.km.is_alive()):
                    return
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "status" and msg["content"].get("execution_state") == "idle":
                break
            kind = KINDS.get(msg["msg_type"])
            if kind is not None and kind.text is Text.STREAM and not msg["content"].get("text", "").startswith("dist_top:"):
                self._show(msg)  # the kernel's notes while the ranks start; an error shows with the cell
        await self.async_wait_for_reply(msg_id)

    def _cell_ends(self, cell: nbformat.NotebookNode, cell_index: int,
                   execute_reply: dict) -> None:
        failed = execute_reply.get("content", {}).get("status") == "error"
        self._emit(self.text.finish())  # the last frame of what was redrawn in place
        self._rule(f"{self._place(cell_index)} {'failed after' if failed else 'done in'} "
                   f"{time.monotonic() - self._t0:.1f}s")

    async def async_execute_cell(self, cell: nbformat.NotebookNode, cell_index: int,
                                 execution_count: int | None = None, store_history: bool = True) -> nbformat.NotebookNode:
        try:
            return await super().async_execute_cell(cell, cell_index, execution_count, store_history)
        finally:
            self.save()  # the cell as nbclient left it (its streams joined), whether it failed or not

    def save(self) -> None:
        """Write the notebook to ``--output`` as it is now, atomically."""
        if self.save_to:
            write_atomically(self.nb, self.save_to)
            self._saved_at = time.monotonic()

    def process_message(self, msg: dict, cell: nbformat.NotebookNode, cell_index: int) -> Any:
        if is_top(msg):  # a live view, never an output of the cell, nor saved with it
            if self.status is not None:
                self.status.update(msg["content"].get("data", {}).get("text/plain", ""), self.text.at_line_start)
            return None
        self._show(msg)
        out = super().process_message(msg, cell, cell_index)
        if time.monotonic() - self._saved_at >= SAVE_EVERY:
            self.save()  # a cell of hours: what it printed so far is kept too
        return out

    def _show(self, msg: dict) -> None:
        self._emit(self.text.feed(msg["msg_type"], msg["content"]))

    def _emit(self, texts: list[tuple[str, str]]) -> None:
        for name, text in texts:
            if not text:
                continue
            stream = sys.stderr if name == "stderr" else sys.stdout
            if self.status is not None:
                self.status.clear()
            if stream is sys.stderr:
                sys.stdout.flush()
            _write(stream, text)
            if self.status is not None and text.endswith("\n"):
                self.status.draw()


def write_atomically(nb: nbformat.NotebookNode, path: str) -> None:
    """Write ``nb`` to ``path`` through a temporary file renamed over it: a reader (or a run
    killed now) sees the old notebook or the new one, never part of one."""
    folder, name = os.path.split(os.path.abspath(path))
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.tmp")
    try:
        nbformat.write(nb, tmp)
        if os.path.exists(path):
            shutil.copymode(path, tmp)  # the output keeps the mode it had
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def run_notebook(path: str, options: list[str], output: str | None = None,
                 cell_timeout: float | None = None) -> int:
    """Execute ``path`` on the distributed kernel, showing output live; 0 on success, 1
    naming the failing cell (and the rank, in the error) when one fails."""
    nb = nbformat.read(path, as_version=4)
    # async: nbclient waits for the kernel on a running event loop, where it notices a dead
    # kernel and our signals; a blocking client waits in zmq, forever if the kernel is gone
    km = kernel_manager(options, AsyncKernelManager)
    client = _LiveClient(nb, km=km, timeout=cell_timeout, live=sys.stdout.isatty(), output=output,
                         resources={"metadata": {"path": str(Path(path).resolve().parent)}})
    status = 0
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError, DeadKernelError, asyncio.CancelledError) as e:
        where = f"cell {client.current + 1} of {len(nb.cells)}" if client.current is not None else "a cell"
        if client.stopped_by is not None:  # a signal cancelled the run (nbclient may call that a dead kernel)
            status = 128 + client.stopped_by
            print(f"\n{path}: stopped by {signal.Signals(client.stopped_by).name} during {where}; "
                  "shutting the kernel and its ranks down", file=sys.stderr)
        elif isinstance(e, asyncio.CancelledError):
            raise
        else:
            status = 1
            if isinstance(e, CellExecutionError):
                what = f"{e.ename}: {strip_ansi(e.evalue)}"
            elif isinstance(e, CellTimeoutError):
                what = f"it ran longer than its timeout ({cell_timeout}s)"
            else:
                what = "the kernel died"
            print(f"\n{path}: {where} failed: {what}", file=sys.stderr)
    finally:
        if km.has_kernel:  # nbclient only shuts down kernels it created itself
            run_sync(km.shutdown_kernel)(now=False)
        if owner_pid(os.path.dirname(km.ip)) == os.getpid():  # kernel_manager's short dir
            shutil.rmtree(os.path.dirname(km.ip), ignore_errors=True)
        if output:
            client.save()
            print(f"wrote {output}", file=sys.stderr)
    return status
