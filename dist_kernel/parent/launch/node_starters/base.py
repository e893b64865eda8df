"""Starting the node agents of a multi-node kernel: the starter processes (issue 13).

The parent starts one node agent per machine (``python -m dist_kernel.node ...``) through a
node starter of the kind ``--launcher`` names (the table: :mod:`dist_kernel.launchers`; Slurm:
:mod:`~dist_kernel.parent.launch.node_starters.slurm`, ssh:
:mod:`~dist_kernel.parent.launch.node_starters.ssh`). :class:`NodeStarter` is what every kind
shares: the starter processes themselves (one for every node, or one per host), each a
:class:`StarterProcess`, and what it started, recorded and ended.

The agents' keys (the *bootstrap*, one JSON line) go to each agent on its stdin, never in argv
or the environment (:meth:`NodeStarter.seal` wraps them where that stdin crosses the network in
clear). Stdin then stays open: its EOF (the starter stopped, or the parent died and the kernel
closed the pipe) tells each agent to end everything. Each starter process's output (the batch
system's messages, ssh's errors, the agents' own stderr) is read continuously into a bounded
tail that :meth:`NodeStarter.failure` quotes when a starter process exits; a kind reads its own
lines (:meth:`NodeStarter._on_line`) and says what the rest of the launch package needs as a
:data:`Phase`.

A SIGKILLed parent cannot stop what its starter started: each starter records it in
``RUNTIME_DIR/launch.json`` (a :class:`~dist_kernel.cleanup.LaunchRecord`: its kind, its
processes, and an opaque record of the rest, :meth:`NodeStarter.started`) and knows how to end
a recorded start (:meth:`NodeStarter.end_recorded`), which the reaper and the next sweep call
by kind (:func:`dist_kernel.parent.launch.node_starters.end_launch`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shlex
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

from dist_kernel.cleanup import LAUNCH_FILE, LaunchRecord, Proc, end_processes
from dist_kernel.exceptions import ConfigError
from dist_kernel.options import KernelConfig
from dist_kernel.processes import describe_exit

#: stderr lines kept per starter process
TAIL_LINES = 40
#: stderr lines quoted by failure()
QUOTED_LINES = 8
#: seconds stop() waits after closing stdin (the agents end themselves), after SIGTERM, after SIGKILL
STOP_GRACE, STOP_TERM_WAIT, STOP_KILL_WAIT = 1.0, 2.0, 0.5

#: what a starter says of the nodes it asked for, all the rest of the launch package hears of a
#: batch system: waiting for them (a queue), given them, or the grant ended under the kernel
#: (cancelled, out of time; :meth:`NodeStarter.failure` says how)
Phase = Literal["pending", "started", "ended"]


def run_quiet(argv: list[str], environ: Mapping[str, str] | None, timeout: float = 10.0) -> str | None:
    """stdout of a quick command that succeeded, else None."""
    try:
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ if environ is None else environ))
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def exit_words(label: str, returncode: int, tail: Sequence[str]) -> str:
    """``"ssh to n2 exited with code 255: ssh: connect to host ..."``: how a starter process
    ended, with the last lines it printed."""
    how = describe_exit(returncode, oom_hint=False)  # a killed starter process was not short of memory
    lines = [ln for ln in tail if ln.strip()][-QUOTED_LINES:]
    if not lines:
        return f"{label} {how} (it printed nothing)"
    return f"{label} {how}: " + "\n".join(lines)


class StarterProcess:
    """One starter process (the batch system's, for every node, or ssh to one host) and what it printed."""

    def __init__(self, label: str, popen: subprocess.Popen, host: str | None) -> None:
        self.label = label
        self.popen = popen
        self.host = host
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.reader: threading.Thread | None = None
        self.exited_at: float | None = None  # monotonic time its exit was seen
        self.read_all = False  # its last lines were waited for once (see failure())
        self.stdin_lock = threading.Lock()  # the key line first, fresh keys after it

    def feed(self, lines: bytes) -> None:
        """Write ``lines`` to its stdin (the whole of it before any later lines); from any thread."""
        with self.stdin_lock:
            try:
                assert self.popen.stdin is not None
                self.popen.stdin.write(lines)
                self.popen.stdin.flush()
            except (OSError, ValueError):  # exited or closed: failure() says why
                pass

    def exited(self) -> bool:
        if self.popen.poll() is None:
            return False
        if self.exited_at is None:
            self.exited_at = time.monotonic()
        return True


class NodeStarter:
    """Starts one node agent per node, records what it started, and ends it; see the module docstring.

    ``agent_argv(node_rank)`` is the argv of the agent of one node (``None`` where one argv
    serves every node and the agent learns its node rank from the batch system). ``on_note``
    gets progress for the first cell (waiting in a queue, ...) and ``on_failure`` the words of
    the first starter process that exits unexpectedly; both are called in the event loop that
    ran :meth:`start`. ``environ``: the environment of the starter processes (default
    ``os.environ``; it also says whether the kernel runs inside a batch allocation).
    """

    #: the ``--launcher`` kind this starter serves (its row in :data:`dist_kernel.launchers.KINDS`);
    #: "" only for a record that names no kind (processes alone)
    kind = ""

    def __init__(self, config: KernelConfig, agent_argv: Callable[[int | None], list[str]], runtime_dir: str,
                 log: logging.Logger, on_note: Callable[[str], None],
                 on_failure: Callable[[str], None] | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.agent_argv = agent_argv
        self.runtime_dir = runtime_dir
        self.log = log
        self.on_note = on_note
        self.on_failure = on_failure
        self.environ = dict(os.environ if environ is None else environ)
        self._children: list[StarterProcess] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.RLock()
        self._stop_lock = threading.Lock()
        self._stopping = False
        self._stopped = False
        self._failure_reported = False
        #: told of each :data:`Phase` of the nodes asked for (pending in a queue, started, ended), in
        #: the loop of :meth:`start`; a kind without a queue (ssh) never calls it
        self.on_phase: Callable[[Phase], None] | None = None

    # ------------------------------------------------------------- before starting
    @classmethod
    def check(cls, config: KernelConfig, environ: Mapping[str, str] | None = None) -> None:
        """Raise ConfigError for a configuration this starter cannot serve (before anything starts)."""

    @classmethod
    def listen_address(cls, config: KernelConfig, environ: Mapping[str, str]) -> str:
        """This machine's address as the nodes should see it, when ``--listen`` does not say."""
        raise NotImplementedError

    # ------------------------------------------------------------- what a node starter provides
    def commands(self) -> list[tuple[str, str | None, list[str]]]:
        """(label, host, argv) of each starter process."""
        raise NotImplementedError

    def hosts(self) -> list[str] | None:
        return None

    def agent_flags(self) -> list[str]:
        """More arguments for every agent's command line (how to open sealed keys)."""
        return []

    def seal(self, bootstrap: bytes) -> bytes:
        """The key line(s) the agents read on stdin: ``bootstrap`` itself, unless that stdin
        crosses the network in clear. Called again once the nodes are given after a wait
        (:meth:`send`): a seal may expire meanwhile, and an agent takes the first line it opens."""
        return bootstrap

    def hello(self, hellos: Mapping[int, dict]) -> None:
        """What the node agents said when they connected (under a batch system, the job they run in)."""

    def started(self) -> dict[str, Any]:
        """What this starter started besides its processes, as the launch record keeps it (a
        batch job: its id and name): opaque to all but :meth:`end_recorded`. JSON-able."""
        return {}

    @classmethod
    def end_recorded(cls, record: LaunchRecord, term_wait: float = STOP_TERM_WAIT) -> tuple[list[Proc], list[str]]:
        """End a start this kind recorded (its kernel is gone: the reaper, the sweep): its
        starter processes, SIGTERM then SIGKILL; a kind that started more ends that too, after
        them. Returns the processes ended and what else was ended, in words."""
        return end_processes(record.pids, term_wait), []

    def _on_line(self, child: StarterProcess, line: str) -> None:
        """A line a starter process printed: a kind reads its batch system's words here."""

    def _phase(self, phase: Phase) -> None:
        if self.on_phase is not None:
            self._call_in_loop(self.on_phase, phase)

    # ------------------------------------------------------------- start
    async def start(self, bootstrap: bytes) -> None:
        """Start the starter processes and give each the bootstrap line on its stdin, which
        stays open. Returns at once (does not wait for the queue or the agents)."""
        self._loop = asyncio.get_running_loop()
        try:
            self._spawn(bootstrap)  # fork+exec and a pipe write of one line: no waiting
        except ConfigError:
            await self.stop()
            raise

    def _spawn(self, bootstrap: bytes) -> None:
        if not bootstrap.endswith(b"\n"):
            raise ValueError("the bootstrap must be whole lines, ending in a newline")
        for label, host, argv in self.commands():
            self.log.info("starting %s: %s", label, shlex.join(argv))
            try:
                popen = subprocess.Popen(
                    argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    env=self.environ, start_new_session=True)  # a Ctrl-C at the parent is not for them
            except OSError as e:
                raise ConfigError(f"cannot run {argv[0]} for {label}: {e.strerror or e}. Fix: install it "
                                  f"or put it on the kernel's PATH, then restart the kernel.") from None
            child = StarterProcess(label, popen, host)
            with self._lock:
                self._children.append(child)
            child.reader = threading.Thread(target=self._read, args=(child,), daemon=True,
                                            name=f"dist_kernel {label}")
            child.reader.start()
            self._record()
            # from a thread: the key line of a large world (a key per rank) outgrows the pipe's
            # 64 KiB, and the write would block the event loop until the agent has started and
            # read it, while the nodes already connected wait for the parent's beats
            threading.Thread(target=child.feed, args=(bootstrap,), daemon=True,
                             name=f"dist_kernel {label} keys").start()

    def send(self, lines: bytes) -> None:
        """More lines for every agent's stdin (freshly sealed keys once the nodes were given)."""
        with self._lock:
            children = list(self._children)
        for child in children:
            child.feed(lines)

    def _read(self, child: StarterProcess) -> None:
        """Read a starter process's output line by line until it closes; note its exit."""
        assert child.popen.stdout is not None
        for raw in iter(child.popen.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\r\n")
            child.tail.append(line)
            self.log.info("%s: %s", child.label, line)
            try:
                self._on_line(child, line)
            except Exception:  # a parse problem must not stop the reading
                self.log.exception("while reading %s", child.label)
        while True:  # a timeout: poll() in other threads gets no answer while wait() blocks
            try:
                child.popen.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:  # it closed its output but runs on
                if self._stopped:
                    return
        child.exited()
        if not self._stopping and not self._failure_reported and self.on_failure is not None:
            words = self.failure()
            if words:
                self._failure_reported = True
                self._call_in_loop(self.on_failure, words)

    def _call_in_loop(self, fn: Callable[[Any], None], text: object) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, text)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def _note(self, text: str) -> None:
        self.log.info("%s", text)
        self._call_in_loop(self.on_note, text)

    def _record(self) -> None:
        """launch.json for the reaper and the sweep (skipped once stopped)."""
        if self._stopped or not os.path.isdir(self.runtime_dir):
            return
        try:
            self.launch_record().write(self.runtime_dir)
        except OSError as e:
            self.log.warning("cannot write %s: %s", LAUNCH_FILE, e)

    # ------------------------------------------------------------- state
    def launch_record(self) -> LaunchRecord:
        """What the reaper and the sweep need to end this start (launch.json)."""
        return LaunchRecord.of(self.kind, self.local_pids(), self.started())

    def record(self) -> None:
        self._record()

    def local_pids(self) -> list[int]:
        """The starter processes' pids, for the reaper."""
        with self._lock:
            return [c.popen.pid for c in self._children]

    def tail(self) -> list[str]:
        """The last lines every starter process printed, each prefixed by its label."""
        with self._lock:
            return [f"{c.label}: {ln}" for c in self._children for ln in list(c.tail)]

    def failure(self) -> str | None:
        """None while every starter process runs (or once stop() was called); else how the
        first one to exit ended, with its last lines."""
        if self._stopping:
            return None
        with self._lock:
            children = list(self._children)
        gone = [c for c in children if c.exited()]
        if not gone:
            return None
        first = min(gone, key=lambda c: c.exited_at or 0.0)
        if not first.read_all and first.reader is not None and first.reader is not threading.current_thread():
            first.reader.join(timeout=0.5)  # its last lines (once: a grandchild may hold the pipe)
            first.read_all = True
        return exit_words(first.label, first.popen.returncode, list(first.tail))

    def expect_exit(self) -> None:
        """The starter processes are about to end on purpose (the parent told the agents to
        stop): from now on their exit is no failure. :meth:`stop` still ends what is left."""
        self._stopping = True

    # ------------------------------------------------------------- stop
    async def stop(self) -> None:
        """End every starter process and what else it started; idempotent, a few seconds at most."""
        await asyncio.get_running_loop().run_in_executor(None, self.stop_sync)

    def stop_sync(self) -> None:
        """:meth:`stop` for code that cannot await (atexit)."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopping = True
            t0 = time.monotonic()
            with self._lock:
                children = list(self._children)
            for c in children:  # EOF: the agents end their ranks and themselves
                with contextlib.suppress(OSError):
                    if c.popen.stdin is not None:
                        c.popen.stdin.close()
            self._end_started(_end_processes(children))
            for c in children:
                if c.reader is not None:
                    c.reader.join(timeout=0.5)
                with contextlib.suppress(OSError):
                    if c.popen.stdout is not None:
                        c.popen.stdout.close()
            self._stopped = True
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.runtime_dir, LAUNCH_FILE))
            self.log.info("%s node starter stopped in %.2fs", self.kind, time.monotonic() - t0)

    def _end_started(self, killed: bool) -> None:
        """End what this kind started besides its processes, once they ended (``killed``: one
        needed SIGKILL, so it may have left work behind)."""


def _end_processes(children: Sequence[StarterProcess]) -> bool:
    """Wait for the starter processes to end, then SIGTERM, then SIGKILL those still running,
    each after its grace; True when any got SIGKILL (a killed starter process may leave work behind)."""
    killed = False
    for sig, wait in ((None, STOP_GRACE), (signal.SIGTERM, STOP_TERM_WAIT), (signal.SIGKILL, STOP_KILL_WAIT)):
        running = [c for c in children if c.popen.poll() is None]
        if not running:
            break
        if sig is not None:
            killed = killed or sig == signal.SIGKILL
            for c in running:
                with contextlib.suppress(OSError):
                    c.popen.send_signal(sig)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(c.popen.poll() is None for c in running):
            time.sleep(0.02)
    return killed
