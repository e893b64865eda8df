"""Section 9 (issue 21): a training step with accelerate and with Transformers' ``Trainer``, in the
kernel against the same code under torchrun.

``python -m benchmarks --only hf`` runs it. Each workload is one function here, run as it is on
both sides: in the kernel, a cell calls it on every rank (the group is already formed); under
``python -m torch.distributed.run --standalone --nproc-per-node N benchmarks/hf_train.py
WORKLOAD`` accelerate forms the group. Rank 0 prints one line ``@@{json}`` with the per-step
timings (:func:`benchmarks.ddp_train.parse` reads it). Runs alternate kernel, torchrun, kernel,
... so that the machine's noise hits both alike (the kernel is shut down while torchrun runs); the
median run of each side counts. Under torchrun the processes get the environment the kernel gives
its CPU ranks (``ACCELERATE_USE_CPU``, one thread per rank on this machine's cores).

- ``accelerate``: the MLP of :mod:`benchmarks.ddp_train` through ``Accelerator.prepare``: a step is
  forward, ``accelerator.backward``, optimizer step, over a prepared ``DataLoader``.
- ``trainer``: a two-layer BERT (``BertConfig``, nothing downloaded) trained by ``Trainer`` with its
  defaults (the notebook progress bar in the kernel, tqdm under torchrun); a step is the time
  between two ``on_step_end`` callbacks, data loading and the progress bar included.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

WORKLOADS = ("accelerate", "trainer")
TARGET = 1.05  # kernel step / torchrun step


def _summary(times: list[float], world: int, loss: float) -> dict:
    return {"median_step_s": statistics.median(times), "mean_step_s": statistics.fmean(times),
            "steps": len(times), "world_size": world, "loss": loss}


def train_accelerate(steps: int = 40, warmup: int = 5, batch: int = 64, width: int = 256, depth: int = 3,
                     seed: int = 0) -> dict:
    """``warmup + steps`` steps of the MLP of ddp_train through accelerate; rank 0's step times."""
    import torch
    from accelerate import Accelerator
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    accelerator = Accelerator()
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    n = batch * accelerator.num_processes * (warmup + steps)
    data = TensorDataset(torch.randn(n, width), torch.randn(n, 1))
    model, opt, dl = accelerator.prepare(model, opt, DataLoader(data, batch_size=batch))
    times: list[float] = []
    accelerator.wait_for_everyone()
    t0 = time.perf_counter()
    for i, (x, y) in enumerate(dl):
        loss = nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1 = time.perf_counter()
        if i >= warmup:
            times.append(t1 - t0)
        t0 = t1
    return _summary(times, accelerator.num_processes, float(loss))


