"""The launcher seam: how a gang of rank processes comes to exist, is signalled and ends.

The supervisor sees only this interface. A :class:`GangLauncher` starts the ranks
(:meth:`~GangLauncher.start`, in waves of at most :attr:`~GangLauncher.wave` ranks that are
starting at once), signals them, stops them, and says what an outsider needs to end them
(:meth:`~GangLauncher.state`). Each rank is a :class:`RankHandle` whose methods carry
jupyter_client's provisioner names (``poll``, ``send_signal``, ``kill``, ``terminate``), and
a :class:`~dist_kernel.parent.channels.Wire` the rank's channel talks over.

:class:`LocalLauncher` starts each rank on this machine through jupyter_client (on IPC
sockets in the kernel's private runtime directory, each with its own HMAC key) and signals it
through ``km.provisioner``; :class:`~dist_kernel.parent.remote.RemoteLauncher` starts node
agents through Slurm or SSH, which start the ranks.
"""

from __future__ import annotations

import abc
import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager

from dist_kernel.options import KernelConfig
from dist_kernel.parent.channels import SocketWire, Wire
from dist_kernel.parent.fault_policy import RemoteCause
from dist_kernel.parent.reaper import write_pids
from dist_kernel.placement import rank_env

#: gloo and NCCL talk over loopback: every rank of a local kernel is on this machine
LOOPBACK = "lo"
#: at most this many local ranks start at once (process start to answering kernel_info): a
#: kernel with many ranks must not starve its own parent, which answers the frontend
START_WAVE = max(4, (os.cpu_count() or 1) // 2)


class RankHandle(Protocol):
    """One launched rank, as a launcher hands it out; provisioner method names."""

    rank: int
    #: what ``poll()`` last saw: the exit code (negative: the signal), None while it runs
    returncode: int | None

    @property
    def pid(self) -> int | None: ...
    @property
    def host(self) -> str:
        """The machine of a rank on another machine ("" on this one)."""
    @property
    def address(self) -> str:
        """That machine's cluster address ("" on this one): how its peers are named."""

    async def poll(self) -> int | None: ...
    async def send_signal(self, signum: int) -> None: ...
    async def kill(self) -> None: ...
    async def terminate(self) -> None: ...
    def exit_reason(self) -> str:
        """Why it is gone, in words, as of the last ``poll()``; "" while it runs."""
    def os_state(self) -> str:
        """The process state letter (``T`` when stopped); "" when unknown."""
    def log_tail(self, lines: int = 30) -> str: ...
    def wire(self) -> tuple[dict, Wire]:
        """The rank's Jupyter connection info (its HMAC key) and the wire to its channels."""


class GangLauncher(abc.ABC):
    """Starts, signals and ends the ranks of one kernel."""

    #: how many ranks may be starting at once (:data:`START_WAVE` on one machine)
    wave: int

    #: told of a fault that takes the whole gang (a node lost, the launcher gone): the supervisor
    #: hears for a moment, names the cause and stops every rank
    on_fault: Callable[[RemoteCause], None] = staticmethod(lambda cause: None)  # type: ignore[assignment]

    #: told when one rank's process may have changed (exited, stopped, continued): the supervisor
    #: looks at that rank alone, so an idle parent costs nothing per rank (issue 26)
    on_change: Callable[[RankHandle], None] = staticmethod(lambda handle: None)  # type: ignore[assignment]

    #: whether :attr:`on_change` hears every change; if not, the supervisor polls every rank
    watches = False

    @abc.abstractmethod
    def start(self, ranks: int) -> AsyncIterator[RankHandle]:
        """Start ``ranks`` ranks, yielding each handle once its process exists. The caller
        takes the next one only when a wave slot is free: taking it launches it."""

    @abc.abstractmethod
    async def stop(self, now: bool = False) -> None:
        """End every rank (``now``: no shutdown request first); idempotent."""

    @abc.abstractmethod
    def stop_now(self) -> None:
        """Last resort from any thread (atexit, SIGTERM): end what can be ended without waiting."""

    async def signal(self, ranks: list[RankHandle], signum: int) -> None:
        """Send ``signum`` to these ranks (their process groups: workers too)."""
        for handle in ranks:
            await handle.send_signal(signum)

    @abc.abstractmethod
    def store(self, generation: int) -> str:
        """Where formation number ``generation`` of the group meets (``Join.store``)."""

    def failure(self) -> str | None:
        """How the launcher itself failed (srun/ssh ended), or None."""
        return None

    @abc.abstractmethod
    def state(self) -> dict:
        """What an outsider (the reaper, the next kernel's sweep) needs to end this gang."""

    @abc.abstractmethod
    def record(self) -> None:
        """Write :meth:`state` where the reaper reads it."""


def describe_exit(code: int | None) -> str:
    """Human words for a process exit status."""
    if code is None:
        return "exited"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (often the out-of-memory killer)" if -code == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {code}"


#: /proc/PID/stat states, in words
_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O (D)", "T": "stopped",
           "t": "stopped by a debugger", "Z": "a zombie", "X": "dead"}


