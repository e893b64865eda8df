"""Turn results.json into the Markdown table, the PNG chart and the README's results block."""

from __future__ import annotations

import math
from pathlib import Path

SECTIONS = ("## 1. Cell round trip", "## 2. Startup", "## 3. Streaming", "## 4. Training",
            "## 5. Parent cost", "## 6. Scaling", "## Targets")
README_BEGIN, README_END = "<!-- results:begin -->", "<!-- results:end -->"


def _ok(x: object) -> bool:
    return isinstance(x, (int, float)) and not math.isnan(x)


def ms(x: float | None) -> str:
    return f"{x * 1e3:.1f}" if _ok(x) else "n/a"


def num(x: float | None, fmt: str = "{:.2f}") -> str:
    return fmt.format(x) if _ok(x) else "n/a"


def ratio(a: float | None, b: float | None) -> float:
    return a / b if _ok(a) and _ok(b) and b else float("nan")


def _med(xs: list[float]) -> float:
    s = sorted(xs)
    if not s:
        return float("nan")
    m = len(s) // 2
    return s[m] if len(s) % 2 else (s[m - 1] + s[m]) / 2


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|",
            *("| " + " | ".join(r) + " |" for r in rows), ""]


def _peer(res: dict, name: str, n: int) -> dict:
    block = res.get(name) or {}
    if "error" in block:
        return {"error": block["error"]}
    return block.get(str(n)) or {}


def _ranks(res: dict) -> list[int]:
    return sorted(int(n) for n in res.get("dist", {}))


def _main_ranks(res: dict) -> list[int]:
    return [n for n in _ranks(res) if n <= 4]


def _thr(d: dict) -> float:
    return (d.get("thr") or {}).get("mb_per_s", float("nan"))


def targets(res: dict) -> list[tuple[str, str, bool | None]]:
    """(target, measured, met) for each target of issue 6 (None: not measured in this run)."""
    dist = res.get("dist", {})
    out: list[tuple[str, str, bool | None]] = []
    for n, limit in ((2, 1.5), (4, 2.0)):
        d = dist.get(str(n))
        if d:
            r = ratio(d["rt"]["median"], d["plain_rt"]["median"])
            out.append((f"round trip at {n} ranks <= {limit}x plain ipykernel",
                        f"{r:.2f}x ({ms(d['rt']['median'])} vs {ms(d['plain_rt']['median'])} ms)", r <= limit))
        else:
            out.append((f"round trip at {n} ranks <= {limit}x plain ipykernel", "not measured", None))
    for n in (2, 4):
        d = dist.get(str(n))
        if d:
            r = ratio(_med(d["startup"]), _med(d["plain_startup"]))
            out.append((f"{n} ranks ready <= 1.3x one ipykernel importing torch",
                        f"{r:.2f}x ({_med(d['startup']):.2f} vs {_med(d['plain_startup']):.2f} s)", r <= 1.3))
    lat = [(n, dist[str(n)]["lat"]["own"]["p50"]) for n in _main_ranks(res) if n > 1]
    if lat:
        worst = max(lat, key=lambda x: x[1])
        out.append(("print-to-client latency p50 < 20 ms",
                    "; ".join(f"{n} ranks {ms(v)} ms" for n, v in lat), worst[1] < 0.020))
    thr = [(n, ratio(_thr(dist[str(n)]), _thr({"thr": dist[str(n)]["plain_thr"]}))) for n in _main_ranks(res) if n > 1]
    if thr:
        out.append(("print throughput >= plain ipykernel",
                    "; ".join(f"{n} ranks {r:.3f}x" for n, r in thr), all(_ok(r) and r >= 1.0 for _, r in thr)))
    tr = [(n, ratio(dist[str(n)]["train"]["median_step_s"], dist[str(n)]["torchrun"]["median_step_s"]))
          for n in _main_ranks(res) if n > 1]
    if tr:
        out.append(("training step within 2% of torchrun",
                    "; ".join(f"{n} ranks {r:.3f}x" for n, r in tr), all(r <= 1.02 for _, r in tr)))
    rss = [(n, max(dist[str(n)]["cost_start"]["rss_mb"], dist[str(n)]["cost_end"]["rss_mb"])) for n in _ranks(res)]
    if rss:
        worst = max(rss, key=lambda x: x[1])
        out.append(("parent resident memory < 80 MB", f"max {worst[1]:.0f} MB (at {worst[0]} ranks)", worst[1] < 80))
    return out


