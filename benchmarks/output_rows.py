"""``python -m benchmarks.output_rows [--ranks 2,4]``: only the print/display rows (issue 19).

The print latency (own / same / rank0, section 3) and the 1 MB identical print against a plain
ipykernel (median of three pairs) as ``python -m benchmarks`` measures them, plus what drift costs:
3,000 identical ``display(i)`` and 100,000 identical flushed prints with rank 1 started 0.5 s late
(seconds to idle, outputs shown, labelled ones), and how long a print made by rank 0 alone takes to
reach the client while the other ranks are idle (finished) and while they run silently. Prints a
JSON object; nothing is written. ``--drift-only --ranks 2,4,8 --lags 0.5,2`` checks issue 19's
done-when at 8 ranks too (too slow for the suite on 2 cores: ~6 min per 100,000-print cell), reading
the spill file as well: ``once_each_unlabelled_in_order``.
"""

from __future__ import annotations

import argparse
import json
import time

from benchmarks import measure
from benchmarks.__main__ import throughput_pairs
from benchmarks.common import Kernel, percentile

LAGGED = "import time\nif rank == 1:\n    time.sleep({lag})\n"
DISPLAYS = LAGGED + "for i in range(3000):\n    display(i)"
PRINTS = LAGGED + "for i in range(100_000):\n    print('the same line', flush=True)"
#: rank 0 prints a stamp ``lines`` times; the others either finish at once or run the same loop silently
ALONE = ("import time as _t\nif rank == 0:\n    for _i in range({lines}):\n        print(f'@{{_t.time():.6f}}', flush=True)\n"
         "        _t.sleep(0.01)\n")
SILENT = ("import time as _t\nfor _i in range({lines}):\n    if rank == 0:\n        print(f'@{{_t.time():.6f}}', flush=True)\n"
          "    _t.sleep(0.01)\n")


def drift_row(k: Kernel, code: str, expected: list[str]) -> dict:
    """Run a drift cell; what was shown live, what went to the spill file, and whether the two
    together are ``expected`` (each output once, unlabelled, in order)."""
    res = k.check(code, timeout=1800)
    rich = [c for _, mt, c in res.outputs if mt == "display_data"]
    text = res.stdout()
    live: list[str] = []
    notes = ""
    for _, mt, c in res.outputs:
        if mt == "stream" and c.get("name") == "stderr":
            notes += c.get("text", "")
            if "saved in full to " in notes:
                break  # what follows the note is in the file
        elif mt == "display_data":
            live.append(str(c.get("data", {}).get("text/plain", "")))
        elif mt == "stream":
            live += c.get("text", "").splitlines()
    saved: list[str] = []
    if "saved in full to " in notes:
        with open(notes.split("saved in full to ")[1].split(" and")[0]) as f:
            saved = [line.rstrip("\n") for line in f if line.strip()]
    return {"seconds": round(res.elapsed, 2), "displays": len(rich),
            "labelled_displays": sum("[rank" in str(c.get("data", {}).get("text/plain", "")) for c in rich),
            "stdout_lines": text.count("\n"), "labelled_lines": text.count("[rank "), "in_spill_file": len(saved),
            "once_each_unlabelled_in_order": [x for x in live + saved if x] == expected}


def drift_rows(k: Kernel, lags: list[float]) -> dict:
    rows = {}
    for lag in lags:
        time.sleep(3)  # the output budget refills
        rows[f"displays_3000_lag_{lag}s"] = drift_row(k, DISPLAYS.format(lag=lag), [str(i) for i in range(3000)])
        time.sleep(3)
        rows[f"prints_100k_lag_{lag}s"] = drift_row(k, PRINTS.format(lag=lag), ["the same line"] * 100_000)
    return rows


def stamp_latency(k: Kernel, code: str) -> dict:
    res = k.check(code, timeout=120)
    lat = [t - float(m.group(1)) for t, mt, c in res.outputs if mt == "stream"
           for m in measure._STAMP.finditer(c.get("text", ""))]
    return {"p50_ms": round(percentile(lat, 50) * 1e3, 1), "p99_ms": round(percentile(lat, 99) * 1e3, 1)}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.output_rows")
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--lines", type=int, default=100)
    p.add_argument("--drift-only", action="store_true",
                   help="only the drift rows (issue 19's done-when: --ranks 2,4,8 --lags 0.5,2)")
    p.add_argument("--lags", default="0.5", help="rank 1's lags for the drift rows, seconds")
    args = p.parse_args()
    lags = [float(x) for x in args.lags.split(",")]
    out: dict = {}
    plain = Kernel("plain")
    try:
        for n in [int(x) for x in args.ranks.split(",")]:
            k = Kernel("dist", n)
            try:
                k.check("import torch.distributed as dist\ndist.barrier()")  # the group formed
                if args.drift_only:
                    out[n] = drift_rows(k, lags)
                    print(json.dumps({n: out[n]}), flush=True)
                    continue
                row: dict = {"latency_ms": {}}
                for mode in ("own", "same", "rank0"):
                    lat = measure.print_latency(k, args.lines, mode=mode)
                    row["latency_ms"][mode] = [round(lat["p50"] * 1e3, 1), round(lat["p99"] * 1e3, 1)]
                row["rank0_alone_others_idle"] = stamp_latency(k, ALONE.format(lines=args.lines))
                row["rank0_alone_others_silent"] = stamp_latency(k, SILENT.format(lines=args.lines))
                plain_thr, thr = throughput_pairs(plain, k, 1.0, 3)
                row["throughput_mb_s"] = round(thr["mb_per_s"], 2)
                row["throughput_vs_plain"] = round(thr["mb_per_s"] / plain_thr["mb_per_s"], 3)
                row.update(drift_rows(k, lags))
                out[n] = row
                print(json.dumps({n: row}), flush=True)
            finally:
                k.shutdown()
    finally:
        plain.shutdown()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
