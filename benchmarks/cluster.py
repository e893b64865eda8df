"""Section 8, several machines (issue 13): the kernel with its ranks on 2 nodes against the same
kernel with its ranks on this machine, and DDP across the 2 nodes against torchrun across them.

The nodes are the network namespaces of ``tests/cluster/lab.sh`` (a real Slurm and an sshd per
node, on one machine): ``n1`` 10.77.0.11 and ``n2`` 10.77.0.12 behind the bridge ``dklab0``
(10.77.0.1, where the parent kernel and this benchmark run). The "network" is a veth pair and a
bridge in one kernel, so the rows show what the launchers, the encrypted parent link and the
per-node agents cost, not what a real network adds (a real cluster adds its link's latency).

Rows (one rank per node, so 2 ranks in all, against a local kernel at 2 ranks):

* cell round trip of ``x = 1`` (alternating blocks with the local kernel) and first-cell startup;
* print -> client latency (the three shapes of section 3);
* a DDP step (``benchmarks/ddp_train.py``) in the kernel across the nodes, and under
  ``torchrun --nnodes 2 --nproc-per-node 1`` started in each node's namespace (static
  rendezvous on node 0's address, ``GLOO_SOCKET_IFNAME=lab0``), side by side.

Without the lab (not root, no namespaces) the section says ``not run: <reason>``.
"""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import ddp_train, measure
from benchmarks.common import ROOT, Kernel, _env, log, median

LAB_SH = ROOT / "tests" / "cluster" / "lab.sh"
SECTION = "## 8. Several machines"
MARKERS = ("<!-- cluster:begin -->", "<!-- cluster:end -->")
NODES = (("n1", "10.77.0.11"), ("n2", "10.77.0.12"))
HEAD = "10.77.0.1"
NODE_IFNAME = "lab0"


