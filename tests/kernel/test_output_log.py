"""The kernel's output log (issue 35, item 5): it holds a running cell's merged output before the
cell ends, where the user finds it, owner-only, and after the kernel is gone."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest
from harness import DistKernel, Output
from jupyter_core.paths import jupyter_runtime_dir

pytestmark = pytest.mark.slow


def wait_for(what, timeout: float = 60, every: float = 0.1):
    """``what()`` once it is truthy; fails after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = what()
        if value or time.monotonic() > deadline:
            assert value, f"not within {timeout}s"
            return value
        time.sleep(every)


def test_the_log_holds_a_running_cells_merged_output_and_outlives_the_kernel(tmp_path):
    mark = tmp_path / "go-on"
    k = DistKernel("--ranks", "2")
    try:
        status = k.execute("%dist_status").of_type("display_data")[0].text
        line = next(s for s in status.splitlines() if s.startswith("output log: "))
        path = line.removeprefix("output log: ").split(" (rotated")[0]
        # in Jupyter's runtime directory, named after the kernel's connection file; owner-only
        connection = Path(k.km.connection_file)
        assert Path(path) == Path(jupyter_runtime_dir()) / "dist_kernel" / (connection.stem + ".log")
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(Path(path).parent).st_mode) == 0o700
        seen: list[str] = []

        def logged() -> str:
            text = Path(path).read_text()
            return text if "[rank 1] from 1" in text else ""

        def read_while_running(out: Output) -> None:
            if "[rank 1] from 1" in out.text and not seen:  # the cell's merged output reached us
                seen.append(wait_for(logged))
                mark.touch()  # only now may the cell end

        cell = (f"import os, time\nprint('the same on every rank', flush=True)\nprint(f'from {{rank}}', flush=True)\n"
                f"while not os.path.exists({str(mark)!r}):\n    time.sleep(0.05)\nprint('after')")
        res = k.execute(cell, on_output=read_while_running)
        assert res.status == "ok", res.explain()
        (during,) = seen
        # the running cell: its number and start, its output merged as in the notebook, no end yet
        running = during.split("── In [2] · ", 1)[1]
        assert running.split("──\n", 1)[1] == "the same on every rank\n[rank 0] from 0\n[rank 1] from 1\n"
        assert "print('after')" not in during and "after\n" not in during
    finally:
        k.shutdown()
    text = Path(path).read_text()  # still there once the kernel is gone
    assert "[rank 1] from 1\nafter\n── In [2] done in " in text
    assert "kernel ended" in text.splitlines()[-1]
