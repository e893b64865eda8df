"""Launching rank processes: where and how each one starts, and how it is signalled.

This is the one place that knows how a rank process comes to exist. :class:`LocalLauncher`
starts each rank on this machine through jupyter_client, on IPC sockets in the kernel's
private runtime directory, each with its own HMAC key; the next launchers (Slurm, SSH)
implement the same small interface. Everything above it (channels, formation, faults) only
sees a :class:`RankProcess` and a connected jupyter_client client.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from dataclasses import dataclass

from jupyter_client import AsyncKernelManager
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager

from dist_kernel.options import KernelConfig
from dist_kernel.placement import rank_env

#: gloo and NCCL talk over loopback: every rank of a local kernel is on this machine
LOOPBACK = "lo"


class _RankSpecManager(KernelSpecManager):
    """Hands jupyter_client the rank kernel's spec, bound to this interpreter."""

    extra_argv: list[str] = []

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:  # noqa: ARG002
        return KernelSpec(
            argv=[sys.executable, "-m", "dist_kernel.rank", "-f", "{connection_file}", *self.extra_argv],
            display_name="dist_kernel rank", language="python", interrupt_mode="signal",
        )


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


@dataclass
class RankProcess:
    """One launched rank: its kernel manager, and what the OS says about it."""

    rank: int
    km: AsyncKernelManager
    log_path: str

    @property
    def pid(self) -> int | None:
        proc = getattr(self.km.provisioner, "process", None)
        return proc.pid if proc is not None else None

    def exit_code(self) -> int | None:
        proc = getattr(self.km.provisioner, "process", None)
        return proc.poll() if proc is not None else None

    async def is_alive(self) -> bool:
        return self.km.has_kernel and await self.km.is_alive()

    async def has_exited(self) -> bool:
        """True once a started process has ended."""
        return self.km.has_kernel and not await self.km.is_alive()

    def os_state(self) -> str:
        """The process state letter from /proc (``T`` when stopped); "" when unknown."""
        pid = self.pid
        if pid is None:
            return ""
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            return ""

    def client(self):  # noqa: ANN201 - jupyter_client's AsyncKernelClient
        return self.km.client()

    def connection_info(self) -> dict:
        """Where the rank's channels are, and its HMAC key (a jupyter_client connection dict)."""
        return self.km.get_connection_info()

    async def interrupt(self) -> None:
        """SIGINT the rank's process group, as Jupyter does for a signal-mode kernel."""
        if self.km.has_kernel:
            with contextlib.suppress(Exception):
                await self.km.interrupt_kernel()

    async def shutdown(self, now: bool) -> None:
        if self.km.has_kernel:
            await self.km.shutdown_kernel(now=now)

    def kill(self) -> None:
        """SIGKILL the rank's whole process group (DataLoader workers included), synchronously."""
        pid = self.pid
        if pid is None:
            return
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)  # each rank leads its own process session
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)

    def log_tail(self, lines: int = 30) -> str:
        """The end of what the rank process wrote outside Jupyter (C-level crashes land here)."""
        return file_tail(self.log_path, lines)


def file_tail(path: str, lines: int = 30) -> str:
    """The last lines of a log file ("" when it cannot be read)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def state_words(letter: str) -> str:
    return _STATES.get(letter, f"state {letter}" if letter else "state unknown")


class LocalLauncher:
    """Starts ranks as child processes of the parent, on this machine."""

    def __init__(self, config: KernelConfig, runtime_dir: str, extra_argv: list[str] | None = None) -> None:
        self.config = config
        self.runtime_dir = runtime_dir
        self.extra_argv = list(extra_argv or [])

    def env(self, rank: int) -> dict[str, str]:
        """A rank's environment: what torchrun sets, plus the kernel's own variables."""
        cfg = self.config
        # KernelManager(env=...) replaces the whole environment; gloo and NCCL talk over loopback
        return rank_env(dict(os.environ), rank=rank, ranks_per_node=cfg.world_size, world_size=cfg.world_size,
                        master_addr="127.0.0.1", master_port=None, runtime_dir=self.runtime_dir,
                        parent_pid=os.getpid(), gpus=cfg.gpus, ifname=LOOPBACK)

    async def launch(self, rank: int) -> RankProcess:
        """Start rank ``rank``; returns once its process exists (not yet ready)."""
        ksm = _RankSpecManager()
        ksm.extra_argv = self.extra_argv
        km = AsyncKernelManager(kernel_name="dist-kernel-rank", kernel_spec_manager=ksm)
        km.transport = "ipc"
        km.ip = os.path.join(self.runtime_dir, f"rank{rank}")
        km.connection_file = os.path.join(self.runtime_dir, f"rank{rank}.json")
        km.autorestart = False  # a restarted rank could not silently rejoin the group
        proc = RankProcess(rank=rank, km=km, log_path=os.path.join(self.runtime_dir, f"rank{rank}.log"))
        with open(proc.log_path, "wb") as log_file:  # noqa: ASYNC230 - tiny local file
            await km.start_kernel(env=self.env(rank), cwd=os.getcwd(), stdout=log_file,
                                  stderr=log_file, stdin=subprocess.DEVNULL)
        return proc
