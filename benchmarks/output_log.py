"""``python -m benchmarks.output_log``: what the kernel's output log costs (issue 35, item 5: nothing
measurable per cell).

Two 2-rank kernels side by side in one run, one with the log (the default, ``--output-log 10MB``),
one with ``--output-log off``; each cell kind runs on the two in turn, cell after cell, so machine
noise hits both alike. For each kind: the round trip (send to the kernel's idle) and the parent's
CPU per cell (``/proc/PID/task/*/schedstat``, nanoseconds, all of its threads, the log's writer
among them), medians, and their ratios with the log against without.

- ``x = 1``: the cost per cell (the cell's start and end events, queued and written);
- 2,000 printed lines, different per rank (labelled, the merger's busiest case): the cost per output;
- a ``\\r`` counter redrawn 500 times on each rank (a merged progress bar: one display, 500 updates):
  what the log's throttling of redrawn displays costs.

    python -m benchmarks.output_log            # ~2 min on 2 cores
    python -m benchmarks.output_log --quick    # a smoke run, ~40 s

Writes ``benchmarks/results/output_log.md`` and ``output_log.json`` (``--out DIR`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

from benchmarks.common import Kernel, log, median
from benchmarks.measure import thread_counters
from dist_kernel.parent.output_log import THREAD_NAME

OUT = Path(__file__).parent / "results"

CELLS = {
    "x = 1": "x = 1",
    "2,000 lines, labelled per rank": "for _i in range(2000):\n    print(rank, _i)",
    "`\\r` bar, 500 frames": "for _i in range(500):\n    print(f'\\r{_i}', end='', flush=True)\nprint()",
}
#: cells of each kind on each kernel
SIZES = {"full": {"x = 1": 400, "2,000 lines, labelled per rank": 30, "`\\r` bar, 500 frames": 30},
         "quick": {"x = 1": 20, "2,000 lines, labelled per rank": 2, "`\\r` bar, 500 frames": 2}}


def cpu_s(k: Kernel) -> tuple[float, float]:
    """The parent's CPU seconds so far, all its threads, and its log writer's (schedstat: ns)."""
    threads = thread_counters(k.pid).values()
    return (sum(cpu for _, _, cpu, _ in threads),
            sum(cpu for comm, _, cpu, _ in threads if comm == THREAD_NAME))


def one(k: Kernel, code: str) -> tuple[float, float, float]:
    """One run of ``code``: its round trip, the parent's CPU for it and its log writer's, in seconds."""
    cpu0, writer0 = cpu_s(k)
    elapsed = k.check(code).elapsed
    cpu, writer = cpu_s(k)
    return elapsed, cpu - cpu0, writer - writer0


def log_file(k: Kernel) -> str | None:
    text = k.check("%dist_status").outputs[0][2]["data"]["text/plain"]
    line = next((s for s in text.splitlines() if s.startswith("output log: ")), "")
    path = line.removeprefix("output log: ").split(" (rotated")[0]
    return path if path.startswith("/") else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run: fewer blocks and cells")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    size = SIZES["quick" if args.quick else "full"]
    started = time.time()
    log("starting two 2-rank kernels: output log on, and --output-log off")
    on, off = Kernel("dist", 2), Kernel("dist", 2, options=("--output-log", "off"))
    rows = []
    try:
        path = log_file(on)
        assert path and log_file(off) is None, "the kernels' logs are not as asked"
        for name, code in CELLS.items():
            got: dict[str, dict[str, list[float]]] = {k: {"t": [], "cpu": [], "writer": []} for k in ("on", "off")}
            on.check(code)  # warm: the first of a kind pays for imports and the merger's caches
            off.check(code)
            for i in range(size[name]):
                for label, k in [("on", on), ("off", off)] if i % 2 == 0 else [("off", off), ("on", on)]:
                    elapsed, cpu, writer = one(k, code)
                    got[label]["t"].append(elapsed)
                    got[label]["cpu"].append(cpu)
                    got[label]["writer"].append(writer)
            row = {"cell": name, "cells": len(got["on"]["t"])}
            for label in ("on", "off"):
                row[f"rt_ms_{label}"] = 1000 * median(got[label]["t"])
                row[f"cpu_ms_{label}"] = 1000 * median(got[label]["cpu"])
            # the writer's CPU, summed (it runs after the cell, so a cell's share can land in the next)
            row["writer_ms"] = 1000 * sum(got["on"]["writer"]) / len(got["on"]["writer"])
            row["rt_ratio"] = row["rt_ms_on"] / row["rt_ms_off"]
            row["cpu_ratio"] = row["cpu_ms_on"] / max(row["cpu_ms_off"], 1e-9)
            rows.append(row)
            log(f"{name}: round trip {row['rt_ms_on']:.1f} vs {row['rt_ms_off']:.1f} ms ({row['rt_ratio']:.2f}x), "
                f"parent CPU {row['cpu_ms_on']:.2f} vs {row['cpu_ms_off']:.2f} ms per cell, "
                f"log writer {row['writer_ms']:.3f} ms")
        log_bytes = os.path.getsize(path) + (os.path.getsize(path + ".1") if os.path.exists(path + ".1") else 0)
    finally:
        on.shutdown()
        off.shutdown()
    write(args, rows, log_bytes, time.time() - started)


def write(args: argparse.Namespace, rows: list[dict], log_bytes: int, took: float) -> None:
    mode = "quick" if args.quick else "full"
    head = (f"{time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} CPU cores (load average {os.getloadavg()[0]:.1f} "
            f"at the end: other jobs ran), {platform.platform()}; "
            f"`python -m benchmarks.output_log{' --quick' if args.quick else ''}` ({mode}, {took:.0f} s). Two 2-rank "
            "kernels side by side, one with the output log (default) and one with `--output-log off`; each cell kind "
            "ran on the two in turn, cell after cell. Round trip: send to the kernel's idle, median. Parent CPU: the "
            "parent process's time on CPU per cell (all threads, the log's writer among them; "
            "`/proc/PID/task/*/schedstat`), median.")
    table = ["| cell | cells each | round trip ms, log on / off | ratio | parent CPU ms per cell, on / off | ratio "
             "| log writer thread CPU ms per cell | writer / parent CPU |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    table += [f"| {r['cell']} | {r['cells']} | {r['rt_ms_on']:.1f} / {r['rt_ms_off']:.1f} | {r['rt_ratio']:.2f}x | "
              f"{r['cpu_ms_on']:.2f} / {r['cpu_ms_off']:.2f} | {r['cpu_ratio']:.2f}x | {r['writer_ms']:.3f} | "
              f"{100 * r['writer_ms'] / max(r['cpu_ms_on'], 1e-9):.1f}% |" for r in rows]
    share = max(100 * r["writer_ms"] / max(r["cpu_ms_on"], 1e-9) for r in rows)
    ratios = [r[k] for r in rows for k in ("rt_ratio", "cpu_ratio")]
    text = "\n".join(["# What the output log costs", "", head, "", *table, "",
                      f"The log's writer thread, where all of its work but putting each output on a queue happens, "
                      f"used at most {share:.1f}% of the parent's CPU per cell. The on/off ratios of this run range "
                      f"from {min(ratios):.2f}x to {max(ratios):.2f}x: what the machine's other jobs moved the two "
                      f"kernels by, in both directions. The log this run wrote: {log_bytes / 1024:.0f} KB.", ""])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "output_log.md").write_text(text)
    (args.out / "output_log.json").write_text(json.dumps({"mode": mode, "rows": rows, "log_bytes": log_bytes,
                                                          "seconds": took}, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()
