"""The rank kernel: a stock ipykernel that also answers the parent's typed requests.

Each rank runs :class:`RankKernel`, an ``IPythonKernel`` subclass: the same shell,
completion, display and comms as the plain Python kernel. What it adds:

- a ``dist_request`` handler on the **control** channel (see :mod:`dist_kernel.protocol`),
  so the parent gets answers while the shell runs a long cell or is blocked in a C++
  collective; nothing the kernel needs lives in the user's namespace;
- cell file names shared by every rank (``/tmp/ipykernel_<parent pid>/<hash>.py``), so a
  warning or traceback that every rank prints the same way merges into one (ipykernel's
  debugger is given the same names, so JupyterLab's breakpoints stop the rank);
- comm ids named after the cell and what the comm opens with (:mod:`~dist_kernel.rank.widgets`),
  so a widget every rank creates the same way is one widget in the frontend;
- no subshells (no shell channel thread: one thread hop less per request), and no
  ``busy``/``execute_input`` on IOPub;
- the count of IOPub messages a cell published, in its reply's metadata, so the parent
  need not wait for the cell's ``idle``;
- no IOPub high-water mark (:mod:`dist_kernel.iopub`): a burst of outputs is queued, never
  dropped;
- Linux ends the rank with the parent (PR_SET_PDEATHSIG), even when it is stuck in C code.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import Any

from ipykernel.compiler import XCachingCompiler, get_tmp_hash_seed, murmur2_x86
from ipykernel.iostream import BackgroundSocket, IOPubThread, OutStream
from ipykernel.ipkernel import IPythonKernel
from jupyter_client.session import Session

from dist_kernel import protocol
from dist_kernel.iopub import UnboundedIOPubApp
from dist_kernel.rank import agent, branches, display_ids, switches, widgets

PARENT_PID_ENV = "JPY_PARENT_PID"


def cell_dir() -> str:
    """Where cells are compiled to: named after the parent kernel, so every rank agrees."""
    # the parent kernel's pid, the same on every machine (a node agent is the ranks' own parent there)
    owner = os.environ.get("DIST_KERNEL_PARENT_PID") or os.environ.get(PARENT_PID_ENV) or os.getppid()
    return os.path.join(tempfile.gettempdir(), f"ipykernel_{owner}")


def cell_file(code: str) -> str:
    """The file a cell of source ``code`` is compiled to (and dumped to by the debugger)."""
    return os.path.join(cell_dir(), f"{murmur2_x86(code, get_tmp_hash_seed())}.py")


class SharedNameCompiler(XCachingCompiler):
    """ipykernel's compiler names a cell's file after the process's own pid: ranks would
    each report the same warning from a different file, and nothing would merge."""

    def get_code_name(self, raw_code: str, code: str, number: int) -> str:
        return cell_file(frontend_source(raw_code))


def frontend_source(code: str) -> str:
    """The source the frontend sent for the running cell, when ``code`` is the code the parent
    made of it (its ``%%rank`` line a comment): JupyterLab's debugger dumped the cell to, and set
    its breakpoints in, the file named after that source. Any other code is its own source."""
    from IPython import get_ipython

    kernel = getattr(get_ipython(), "kernel", None)
    try:
        request = kernel.get_parent("shell") if kernel is not None else {}
    except Exception:  # noqa: BLE001 - no request in this context
        request = {}
    source = protocol.meta_of(request.get("metadata")).get(protocol.META_SOURCE)
    sent = (request.get("content") or {}).get("code")
    return source if isinstance(source, str) and sent == code else code


def debugger_sees_shared_names() -> None:
    """ipykernel's debugger dumps a cell (``dumpCell``) to, and tells the frontend
    (``debugInfo``), the file names of ipykernel's own compiler: under the rank's own pid. The
    rank compiles cells under :func:`cell_dir`, so breakpoints set in those files would never
    stop it: the debugger is given the rank's names."""
    from ipykernel import debugger

    debugger.get_tmp_directory = cell_dir
    debugger.get_file_name = cell_file


