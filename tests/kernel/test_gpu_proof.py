"""The GPU proof (``python -m benchmarks.gpu``) is ready for a GPU machine: rehearsed here on CPU.

A session lent a GPU has 30 minutes of device time; the harness must not spend them on its
own bugs. On CPU the same checks run with ``--gpus none``: real kernels, real fastai, real
torchrun; only the CUDA memory readings are left out, and the report says so.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu import _uuid, records  # noqa: E402


def run_gpu_proof(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run([sys.executable, "-m", "benchmarks.gpu", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_records_are_read_from_merged_and_labelled_output():
    text = ('@@{"rank": 0, "x": 1}\n[rank 1] @@{"rank": 1, "x": 2}\n[rank 0,2] noise\n'
            'Epoch 1/1 ...\n[rank 2] @@{"rank": 2, "x": 3}\n')
    assert records(text) == {0: {"rank": 0, "x": 1}, 1: {"rank": 1, "x": 2}, 2: {"rank": 2, "x": 3}}


def test_gpu_uuids_compare_across_nvidia_smi_and_torch_spellings():
    assert _uuid("GPU-5B9C1d2e-0000-1111-2222-333344445555") == _uuid("5b9c1d2e-0000-1111-2222-333344445555")
    assert _uuid("GPU-5b9c1d2e-0000") != _uuid("5b9c1d2e-0001")


def test_without_a_gpu_it_refuses_and_says_how_to_rehearse():
    proc = run_gpu_proof("--out", "/nonexistent", timeout=120)
    assert proc.returncode == 2
    assert "No CUDA GPU here" in proc.stderr and "--rehearse" in proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_whole_gpu_proof_runs_on_cpu_as_a_rehearsal(tmp_path: Path):
    proc = run_gpu_proof("--rehearse", "--out", str(tmp_path), "--images", "48", "--image-size", "32",
                         "--bs", "16", "--epochs", "1", "--arch", "resnet18")
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "gpu.json").read_text())
    checks = {c["name"]: c for c in report["checks"]}
    assert list(checks) == ["backend", "gpus", "empty_cache", "fastai", "ddp", "lifecycle", "faults"]
    assert {n: c["ok"] for n, c in checks.items()} == {
        "backend": True, "gpus": True, "empty_cache": None, "fastai": True, "ddp": True, "lifecycle": True,
        "faults": None}

    backend = checks["backend"]["data"]["runs"]
    assert {case: sorted(recs) for case, recs in backend.items()} == {"gloo@1": ["0"], "gloo@2": ["0", "1"]}
    assert {r["sum"][0] for r in backend["gloo@2"].values()} == {3.0}
    assert "ConfigError" in checks["gpus"]["data"]["missing_gpu_error"]
    assert checks["gpus"]["data"]["agree"]["accelerate"] == checks["gpus"]["data"]["agree"]["fastai"] == "cpu"
    fastai = checks["fastai"]["data"]
    assert fastai["kernel"]["device"] == fastai["script"]["device"] == "cpu" and fastai["ratio_kernel_over_script"] > 0
    assert checks["ddp"]["data"]["kernel"]["backend"] == checks["ddp"]["data"]["torchrun"]["backend"] == "gloo"

    md = (tmp_path / "gpu.md").read_text()
    assert "no GPU (rehearsal on CPU)" in md and "python -m benchmarks.gpu --rehearse" in md
    assert "| empty_cache | not run | not run: needs CUDA |" in md
