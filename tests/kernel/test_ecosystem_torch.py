"""Lightning, FSDP2 + torch.distributed.checkpoint, torch.compile + DistributedSampler, DeepSpeed: the
example notebooks, unchanged, on real ranks (real kernel, gloo on CPU), against the same cells
run as a script under ``torchrun --nproc-per-node 2``.

Each test runs one notebook through nbclient at 2 ranks with cells appended that report each
rank's evidence as ``DKTEST {json}`` lines, then the same cells (notebook + probe) as a script
under torchrun, and compares: each rank's share of the data, replicas equal, results equal
within tolerance. ``python -m dist_kernel run`` runs the four notebooks at 4 ranks.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from dist_kernel.runner import kernel_manager

ROOT = Path(__file__).parents[2]
EXAMPLES = ROOT / "examples"


@pytest.fixture(scope="module", autouse=True)
def _venv_extension_cache():
    """DeepSpeed's shm op in a JIT cache of this venv's own, for the kernel and torchrun alike (as
    ``benchmarks/torch_train.py`` does). torch's default cache is one per user that every venv shares,
    and the op's build file names the venv: after a run from another checkout's venv the test rebuilt
    the op (28 s alone, over 100 s beside the lane's other workers). Setting up builds it there
    (``.ci/build-deepspeed-op.sh``, the README's first command); without that the first run does."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TORCH_EXTENSIONS_DIR", os.environ.get("TORCH_EXTENSIONS_DIR")
                  or os.path.join(sys.prefix, "torch_extensions"))
        yield
_LINE = re.compile(r"DKTEST (?P<json>\{.*\})$", re.M)  # a rank label or a progress bar may come first

#: what the kernel defines before the first cell, as a script defines it under torchrun
#: (Lightning forms the group itself in ``fit``: its script does not)
SCRIPT_HEAD = "import os\nrank, world_size = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])\n"
SCRIPT_GROUP = "import torch.distributed as dist\ndist.init_process_group('gloo')\n"
SCRIPT_TAIL = "\nimport torch.distributed as dist\ndist.barrier()\ndist.destroy_process_group()\n"

LIGHTNING_PROBE = """\
import json, multiprocessing, psutil
print('DKTEST', json.dumps(dict(
    rank=rank, rows=model.train_rows, params=flat.tolist(), val_loss=metrics[0]['val_loss'],
    preds=len(preds), preds_ordered=bool(torch.allclose(ordered, expected, atol=1e-6)),
    strategy=type(trainer.strategy).__name__, env=type(trainer.strategy.cluster_environment).__name__,
    world=trainer.world_size, global_rank=trainer.global_rank,
    children=len(psutil.Process().children()) + len(multiprocessing.active_children()))))
"""
FSDP_PROBE = """\
import json
print('DKTEST', json.dumps(dict(rank=rank, local_rows=local.shape[0], full=flat.tolist(), loaded_same=bool(same),
      sharded=type(model[0].weight).__name__)))
"""
COMPILE_PROBE = """\
import json
print('DKTEST', json.dumps(dict(rank=rank, per_epoch=[len(s) for s in seen], seen=seen, params=flat.tolist(),
      compiled=type(compiled).__name__)))
"""
DEEPSPEED_PROBE = """\
import json
print('DKTEST', json.dumps(dict(rank=rank, share=share, total=total, params=flat.tolist(),
      optimizer=type(optimizer).__name__, stage=engine.zero_optimization_stage())))
"""


def code_cells(name: str) -> list[str]:
    return [c.source for c in nbformat.read(EXAMPLES / name, as_version=4).cells if c.cell_type == "code"]


def events(text: str) -> dict[int, dict]:
    """Each rank's DKTEST report, by rank."""
    found = [json.loads(m["json"]) for m in _LINE.finditer(text)]
    return {e["rank"]: e for e in found}


def in_kernel(name: str, probe: str, ranks: int = 2) -> tuple[list, dict[int, dict]]:
    """Run the notebook + probe through nbclient; its cells and each rank's report."""
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell(probe))
    client = NotebookClient(nb, km=kernel_manager(["--ranks", str(ranks)]), timeout=300,
                            resources={"metadata": {"path": str(EXAMPLES)}})
    client.execute()
    text = "".join(o.get("text", "") for o in nb.cells[-1].outputs)
    return [c for c in nb.cells[:-1] if c.cell_type == "code"], events(text)