def train_trainer(steps: int = 40, warmup: int = 5, batch: int = 16, seed: int = 0) -> dict:
    """``warmup + steps`` steps of a two-layer BERT with ``Trainer``'s defaults; rank 0's step times."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback, TrainingArguments

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):  # Trainer's signature
            self.ends.append(time.perf_counter())

    class Tokens(torch.utils.data.Dataset):
        def __init__(self, n: int) -> None:
            g = torch.Generator().manual_seed(seed)
            self.x = torch.randint(0, 64, (n, 32), generator=g)
            self.y = torch.randint(0, 2, (n,), generator=g)

        def __len__(self) -> int:
            return len(self.y)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.x[i], "labels": self.y[i]}

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=128, max_position_embeddings=32, num_labels=2)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    clock = StepClock()
    args = TrainingArguments(tempfile.mkdtemp(prefix="hf_bench_"), per_device_train_batch_size=batch,
                             max_steps=warmup + steps + 1, logging_steps=10, save_strategy="no", report_to="none",
                             seed=seed, ddp_find_unused_parameters=False)
    trainer = Trainer(model=BertForSequenceClassification(config), args=args,
                      train_dataset=Tokens(batch * world * (warmup + steps + 1)), callbacks=[clock])
    out = trainer.train()
    ends = clock.ends[warmup:]
    return _summary([b - a for a, b in zip(ends, ends[1:], strict=False)], world, out.training_loss)


def run_workload(name: str, **kw: int) -> dict:
    return {"accelerate": train_accelerate, "trainer": train_trainer}[name](**kw)


def kernel_cell(name: str, **kw: int) -> str:
    """The cell the benchmark runs in the distributed kernel."""
    return ("import json as _json\nfrom benchmarks.hf_train import run_workload as _run\n"
            f"_res = _run({name!r}, **{kw!r})\n"
            "if rank == 0:\n    print('@@' + _json.dumps(_res))\n")


#: per workload, its sizes in a full and in a quick run
SIZES = {"full": {"accelerate": dict(steps=200, warmup=10), "trainer": dict(steps=60, warmup=5)},
         "quick": {"accelerate": dict(steps=5, warmup=2, width=64, depth=2), "trainer": dict(steps=5, warmup=2)}}


def run(cfg: dict, res: dict, mode: str, ranks: int = 2) -> None:
    """Measure every workload, kernel and torchrun alternating; results into ``res["hf"]``."""
    from benchmarks import ddp_train, measure
    from benchmarks.common import Kernel, log

    repeats = 5 if mode == "full" else 1  # pairs of runs: this shared machine's load swings step times 5x
    out: dict = {"ranks": ranks, "workloads": {}}
    res["hf"] = out
    for name in WORKLOADS:
        kw = SIZES[mode][name]
        row: dict = {"kernel": [], "torchrun": [], "sizes": kw}
        out["workloads"][name] = row
        # the environment the kernel gives its CPU ranks (placement.py)
        env = {"ACCELERATE_USE_CPU": "true", "DS_ACCELERATOR": "cpu", "HF_HUB_OFFLINE": "1",
               "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // ranks))}
        try:
            for _ in range(repeats):
                # the kernel is shut down while torchrun runs: its idle ranks must not slow the peer
                k = Kernel("dist", ranks)
                try:
                    k.check(kernel_cell(name, **{**kw, "steps": 2, "warmup": 1}), timeout=600)  # imports, first use
                    row["kernel"].append(ddp_train.parse(k.check(kernel_cell(name, **kw), timeout=600).stdout()))
                finally:
                    k.shutdown()
                row["torchrun"].append(measure.train_torchrun(ranks, "hf_train.py", (name,), env, **kw))
                log(f"hf {name}: step {row['kernel'][-1]['median_step_s'] * 1e3:.2f} ms in kernel vs "
                    f"{row['torchrun'][-1]['median_step_s'] * 1e3:.2f} ms torchrun")
        except Exception as e:  # noqa: BLE001 - reported in the table
            row["error"] = f"{type(e).__name__}: {str(e)[-400:]}"
            log(f"hf {name}: failed: {row['error']}")


def _median_step(runs: list[dict]) -> float:
    return statistics.median(r["median_step_s"] for r in runs) if runs else float("nan")


def targets(res: dict) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) per workload: the kernel's step within 1.05x of torchrun's."""
    rows = []
    for name, row in (res.get("hf") or {}).get("workloads", {}).items():
        k, t = _median_step(row["kernel"]), _median_step(row["torchrun"])
        met = None if "error" in row or not (k == k and t == t) else k / t <= TARGET
        rows.append((f"{name} training step within {TARGET:.2f}x of torchrun", f"{k / t:.3f}x" if met is not None
                     else row.get("error", "n/a"), met))
    return rows


SECTION = "## 9. accelerate and Transformers' Trainer"
MARKERS = ("<!-- hf:begin -->", "<!-- hf:end -->")


def markdown(res: dict) -> str:
    """Section 9 as Markdown (its heading included)."""
    hf = res.get("hf")
    lines = [SECTION, ""]
    if not hf:
        return "\n".join(lines + ["not run: this run did not include the section", ""])
    lines += [f"A training step at {hf['ranks']} ranks on CPU/gloo: the same function in the kernel (every rank "
              "runs the cell) and under `torchrun --standalone` (`benchmarks/hf_train.py`), runs alternating; "
              "median step time of rank 0 per run, the median run per side. `accelerate`: the MLP of section 4 "
              "through `Accelerator.prepare`; `trainer`: a two-layer BERT with `Trainer`'s defaults (progress "
              "bar included: the notebook one in the kernel, tqdm under torchrun).", "",
              "| workload | kernel ms/step | torchrun ms/step | ratio | target | runs (kernel / torchrun ms) |",
              "| --- | --- | --- | --- | --- | --- |"]
    for name, row in hf["workloads"].items():
        if "error" in row:
            lines.append(f"| {name} | failed | | | <= {TARGET:.2f}x | {row['error'][:200]} |")
            continue
        k, t = _median_step(row["kernel"]), _median_step(row["torchrun"])
        runs = " / ".join(", ".join(f"{r['median_step_s'] * 1e3:.2f}" for r in row[side]) for side in ("kernel", "torchrun"))
        lines.append(f"| {name} | {k * 1e3:.2f} | {t * 1e3:.2f} | {k / t:.3f}x | <= {TARGET:.2f}x "
                     f"({'met' if k / t <= TARGET else 'not met'}) | {runs} |")
    return "\n".join(lines + [""])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("workload", choices=WORKLOADS)
    for name in ("steps", "warmup", "batch", "width", "depth"):
        p.add_argument(f"--{name}", type=int, default=None)
    a = p.parse_args()
    kw = {k: v for k, v in vars(a).items() if k != "workload" and v is not None}
    from benchmarks.ddp_train import report_and_leave

    report_and_leave(run_workload(a.workload, **kw))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    main()