class RankKernel(IPythonKernel):
    """One rank; see the module docstring."""

    implementation = "dist_kernel.rank"
    # private ipykernel API, written for ipykernel 7.4 (pyproject caps it below 8)
    _execute_sleep = 0.0  # the base class sleeps 0.5 ms before each reply; the parent counts messages instead
    compiler_class = SharedNameCompiler
    control_msg_types = [*IPythonKernel.control_msg_types, protocol.REQUEST]

    def __init__(self, **kwargs: Any) -> None:
        debugger_sees_shared_names()
        super().__init__(**kwargs)
        if self.shell_channel_thread is None:  # no subshells (RankKernelApp.init_control)
            self.shell_channel_thread = _NoShellChannel()
        self._main_loop: asyncio.AbstractEventLoop | None = None
        shell = self.shell
        assert shell is not None  # IPythonKernel.__init__ made it
        shell.events.register("pre_run_cell", agent.before_cell)
        shell.events.register("post_run_cell", agent.after_cell)
        shell.showtraceback = self._showing(shell.showtraceback)
        # IOPub messages published for the running cell, counted up to its reply (see finish_metadata)
        self._counting: str | None = None
        self._published = 0
        self._told: str | None = None  # the cell whose reply carries its count: no idle for it
        self._count_lock = threading.Lock()
        session = self._session
        session.send = self._counted(session.send)  # type: ignore[method-assign]  # this instance's send, wrapped to count
        # identical widgets (displays made with display_id=True) on every rank get one comm id (display id),
        # so the frontend shows one widget (display)
        widgets.install(lambda: self.get_parent("shell"))
        display_ids.install(lambda: self.get_parent("shell"), getattr(type(shell).run_code, "__code__", None))
        # output made under `if rank == 0:` is marked as the rank's own: the parent does not hold
        # it for the other ranks (see dist_kernel.rank.branches)
        branches.configure(cell_dir() + os.sep, getattr(type(shell).run_code, "__code__", None))
        pub = getattr(shell, "display_pub", None)
        if pub is not None:
            pub.publish = _marking_branches(pub.publish)

    @property
    def _session(self) -> Session:
        """The kernel's session (ipykernel types it optional: the app sets it before start)."""
        assert self.session is not None
        return self.session

    @property
    def _supports_kernel_subshells(self) -> bool:
        return False  # the stand-in of _NoShellChannel is not a shell channel thread

    @staticmethod
    def _showing(show: Callable[..., Any]) -> Callable[..., Any]:
        """``shell.showtraceback`` that tells the agent the cell's code is not running."""
        def showtraceback(*args: Any, **kwargs: Any) -> Any:
            _drop_interrupt_frame(sys.exc_info()[1])
            with agent.showing_traceback(bool(kwargs.get("running_compiled_code")), sys.exc_info()[1]):
                return show(*args, **kwargs)

        return showtraceback

    def pre_handler_hook(self) -> None:
        """SIGINT raises only while a cell's own code runs (see :func:`agent.in_code`)."""
        super().pre_handler_hook()
        signal.signal(signal.SIGINT, _interrupt_cell)

    @contextlib.contextmanager
    def _cancel_on_sigint(self, future: asyncio.Future) -> Iterator[None]:
        """ipykernel's SIGINT handler for a cell with a top-level ``await``, which cancels the
        cell's coroutine, and then wakes the event loop. ipykernel schedules the cancel from the
        handler with a ``call_soon`` that nothing wakes up for: a cell awaiting a 100 s sleep
        went on sleeping after the stop button, and was given up on as "did not stop"."""
        with super()._cancel_on_sigint(future):
            cancel = signal.getsignal(signal.SIGINT)
            loop = asyncio.get_running_loop()

            def cancel_and_wake(signum: int, frame: Any) -> None:
                if callable(cancel):
                    cancel(signum, frame)
                loop.call_soon_threadsafe(_nothing)  # writes to the loop's self-pipe: it wakes

            signal.signal(signal.SIGINT, cancel_and_wake)
            yield  # ipykernel's context restores the handler it found (_interrupt_cell)

    def _counted(self, send: Callable[..., Any]) -> Callable[..., Any]:
        """``session.send`` that counts the IOPub messages of the running cell (every thread's:
        its streams are sent from the IOPub thread, its displays from the main thread)."""
        def counted_send(stream: Any, msg_or_type: Any, content: Any = None, parent: Any = None,
                         *args: Any, **kwargs: Any) -> Any:
            counting = self._counting
            if counting is not None and isinstance(stream, (BackgroundSocket, IOPubThread)):
                if isinstance(msg_or_type, dict):
                    parent = msg_or_type.get("parent_header")
                if _msg_id(parent) == counting:
                    with self._count_lock:
                        if self._counting == counting:
                            self._published += 1
            return send(stream, msg_or_type, content, parent, *args, **kwargs)

        return counted_send

    def init_metadata(self, parent: dict) -> dict:
        with self._count_lock:
            self._counting = _msg_id(parent)
            self._published = 0
        count = protocol.meta_of(parent.get("metadata")).get(protocol.META_COUNT)
        if isinstance(count, int) and count > 0 and (parent.get("content") or {}).get("store_history", True):
            # the parent's count, not this rank's own: a %%rank cell that left it out would put
            # it a cell behind the prompt (`Cell In[1]` in the traceback of cell [2])
            self.shell.execution_count = count  # type: ignore[union-attr]  # IPythonKernel made it
        return super().init_metadata(parent)

    def start(self) -> None:
        super().start()
        self._main_loop = asyncio.get_event_loop()  # the shell's loop, on the main thread

    def finish_metadata(self, parent: dict, metadata: dict, reply_content: dict) -> dict:
        """Tell the parent, in the execute_reply, when the cell's error broke the process group,
        or the cell gave up a wait in group creation (it then re-forms the group on every rank)."""
        metadata = super().finish_metadata(parent, metadata, reply_content)
        result = getattr(self.shell, "last_execution_result", None)
        error = getattr(result, "error_in_exec", None) if result is not None else None
        info: dict = {}
        if agent.group_broke(error if reply_content.get("status") == "error" else None):
            info[protocol.META_GROUP_BROKEN] = True
        elif agent.group_destroyed():  # the cell destroyed it: the parent decides what now
            info[protocol.META_GROUP_DESTROYED] = True
        if reply_content.get("status") == "error":
            seq = agent.group_seq()  # the parent compares the ranks' (out of step: re-form)
            if seq is not None:
                info[protocol.META_SEQ] = seq
        # how many IOPub messages this cell published before its reply (streams are flushed by
        # now): the parent has all of its output once it holds the reply and that many
        # messages, without waiting for the idle that the IOPub thread sends after the reply
        with self._count_lock:
            if self._counting == _msg_id(parent):
                info[protocol.META_IOPUB] = self._published
                self._told = self._counting
            self._counting = None
        if info:
            metadata[protocol.META] = info
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
        if isinstance(req, (protocol.Join, protocol.Sync)):
            # both are collectives of the whole group, on the main thread (CUDA's device is per thread)
            work = _join if isinstance(req, protocol.Join) else _sync
            asyncio.ensure_future(self._answer(stream, ident, parent, req.op, self._on_main(work, req)))
        elif isinstance(req, protocol.Teardown):
            # destroying a group can wait on its work threads: never on the control loop itself
            loop = asyncio.get_running_loop()
            try:
                pending = loop.run_in_executor(None, agent.teardown_group, req.peer_pids, req.peer_hosts)
            except RuntimeError:  # no thread to be had (out of memory): answer it here, late or not
                pending = _done(loop, agent.teardown_group(req.peer_pids, req.peer_hosts))
            asyncio.ensure_future(self._answer(stream, ident, parent, req.op, pending))
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
        self._session.send(stream, protocol.REPLY, protocol.reply_content(op, result), parent, ident=ident)

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
    # nor "busy": not sending them halves the messages a cell costs (issue 14). "idle" stays
    # for every request but a counted cell: it tells the parent a request's output is complete.
    # private ipykernel API, written for ipykernel 7.4 (pyproject caps it below 8)
    def _publish_execute_input(self, code: str, parent: dict, execution_count: int) -> None:
        return

    # private ipykernel API, written for ipykernel 7.4 (pyproject caps it below 8)
    def _publish_status(self, status: str, channel: str, parent: dict | None = None) -> None:
        if status == "busy":
            return
        # nor the idle of a cell whose reply told the parent how many messages to wait for
        # (see finish_metadata): with nothing else to publish, the IOPub thread never wakes
        if channel == "shell" and parent is None and self._told is not None:
            told, self._told = self._told, None
            if told == _msg_id(self.get_parent("shell")):
                return
        # nor an idle for the parent's own typed requests, which are answered by their reply
        if channel == "control" and self.get_parent("control").get("header", {}).get("msg_type") == protocol.REQUEST:
            return
        super()._publish_status(status, channel, parent)