def under_torchrun(name: str, probe: str, tmp_path: Path, group: bool = True) -> dict[int, dict]:
    """The notebook's code cells + probe as one script under ``torchrun --nproc-per-node 2``."""
    script = tmp_path / f"{Path(name).stem}.py"
    script.write_text(SCRIPT_HEAD + (SCRIPT_GROUP if group else "") + "\n".join(code_cells(name))
                      + "\n" + probe + SCRIPT_TAIL)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # as the kernel sets it on this machine's ranks
    logs = tmp_path / "torchrun_logs"  # each rank's stdout in a file: long lines of two ranks interleave on a pipe
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "--log-dir", str(logs), "--redirects", "1", str(script)],
                          capture_output=True, text=True, timeout=400, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = events("\n".join(p.read_text() for p in logs.rglob("stdout.log")))
    assert sorted(found) == [0, 1], proc.stderr[-3000:]
    return found


def cell_text(cell) -> str:
    return "".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in cell.outputs)


WIDGET = "application/vnd.jupyter.widget-view+json"


def assert_shown_once(text: str, *lines: str) -> None:
    """Lines every rank printed alike appear once, without a rank label."""
    for line in lines:
        assert text.count(line + "\n") == 1 and f"] {line}" not in text, (line, text[-2000:])


def assert_close(a: list[float], b: list[float], tol: float = 1e-4) -> None:
    assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) <= tol


def test_lightning_ddp_trains_on_the_kernels_ranks_like_torchrun(tmp_path):
    cells, ev = in_kernel("lightning_ddp.ipynb", LIGHTNING_PROBE)
    assert sorted(ev) == [0, 1]
    for r, e in ev.items():
        # the kernel's group, no launcher, no fork: Lightning sees the processes as created outside it
        assert (e["strategy"], e["env"], e["world"], e["global_rank"], e["children"]) == (
            "DDPStrategy", "LightningEnvironment", 2, r, 0)
        assert e["rows"] == 3 * 384 // 2  # each rank its half of every epoch
        assert e["preds"] == 128 // 2 and e["preds_ordered"]
    assert ev[0]["params"] == ev[1]["params"] and ev[0]["val_loss"] == ev[1]["val_loss"]
    text = "".join(cell_text(c) for c in cells)
    assert_shown_once(text, "rows this rank trained on: 576 of 1152 (3 epochs, 2 ranks)", "replicas equal: True",
                      f"validation loss: {round(ev[0]['val_loss'], 3)}", "predictions complete and in order: True")
    # one progress bar (rank 0's, Lightning's only one), shown unlabelled
    fit = next(c for c in cells if "trainer.fit" in c.source)
    bars = [o for o in fit.outputs if WIDGET in o.get("data", {})]
    assert len(bars) == 1 and not bars[0].metadata and "[rank" not in bars[0].data["text/plain"]
    ref = under_torchrun("lightning_ddp.ipynb", LIGHTNING_PROBE, tmp_path, group=False)
    assert ref[0]["rows"] == ev[0]["rows"] and ref[0]["env"] == "TorchElasticEnvironment"
    assert_close(ev[0]["params"], ref[0]["params"])
    assert abs(ev[0]["val_loss"] - ref[0]["val_loss"]) < 1e-4


def test_lightning_off_gives_lightnings_own_notebook_refusal():
    from harness import DistKernel

    k = DistKernel("--ranks", "2", "--lightning", "off")
    try:
        res = k.execute("import lightning as L\nL.Trainer(accelerator='cpu', devices=2, strategy='ddp')", timeout=180)
        assert res.status == "error" and "not compatible with an interactive environment" in str(res.outputs)
        on = k.execute("%dist_lightning on")
        assert on.status == "error" and "started with --lightning off" in on.reply["evalue"]  # never installed
    finally:
        k.shutdown()


