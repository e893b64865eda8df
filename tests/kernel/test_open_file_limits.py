"""A kernel whose process may open too few files for its ranks raises its own limit, or says
which limit stops it: never "Too many open files" half-way through the ranks' start (issue 26)."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from dist_kernel.parent.limits import fds_needed

RANKS = 4
#: enough for the runner and the parent kernel themselves, too few for RANKS ranks
LOW = 110


def _run_with_open_files(soft: int, hard: int, tmp_path: Path) -> subprocess.CompletedProcess:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(
        "import resource, torch.distributed as dist\n"
        "dist.all_reduce(t := __import__('torch').ones(1))\n"
        "print(world_size, int(t.item()), resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= 0)")]
    path = tmp_path / "limits.ipynb"
    nbformat.write(nb, path)

    def limit() -> None:  # inherited by the runner, the kernel and its ranks
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return subprocess.run([sys.executable, "-m", "dist_kernel", "run", str(path), "--ranks", str(RANKS),
                           "--output", str(tmp_path / "out.ipynb")],
                          preexec_fn=limit, capture_output=True, text=True, timeout=240)


@pytest.mark.timeout(300)
def test_a_soft_limit_too_low_for_the_ranks_is_raised_and_every_rank_starts(tmp_path: Path) -> None:
    assert fds_needed(RANKS) > LOW
    proc = _run_with_open_files(LOW, 4096, tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = nbformat.read(tmp_path / "out.ipynb", as_version=4)
    text = "".join(o.get("text", "") for o in out.cells[0].outputs)
    assert text == f"{RANKS} {RANKS} True\n", text


@pytest.mark.timeout(300)
def test_a_hard_limit_too_low_for_the_ranks_is_a_clear_error_naming_it(tmp_path: Path) -> None:
    proc = _run_with_open_files(LOW, LOW, tmp_path)
    assert proc.returncode != 0
    said = proc.stdout + proc.stderr
    assert f"--ranks {RANKS} on this machine needs" in said and f"hard limit is {LOW}" in said, said[-3000:]
    assert "ulimit -Hn" in said
    assert "Too many open files" not in said