def markdown(res: dict) -> str:
    meta = res.get("meta", {})
    dist = res.get("dist", {})
    v = meta.get("versions", {})
    lines = ["# dist_kernel benchmarks", "",
             f"Mode **{meta.get('mode')}**, {meta.get('date')}, {meta.get('cpus')} CPU cores, {meta.get('machine')}; "
             f"python {v.get('python')}, torch {v.get('torch')}, ipykernel {v.get('ipykernel')}, "
             f"jupyter_client {v.get('jupyter_client')}, ipyparallel {v.get('ipyparallel')}, "
             f"nbdistributed {v.get('nbdistributed')}. Run took {num(meta.get('duration_s'), '{:.0f}')} s. "
             "All ranks run on CPU (gloo). Ratios compare numbers measured side by side in this run.", ""]

    # 1. round trip
    lines += [SECTIONS[0], "", "`x = 1`, from sending execute_request to the kernel's idle status, in ms. "
              "Plain ipykernel blocks alternate with the distributed kernel's so noise hits both.", ""]
    rows = []
    for n in _main_ranks(res):
        d = dist[str(n)]
        rows.append([f"dist_kernel, {n} rank(s)", ms(d["rt"]["median"]), ms(d["rt"]["p90"]),
                     ms(d["plain_rt"]["median"]), f"{ratio(d['rt']['median'], d['plain_rt']['median']):.2f}x"])
    plain_all = res.get("plain", {}).get("rt_all", {})
    for name in ("ipyparallel", "nbdistributed"):
        block = res.get(name) or {}
        if "error" in block:
            rows.append([name, "n/a", "n/a", "", block["error"]])
            continue
        for n in sorted(int(k) for k in block):
            d = block[str(n)]
            if "error" in d:
                rows.append([f"{name}, {n} engine(s)", "failed", "", "", d["error"]])
                continue
            base = dist[str(n)]["plain_rt"]["median"] if str(n) in dist else plain_all.get("median")
            label = "`%px x = 1`" if name == "ipyparallel" else "auto-distributed cell"
            rows.append([f"{name} {label}, {n} engine(s)", ms(d["median"]), ms(d["p90"]), ms(base),
                         f"{ratio(d['median'], base):.2f}x"])
    lines += _table(["system", "median ms", "p90 ms", "plain ipykernel median ms", "ratio"], rows)

    # 2. startup
    lines += [SECTIONS[1], "", "From starting the kernel to the first cell's result with torch imported "
              "(and, for dist_kernel, every rank in the process group), in seconds (median of the samples).", ""]
    rows = []
    for n in _ranks(res):
        d = dist[str(n)]
        rows.append([f"dist_kernel, {n} rank(s)", num(_med(d["startup"])), num(_med(d["plain_startup"])),
                     f"{ratio(_med(d['startup']), _med(d['plain_startup'])):.2f}x", str(len(d["startup"]))])
    for name in ("ipyparallel", "nbdistributed"):
        block = res.get(name) or {}
        for n in sorted(int(k) for k in block if k != "error"):
            d = block[str(n)]
            if "startup" in d:
                base = _med(dist[str(n)]["plain_startup"]) if str(n) in dist else float("nan")
                what = "Cluster start + `%px import torch`" if name == "ipyparallel" else "`%dist_init` + first cell"
                rows.append([f"{name} ({what}), {n}", num(d["startup"]), num(base), f"{ratio(d['startup'], base):.2f}x",
                             "1 (in a running kernel)"])
    lines += _table(["system", "ready s", "plain ipykernel + import torch s", "ratio", "samples"], rows)

    # 3. streaming
    lines += [SECTIONS[2], "", "Latency: each rank prints `time.time()` every 10 ms; the client subtracts it on "
              "receipt. *own*: every rank prints its own stamp (lines differ, shown labelled); *same*: ranks "
              "agree on the stamp with an all_reduce first (identical lines, shown once); *rank0*: only rank 0 "
              "prints. Throughput: one `sys.stdout.write` of "
              f"{meta.get('sizes', {}).get('thr_mb')} MB in 100-byte lines, identical on every rank; MB of one copy "
              "per second from send to idle.", ""]
    pl = res.get("plain", {}).get("lat", {})
    rows = [["plain ipykernel", ms(pl.get("p50")), ms(pl.get("p99")), "", "", "", "see rows"]]
    for n in _ranks(res):
        d = dist[str(n)]
        lat = d["lat"]
        thr = d.get("thr", {})
        thr_txt = num(thr.get("mb_per_s")) if "error" not in thr else f"failed: {thr['error'][:60]}"
        rows.append([f"dist_kernel, {n} rank(s)", ms(lat["own"]["p50"]), ms(lat["own"]["p99"]),
                     f"{ms(lat['same']['p50'])} / {ms(lat['same']['p99'])}",
                     f"{ms(lat['rank0']['p50'])} / {ms(lat['rank0']['p99'])}",
                     f"{thr_txt} vs {num(d['plain_thr']['mb_per_s'])}",
                     f"{ratio(_thr(d), d['plain_thr']['mb_per_s']):.3f}x"])
    lines += _table(["system", "own p50 ms", "own p99 ms", "same p50/p99 ms", "rank0 p50/p99 ms",
                     "MB/s (vs plain)", "throughput ratio"], rows)

    # 4. training
    tcfg = meta.get("sizes", {}).get("train", {})
    lines += [SECTIONS[3], "", f"DDP (gloo, CPU) MLP width {tcfg.get('width')}, depth {tcfg.get('depth')}, batch "
              f"{tcfg.get('batch')} per rank, {tcfg.get('steps')} timed steps after {tcfg.get('warmup')} warm-up; "
              "the same function (`benchmarks/ddp_train.py`) in the kernel and under "
              "`python -m torch.distributed.run --standalone`. Median step time of rank 0, ms.", ""]
    rows = []
    for n in _ranks(res):
        d = dist[str(n)]
        k, t = d["train"], d["torchrun"]
        rows.append([str(n), ms(k["median_step_s"]), ms(t["median_step_s"]),
                     f"{ratio(k['median_step_s'], t['median_step_s']):.3f}x",
                     f"{ms(k['mean_step_s'])} / {ms(t['mean_step_s'])}", f"{k['threads']} / {t['threads']}"])
    lines += _table(["ranks", "kernel step ms", "torchrun step ms", "ratio (median)", "mean step ms kernel / torchrun",
                     "torch threads per rank kernel / torchrun"], rows)

    # 5. parent cost
    pc = res.get("plain", {})
    lines += [SECTIONS[4], "", "The parent process (psutil): resident memory after start and after the run, CPU "
              "time per `x = 1` cell, and CPU while idle. The plain ipykernel row is the baseline kernel "
              "process (it has torch imported).", ""]
    rows = []
    if "cost" in pc:
        rows.append(["plain ipykernel", num(pc["cost"]["rss_mb"], "{:.0f}"), "",
                     ms(pc.get("rt_all", {}).get("cpu_per_cell")), num(pc["cost"]["idle_cpu_pct"], "{:.1f}")])
    for n in _ranks(res):
        d = dist[str(n)]
        rows.append([f"dist_kernel parent, {n} rank(s)", num(d["cost_start"]["rss_mb"], "{:.0f}"),
                     num(d["cost_end"]["rss_mb"], "{:.0f}"), f"{ms(d['rt']['cpu_per_cell'])} "
                     f"(plain {ms(d['plain_rt']['cpu_per_cell'])})", num(d["cost_start"]["idle_cpu_pct"], "{:.1f}")])
    lines += _table(["process", "RSS MB after start", "RSS MB at end", "CPU ms per cell", "idle CPU %"], rows)

    # 6. scaling
    lines += [SECTIONS[5], "", f"Sections 1-5 from 1 to {max(_ranks(res), default=1)} ranks. This machine has "
              f"{meta.get('cpus')} cores, so beyond 2 ranks the ranks share cores and every number includes that "
              "contention; sizes are kept small for that reason.", ""]
    rows = []
    for n in _ranks(res):
        d = dist[str(n)]
        rows.append([str(n), f"{ms(d['rt']['median'])} ({ratio(d['rt']['median'], d['plain_rt']['median']):.1f}x)",
                     f"{num(_med(d['startup']))} ({ratio(_med(d['startup']), _med(d['plain_startup'])):.2f}x)",
                     ms(d["lat"]["own"]["p50"]), num(_thr(d)),
                     f"{ms(d['train']['median_step_s'])} ({ratio(d['train']['median_step_s'], d['torchrun']['median_step_s']):.2f}x)",
                     num(max(d["cost_start"]["rss_mb"], d["cost_end"]["rss_mb"]), "{:.0f}")])
    lines += _table(["ranks", "round trip ms (vs plain)", "ready s (vs plain)", "print p50 ms", "print MB/s",
                     "train step ms (vs torchrun)", "parent RSS MB"], rows)

    # targets
    lines += [SECTIONS[6], ""]
    rows = [[t, m, {True: "met", False: "**missed**", None: "n/a"}[ok]] for t, m, ok in targets(res)]
    lines += _table(["target (issue 6)", "measured", "result"], rows)
    return "\n".join(lines)


