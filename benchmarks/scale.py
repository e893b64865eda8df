"""``python -m benchmarks.scale``: a trivial cell against the rank count, real ranks (issue 26).

Each rank count N gets a Distributed Python kernel of N CPU ranks and, side by side in the same
run, ipyparallel's DirectView over N engines driven from a plain ipykernel, as its users run it
(``rc[:].execute("x = 1", block=True)`` in a cell), and a plain ipykernel as the floor. Cells are
sent as JupyterLab sends them (``store_history=True``, ``silent=False``: see
:meth:`benchmarks.common.Kernel.execute`), in alternating blocks so that machine noise hits every
side alike. Rows: p10/p50/p90 of ``x = 1``, p50 of ``%%rank 0`` and of ``print(1)``, the parent's
CPU per cell, and the ratio of our p50 to ipyparallel's.

    python -m benchmarks.scale --ranks 2,4,8 --reps 60     # here (2 cores): ~5 min
    python -m benchmarks.scale --ranks 8,16,32 --reps 60   # a 16-core machine

Writes ``benchmarks/results/scale.md``, ``scale.json`` and ``scale.png`` (ms against ranks).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from benchmarks.common import ROOT, Kernel, log, percentile, write_block
from benchmarks.peers import available

RESULTS = ROOT / "benchmarks" / "results"
#: this benchmark's block of results/scale.md (the simulated ranks' is benchmarks.sim_scale's)
MARKERS = ("<!-- real:begin -->", "<!-- real:end -->")
CELLS = {"x = 1": "x = 1", "%%rank 0": "%%rank 0\nx = 1", "print(1)": "print(1)"}
BLOCK = 10


def _ipp_start(engines: int) -> Kernel:
    k = Kernel("plain")
    k.check(f"import ipyparallel as ipp\ncluster = ipp.Cluster(n={engines}, log_level=40)\n"
            "rc = cluster.start_and_connect_sync()\ndv = rc[:]\ndv.block = True", timeout=300)
    k.check("dv.execute('x = 1')")
    return k


def _times(k: Kernel, code: str, n: int) -> list[float]:
    return [k.execute(code, keep_outputs=False).elapsed for _ in range(n)]


def _stats(xs: list[float]) -> dict:
    return {"p10": percentile(xs, 10) * 1e3, "p50": percentile(xs, 50) * 1e3, "p90": percentile(xs, 90) * 1e3,
            "n": len(xs)}


def measure(n: int, reps: int, plain: Kernel) -> dict:
    """Every row for N ranks, the sides interleaved in blocks of :data:`BLOCK` cells."""
    dist = Kernel("dist", n, ("--gpus", "none", "--oversubscribe", "on"), ready_timeout=300)
    ipp = _ipp_start(n) if available("ipyparallel") else None
    try:
        dist.check("import torch.distributed as dist\nassert dist.get_world_size() == world_size", timeout=300)
        for code in CELLS.values():
            _times(dist, code, 3)  # warm up: the first cells compile and import
        samples: dict[str, list[float]] = {name: [] for name in CELLS}
        samples["ipyparallel"], samples["plain"] = [], []
        parent = dist.proc()
        cpu = 0.0
        for _ in range(max(1, reps // BLOCK)):
            for name, code in CELLS.items():
                c0 = sum(parent.cpu_times()[:2])
                samples[name] += _times(dist, code, BLOCK)
                if name == "x = 1":
                    cpu += sum(parent.cpu_times()[:2]) - c0
            if ipp is not None:
                samples["ipyparallel"] += _times(ipp, "dv.execute('x = 1')", BLOCK)
            samples["plain"] += _times(plain, "x = 1", BLOCK)
        row = {name: _stats(xs) for name, xs in samples.items() if xs}
        row["parent_cpu_ms_per_cell"] = cpu / len(samples["x = 1"]) * 1e3
        if "ipyparallel" in row:
            row["ratio_to_ipyparallel"] = row["x = 1"]["p50"] / row["ipyparallel"]["p50"]
        row["p90_over_p50"] = row["x = 1"]["p90"] / row["x = 1"]["p50"]
        return row
    finally:
        if ipp is not None:
            try:
                ipp.execute("cluster.stop_cluster_sync()", timeout=60)
            finally:
                ipp.shutdown()
        dist.shutdown()


def report(res: dict) -> str:
    lines = [
        "# A trivial cell against the rank count (real CPU ranks)",
        "",
        f"{res['machine']}, {res['date']}. `python -m benchmarks.scale --ranks {res['ranks']} --reps {res['reps']}`; "
        "every cell sent with `store_history=True`, as JupyterLab sends it. ms; ipyparallel is "
        "`dv.execute('x = 1')` (DirectView, block=True) in a plain ipykernel's cell, run in the same blocks.",
        "",
        "| ranks | p10 | p50 | p90 | p90/p50 | `%%rank 0` p50 | `print(1)` p50 | parent CPU per cell | "
        "ipyparallel p50 | ours / ipyparallel | plain ipykernel p50 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, row in sorted(res["rows"].items(), key=lambda kv: int(kv[0])):
        x = row["x = 1"]
        ipp = row.get("ipyparallel")
        lines.append(
            f"| {n} | {x['p10']:.1f} | {x['p50']:.1f} | {x['p90']:.1f} | {row['p90_over_p50']:.2f} | "
            f"{row['%%rank 0']['p50']:.1f} | {row['print(1)']['p50']:.1f} | {row['parent_cpu_ms_per_cell']:.2f} | "
            + (f"{ipp['p50']:.1f} | {row['ratio_to_ipyparallel']:.2f}" if ipp else "not installed | -")
            + f" | {row['plain']['p50']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted(int(n) for n in res["rows"])
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, label in (("x = 1", "dist_kernel x = 1"), ("print(1)", "dist_kernel print(1)"),
                       ("ipyparallel", "ipyparallel DirectView"), ("plain", "plain ipykernel")):
        pts = [(n, res["rows"][str(n)][key]["p50"]) for n in ns if key in res["rows"][str(n)]]
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=f"{label} (p50)")
    pts = [(n, res["rows"][str(n)]["x = 1"]["p90"]) for n in ns]
    ax.plot(*zip(*pts, strict=True), marker="x", linestyle="--", label="dist_kernel x = 1 (p90)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks")
    ax.set_ylabel("ms per cell")
    ax.set_title(res["machine"])
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2,4,8", help="comma list of rank counts")
    p.add_argument("--reps", type=int, default=60, help="cells per row and side")
    p.add_argument("--out", default=str(RESULTS), help="folder for scale.md/json/png")
    a = p.parse_args(argv)
    ranks = [int(x) for x in a.ranks.split(",")]
    res = {"machine": f"{os.cpu_count()} cores, {platform.machine()}, Python {sys.version.split()[0]}",
           "date": time.strftime("%Y-%m-%d"), "ranks": a.ranks, "reps": a.reps, "rows": {}}
    plain = Kernel("plain")
    try:
        for n in ranks:
            log(f"scale: {n} ranks")
            res["rows"][str(n)] = measure(n, a.reps, plain)
    finally:
        plain.shutdown()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scale.json").write_text(json.dumps(res, indent=1))
    text = report(res)
    write_block(out / "scale.md", text, MARKERS)  # the page's other blocks and prose stay
    plot(res, out / "scale.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
