"""``python -m benchmarks [--quick] [--out DIR]``: measure dist_kernel against its peers, side by side.

Writes DIR/results.md (tables), DIR/results.png (chart) and DIR/results.json (raw numbers).
With the default DIR and without --quick it also refreshes the results in benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

from benchmarks import cluster, hf_train, lightning_train, measure, peers, report, torch_train
from benchmarks.common import Kernel, log, median

HERE = Path(os.path.abspath(__file__)).parent
DEFAULT_OUT = HERE / "results"

SIZES = {
    # the smoke test's run (tests/kernel/test_benchmarks_smoke.py): every section and row kind once, at the
    # fewest processes; one rank count exercises the same code as several
    "quick": dict(ranks=[2], main_ranks=[2], startup_repeat_ranks=[], startup_repeats=1, rt_reps=20,
                  rt_block=10, lat_lines=10, thr_mb=0.05, train=dict(steps=5, warmup=2, batch=16, width=64, depth=2),
                  peer_ranks=[2], ipp_reps=10, nbd_reps=0, idle_s=0.5, idle=dict(ranks=2, settle=0.5, window=1.0),
                  cluster=dict(launchers=["ssh"], rt_reps=20, rt_block=10, threads=1, train_repeats=1)),
    "full": dict(ranks=[1, 2, 4, 8], main_ranks=[1, 2, 4], startup_repeat_ranks=[2, 4], startup_repeats=3,
                 rt_reps=200, rt_block=25, lat_lines=100, thr_mb=1.0,
                 train=dict(steps=40, warmup=5, batch=64, width=256, depth=3),
                 peer_ranks=[1, 2, 4], ipp_reps=100, nbd_reps=20, idle_s=2.0,
                 idle=dict(ranks=2, settle=3.0, window=10.0),
                 cluster=dict(launchers=["ssh", "slurm"], rt_reps=100, rt_block=25, threads=1, train_repeats=3)),
}


def roundtrip_pair(plain: Kernel, dist: Kernel, reps: int, block: int) -> tuple[dict, dict]:
    """Alternate blocks of cells on the two kernels so machine noise hits both alike."""
    a: list[dict] = []
    b: list[dict] = []
    for _ in range(max(1, reps // block)):
        a.append(measure.roundtrip(plain, block, warmup=1))
        b.append(measure.roundtrip(dist, block, warmup=1))
    return _merge_rt(a), _merge_rt(b)


def _merge_rt(parts: list[dict]) -> dict:
    xs = [x for p in parts for x in p["samples"]]
    return {"median": median(xs), "p90": measure.percentile(xs, 90),
            "cpu_per_cell": sum(p["cpu_per_cell"] for p in parts) / len(parts), "n": len(xs)}


def plain_startup() -> float:
    k = Kernel("plain")
    try:
        return measure.first_cell(k)
    finally:
        k.shutdown()


def dist_startup(n: int) -> float:
    k = Kernel("dist", n)
    try:
        return measure.first_cell(k)
    finally:
        k.shutdown()


def run_dist(n: int, plain: Kernel, cfg: dict, res: dict) -> None:
    out: dict = {"startup": [], "plain_startup": []}
    res["dist"][str(n)] = out
    log(f"{n} rank(s): plain ipykernel start + import torch (paired baseline)")
    out["plain_startup"].append(plain_startup())
    log(f"{n} rank(s): starting the distributed kernel")
    k = Kernel("dist", n)
    try:
        out["startup"].append(measure.first_cell(k))
        log(f"{n} rank(s): ready in {out['startup'][0]:.2f}s")
        out["cost_start"] = measure.parent_cost(k, cfg["idle_s"])
        out["plain_rt"], out["rt"] = roundtrip_pair(plain, k, cfg["rt_reps"], cfg["rt_block"])
        log(f"{n} rank(s): round trip {out['rt']['median'] * 1e3:.1f} ms vs plain {out['plain_rt']['median'] * 1e3:.1f} ms")
        out["lat"] = {mode: measure.print_latency(k, cfg["lat_lines"], mode=mode) for mode in ("own", "same", "rank0")}
        log(f"{n} rank(s): print latency p50 {out['lat']['own']['p50'] * 1e3:.1f} ms")
        out["train"] = _median_run([measure.train_in_kernel(k, **cfg["train"]) for _ in range(_train_runs(res))])
        try:
            out["plain_thr"], out["thr"] = throughput_pairs(plain, k, cfg["thr_mb"], _train_runs(res))
            log(f"{n} rank(s): throughput {out['thr']['mb_per_s']:.2f} MB/s vs plain {out['plain_thr']['mb_per_s']:.1f}")
        except Exception as e:  # noqa: BLE001 - a timeout here must not lose the rest of the run
            out["thr"] = {"error": f"{type(e).__name__}: {e}"}
            out.setdefault("plain_thr", {})
            log(f"{n} rank(s): throughput failed: {e}")
        out["cost_end"] = measure.parent_cost(k, 0.1)
    finally:
        k.shutdown()
    log(f"{n} rank(s): torchrun")
    try:
        out["torchrun"] = _median_run([measure.train_torchrun(n, **cfg["train"]) for _ in range(_train_runs(res))])
    except Exception as e:  # noqa: BLE001 - reported in the table
        out["torchrun"] = {"error": f"{type(e).__name__}: {str(e)[-300:]}", "median_step_s": float("nan"),
                           "mean_step_s": float("nan"), "threads": "?"}
    log(f"{n} rank(s): step {out['train']['median_step_s'] * 1e3:.2f} ms in kernel vs "
        f"{out['torchrun']['median_step_s'] * 1e3:.2f} ms torchrun")
    if n in cfg["startup_repeat_ranks"]:
        for _ in range(cfg["startup_repeats"] - 1):
            out["plain_startup"].append(plain_startup())
            out["startup"].append(dist_startup(n))


def _train_runs(res: dict) -> int:
    """Training runs per side: one run of 40 steps is easily disturbed by other jobs on the machine."""
    return 3 if res["meta"]["mode"] == "full" else 1


def _median_run(runs: list[dict], key: str = "median_step_s") -> dict:
    """The run with the median ``key``, and every run's value (``runs_<key>``)."""
    ordered = sorted(runs, key=lambda r: r[key])
    return {**ordered[len(ordered) // 2], f"runs_{key}": [r[key] for r in runs]}


def throughput_pairs(plain: Kernel, dist: Kernel, mb: float, pairs: int) -> tuple[dict, dict]:
    """The 1 MB print on the plain kernel, then on the distributed one, ``pairs`` times; the
    median of each. Before each distributed print the output budget (1 MB burst, refilled at
    0.4 MB/s) is let refill, so every print is measured below the flood cap."""
    a: list[dict] = []
    b: list[dict] = []
    for _ in range(pairs):
        a.append(measure.throughput(plain, mb))
        time.sleep(mb * 1e6 / 400_000 + 0.1)
        b.append(measure.throughput(dist, mb))
    return _median_run(a, "mb_per_s"), _median_run(b, "mb_per_s")


#: a plain kernel in which the user formed a (world-1) gloo group: the like-for-like peer of an
#: idle rank, which holds one too (torch's gloo thread wakes ~100 times a second in either)
GLOO_GROUP_CELL = ("import os, tempfile, torch.distributed as dist\nos.environ.setdefault('GLOO_SOCKET_IFNAME', 'lo')\n"
                   "dist.init_process_group('gloo', store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)")


def run_idle(plain: Kernel, cfg: dict, res: dict) -> None:
    """Issue 12: a rank's idle CPU and wakeups per second beside a plain ipykernel's, sampled in
    the same window; the parent's for information (it polls its ranks from its own side)."""
    icfg = cfg["idle"]
    n = icfg["ranks"]
    log(f"idle: {n} rank(s) beside the plain ipykernel, {icfg['window']:.0f} s window")
    k = Kernel("dist", n)
    plain_pg = Kernel("plain")
    gloo = None
    try:
        # the same cells in all: torch imported (a rank has it for its group), one trivial cell
        for kern in (plain, k, plain_pg):
            kern.check(measure.FIRST_CELL)
            kern.check("x = 1")
        plain_pg.check(GLOO_GROUP_CELL)
        names = {**measure.thread_names(plain), **measure.thread_names(k), **measure.pyspy_thread_names(k.pid)}
        ranks = measure.rank_pids(k)
        gloo, gloo_names = measure.gloo_idle_process()
        names.update(gloo_names)
        time.sleep(icfg["settle"])  # let the replies, status messages and heartbeats of those cells pass
        procs = {"plain ipykernel": plain.pid, "plain ipykernel + gloo group": plain_pg.pid,
                 **{f"rank {r}": pid for r, pid in sorted(ranks.items())}, "dist_kernel parent": k.pid}
        if gloo.poll() is None:
            procs["python + gloo group, no kernel"] = gloo.pid
        res["idle"] = {"ranks": n, **measure.idle_cost(procs, icfg["window"], names)}
    finally:
        if gloo is not None:
            gloo.communicate(timeout=30)  # closes its stdin: it exits
        plain_pg.shutdown()
        k.shutdown()
    p = res["idle"]["procs"]
    log("idle: " + "; ".join(f"{label} {v['sched_cpu_per_s'] * 1e3:.2f} ms CPU/s, {v['wakeups_per_s']:.1f} wakeups/s"
                             for label, v in p.items()))


def run_peers(cfg: dict, res: dict) -> None:
    for name, fn, reps in (("ipyparallel", peers.ipyparallel, cfg["ipp_reps"]),
                           ("nbdistributed", peers.nbdistributed, cfg["nbd_reps"])):
        if not peers.available(name):
            res[name] = {"error": f"{name} is not installed (pip install {name})"}
            log(res[name]["error"])
            continue
        if not reps:
            # nbdistributed loses its first distributed cell to a 30 s timeout: too slow for --quick
            res[name] = {"error": "skipped in --quick (its first cell waits out a 30 s timeout)"}
            continue
        res[name] = {}
        for n in cfg["peer_ranks"]:
            log(f"{name}: {n} engine(s)")
            try:
                res[name][str(n)] = fn(n, reps)
                res[name][str(n)].pop("samples", None)
            except Exception as e:  # noqa: BLE001 - a peer that fails is reported, not fatal
                res[name][str(n)] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                log(f"{name} {n}: {e}")


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version()}
    for pkg in ("torch", "ipykernel", "jupyter_client", "pyzmq", "ipyparallel", "nbdistributed", "dist-kernel"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny sizes (the CI smoke test)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="output folder (default benchmarks/results)")
    p.add_argument("--ranks", default=None, help="comma list of rank counts (default 1,2,4,8; quick 2)")
    p.add_argument("--no-peers", action="store_true", help="skip ipyparallel and nbdistributed")
    p.add_argument("--no-cluster", action="store_true",
                   help="skip section 8 even where the cluster lab is up (it then reads \"not run\")")
    p.add_argument("--from-json", default=None, help="only redraw the table and chart from a results.json")
    p.add_argument("--only", choices=["idle", "cluster", "lightning", "hf", "torch"], default=None,
                   help="run one section alone: idle (issue 12), cluster (issue 13), lightning (issue 21: a Lightning "
                        "DDP step against torchrun), hf (issue 21: accelerate and Trainer steps against torchrun) or "
                        "torch (issue 21: FSDP2, torch.compile with DDP and DeepSpeed ZeRO-2 steps against torchrun); "
                        "writes <section>.md and <section>.json, not results.*")
    p.add_argument("--idle-window", type=float, default=None, help="seconds the idle section samples (full 10, quick 1)")
    a = p.parse_args(argv)
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = a.only or "results"

    if a.from_json:
        res = json.loads(Path(a.from_json).read_text())
        stem = ("results" if res.get("dist") else "idle" if "idle" in res else "cluster" if "cluster" in res
                else "lightning" if "lightning" in res else "hf" if "hf" in res else "torch" if "torch" in res
                else "results")
    else:
        mode = "quick" if a.quick else "full"
        cfg = dict(SIZES[mode])
        if a.ranks:
            cfg["ranks"] = [int(x) for x in a.ranks.split(",")]
            cfg["main_ranks"] = [n for n in cfg["ranks"] if n <= 4]
        if a.idle_window:
            cfg["idle"] = {**cfg["idle"], "window": a.idle_window}
        t0 = time.perf_counter()
        res = {"meta": {"mode": mode, "cpus": os.cpu_count(), "machine": platform.platform(),
                        "date": time.strftime("%Y-%m-%d %H:%M"), "versions": versions(),
                        "sizes": {k: v for k, v in cfg.items()}, "only": a.only},
               "dist": {}}
        log(f"mode {mode}: " + (f"only {a.only}" if a.only else f"ranks {cfg['ranks']}")
            + ("" if a.only in ("cluster", "lightning", "hf", "torch") else "; plain ipykernel baseline"))
        if a.only == "lightning":
            lightning_train.run(cfg, res)
        elif a.only == "hf":
            hf_train.run(cfg, res, mode)
        elif a.only == "torch":
            torch_train.run(cfg, res)
        elif a.only != "cluster":
            plain = Kernel("plain")
            try:
                plain.check(measure.FIRST_CELL)
                # first, while the plain kernel is fresh and no other kernel of this run is up
                run_idle(plain, cfg, res)
                if not a.only:
                    res["plain"] = {"lat": measure.print_latency(plain, cfg["lat_lines"], mode="own")}
                    for n in cfg["ranks"]:
                        run_dist(n, plain, cfg, res)
                    res["plain"]["cost"] = measure.parent_cost(plain, 0.1)
                    res["plain"]["rt_all"] = measure.roundtrip(plain, cfg["rt_block"])
                    res["plain"]["rt_all"].pop("samples")
            finally:
                plain.shutdown()
        if not a.only and not a.no_peers:
            run_peers(cfg, res)
        if a.no_cluster and a.only is None:
            res["cluster"] = {"error": "not run: --no-cluster"}
        elif a.only in (None, "cluster"):
            cluster.run(cfg, res)  # section 8: on the lab's two nodes, or "not run: <why>"
        res["meta"]["duration_s"] = time.perf_counter() - t0
    return _write(res, out_dir, stem, from_json=bool(a.from_json))


def _write(res: dict, out_dir: Path, stem: str, from_json: bool) -> int:
    """DIR/<stem>.json and .md (and the chart for a whole run); a full run into the default
    folder also refreshes its blocks in benchmarks/README.md."""
    (out_dir / f"{stem}.json").write_text(json.dumps(res, indent=1) + "\n")
    md_text = report.markdown(res)
    (out_dir / f"{stem}.md").write_text(md_text)
    if res.get("dist"):
        report.chart(res, out_dir / f"{stem}.png")
    if not from_json and res["meta"]["mode"] == "full" and out_dir.resolve() == DEFAULT_OUT.resolve():
        if res.get("dist"):
            report.update_readme(HERE / "README.md", report.markdown(res, idle=False))
        if res.get("idle"):
            report.update_readme(HERE / "README.md", report.idle_block(res), report.IDLE_MARKERS)
        if res.get("cluster"):
            report.update_readme(HERE / "README.md", cluster.markdown(res), cluster.MARKERS)
        if res.get("hf"):
            report.update_readme(HERE / "README.md", hf_train.markdown(res), hf_train.MARKERS)
    log(f"wrote {out_dir / (stem + '.md')}")
    print(md_text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
