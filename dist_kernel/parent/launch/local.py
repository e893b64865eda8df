"""The gang launcher of one machine: each rank a child process of the parent.

:class:`LocalLauncher` starts each rank through jupyter_client (on IPC sockets in the kernel's
private runtime directory, each with its own HMAC key) and signals it through
``km.provisioner``; :class:`ProcessEvents` hears the ranks exit, stop and continue as events.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable

from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager

from dist_kernel.cleanup import kill_rank_processes
from dist_kernel.options import KernelConfig
from dist_kernel.parent.launch.base import GangLauncher, RankHandle
from dist_kernel.parent.reaper import write_pids
from dist_kernel.parent.wire import SocketWire, Wire
from dist_kernel.placement import rank_env
from dist_kernel.processes import describe_exit, file_tail, proc_state, signal_main_thread

#: gloo and NCCL talk over loopback: every rank of a local kernel is on this machine
LOOPBACK = "lo"
#: at most this many local ranks start at once (process start to answering kernel_info): a
#: kernel with many ranks must not starve its own parent, which answers the frontend
START_WAVE = max(4, (os.cpu_count() or 1) // 2)


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

    def unwatch(self, pid: int) -> None:
        """No longer hear ``pid`` (a rank being ended on purpose)."""
        self._forget(pid)

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

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
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
            self._pid = provisioner.pid  # type: ignore[attr-defined]  # LocalProvisioner's, the only one used here
        return self._pid

    async def poll(self) -> int | None:
        provisioner = self.km.provisioner
        if self.returncode is None and provisioner is not None and provisioner.has_process:
            self.returncode = await provisioner.poll()
        return self.returncode

    async def send_signal(self, signum: int) -> None:
        if self.km.provisioner is not None and self.returncode is None:
            try:
                # a stopped rank, once resumed, may hand the group's SIGINT to another thread,
                # which would leave the cell running: it gets one, to its main thread, instead
                # (one only: a second SIGINT could interrupt the user's own except clause)
                if not (signum == signal.SIGINT and self.pid is not None and proc_state(self.pid) in ("T", "t")
                        and signal_main_thread(self.pid, signum)):
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
        info = dict(self.km.get_connection_info(session=False))
        return info, SocketWire(info)

    async def shutdown(self, now: bool) -> None:
        """A shutdown request, then the provisioner's kill (jupyter_client's own sequence)."""
        if self.km.has_kernel:
            await self.km.shutdown_kernel(now=now)

    async def forget(self) -> None:
        """Once the process is gone: collect it, and remove its sockets and connection file."""
        await self.poll()
        with contextlib.suppress(Exception):
            await self.km._async_cleanup_resources()  # private jupyter_client API (8.x): no public async one


class LocalLauncher(GangLauncher):
    """Starts ranks as child processes of the parent, on this machine, in waves."""

    wave = START_WAVE

    def __init__(self, config: KernelConfig, runtime_dir: str, extra_argv: list[str], log: logging.Logger,
                 on_note: Callable[[str], None]) -> None:
        self.config = config
        self.runtime_dir = runtime_dir
        self.extra_argv = list(extra_argv)
        self.log = log
        self.on_note = on_note  # nothing to wait for here: ranks on this machine start at once
        self.ranks: dict[int, LocalRank] = {}
        self._exits = ProcessEvents(self._changed_pid)
        self.watches = self._exits.available
        self._burials: dict[int, asyncio.Future] = {}  # a dead rank's pid -> the end of what it left

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
        """Start rank ``rank``; returns once its process exists (not yet ready). A rank that ran
        before (dead, now started anew) first has its sockets and connection file removed."""
        old = self.ranks.pop(rank, None)
        if old is not None:
            await old.forget()
            await self._bury(old)  # before the new one starts: it carries the same rank number
        ksm = _RankSpecManager()
        ksm.extra_argv = self.extra_argv
        km = AsyncKernelManager(kernel_name="dist-kernel-rank", kernel_spec_manager=ksm)
        km.transport = "ipc"
        km.ip = os.path.join(self.runtime_dir, f"rank{rank}")
        km.connection_file = os.path.join(self.runtime_dir, f"rank{rank}.json")
        km.autorestart = False  # a restarted rank could not silently rejoin the group
        handle = LocalRank(rank, km, os.path.join(self.runtime_dir, f"rank{rank}.log"))
        self.ranks[rank] = handle
        # appended: a rank started anew keeps what its dead predecessor wrote
        with open(handle.log_path, "ab") as log_file:  # noqa: ASYNC230 - tiny local file
            await km.start_kernel(env=self.env(rank), cwd=os.getcwd(), stdout=log_file,
                                  stderr=log_file, stdin=subprocess.DEVNULL)
        if handle.pid is not None:
            self._exits.watch(handle.pid)
        self.record()
        return handle

    async def end(self, rank: int) -> None:
        handle = self.ranks.pop(rank, None)  # forgotten first: its exit is no news
        if handle is None:
            return
        if handle.pid is not None:
            self._exits.unwatch(handle.pid)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(handle.shutdown(now=False), timeout=5)
        await handle.kill()
        await handle.forget()
        await self._bury(handle)
        self.record()

    def died(self, handle: RankHandle) -> None:
        if handle.pid is not None and handle.pid not in self._burials:
            self._burials[handle.pid] = asyncio.get_running_loop().run_in_executor(
                None, kill_rank_processes, self.runtime_dir, handle.rank, handle.pid,
                [p for p in self._live_pids() if p != handle.pid])

    async def _bury(self, handle: LocalRank) -> None:
        """End what a rank that is gone left (:func:`cleanup.kill_rank_processes`), once: the
        burial its death began, or one now."""
        if handle.pid is None:
            return
        self.died(handle)
        with contextlib.suppress(Exception):
            await self._burials.pop(handle.pid)

    def _live_pids(self) -> list[int]:
        return [p for h in self.ranks.values() if h.returncode is None and (p := h.pid) is not None]

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
