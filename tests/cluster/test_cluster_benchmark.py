"""The benchmark's section 8 runs end to end on the lab's two nodes (no timing assertions).

The kernel lane's smoke test (tests/kernel/test_benchmarks_smoke.py) runs every other section with
``--no-cluster``: the lab is this lane's, and the two lanes run side by side.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(420)  # ~1.5 min alone
def test_section_8_measures_the_kernel_and_torchrun_across_the_two_nodes(lab, tmp_path: Path) -> None:
    out = tmp_path / "cluster"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--only", "cluster", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=410)
    assert proc.returncode == 0, proc.stderr[-4000:]
    c = json.loads((out / "cluster.json").read_text())["cluster"]
    md = (out / "cluster.md").read_text()
    assert "error" not in c, c["error"]
    ssh = c["launchers"]["ssh"]
    assert "error" not in ssh, ssh["error"]
    for key in ("startup", "rt", "local_rt", "lat", "train"):
        assert key in ssh, f"{key} missing for the ssh kernel"
    assert ssh["hosts"] == "[rank 0] n1\n[rank 1] n2\n", ssh["hosts"]  # it really ran on the two nodes
    for side in ("kernel", "torchrun"):  # DDP across the nodes, in the kernel and under torchrun --nnodes 2
        assert ssh["train"][side].get("world_size") == 2, ssh["train"]
        assert c["local"]["train"][side].get("world_size") == 2, c["local"]["train"]
    assert "| ssh, 2 nodes x 1 rank |" in md and "torchrun --nnodes 2" in md
