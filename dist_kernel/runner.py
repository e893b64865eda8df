"""Whole-notebook runs through nbclient, without installing a kernelspec first."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import nbformat
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager
from jupyter_core.paths import jupyter_runtime_dir
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from dist_kernel.kernelspec import kernel_json
from dist_kernel.parent.merge import strip_ansi


class _SpecManager(KernelSpecManager):
    """Gives nbclient the Distributed Python spec with the chosen options."""

    options: list[str] = []

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:  # noqa: ARG002
        return KernelSpec(**kernel_json(self.options))


def spec_manager(options: list[str]) -> KernelSpecManager:
    """A spec manager whose every spec is Distributed Python with ``options``."""
    ksm = _SpecManager()
    ksm.options = list(options)
    return ksm


def kernel_manager(options: list[str]) -> KernelManager:
    """A KernelManager that starts the distributed kernel with ``options``, over IPC sockets."""
    km = KernelManager(kernel_name="distributed-python", kernel_spec_manager=spec_manager(options))
    km.transport = "ipc"  # nothing on TCP at all, and no warning about unencrypted TCP
    runtime = jupyter_runtime_dir()
    os.makedirs(runtime, mode=0o700, exist_ok=True)
    km.ip = os.path.join(runtime, f"dist-kernel-{uuid.uuid4().hex[:12]}-ipc")
    return km


def _print_outputs(cell: nbformat.NotebookNode, index: int) -> None:
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            (sys.stderr if out.name == "stderr" else sys.stdout).write(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            text = out.get("data", {}).get("text/plain")
            if text:
                print(text)


def run_notebook(path: str, options: list[str], output: str | None = None,
                 cell_timeout: float | None = None) -> int:
    """Execute ``path`` on the distributed kernel; 0 on success, 1 naming the failing cell."""
    nb = nbformat.read(path, as_version=4)
    km = kernel_manager(options)
    client = NotebookClient(nb, km=km, timeout=cell_timeout,
                            resources={"metadata": {"path": str(Path(path).resolve().parent)}},
                            on_cell_executed=lambda cell, cell_index, **_: _print_outputs(cell, cell_index))
    status = 0
    try:
        client.execute()
    except CellExecutionError as e:
        status = 1
        failed = next((i for i, c in enumerate(nb.cells)
                       if any(o.get("output_type") == "error" for o in c.get("outputs", []))), None)
        where = f"cell {failed + 1} of {len(nb.cells)}" if failed is not None else "a cell"
        print(f"\n{path}: {where} failed: {e.ename}: {strip_ansi(e.evalue)}", file=sys.stderr)
    finally:
        if km.has_kernel:  # nbclient only shuts down kernels it created itself
            km.shutdown_kernel(now=False)
        if output:
            nbformat.write(nb, output)
            print(f"wrote {output}", file=sys.stderr)
    return status
