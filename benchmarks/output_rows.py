"""``python -m benchmarks.output_rows [--ranks 2,4]``: only the print/display rows (issue 19).

The print latency (own / same / rank0, section 3) and the 1 MB identical print against a plain
ipykernel (median of three pairs) as ``python -m benchmarks`` measures them, plus what drift costs:
3,000 identical ``display(i)`` and 100,000 identical flushed prints with rank 1 started 0.5 s late
(seconds to idle, outputs shown, labelled ones), and how long a print made by rank 0 alone takes to
reach the client while the other ranks are idle (finished) and while they run silently. Prints a
JSON object; nothing is written.
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


def drift_row(k: Kernel, code: str) -> dict:
    res = k.check(code, timeout=600)
    rich = [c for _, mt, c in res.outputs if mt == "display_data"]
    text = res.stdout()
    return {"seconds": round(res.elapsed, 2), "displays": len(rich),
            "labelled_displays": sum("[rank" in str(c.get("data", {}).get("text/plain", "")) for c in rich),
            "stdout_lines": text.count("\n"), "labelled_lines": text.count("[rank ")}


def stamp_latency(k: Kernel, code: str) -> dict:
    res = k.check(code, timeout=120)
    lat = [t - float(m.group(1)) for t, mt, c in res.outputs if mt == "stream"
           for m in measure._STAMP.finditer(c.get("text", ""))]
    return {"p50_ms": round(percentile(lat, 50) * 1e3, 1), "p99_ms": round(percentile(lat, 99) * 1e3, 1)}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.output_rows")
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--lines", type=int, default=100)
    args = p.parse_args()
    out: dict = {}
    plain = Kernel("plain")
    try:
        for n in [int(x) for x in args.ranks.split(",")]:
            k = Kernel("dist", n)
            try:
                k.check("import torch")
                row: dict = {"latency_ms": {}}
                for mode in ("own", "same", "rank0"):
                    lat = measure.print_latency(k, args.lines, mode=mode)
                    row["latency_ms"][mode] = [round(lat["p50"] * 1e3, 1), round(lat["p99"] * 1e3, 1)]
                row["rank0_alone_others_idle"] = stamp_latency(k, ALONE.format(lines=args.lines))
                row["rank0_alone_others_silent"] = stamp_latency(k, SILENT.format(lines=args.lines))
                plain_thr, thr = throughput_pairs(plain, k, 1.0, 3)
                row["throughput_mb_s"] = round(thr["mb_per_s"], 2)
                row["throughput_vs_plain"] = round(thr["mb_per_s"] / plain_thr["mb_per_s"], 3)
                time.sleep(3)  # the output budget refills
                row["displays_3000_lag_0.5s"] = drift_row(k, DISPLAYS.format(lag=0.5))
                time.sleep(3)
                row["prints_100k_lag_0.5s"] = drift_row(k, PRINTS.format(lag=0.5))
                out[n] = row
                print(json.dumps({n: row}), flush=True)
            finally:
                k.shutdown()
    finally:
        plain.shutdown()
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
