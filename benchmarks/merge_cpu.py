"""``python -m benchmarks.merge_cpu``: the merger's CPU per cell against the rank count (issue 26).

No kernel and no processes: fake ranks feed :class:`~dist_kernel.parent.merge.CellMerger`
directly, in the order a parent receives them (every rank's output, then each rank's reply and
its end), with the merger polled and drained every few messages as the parent's flushes do.
Two cells: ``print(1)`` on every rank (identical lines, merged into one) and ``print(rank)``
(a labelled line per rank). It reports the process CPU per cell at each rank count and the
ratio at 1,024 ranks to that at 64 (issue 26 asks for at most 3: the work per message must not
grow with the rank count).

    python -m benchmarks.merge_cpu                 # ~1 min on 2 cores
    python -m benchmarks.merge_cpu --ranks 2,64 --min-time 0.2
"""

from __future__ import annotations

import argparse
import time

from dist_kernel.parent.merge import CellMerger

CELLS = {"print(1)": lambda rank: "1\n", "print(rank)": lambda rank: f"{rank}\n"}
FLUSH_EVERY = 16  # messages between the parent's flushes (poll + take) in the simulated cell
STEP = 1e-5  # simulated seconds between two messages


def run_cell(n: int, text_of) -> list:
    """One cell on ``n`` fake ranks; returns what the merger published."""
    merger = CellMerger(range(n))
    out: list = []
    now = 0.0
    events = 0

    def tick() -> None:
        nonlocal events
        events += 1
        if events % FLUSH_EVERY == 0:
            merger.poll(now)
            out.extend(merger.take())

    for rank in range(n):
        now += STEP
        merger.add(rank, "stream", {"name": "stdout", "text": text_of(rank)}, now, now)
        tick()
    for rank in range(n):
        now += STEP
        merger.rank_replied(rank, {"status": "ok"}, now)
        merger.rank_done(rank, now)
        tick()
    merger.finish(now)
    out.extend(merger.take())
    return out


def cpu_per_cell(n: int, text_of, min_time: float) -> float:
    """Seconds of process CPU per cell, the mean over enough cells to fill ``min_time``."""
    run_cell(n, text_of)  # warm up (caches, the first allocations)
    cells, start = 0, time.process_time()
    while True:
        run_cell(n, text_of)
        cells += 1
        spent = time.process_time() - start
        if spent >= min_time and cells >= 3:
            return spent / cells


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2,64,256,1024", help="comma-separated rank counts")
    p.add_argument("--min-time", type=float, default=1.0, help="CPU seconds measured per row (at least 3 cells)")
    args = p.parse_args(argv)
    ranks = [int(x) for x in args.ranks.split(",")]
    rows = {name: {n: cpu_per_cell(n, fn, args.min_time) for n in ranks} for name, fn in CELLS.items()}
    print(f"{'ranks':>6} | " + " | ".join(f"{name + ' ms/cell':>20}" for name in CELLS))
    for n in ranks:
        print(f"{n:>6} | " + " | ".join(f"{rows[name][n] * 1e3:>20.3f}" for name in CELLS))
    if 64 in ranks and 1024 in ranks:
        for name in CELLS:
            print(f"{name}: 1024/64 = {rows[name][1024] / rows[name][64]:.1f}x "
                  f"(ranks x16; per rank {rows[name][1024] / rows[name][64] / 16:.2f}x)")


if __name__ == "__main__":
    main()
