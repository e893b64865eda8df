"""The benchmark command runs end to end at tiny sizes (no timing assertions: CI machines vary)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytest.importorskip("matplotlib")
pytest.importorskip("psutil")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_quick_benchmark_writes_table_and_chart(tmp_path: Path) -> None:
    out = tmp_path / "results"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stderr[-4000:]

    sys.path.insert(0, str(ROOT))
    from benchmarks.report import SECTIONS

    md = (out / "results.md").read_text()
    for heading in SECTIONS:
        assert heading in md, f"{heading!r} missing from results.md"
    assert "| dist_kernel, 2 rank(s) |" in md
    assert "ipyparallel" in md and "nbdistributed" in md  # measured, or the reason it was not
    png = (out / "results.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    res = json.loads((out / "results.json").read_text())
    assert res["meta"]["mode"] == "quick"
    for n in ("1", "2"):
        d = res["dist"][n]
        for key in ("startup", "plain_startup", "rt", "plain_rt", "lat", "thr", "plain_thr", "train", "torchrun",
                    "cost_start", "cost_end"):
            assert key in d, f"{key} missing at {n} ranks"
        assert "error" not in d["thr"], d["thr"]
