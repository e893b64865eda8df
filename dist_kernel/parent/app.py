"""The parent kernel's process: the ipykernel application around :class:`DistributedKernel`,
its signals, and :func:`launch`, what kernel.json's argv runs (``python -m dist_kernel kernel``).

Apart from ``kernel.py`` so that the kernel's handlers are read without the process around them.
"""

from __future__ import annotations

import asyncio
import signal
import time
from typing import Any

import psutil
from traitlets import Any as AnyTrait

from dist_kernel.exceptions import ConfigError
from dist_kernel.iopub import UnboundedIOPubApp
from dist_kernel.options import KernelConfig
from dist_kernel.parent.kernel import DistributedKernel, ignore_sigterm
from dist_kernel.parent.output_log import OutputLog


class DistributedKernelApp(UnboundedIOPubApp):
    """IPKernelApp that runs :class:`DistributedKernel` and keeps its own prints off IOPub."""

    name = "dist-kernel"
    kernel_class = DistributedKernel
    outstream_class = None  # type: ignore[assignment]  # a trait that allows None: the parent's own prints go to its log, never into a cell
    dist_config = AnyTrait(None)
    rank_argv = AnyTrait(None)  # kernel arguments from the frontend, for the ranks too

    def init_control(self, context: Any) -> None:
        super().init_control(context)
        # no subshells: shell messages are handled on the main loop, where the rank clients live
        # private ipykernel API, written for ipykernel 7.4 (pyproject caps it below 8)
        self.shell_channel_thread = None

    def init_signal(self) -> None:
        # SIGINT reaching the parent (signal-mode frontends, a terminal) interrupts the ranks
        # instead of killing the parent; SIGTERM ends the ranks before the parent goes.
        def on_sigint(*_: Any) -> None:
            kernel = self.kernel
            if kernel is not None and kernel._main_loop is not None and kernel.ranks is not None:
                kernel._main_loop.call_soon_threadsafe(
                    lambda: asyncio.ensure_future(kernel._interrupt_busy()))

        def on_sigterm(*_: Any) -> None:
            ignore_sigterm()
            kernel = self.kernel
            if kernel is not None and kernel.ranks is not None:
                kernel.ranks.cleanup_sync()
            raise SystemExit(0)

        signal.signal(signal.SIGINT, on_sigint)
        signal.signal(signal.SIGTERM, on_sigterm)

    def init_kernel(self) -> None:
        super().init_kernel()
        self.kernel.dist_config = self.dist_config
        self.kernel.extra_argv = list(self.rank_argv or [])
        self.kernel.output_log = OutputLog.open(self.abs_connection_file, self.dist_config)


def launch(connection_file: str, config: KernelConfig | ConfigError, extra_argv: list[str] | None = None) -> None:
    """Start the parent kernel (what kernel.json's argv runs)."""
    started = time.monotonic()
    app = DistributedKernelApp.instance(dist_config=config, rank_argv=list(extra_argv or []))
    app.initialize(["-f", connection_file, *(extra_argv or [])])
    # imports and the interpreter's own start come before this function: count from the process's start
    since_exec = time.time() - psutil.Process().create_time()
    app.log.info("dist_kernel parent initialised in %.3fs (%.2fs since the process started)",
                 time.monotonic() - started, since_exec)
    app.start()


