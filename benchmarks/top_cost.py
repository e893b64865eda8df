"""``python -m benchmarks.top_cost``: what ``%dist_top`` costs (issue 28, section 2: under 1% of a
core per node, nothing while no cell runs).

Three measurements, each as CPU seconds of a process (user + system, all threads) over a window:

1. The parent kernel and its ranks during a 10 s sleeping cell (``time.sleep(10)``), with
   ``%dist_top`` off, then on; a plain ipykernel running the same cell beside it.
2. The parent while no cell runs for 10 s with ``%dist_top`` on (it should do nothing more).
3. A node agent's share: the agent samples its ranks (psutil, NVML) once per beat (0.5 s) while
   the parent asks. Measured in this process, calling the agent's sampler on the ranks' pids at
   the agent's rate for the same window (the agent's relaying is the same with it off or on).

    python -m benchmarks.top_cost                  # ~1.5 min on 2 cores
    python -m benchmarks.top_cost --window 5

Writes ``benchmarks/results/top_cost.md``.
"""

from __future__ import annotations

import argparse
import os
import platform
import time
from pathlib import Path

import psutil

from benchmarks.common import Kernel, log
from dist_kernel.load import LoadSampler
from dist_kernel.tunnel import BEAT_INTERVAL

OUT = Path(__file__).parent / "results" / "top_cost.md"


def cpu_s(procs: list[psutil.Process]) -> float:
    """CPU seconds (user + system) the processes used so far."""
    total = 0.0
    for p in procs:
        t = p.cpu_times()
        total += t.user + t.system
    return total


def during(k: Kernel, code: str, procs: dict[str, list[psutil.Process]]) -> tuple[dict[str, float], float]:
    """Each group's CPU seconds while ``code`` runs on ``k``, and the cell's wall time."""
    before = {name: cpu_s(ps) for name, ps in procs.items()}
    t0 = time.monotonic()
    k.check(code, timeout=600)
    wall = time.monotonic() - t0
    return {name: cpu_s(ps) - before[name] for name, ps in procs.items()}, wall


def idle(procs: dict[str, list[psutil.Process]], window: float) -> dict[str, float]:
    before = {name: cpu_s(ps) for name, ps in procs.items()}
    time.sleep(window)
    return {name: cpu_s(ps) - before[name] for name, ps in procs.items()}


def agent_share(pids: list[int], window: float) -> float:
    """CPU seconds the agent's sampling of ``pids`` costs over ``window`` (one sample per beat)."""
    sampler = LoadSampler()
    t_cpu = time.thread_time()
    end = time.monotonic() + window
    while time.monotonic() < end:
        for pid in pids:
            sampler.sample(pid, 0)  # GPU 0: NVML where it exists, n/a here otherwise
        time.sleep(BEAT_INTERVAL)
    return time.thread_time() - t_cpu


def pct(cpu: float, wall: float) -> str:
    return f"{100 * cpu / wall:.2f}%"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--window", type=float, default=10.0, help="seconds per measurement (default 10)")
    ap.add_argument("--ranks", type=int, default=2)
    args = ap.parse_args()
    w = args.window
    cell = f"time.sleep({w})"

    log("starting a plain ipykernel and dist_kernel")
    plain = Kernel("plain")
    dist = Kernel("dist", args.ranks)
    try:
        plain.check("import time")
        dist.check("import time, torch")
        parent = dist.proc()
        ranks = [c for c in parent.children() if "dist_kernel.rank" in " ".join(c.cmdline())]
        groups = {"parent": [parent], "ranks": ranks}
        log("plain ipykernel: sleeping cell")
        plain_cpu, plain_wall = during(plain, cell, {"plain": [plain.proc()]})
        log("%dist_top off: sleeping cell")
        off, off_wall = during(dist, cell, groups)
        dist.check("%dist_top")
        log("%dist_top on: sleeping cell")
        on, on_wall = during(dist, cell, groups)
        log("%dist_top on: no cell")
        quiet = idle(groups, w)
        log("node agent's sampling")
        agent = agent_share([r.pid for r in ranks], w)
    finally:
        dist.shutdown()
        plain.shutdown()

    rows = [
        ("plain ipykernel, sleeping cell", plain_cpu["plain"], plain_wall, ""),
        ("dist_kernel parent, sleeping cell, %dist_top off", off["parent"], off_wall,
         f"{off['parent'] / max(plain_cpu['plain'], 1e-9):.1f}x"),
        ("dist_kernel parent, sleeping cell, %dist_top on", on["parent"], on_wall,
         f"{on['parent'] / max(plain_cpu['plain'], 1e-9):.1f}x"),
        (f"dist_kernel's {len(ranks)} ranks, sleeping cell, %dist_top off", off["ranks"], off_wall, ""),
        (f"dist_kernel's {len(ranks)} ranks, sleeping cell, %dist_top on", on["ranks"], on_wall, ""),
        ("dist_kernel parent, no cell, %dist_top on", quiet["parent"], w, ""),
        (f"node agent's sampling of {len(ranks)} ranks (per node)", agent, w, ""),
    ]
    added = (on["parent"] - off["parent"]) / on_wall
    lines = [
        "# What `%dist_top` costs",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPU cores, {platform.platform()}; "
        f"`python -m benchmarks.top_cost --window {w:g} --ranks {args.ranks}`. CPU is user + system time "
        "of each process (all threads) over the window, from psutil; the plain ipykernel ran the same "
        "cell side by side. The ranks' row counts their `where` answers (control thread), not their main "
        "threads' work.",
        "",
        "| process | CPU s | window s | % of a core | vs plain ipykernel |",
        "| --- | --- | --- | --- | --- |",
        *(f"| {name} | {cpu:.3f} | {wall:.1f} | {pct(cpu, wall)} | {ratio} |" for name, cpu, wall, ratio in rows),
        "",
        f"`%dist_top` added {100 * added:.2f}% of a core to the parent on this machine (its sampling and "
        f"the ranks' `where` round trips, once a second), and the agent's sampling costs "
        f"{pct(agent, w)} of a core per node; with no cell running the parent used {pct(quiet['parent'], w)}.",
        "",
    ]
    OUT.write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