def test_fsdp2_shards_and_a_dcp_checkpoint_round_trips_like_torchrun(tmp_path):
    cells, ev = in_kernel("fsdp_dcp.ipynb", FSDP_PROBE)
    assert sorted(ev) == [0, 1]
    for e in ev.values():
        assert e["sharded"] == "DTensor" and e["local_rows"] == 64 // 2 and e["loaded_same"]
    assert ev[0]["full"] == ev[1]["full"]  # the gathered full state dict, identical on both ranks
    text = "".join(cell_text(c) for c in cells)
    assert_shown_once(text, "each rank holds 32 of the first layer's 64 rows",
                      "full state dict: 6 tensors, 5313 values; equal on every rank: True",
                      "loaded model gives the same outputs: True")
    ref = under_torchrun("fsdp_dcp.ipynb", FSDP_PROBE, tmp_path)
    assert_close(ev[0]["full"], ref[0]["full"])


def test_compiled_ddp_with_a_distributed_sampler_like_torchrun(tmp_path):
    cells, ev = in_kernel("compile_sampler.ipynb", COMPILE_PROBE)
    assert sorted(ev) == [0, 1]
    for e in ev.values():
        assert e["per_epoch"] == [512, 512, 512] and e["compiled"] == "OptimizedModule"
    for epoch in range(3):  # disjoint halves, together the whole dataset
        assert sorted(ev[0]["seen"][epoch] + ev[1]["seen"][epoch]) == list(range(1024))
    assert ev[0]["seen"][0] != ev[0]["seen"][1]  # set_epoch reshuffled
    assert ev[0]["params"] == ev[1]["params"]
    text = "".join(cell_text(c) for c in cells)
    assert_shown_once(text, "each epoch covered once: True", "epochs shuffled differently: True",
                      "replicas equal: True")
    ref = under_torchrun("compile_sampler.ipynb", COMPILE_PROBE, tmp_path)
    assert ref[0]["seen"] == ev[0]["seen"]
    assert_close(ev[0]["params"], ref[0]["params"])


@pytest.mark.timeout(600)  # without .ci/build-deepspeed-op.sh it builds DeepSpeed's shm op first: minutes beside the others
def test_deepspeed_zero2_trains_on_cpu_like_torchrun(tmp_path):
    cells, ev = in_kernel("deepspeed_zero.ipynb", DEEPSPEED_PROBE)
    assert sorted(ev) == [0, 1]
    for e in ev.values():
        assert (e["optimizer"], e["stage"]) == ("DeepSpeedZeroOptimizer", 2)
        assert e["share"] * 2 >= e["total"] > e["share"]  # each rank holds half of the optimizer state
    assert ev[0]["params"] == ev[1]["params"]
    text = "".join(cell_text(c) for c in cells)
    assert_shown_once(text, "replicas equal: True")
    ref = under_torchrun("deepspeed_zero.ipynb", DEEPSPEED_PROBE, tmp_path, group=False)
    assert ref[0]["share"] == ev[0]["share"]
    assert_close(ev[0]["params"], ref[0]["params"])


NOTEBOOKS = ("lightning_ddp.ipynb", "fsdp_dcp.ipynb", "compile_sampler.ipynb", "deepspeed_zero.ipynb")


def test_the_notebooks_run_at_4_ranks_through_dist_kernel_run(tmp_path):
    # one kernel for all four (CI time): their cells one after the other, each notebook as it is
    nb = nbformat.v4.new_notebook()
    for name in NOTEBOOKS:
        nb.cells += nbformat.read(EXAMPLES / name, as_version=4).cells
    path = tmp_path / "ecosystem.ipynb"
    nbformat.write(nb, path)
    proc = subprocess.run([sys.executable, "-m", "dist_kernel", "run", str(path), "--ranks", "4"],
                          capture_output=True, text=True, cwd=EXAMPLES, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # each notebook's result lines once, unlabelled, in order
    results = [line for line in proc.stdout.splitlines() if line.endswith((": True", ": False"))]
    assert results == ["replicas equal: True", "predictions complete and in order: True",
                       "full state dict: 6 tensors, 5313 values; equal on every rank: True",
                       "loaded model gives the same outputs: True", "each epoch covered once: True",
                       "epochs shuffled differently: True", "replicas equal: True", "replicas equal: True"], proc.stdout[-3000:]
    assert "rows this rank trained on: 288 of 1152 (3 epochs, 4 ranks)\n" in proc.stdout
    assert "each rank holds 16 of the first layer's 64 rows\n" in proc.stdout