def state_words(letter: str) -> str:
    return _STATES.get(letter, f"state {letter}" if letter else "state unknown")


def proc_state(pid: int | None) -> str:
    """A process's state letter from /proc (``T`` when stopped); "" when unknown."""
    if pid is None:
        return ""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def file_tail(path: str, lines: int = 30) -> str:
    """The last lines of a log file ("" when it cannot be read)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


# ============================================================================ this machine
class ProcessEvents:
    """Hears the parent's own child processes change, without polling them (issue 26).

    An exit wakes the event loop through the process's pidfd (Linux 5.3+), naming the process
    at once; a stop (SIGSTOP, a debugger) and a continue arrive as SIGCHLD, after which
    ``waitid`` names each child that stopped or continued. Neither reaps a process: jupyter_client's
    ``poll()`` still collects the exit code. ``available`` is False where either is missing
    (another OS, a loop off the main thread): the supervisor then polls as before.
    """

    def __init__(self, on_event: Callable[[int], None]) -> None:
        self.on_event = on_event
        self._fds: dict[int, int] = {}  # pid -> pidfd
        self._loop: asyncio.AbstractEventLoop | None = None
        self.available = hasattr(os, "pidfd_open") and hasattr(os, "waitid") and hasattr(signal, "SIGCHLD")

    def watch(self, pid: int) -> None:
        """Hear ``pid``'s exit, stops and continues (``pid`` is a child of this process)."""
        if not self.available:
            return
        loop = asyncio.get_running_loop()
        try:
            if self._loop is None:
                loop.add_signal_handler(signal.SIGCHLD, self._stopped_or_continued)
                self._loop = loop
            fd = os.pidfd_open(pid)
        except (OSError, ValueError, RuntimeError, NotImplementedError):
            self.available = False  # the supervisor polls; an exit already gone is seen there too
            return
        self._fds[pid] = fd
        loop.add_reader(fd, self._exited, pid)

    def _exited(self, pid: int) -> None:
        self._forget(pid)
        self.on_event(pid)

    def _stopped_or_continued(self) -> None:
        flags = os.WSTOPPED | os.WCONTINUED | os.WNOHANG  # no WEXITED: exits stay for poll() to reap
        while True:
            try:
                info = os.waitid(os.P_ALL, 0, flags)
            except ChildProcessError:
                return
            if info is None:
                return
            if info.si_pid in self._fds:
                self.on_event(info.si_pid)

    def _forget(self, pid: int) -> None:
        fd = self._fds.pop(pid, None)
        if fd is not None:
            if self._loop is not None:
                self._loop.remove_reader(fd)
            os.close(fd)

    def close(self) -> None:
        """Stop hearing (the ranks are being ended: their exits are no news)."""
        for pid in list(self._fds):
            self._forget(pid)
        if self._loop is not None:
            self._loop.remove_signal_handler(signal.SIGCHLD)
            self._loop = None


class _RankSpecManager(KernelSpecManager):
    """Hands jupyter_client the rank kernel's spec, bound to this interpreter."""

    extra_argv: list[str] = []

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:  # noqa: ARG002
        return KernelSpec(
            argv=[sys.executable, "-m", "dist_kernel.rank", "-f", "{connection_file}", *self.extra_argv],
            display_name="dist_kernel rank", language="python", interrupt_mode="signal",
        )


class LocalRank:
    """A rank on this machine: a jupyter_client kernel manager, signalled through its provisioner
    (which signals the rank's process group: it leads its own session, DataLoader workers included)."""

    host = ""
    address = ""

    def __init__(self, rank: int, km: AsyncKernelManager, log_path: str) -> None:
        self.rank = rank
        self.km = km
        self.log_path = log_path
        self.returncode: int | None = None
        self._pid: int | None = None

    @property
    def pid(self) -> int | None:
        provisioner = self.km.provisioner
        if self._pid is None and provisioner is not None:
            self._pid = provisioner.pid
        return self._pid

    async def poll(self) -> int | None:
        provisioner = self.km.provisioner
        if self.returncode is None and provisioner is not None and provisioner.has_process:
            self.returncode = await provisioner.poll()
        return self.returncode

    async def send_signal(self, signum: int) -> None:
        if self.km.provisioner is not None and self.returncode is None:
            try:
                await self.km.provisioner.send_signal(signum)
            except OSError:  # gone meanwhile: poll() says so
                pass

    async def kill(self) -> None:
        if self.km.provisioner is not None:
            await self.km.provisioner.kill()

    async def terminate(self) -> None:
        if self.km.provisioner is not None:
            await self.km.provisioner.terminate()

    def exit_reason(self) -> str:
        return describe_exit(self.returncode) if self.returncode is not None else ""

    def os_state(self) -> str:
        return proc_state(self.pid)

    def log_tail(self, lines: int = 30) -> str:
        """The end of what the rank process wrote outside Jupyter (C-level crashes land here)."""
        return file_tail(self.log_path, lines)

    def wire(self) -> tuple[dict, Wire]:
        info = self.km.get_connection_info(session=False)
        return info, SocketWire(info)

    async def shutdown(self, now: bool) -> None:
        """A shutdown request, then the provisioner's kill (jupyter_client's own sequence)."""
        if self.km.has_kernel:
            await self.km.shutdown_kernel(now=now)


