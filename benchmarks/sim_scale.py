"""``python -m benchmarks.sim_scale``: the real parent at 64 to 1,024 simulated ranks (issue 26).

The parent kernel runs unmodified, started through jupyter_client; its ranks are stub ranks
behind stub node agents (``--launcher stub``, :mod:`dist_kernel.testing`): the real remote
launcher, listener (CurveZMQ), channels (HMAC checked on every message) and output merging,
with stand-ins that answer at once on the far side. Every cell is sent as JupyterLab sends it
(``store_history=True``, ``silent=False``). Layouts: 64 ranks (8 nodes x 8), 256 (16 x 16),
1,024 (16 x 64). For each: ``x = 1`` p50/p90 (send -> idle), ``print(rank)`` until its output
is complete (checked complete, ordered and labelled), the parent's CPU per cell (and the stub
nodes', which share the cores), and the idle parent's CPU over a few seconds, with 2 ranks
against 1,024.

    python -m benchmarks.sim_scale            # ~2 min on 2 cores

Writes the block between ``<!-- sim:begin -->`` and ``<!-- sim:end -->`` in
``benchmarks/results/scale.md`` (appended when absent), ``sim_scale.json`` and ``sim_scale.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import psutil

from benchmarks.common import Kernel, log, percentile, write_block
from benchmarks.scale import RESULTS

#: (nodes, ranks per node)
LAYOUTS = ((8, 8), (16, 16), (16, 64))
IDLE_S = 5.0
BEGIN, END = "<!-- sim:begin -->", "<!-- sim:end -->"


def stub_kernel(nodes: int, per_node: int) -> Kernel:
    return Kernel("dist", nodes * per_node, ("--launcher", "stub", "--nodes", str(nodes)), ready_timeout=120)


def _cpu(procs: list[psutil.Process]) -> float:
    """CPU seconds (user + system) used so far by ``procs`` (gone ones count 0)."""
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


def _stub_nodes(k: Kernel) -> list[psutil.Process]:
    return [p for p in k.proc().children(recursive=True) if "dist_kernel.testing.stub_node" in " ".join(p.cmdline())]


def _cells(k: Kernel, code: str, n: int, check: str | None = None) -> dict:
    """``n`` cells of ``code``: send -> idle and send -> last output, in ms; the parent's and
    the stub nodes' CPU per cell. ``check``: the stdout every cell must show."""
    parent, nodes = [k.proc()], _stub_nodes(k)
    cpu0, nodes0 = _cpu(parent), _cpu(nodes)
    idle, last = [], []
    for _ in range(n):
        sent = time.time()
        res = k.execute(code)
        if res.reply.get("status") != "ok" or (check is not None and res.stdout() != check):
            raise RuntimeError(f"{code!r}: {res.reply.get('status')} {res.text()[:300]!r}")
        idle.append(res.elapsed * 1e3)
        if res.outputs:
            last.append((res.outputs[-1][0] - sent) * 1e3)
    out = {"p50": percentile(idle, 50), "p90": percentile(idle, 90), "n": n,
           "parent_cpu_ms": (_cpu(parent) - cpu0) / n * 1e3, "nodes_cpu_ms": (_cpu(nodes) - nodes0) / n * 1e3}
    if last:
        out["last_output_p50"], out["last_output_p90"] = percentile(last, 50), percentile(last, 90)
    return out


def idle_cpu(k: Kernel, seconds: float = IDLE_S) -> float:
    """The idle parent's CPU, ms per second, over ``seconds``."""
    p = k.proc()
    time.sleep(1.0)  # the last cell's tail settles
    c0, t0 = _cpu([p]), time.monotonic()
    time.sleep(seconds)
    return (_cpu([p]) - c0) / (time.monotonic() - t0) * 1e3