class _NoShellChannel:
    """Stands in for the shell channel thread that a rank does without (no subshells).

    ipykernel's ``do_execute`` asks it, for a cell with a top-level ``await``, whether the
    cell runs on the shell's own thread (``parent_thread``: then SIGINT cancels the cell's
    coroutine). With None there it raised AttributeError after the coroutine had started: the
    cell ran, but no reply was ever sent, and it stayed busy for good (issue 30). Falsy, as the
    None it replaces, for ipykernel's every other ``if shell_channel_thread`` check."""

    parent_thread = threading.main_thread()

    def __bool__(self) -> bool:
        return False


def _marking_branches(publish: Callable[..., Any]) -> Callable[..., Any]:
    """``display_pub.publish`` that marks a display made inside a branch on the rank."""
    def marking_publish(data: dict, metadata: dict | None = None, *args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is threading.main_thread() and branches.in_rank_branch(sys._getframe(1)):
            metadata = protocol.with_meta(metadata, {protocol.META_BRANCH: True})
        return publish(data, metadata, *args, **kwargs)

    return marking_publish


def _interrupt_cell(signum: int, frame: Any) -> None:
    if agent.in_code():
        raise KeyboardInterrupt
    # else the cell's code is over (its traceback is being shown, its reply sent): the stop
    # this signal asked for has happened


def _drop_interrupt_frame(error: BaseException | None) -> None:
    """A KeyboardInterrupt raised by :func:`_interrupt_cell` ends in its frame, which is the
    kernel's, not the user's: cut it off, so the traceback ends where the cell was stopped, as
    in a plain kernel; so are debugpy's, when the rank was stopped at a breakpoint. (``__tracebackhide__`` cannot do it: IPython always shows the last frame.)"""
    if not isinstance(error, KeyboardInterrupt):
        return
    tb = error.__traceback__
    while tb is not None and tb.tb_next is not None:
        nxt = tb.tb_next
        if (nxt.tb_next is None and nxt.tb_frame.f_code is _interrupt_cell.__code__) \
                or _in_debugger(nxt.tb_frame.f_code.co_filename):
            # the rank stood at a breakpoint: the frames below are the debugger's own wait
            tb.tb_next = None  # writable since Python 3.7
            return
        tb = nxt


def _in_debugger(filename: str) -> bool:
    """Is this a frame of debugpy (pydevd), where a rank stopped at a breakpoint waits?"""
    return "_pydevd_bundle" in filename or f"{os.sep}debugpy{os.sep}" in filename


def _nothing() -> None:
    return


def _msg_id(parent: Any) -> str | None:
    """The msg_id of a parent given as a message or as its header."""
    if not isinstance(parent, dict):
        return None
    header = parent.get("header", parent)
    return header.get("msg_id") if isinstance(header, dict) else None


def _done(loop: asyncio.AbstractEventLoop, value: Any) -> asyncio.Future:
    fut = loop.create_future()
    fut.set_result(value)
    return fut


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


def _sync(req: protocol.Sync) -> protocol.Synced:
    """``%dist_sync``: copy variables from one rank to the others (:mod:`dist_kernel.rank.sync`),
    as a cell runs: the stop button's SIGINT raises in it (between requests ipykernel ignores
    SIGINT), and ``where`` sees a busy rank at a step of the copy."""
    from dist_kernel.rank import sync

    previous = signal.signal(signal.SIGINT, _interrupt_cell)
    try:
        with agent.on_request("%dist_sync"):
            return sync.sync(req)
    finally:
        signal.signal(signal.SIGINT, previous)


def _set_option(req: protocol.SetOption) -> protocol.Done:
    """A rank switch (:mod:`dist_kernel.rank.switches`), switched at run time (the protocol
    validated the name)."""
    switches.switch(req.name, req.on)
    return protocol.Done(outcome=f"{req.name} {'on' if req.on else 'off'}")


_QUICK: dict[type, Callable[[Any], Any]] = {
    protocol.Where: lambda req: agent.where(),
    protocol.Status: lambda req: agent.status(),
    protocol.SetOption: _set_option,
}


class RankOutStream(OutStream):
    """ipykernel's stdout/stderr, whose ``flush()`` returns at once when everything written
    has been sent. ipykernel flushes both streams twice per request, and each flush from the
    main thread waits for a round trip through the IOPub thread, even with nothing to send.

    ``_writes`` counts writes once their text is in the buffer; a ``_flush`` (on the IOPub
    thread) notes how many writes it had seen before it took the buffers, once it has sent
    them. Equal counts: every write so far is sent (and counted for the cell's reply)."""

    _writes = 0
    _flushed = 0
    #: set by :func:`dist_kernel.rank.agent.solo_output`: text written meanwhile is this rank's
    #: alone (rank 0's progress bar or log line): it goes out at once in a stream message of its
    #: own, marked in its content (as a rich output is in its metadata); the parent shows it
    #: unlabelled, as one process would, and removes the mark. Text buffered before keeps its
    #: timing, so it still meets its twins from the other ranks.
    solo = False
    #: the text buffered now was written inside a branch on the rank (``if rank == 0:``, see
    #: :mod:`dist_kernel.rank.branches`): its stream messages are marked so (by :meth:`_mark`).
    #: Only the main thread changes it, and only with nothing buffered, so a message is never half
    #: marked
    branch = False

    def _mark(self, msg: dict) -> dict:
        if self.branch and msg.get("msg_type") == "stream":
            msg["content"]["metadata"] = protocol.with_meta(None, {protocol.META_BRANCH: True})
        return msg

    def write(self, string: str) -> int | None:  # type: ignore[override]
        if isinstance(string, str) and string and threading.current_thread() is threading.main_thread():
            if self.solo:
                content = {"name": self.name, "text": string,
                           "metadata": protocol.with_meta(None, {protocol.META_SOLO: True})}
                self.session.send(self.pub_thread, "stream", content, parent=self.parent_header, ident=self.topic)
                return len(string)
            branch = branches.in_rank_branch(sys._getframe(1))
            if branch != self.branch:
                self.flush()  # what was written before leaves marked as it was written
                self.branch = branch
        n = super().write(string)
        self._writes += 1
        return n

    # private ipykernel API, written for ipykernel 7.4 (pyproject caps it below 8)
    def _flush(self) -> None:
        if not getattr(self._local, "marking", False):  # hooks are per thread: the sending thread's
            self._local.marking = True
            self.register_hook(self._mark)
        seen = self._writes
        super()._flush()
        self._flushed = seen

    def flush(self) -> None:
        if self._writes == self._flushed and self.echo is None:
            return
        super().flush()


class RankKernelApp(UnboundedIOPubApp):
    """IPKernelApp for :class:`RankKernel`, with no IOPub high-water mark."""

    name = "dist-kernel-rank"
    kernel_class = RankKernel
    outstream_class = "dist_kernel.rank.kernel.RankOutStream"

    def init_kernel(self) -> None:
        """Create the kernel, its history kept in memory on every rank but rank 0 (see
        :func:`history_in_memory`)."""
        history_in_memory(self.config, os.environ.get("DIST_KERNEL_RANK"))
        super().init_kernel()

    def init_control(self, context: Any) -> None:
        super().init_control(context)
        # no subshells: only the parent talks to a rank, and it never asks for one. Without the
        # shell channel thread each shell request reaches the main thread directly instead of
        # through a second thread and an inproc socket (a quarter of a rank's CPU per cell)
        # private ipykernel API, written for ipykernel 7.4 (pyproject caps it below 8)
        self.shell_channel_thread = None


def history_in_memory(config: Any, rank: str | None) -> bool:
    """Keep IPython's input history in memory on every rank but rank 0; True where it did.

    Every rank would otherwise write each cell to the user's one ``history.sqlite``, and each
    commit fsyncs under the file's lock: N ranks queue on it, the losers back off for up to
    100 ms, and the file receives every cell N times (issue 26). Rank 0 keeps the user's file,
    so history carries across sessions as in a plain kernel (the parent asks rank 0 for
    ``history_request``); the others keep ``_``, ``Out``, ``_i`` and ``%history`` in memory.
    The rest of the user's ``HistoryManager`` configuration (``enabled``, ``db_log_output``,
    ...) applies on every rank; a ``hist_file`` of theirs is rank 0's alone, or the ranks would
    take turns on it again.
    """
    if rank in (None, "", "0"):
        return False
    config.HistoryManager.hist_file = ":memory:"
    return True


def main() -> None:
    """``python -m dist_kernel.rank -f CONNECTION_FILE [ipykernel options]``."""
    parent = os.environ.get(PARENT_PID_ENV)
    if parent and parent.isdigit():
        agent.die_with_parent(int(parent))
    assert threading.current_thread() is threading.main_thread()
    RankKernelApp.launch_instance()