def chart(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dist = res.get("dist", {})
    ranks = _ranks(res)
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    fig.suptitle(f"dist_kernel vs peers ({res.get('meta', {}).get('mode')} run, "
                 f"{res.get('meta', {}).get('cpus')} CPU cores)")

    ax = axes[0][0]
    ax.plot(ranks, [dist[str(n)]["rt"]["median"] * 1e3 for n in ranks], "o-", label="dist_kernel")
    ax.plot(ranks, [dist[str(n)]["plain_rt"]["median"] * 1e3 for n in ranks], "s--", label="plain ipykernel")
    for name, marker in (("ipyparallel", "^-"), ("nbdistributed", "v-")):
        block = res.get(name) or {}
        ns = sorted(int(k) for k in block if k != "error" and "median" in block[k])
        if ns:
            ax.plot(ns, [block[str(n)]["median"] * 1e3 for n in ns], marker, label=name)
    ax.set(title="1. round trip `x = 1` (median)", xlabel="ranks / engines", ylabel="ms", yscale="log")
    ax.legend(fontsize=8)

    ax = axes[0][1]
    ax.plot(ranks, [_med(dist[str(n)]["startup"]) for n in ranks], "o-", label="dist_kernel ready")
    ax.plot(ranks, [_med(dist[str(n)]["plain_startup"]) for n in ranks], "s--", label="plain ipykernel + import torch")
    ax.plot(ranks, [1.3 * _med(dist[str(n)]["plain_startup"]) for n in ranks], ":", color="gray", label="target 1.3x")
    ax.set(title="2. startup", xlabel="ranks", ylabel="s")
    ax.legend(fontsize=8)

    ax = axes[0][2]
    for mode in ("own", "same", "rank0"):
        ax.plot(ranks, [dist[str(n)]["lat"][mode]["p50"] * 1e3 for n in ranks], "o-", label=f"dist_kernel p50 ({mode})")
    ax.axhline(res.get("plain", {}).get("lat", {}).get("p50", float("nan")) * 1e3, ls="--", color="k",
               label="plain ipykernel p50")
    ax.axhline(20, ls=":", color="gray", label="target 20 ms")
    ax.set(title="3a. print -> client latency", xlabel="ranks", ylabel="ms")
    ax.legend(fontsize=8)

    ax = axes[1][0]
    ax.plot(ranks, [_thr(dist[str(n)]) for n in ranks], "o-", label="dist_kernel")
    ax.plot(ranks, [dist[str(n)]["plain_thr"]["mb_per_s"] for n in ranks], "s--", label="plain ipykernel")
    ax.set(title="3b. large print throughput", xlabel="ranks", ylabel="MB/s", yscale="log")
    ax.legend(fontsize=8)

    ax = axes[1][1]
    ax.plot(ranks, [dist[str(n)]["train"]["median_step_s"] * 1e3 for n in ranks], "o-", label="in dist_kernel")
    ax.plot(ranks, [dist[str(n)]["torchrun"]["median_step_s"] * 1e3 for n in ranks], "s--", label="torchrun")
    ax.set(title="4. DDP step time (median)", xlabel="ranks", ylabel="ms")
    ax.legend(fontsize=8)

    ax = axes[1][2]
    ax.bar([str(n) for n in ranks], [max(dist[str(n)]["cost_start"]["rss_mb"], dist[str(n)]["cost_end"]["rss_mb"])
                                     for n in ranks], label="parent RSS MB")
    ax.axhline(80, ls=":", color="gray", label="target 80 MB")
    ax2 = ax.twinx()
    ax2.plot([str(n) for n in ranks], [dist[str(n)]["rt"]["cpu_per_cell"] * 1e3 for n in ranks], "o-", color="C1",
             label="parent CPU ms / cell")
    ax.set(title="5. parent cost", xlabel="ranks", ylabel="MB")
    ax2.set_ylabel("CPU ms per cell")
    ax.legend(loc="upper left", fontsize=8)
    ax2.legend(loc="upper right", fontsize=8)

    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def update_readme(readme: Path, md_text: str) -> None:
    """Replace the block between the results markers in the README with the new tables."""
    if not readme.exists():
        return
    text = readme.read_text()
    if README_BEGIN not in text or README_END not in text:
        return
    body = "\n".join(line for line in md_text.splitlines() if not line.startswith("# "))
    body = body.replace("\n## ", "\n### ")
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    readme.write_text(f"{head}{README_BEGIN}\n{body.strip()}\n\n{README_END}{tail}")