class LocalLauncher(GangLauncher):
    """Starts ranks as child processes of the parent, on this machine, in waves."""

    wave = START_WAVE

    def __init__(self, config: KernelConfig, runtime_dir: str, extra_argv: list[str] | None = None) -> None:
        self.config = config
        self.runtime_dir = runtime_dir
        self.extra_argv = list(extra_argv or [])
        self.ranks: dict[int, LocalRank] = {}
        self._exits = ProcessEvents(self._changed_pid)
        self.watches = self._exits.available

    def _changed_pid(self, pid: int) -> None:
        handle = next((h for h in self.ranks.values() if h.pid == pid), None)
        if handle is not None:
            self.on_change(handle)

    def env(self, rank: int) -> dict[str, str]:
        """A rank's environment: what torchrun sets, plus the kernel's own variables."""
        cfg = self.config
        # KernelManager(env=...) replaces the whole environment; gloo and NCCL talk over loopback
        return rank_env(dict(os.environ), rank=rank, ranks_per_node=cfg.world_size, world_size=cfg.world_size,
                        master_addr="127.0.0.1", master_port=None, runtime_dir=self.runtime_dir,
                        parent_pid=os.getpid(), gpus=cfg.gpus, ifname=LOOPBACK)

    async def start(self, ranks: int) -> AsyncIterator[LocalRank]:
        for rank in range(ranks):
            yield await self.launch(rank)

    async def launch(self, rank: int) -> LocalRank:
        """Start rank ``rank``; returns once its process exists (not yet ready)."""
        ksm = _RankSpecManager()
        ksm.extra_argv = self.extra_argv
        km = AsyncKernelManager(kernel_name="dist-kernel-rank", kernel_spec_manager=ksm)
        km.transport = "ipc"
        km.ip = os.path.join(self.runtime_dir, f"rank{rank}")
        km.connection_file = os.path.join(self.runtime_dir, f"rank{rank}.json")
        km.autorestart = False  # a restarted rank could not silently rejoin the group
        handle = LocalRank(rank, km, os.path.join(self.runtime_dir, f"rank{rank}.log"))
        self.ranks[rank] = handle
        with open(handle.log_path, "wb") as log_file:  # noqa: ASYNC230 - tiny local file
            await km.start_kernel(env=self.env(rank), cwd=os.getcwd(), stdout=log_file,
                                  stderr=log_file, stdin=subprocess.DEVNULL)
        if handle.pid is not None:
            self._exits.watch(handle.pid)
        self.record()
        return handle

    def store(self, generation: int) -> str:
        """A file in the private runtime dir (mode 0700): no port, no race, no collision."""
        return os.path.join(self.runtime_dir, f"store-{generation}")

    async def stop(self, now: bool = False) -> None:
        async def one(handle: LocalRank) -> None:
            # a stopped rank cannot answer a shutdown request: don't wait for one
            stopped = proc_state(handle.pid) in ("T", "t")
            try:
                await asyncio.wait_for(handle.shutdown(now=now or stopped), timeout=3 if now else 5)
            except Exception:  # noqa: BLE001 - the kill below ends it in any case
                pass
            await handle.kill()

        self._exits.close()
        await asyncio.gather(*(one(h) for h in self.ranks.values()), return_exceptions=True)

    def stop_now(self) -> None:
        """Nothing to do without a loop: the supervisor's sweep of the kernel's processes
        (cleanup.kill_kernel_processes: the ranks' sessions and groups, and what escaped them)
        SIGKILLs every rank synchronously."""

    def state(self) -> dict:
        return {"ranks": [p for p in (h.pid for h in self.ranks.values()) if p]}

    def record(self) -> None:
        write_pids(self.runtime_dir, self.state()["ranks"])
