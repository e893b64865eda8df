"""The benchmark command runs end to end at tiny sizes (no timing assertions: CI machines vary)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

# the benchmarks draw with matplotlib ([bench]) and sample with psutil (a base dependency); both are
# installed wherever the tests run, so a missing one fails this file at once instead of skipping it
import matplotlib  # noqa: F401
import psutil  # noqa: F401
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(420)  # ~2 min
def test_quick_benchmark_writes_table_and_chart(tmp_path: Path) -> None:
    out = tmp_path / "results"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    # section 8 runs on the cluster lab, which this lane leaves to the cluster lane (running beside
    # it): tests/cluster/test_cluster_benchmark.py checks that section measured
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--no-cluster", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=410)
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
    assert list(res["dist"]) == ["2"]  # --quick: one rank count, the same code as several
    for n in res["dist"]:
        d = res["dist"][n]
        for key in ("startup", "plain_startup", "rt", "plain_rt", "lat", "thr", "plain_thr", "train", "torchrun",
                    "cost_start", "cost_end"):
            assert key in d, f"{key} missing at {n} ranks"
        assert "error" not in d["thr"], d["thr"]
    _check_idle(res)
    assert res["cluster"] == {"error": "not run: --no-cluster"} and "not run: --no-cluster" in md


def _check_idle(res: dict) -> None:
    """Section 7's numbers have the right shape: every process, totals and per-thread rows."""
    idle = res["idle"]
    assert idle["window_s"] > 0
    procs = idle["procs"]
    assert {"plain ipykernel", "rank 0", "rank 1", "dist_kernel parent"} <= set(procs), list(procs)
    for label, v in procs.items():
        assert v["pid"] > 0 and v["threads"], label
        assert v["cpu_per_s"] >= 0 and v["wakeups_per_s"] >= 0, (label, v)
        for t in v["threads"]:
            assert {"tid", "comm", "name", "cpu_per_s", "sched_cpu_per_s", "wakeups_per_s"} <= set(t), t
    # the rank and the plain kernel ran the cell that names their Python threads
    assert any(t["name"] == "MainThread" for t in procs["rank 0"]["threads"])
    assert any(t["name"] == "MainThread" for t in procs["plain ipykernel"]["threads"])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_idle_only_writes_its_section(tmp_path: Path) -> None:
    out = tmp_path / "idle"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--only", "idle", "--idle-window", "0.5",
                           "--out", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-4000:]

    sys.path.insert(0, str(ROOT))
    from benchmarks.report import IDLE_SECTION

    md = (out / "idle.md").read_text()
    assert IDLE_SECTION in md and "| rank 0 |" in md and "idle rank wakeups/s <= plain" in md
    assert not (out / "results.md").exists()  # --only leaves a whole run's files alone
    res = json.loads((out / "idle.json").read_text())
    assert res["meta"]["only"] == "idle" and not res["dist"]
    _check_idle(res)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_scale_benchmark_writes_its_table_json_and_chart(tmp_path: Path) -> None:
    out = tmp_path / "scale"
    out.mkdir()
    # the results page also holds the simulated ranks' block and prose: the benchmark rewrites its own block only
    kept = "Prose about the runs.\n\n<!-- sim:begin -->\nthe simulated ranks' table\n<!-- sim:end -->\n"
    (out / "scale.md").write_text(kept)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.scale", "--ranks", "2", "--reps", "10", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads((out / "scale.json").read_text())
    row = res["rows"]["2"]
    for key in ("x = 1", "%%rank 0", "print(1)", "plain", "ipyparallel"):
        assert row[key]["n"] == 10, (key, row[key])
    assert row["parent_cpu_ms_per_cell"] > 0 and row["ratio_to_ipyparallel"] > 0
    md = (out / "scale.md").read_text()
    assert "| 2 |" in md and "store_history=True" in md and md.startswith(kept)
    assert (out / "scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_output_log_benchmark_writes_its_table_and_json(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "benchmarks.output_log", "--quick", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads((tmp_path / "output_log.json").read_text())["rows"]
    assert [r["cell"] for r in rows] == ["x = 1", "2,000 lines, labelled per rank", "`\\r` bar, 500 frames"]
    assert all(r["rt_ms_on"] > 0 and r["rt_ms_off"] > 0 and r["cpu_ratio"] > 0 for r in rows)
    assert "| x = 1 |" in (tmp_path / "output_log.md").read_text()
