"""A notebook's code as a script, run under torchrun: the peer a notebook's distributed run is
compared with ("the same code a user runs in a script under torchrun").

An example notebook that supports this has no magics in its code cells, tags the cells that
only make sense in the kernel (``kernel-only``: ``notebook_launcher``), and prints one line
``RESULT {json}`` with the numbers to compare. Used by the ecosystem tests (accelerate,
Transformers, Lightning, ...)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import nbformat

KERNEL_ONLY = "kernel-only"
#: how a script under torchrun ends, as torch asks: a process that exits with its group still up
#: can abort in the group's destructor ("terminate called without an active exception", seen
#: with the Transformers Trainer under torch 2.14 after the script's last line had run)
END_OF_SCRIPT = ("\nimport torch.distributed as _dist\n"
                 "if _dist.is_initialized():\n    _dist.barrier()\n    _dist.destroy_process_group()\n")


def script_of(notebook: Path) -> str:
    """The code cells of ``notebook``, in order, without its ``kernel-only`` cells."""
    nb = nbformat.read(notebook, as_version=4)
    cells = [c.source for c in nb.cells
             if c.cell_type == "code" and KERNEL_ONLY not in c.metadata.get("tags", [])]
    return "\n\n".join(cells) + "\n"


def torchrun(notebook: Path, nproc: int, workdir: Path, env: dict[str, str] | None = None,
             timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``notebook``'s script under ``torchrun --standalone --nproc-per-node nproc`` in ``workdir``,
    with the environment the kernel gives its CPU ranks (``ACCELERATE_USE_CPU``, one thread each)."""
    script = workdir / (notebook.stem + ".py")
    script.write_text(script_of(notebook) + END_OF_SCRIPT)
    full = {**os.environ, "ACCELERATE_USE_CPU": "true", "DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": "",
            "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc)), **(env or {})}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           f"--nproc-per-node={nproc}", str(script)],
                          capture_output=True, text=True, cwd=workdir, env=full, timeout=timeout)


def results(text: str) -> list[dict]:
    """Every ``RESULT {json}`` in ``text`` (one per process under torchrun, once in the kernel).

    Under torchrun the processes share one stdout pipe: ``print`` writes the text and its newline
    separately, so two processes' results can share a line. Each write is whole (a pipe keeps
    writes below 4 KiB together), so each ``RESULT {...}`` is read where it starts."""
    decoder = json.JSONDecoder()
    found, start = [], text.find("RESULT {")
    while start != -1:
        value, end = decoder.raw_decode(text, start + len("RESULT "))
        found.append(value)
        start = text.find("RESULT {", end)
    return found