def measure(nodes: int, per_node: int, reps: int) -> dict:
    n = nodes * per_node
    t0 = time.perf_counter()
    k = stub_kernel(nodes, per_node)
    try:
        k.check("x = 1")  # waits for every rank
        ready = time.perf_counter() - t0
        _cells(k, "x = 1", 3)
        row = {"nodes": nodes, "per_node": per_node, "ready_s": ready,
               "x = 1": _cells(k, "x = 1", reps),
               "print(rank)": _cells(k, "print(rank)", max(5, reps // 3),
                                     check="".join(f"[rank {r}] {r}\n" for r in range(n)))}
        if n == max(a * b for a, b in LAYOUTS):
            row["idle_cpu_ms_per_s"] = idle_cpu(k)
        return row
    finally:
        k.shutdown()


def report(res: dict) -> str:
    rows = res["rows"]
    lines = [
        "## Simulated ranks: the real parent behind stub nodes (issue 26)",
        "",
        f"{res['machine']}, {res['date']}. `python -m benchmarks.sim_scale --reps {res['reps']}`: the parent "
        "kernel unmodified, its ranks stub ranks behind stub node agents (`--launcher stub`, "
        "`dist_kernel/testing/`), which answer at once; every cell sent with `store_history=True`, "
        "`silent=False`. ms. `print(rank)` output checked complete, ordered and labelled on every cell; "
        "\"last output\" is send -> its last stream message, \"idle\" send -> idle. CPU per cell is "
        "user + system of the parent process (all its threads); the stub nodes' CPU is shown beside it "
        "because they share the 2 cores.",
        "",
        "| ranks | nodes x ranks | ready s | `x = 1` p50 | p90 | parent CPU ms/cell | stub nodes CPU ms/cell "
        "| `print(rank)` last output p50 | p90 | idle p50 | parent CPU ms/cell |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, r in sorted(rows.items(), key=lambda kv: int(kv[0])):
        x, p = r["x = 1"], r["print(rank)"]
        lines.append(f"| {n} | {r['nodes']} x {r['per_node']} | {r['ready_s']:.1f} | {x['p50']:.1f} | {x['p90']:.1f} "
                     f"| {x['parent_cpu_ms']:.1f} | {x['nodes_cpu_ms']:.1f} | {p['last_output_p50']:.1f} "
                     f"| {p['last_output_p90']:.1f} | {p['p50']:.1f} | {p['parent_cpu_ms']:.1f} |")
    lo, hi = min(rows, key=int), max(rows, key=int)
    ratio = rows[hi]["x = 1"]["parent_cpu_ms"] / rows[lo]["x = 1"]["parent_cpu_ms"]
    lines += ["", f"Parent CPU per `x = 1` cell at {hi} ranks: {ratio:.1f}x that at {lo}. Idle parent CPU over "
              f"{IDLE_S:.0f} s: {res['idle'][hi]:.1f} ms/s at {hi} ranks, {res['idle']['2']:.1f} ms/s at 2 "
              "(1 stub node x 2)."]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ns = sorted(int(n) for n in res["rows"])
    fig, ax = plt.subplots(figsize=(6, 4))
    for key, stat, label in (("x = 1", "p50", "x = 1 (p50)"), ("x = 1", "p90", "x = 1 (p90)"),
                             ("print(rank)", "last_output_p50", "print(rank), last output (p50)")):
        ax.plot(ns, [res["rows"][str(n)][key][stat] for n in ns], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ranks (stub)")
    ax.set_ylabel("ms per cell")
    ax.set_title(f"real parent, stub ranks: {res['machine']}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args(argv)
    res: dict = {"machine": f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}",
                 "date": time.strftime("%Y-%m-%d"), "reps": a.reps, "rows": {}, "idle": {}}
    for nodes, per_node in LAYOUTS:
        log(f"{nodes} x {per_node} stub ranks")
        row = res["rows"][str(nodes * per_node)] = measure(nodes, per_node, a.reps)
        if "idle_cpu_ms_per_s" in row:
            res["idle"][str(nodes * per_node)] = row["idle_cpu_ms_per_s"]
    log("idle parent at 2 ranks")
    k = stub_kernel(1, 2)
    try:
        k.check("x = 1")
        res["idle"]["2"] = idle_cpu(k)
    finally:
        k.shutdown()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim_scale.json").write_text(json.dumps(res, indent=1))
    text = report(res)
    write_block(out / "scale.md", text, (BEGIN, END))
    plot(res, out / "sim_scale.png")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