def lab_env() -> tuple[dict[str, str] | None, str]:
    """The lab's environment when the lab is up (env.sh exists; ``lab.sh up`` is then run again, which
    is idempotent and restarts a daemon that died): (env, "") or (None, why not). A benchmark run
    never builds the lab itself (that installs Debian packages): ``sudo tests/cluster/lab.sh up``."""
    env_sh = Path(os.environ.get("LAB_DIR", "/run/dk-cluster-lab")) / "env.sh"
    if os.geteuid() != 0:
        return None, "the cluster lab needs root (sudo tests/cluster/lab.sh up, then run as root)"
    if not env_sh.exists():
        return None, f"the cluster lab is not up ({env_sh} missing; sudo tests/cluster/lab.sh up)"
    try:
        p = subprocess.run(["bash", str(LAB_SH), "up"], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return None, "lab.sh up did not finish in 600 s"
    if p.returncode == 77:
        line = next((ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("SKIP:")), "SKIP: lab.sh up")
        return None, line.removeprefix("SKIP:").strip()
    if p.returncode != 0:
        return None, f"lab.sh up failed ({p.returncode}): {(p.stderr or p.stdout).strip().splitlines()[-1:]}"
    out = subprocess.run(["bash", "-c", f'set -a; . "{env_sh}"; env -0'], capture_output=True, check=True).stdout
    env = dict(kv.split("=", 1) for kv in out.decode().split("\0") if "=" in kv)
    return {k: v for k, v in env.items() if k.startswith("LAB_") or k == "SLURM_CONF"}, ""


def launcher_options(launcher: str) -> tuple[str, ...]:
    """Kernel options for 2 nodes x 1 rank with ``launcher`` (ssh or slurm)."""
    if launcher == "ssh":
        return ("--launcher", "ssh", "--hosts", ",".join(a for _, a in NODES), "--ranks-per-node", "1",
                "--listen", HEAD)
    return ("--launcher", "slurm", "--nodes", str(len(NODES)), "--ranks-per-node", "1", "--listen", HEAD)


@contextlib.contextmanager
def _lab_environ(lab: dict[str, str]):
    """The parent kernel inherits the benchmark's environment: add what the launchers read."""
    add = {"SLURM_CONF": lab["SLURM_CONF"], "DIST_KERNEL_SSH_OPTS": lab["LAB_SSH_OPTS"]}
    old = {k: os.environ.get(k) for k in add}
    os.environ.update(add)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _in_node(ns: str, argv: list[str]) -> list[str]:
    """``argv`` as a process on node ``ns``: its network namespace and its hostname (as slurmd's and
    sshd's children have it)."""
    return ["ip", "netns", "exec", ns, "unshare", "--uts", "sh", "-c", 'hostname "$0"; exec "$@"', ns, *argv]


def train_torchrun_nodes(threads: int | None = None, timeout: float = 600, **kw: int) -> dict:
    """``torchrun --nnodes 2 --nproc-per-node 1`` in each node's namespace, static rendezvous on node
    0's address; rank 0's timings (as :func:`benchmarks.measure.train_torchrun`). ``threads``: the
    workers' OMP_NUM_THREADS (None: torchrun's own rule, which sets none for one process per node)."""
    port = random.randint(29600, 29999)
    master = NODES[0][1]
    env = {**_env(), "GLOO_SOCKET_IFNAME": NODE_IFNAME}
    env.pop("OMP_NUM_THREADS", None)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    procs = []
    t0 = time.perf_counter()
    for i, (ns, _) in enumerate(NODES):
        argv = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={len(NODES)}", "--nproc-per-node=1",
                f"--node-rank={i}", f"--master-addr={master}", f"--master-port={port}",
                os.path.join("benchmarks", "ddp_train.py"), *(f"--{k}={v}" for k, v in kw.items())]
        procs.append(subprocess.Popen(_in_node(ns, argv), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    try:
        res = ddp_train.parse(outs[0][0])
    except ValueError:
        raise RuntimeError("torchrun across the nodes failed (" + ", ".join(str(p.returncode) for p in procs)
                           + "):\n" + "\n".join(err[-1500:] for _, err in outs)) from None
    res["returncode"] = [p.returncode for p in procs]
    if any(p.returncode for p in procs):  # rank 0's result counts; say why a node's torchrun failed after it
        res["stderr_tail"] = [err[-800:] for _, err in outs]
    res["launch_to_exit_s"] = time.perf_counter() - t0
    return res


def _roundtrip_pair(a: Kernel, b: Kernel, reps: int, block: int) -> tuple[dict, dict]:
    """Alternate blocks of ``x = 1`` on the two kernels so machine noise hits both alike."""
    xa: list[float] = []
    xb: list[float] = []
    for _ in range(max(1, reps // block)):
        xa += measure.roundtrip(a, block, warmup=1)["samples"]
        xb += measure.roundtrip(b, block, warmup=1)["samples"]
    return ({"median": median(xa), "p90": measure.percentile(xa, 90), "n": len(xa)},
            {"median": median(xb), "p90": measure.percentile(xb, 90), "n": len(xb)})


def _summary(runs: list[dict]) -> dict:
    """Several training runs as one row: medians over the runs of each run's median and mean step."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"error": runs[-1]["error"] if runs else "no run", "median_step_s": float("nan"),
                "mean_step_s": float("nan")}
    return {"median_step_s": median([r["median_step_s"] for r in ok]), "mean_step_s": median([r["mean_step_s"] for r in ok]),
            "runs_median_step_s": [r["median_step_s"] for r in ok], "threads": ok[0]["threads"],
            "world_size": ok[0]["world_size"], "failed_runs": len(runs) - len(ok)}


def _attempt(fn) -> dict:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - reported in the table
        return {"error": f"{type(e).__name__}: {str(e)[-600:]}"}


def _train_pair(k: Kernel, torchrun, cfg: dict) -> dict:
    """The DDP step in the kernel and under torchrun, alternating ``repeats`` times (while the kernel
    idles) so machine noise hits both; every rank on both sides uses ``threads`` torch threads."""
    ccfg = cfg["cluster"]
    cell = f"import torch as _torch\n_torch.set_num_threads({ccfg['threads']})\n" + ddp_train.kernel_cell(**cfg["train"])
    kernel_runs, torchrun_runs = [], []
    for _ in range(ccfg["train_repeats"]):
        kernel_runs.append(_attempt(lambda: ddp_train.parse(k.check(cell, timeout=600).stdout())))
        torchrun_runs.append(_attempt(torchrun))
    return {"kernel": _summary(kernel_runs), "torchrun": _summary(torchrun_runs)}


def _kernel_rows(k: Kernel, cfg: dict) -> dict:
    out: dict = {"startup": measure.first_cell(k)}
    # an ssh node's ranks start in the remote $HOME without the parent's PYTHONPATH: make
    # benchmarks/ importable there as here (the lab's nodes share this filesystem, as a cluster's do)
    k.check(f"import sys\nif {str(ROOT)!r} not in sys.path:\n    sys.path.insert(0, {str(ROOT)!r})")
    out["hosts"] = k.check("import socket\nprint(socket.gethostname())").text()
    out["lat"] = {mode: measure.print_latency(k, cfg["lat_lines"], mode=mode) for mode in ("own", "same", "rank0")}
    return out


def run(cfg: dict, res: dict) -> None:
    """Fill ``res["cluster"]``: the rows above, or ``{"error": "not run: ..."}``."""
    ccfg = cfg["cluster"]
    lab, why = lab_env()
    if lab is None:
        res["cluster"] = {"error": f"not run: {why}"}
        log(f"cluster: {res['cluster']['error']}")
        return
    out: dict = {"launchers": {}, "nodes": [n for n, _ in NODES], "threads": ccfg["threads"]}
    res["cluster"] = out
    threads = ccfg["threads"]
    log("cluster: local kernel at 2 ranks (the baseline)")
    local = Kernel("dist", 2)
    try:
        out["local"] = _kernel_rows(local, cfg)
        log("cluster: DDP step, local kernel vs torchrun --standalone at 2 ranks")
        out["local"]["train"] = _train_pair(local, lambda: measure.train_torchrun(2, **cfg["train"]), cfg)
        for launcher in ccfg["launchers"]:
            log(f"cluster: {launcher} kernel, {len(NODES)} nodes x 1 rank")
            row: dict = {}
            out["launchers"][launcher] = row
            try:
                with _lab_environ(lab):
                    k = Kernel("dist", len(NODES), launcher_options(launcher))
                try:
                    row.update(_kernel_rows(k, cfg))
                    row["local_rt"], row["rt"] = _roundtrip_pair(local, k, ccfg["rt_reps"], ccfg["rt_block"])
                    log(f"cluster: {launcher}: DDP step vs torchrun --nnodes 2 across the nodes")
                    row["train"] = _train_pair(k, lambda: train_torchrun_nodes(threads, **cfg["train"]), cfg)
                finally:
                    k.shutdown()
                log(f"cluster: {launcher}: round trip {row['rt']['median'] * 1e3:.1f} ms vs local "
                    f"{row['local_rt']['median'] * 1e3:.1f} ms; step {row['train']['kernel']['median_step_s'] * 1e3:.2f} "
                    f"ms vs torchrun {row['train']['torchrun']['median_step_s'] * 1e3:.2f} ms")
            except Exception as e:  # noqa: BLE001 - reported in the table, the rest of the run goes on
                row["error"] = f"{type(e).__name__}: {str(e)[-400:]}"
                log(f"cluster: {launcher} failed: {row['error']}")
    finally:
        local.shutdown()


# ------------------------------------------------------------------------------ report
def _ms(x: object) -> str:
    return f"{x * 1e3:.1f}" if isinstance(x, (int, float)) and x == x else "n/a"


def _ratio(a: object, b: object) -> str:
    ok = all(isinstance(v, (int, float)) and v == v for v in (a, b)) and b
    return f"{a / b:.2f}x" if ok else "n/a"


def _lat(row: dict, mode: str) -> str:
    lat = (row.get("lat") or {}).get(mode) or {}
    return f"{_ms(lat.get('p50'))} / {_ms(lat.get('p99'))}"


def _cell(text: str, limit: int = 160) -> str:
    """One Markdown table cell: a single line, no pipes."""
    return " ".join(str(text).split()).replace("|", "/")[:limit]


def markdown(res: dict) -> str:
    """Section 8 as Markdown (its heading included)."""
    c = res.get("cluster")
    lines = [SECTION, ""]
    if not c:
        return "\n".join(lines + ["not run: this run did not include the section", ""])
    if "error" in c:
        return "\n".join(lines + [_cell(c["error"], 400), ""])
    tcfg = res.get("meta", {}).get("sizes", {}).get("train", {})
    lines += ["The kernel with one rank on each of 2 nodes (the network namespaces n1 and n2 of "
              "`tests/cluster/lab.sh`: a real Slurm and an sshd per node, behind one bridge on this machine) "
              "against the same kernel with its 2 ranks on this machine. Round trip: `x = 1`, send -> idle, in "
              "blocks alternating with the local kernel (its column is from those same blocks). Print latency as in "
              "section 3 (p50 / p99 ms). The nodes share this machine's clock and its 2 cores, and the link is a "
              "veth pair: the rows show what the launcher, the encrypted parent link (CurveZMQ) and the per-node "
              "agent cost, not a real network's latency.", ""]
    local = c.get("local", {})
    rows = [["local, 2 ranks", f"{local.get('startup', float('nan')):.2f}", "", "", "", "",
             _lat(local, "own"), _lat(local, "same"), _lat(local, "rank0")]]
    for launcher, row in c.get("launchers", {}).items():
        label = f"{launcher}, 2 nodes x 1 rank"
        if "error" in row:
            rows.append([label, "failed", "", "", "", "", _cell(row["error"]), "", ""])
            continue
        rt, lrt = row.get("rt", {}), row.get("local_rt", {})
        rows.append([label, f"{row.get('startup', float('nan')):.2f}", _ms(rt.get("median")), _ms(rt.get("p90")),
                     _ms(lrt.get("median")), _ratio(rt.get("median"), lrt.get("median")),
                     _lat(row, "own"), _lat(row, "same"), _lat(row, "rank0")])
    head = ["kernel", "ready s", "round trip median ms", "p90 ms", "local 2 ranks median ms", "ratio",
            "print own p50/p99", "same p50/p99", "rank0 p50/p99"]
    lines += ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|",
              *("| " + " | ".join(r) + " |" for r in rows), ""]

    lines += [f"DDP step (`benchmarks/ddp_train.py`, gloo, CPU, MLP width {tcfg.get('width')}, depth "
              f"{tcfg.get('depth')}, batch {tcfg.get('batch')} per rank, {tcfg.get('steps')} timed steps after "
              f"{tcfg.get('warmup')} warm-up; median step of rank 0, ms, median over "
              f"{res.get('meta', {}).get('sizes', {}).get('cluster', {}).get('train_repeats')} runs that alternate "
              "kernel and torchrun). Across the nodes: the kernel (one rank per node) against "
              "`torchrun --nnodes 2 --nproc-per-node 1` started in each node's namespace (static rendezvous on "
              "n1's 10.77.0.11, `GLOO_SOCKET_IFNAME=lab0`). On this machine, for reference: the local kernel "
              f"against `torchrun --standalone --nproc-per-node 2`. Every rank on both sides runs {c.get('threads')} "
              "torch thread(s): the lab's two nodes share this machine's 2 cores, and with 2 threads per rank each "
              "side's step time swung 1-50 ms from run to run (OpenMP threads spinning on oversubscribed cores).", ""]

    def train_row(label: str, pair: dict) -> list[str]:
        k, t = pair.get("kernel", {}), pair.get("torchrun", {})
        tr = _ms(t.get("median_step_s")) if "error" not in t else f"failed: {_cell(t['error'], 80)}"
        kr = _ms(k.get("median_step_s")) if "error" not in k else f"failed: {_cell(k['error'], 80)}"
        return [label, kr, tr, _ratio(k.get("median_step_s"), t.get("median_step_s")),
                f"{_ms(k.get('mean_step_s'))} / {_ms(t.get('mean_step_s'))}",
                f"{k.get('threads', '?')} / {t.get('threads', '?')}"]

    rows = [train_row(f"2 nodes ({launcher} kernel vs torchrun --nnodes 2)", row["train"])
            for launcher, row in c.get("launchers", {}).items() if "train" in row]
    if "train" in local:
        rows.append(train_row("this machine, 2 ranks (local kernel vs torchrun --standalone)", local["train"]))
    head = ["where", "kernel step ms", "torchrun step ms", "ratio (median)", "mean step ms kernel / torchrun",
            "torch threads per rank kernel / torchrun"]
    lines += ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|",
              *("| " + " | ".join(r) + " |" for r in rows), ""]
    return "\n".join(lines)
