"""The kernelspec that starts the parent kernel: one definition for `install`, `run` and tests."""

from __future__ import annotations

import importlib.util
import sys

DEFAULT_NAME = "distributed-python"
DEFAULT_DISPLAY_NAME = "Distributed Python"


def kernel_argv(options: list[str], executable: str | None = None) -> list[str]:
    """The argv a kernelspec uses to start the parent kernel."""
    return [executable or sys.executable, "-m", "dist_kernel", "kernel", "-f", "{connection_file}", *options]


def kernel_json(options: list[str], display_name: str = DEFAULT_DISPLAY_NAME,
                executable: str | None = None) -> dict:
    return {
        "argv": kernel_argv(options, executable),
        "display_name": display_name,
        "language": "python",
        # the parent is never signalled: it receives interrupt_request and SIGINTs the busy ranks
        "interrupt_mode": "message",
        # JupyterLab's debugger, on one rank (parent/debugger.py): where the ranks' Python has debugpy
        "metadata": {"debugger": importlib.util.find_spec("debugpy") is not None},
    }
