"""What each section measures on one started kernel (plain or distributed)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

from benchmarks import ddp_train
from benchmarks.common import ROOT, Kernel, _env, median, percentile

#: the first cell after start: torch imported and (in the distributed kernel) the group formed
FIRST_CELL = "import torch, torch.distributed as dist\nprint(dist.is_initialized())"

_STAMP = re.compile(r"@(\d+\.\d+)")


def first_cell(k: Kernel) -> float:
    """Seconds from the kernel's start to the first cell's result (torch imported, group formed)."""
    k.check(FIRST_CELL)
    return time.perf_counter() - k.started


def roundtrip(k: Kernel, reps: int, code: str = "x = 1", warmup: int = 3) -> dict:
    """Round trip of a trivial cell (send -> idle), and the kernel process's CPU per cell."""
    for _ in range(warmup):
        k.check(code)
    proc = k.proc()
    cpu0 = sum(proc.cpu_times()[:2])
    xs = [k.execute(code, keep_outputs=False).elapsed for _ in range(reps)]
    cpu = (sum(proc.cpu_times()[:2]) - cpu0) / reps
    return {"median": median(xs), "p90": percentile(xs, 90), "cpu_per_cell": cpu, "samples": xs}


def latency_cell(lines: int, gap: float, mode: str) -> str:
    """A cell printing ``lines`` stamped lines; ``mode``: own (each rank its time), same, rank0."""
    head = "import time as _t\n"
    if mode == "same":
        head += ("import torch as _torch, torch.distributed as _dist\n"
                 "def _stamp():\n    s = _torch.tensor([_t.time()], dtype=_torch.float64)\n"
                 "    _dist.all_reduce(s, op=_dist.ReduceOp.MAX)\n    return s.item()\n")
    else:
        head += "_stamp = _t.time\n"
    cond = "rank == 0" if mode == "rank0" else "True"
    return head + (f"for _i in range({lines}):\n    _s = _stamp()\n"
                   f"    if {cond}:\n        print(f'@{{_s:.6f}}', flush=True)\n    _t.sleep({gap})\n")


def print_latency(k: Kernel, lines: int, gap: float = 0.01, mode: str = "own") -> dict:
    """print() on a rank -> stream message at the client: p50/p99 over every stamped line."""
    res = k.check(latency_cell(lines, gap, mode), timeout=120)
    lat = [t - float(m.group(1)) for t, mt, c in res.outputs if mt == "stream"
           for m in _STAMP.finditer(c.get("text", ""))]
    return {"p50": percentile(lat, 50), "p99": percentile(lat, 99), "n": len(lat)}


def throughput(k: Kernel, mb: float, timeout: float = 300) -> dict:
    """One print of ``mb`` MB (100-byte lines): MB/s of one copy, send -> idle."""
    nlines = max(1, int(mb * 1e6 / 100))
    code = f"import sys as _sys\n_sys.stdout.write(('x' * 99 + '\\n') * {nlines})\n_sys.stdout.flush()"
    res = k.check(code, timeout=timeout)
    out = res.stdout()
    size = nlines * 100
    return {"mb_per_s": size / 1e6 / res.elapsed, "seconds": res.elapsed, "bytes_received": len(out),
            "labelled_lines": out.count("[rank ")}


def train_in_kernel(k: Kernel, **kw: int) -> dict:
    res = k.check(ddp_train.kernel_cell(**kw), timeout=600)
    return ddp_train.parse(res.stdout())


def train_torchrun(ranks: int, script: str = "ddp_train.py", args: tuple[str, ...] = (),
                   env: dict[str, str] | None = None, **kw: int) -> dict:
    """Run ``benchmarks/<script> <args> --k=v ...`` under torchrun; rank 0's ``@@`` result."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           os.path.join("benchmarks", script), *args] + [f"--{k}={v}" for k, v in kw.items()]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env={**_env(), **(env or {})}, capture_output=True, text=True, timeout=600)
    try:
        res = ddp_train.parse(p.stdout)  # rank 0's result counts even if teardown failed later
    except ValueError:
        raise RuntimeError(f"torchrun failed ({p.returncode}):\n{p.stderr[-3000:]}") from None
    res["returncode"] = p.returncode
    res["launch_to_exit_s"] = time.perf_counter() - t0
    return res


def parent_cost(k: Kernel, idle_s: float) -> dict:
    """The kernel process's resident memory and its CPU while idle (no cell running)."""
    proc = k.proc()
    cpu0 = sum(proc.cpu_times()[:2])
    time.sleep(idle_s)
    idle_cpu = (sum(proc.cpu_times()[:2]) - cpu0) / idle_s
    return {"rss_mb": proc.memory_info().rss / 2**20, "idle_cpu_pct": 100 * idle_cpu}


# --- idle cost (issue 12): CPU and wakeups of a kernel process that runs no cell -------------------

_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100

#: run in a kernel to map its OS thread ids to Python thread names (comm is "python" for all
#: Python threads before 3.14, so /proc alone cannot tell IOPub from Heartbeat)
THREAD_NAMES_CELL = ("import json as _j, os as _o, threading as _th\n"
                     "print('@threads' + _j.dumps({'pid': _o.getpid(), 'names': {t.native_id: t.name + "
                     "('' if type(t) is _th.Thread or type(t).__name__[0] == '_' or type(t).__name__ in t.name "
                     "else f' ({type(t).__name__})') "
                     "for t in _th.enumerate()}}))")

#: a bare Python process (no kernel) holding an idle world-1 gloo group: what torch itself costs
#: while idle, in any process with a gloo group (a torchrun worker too)
GLOO_IDLE_SCRIPT = (
    "import os, sys, tempfile, torch, torch.distributed as dist\n"
    "dist.init_process_group('gloo', store=dist.FileStore(tempfile.mktemp(), 1), rank=0, world_size=1)\n"
    "dist.all_reduce(torch.ones(1))\n"
    f"exec({THREAD_NAMES_CELL!r})\n"
    "print('ready', flush=True)\n"
    "sys.stdin.read()  # idle until the benchmark closes stdin\n")


def thread_names(k: Kernel) -> dict[int, dict[int, str]]:
    """{pid: {tid: Python thread name}} for every process that ran the cell (each rank, or the kernel)."""
    out: dict[int, dict[int, str]] = {}
    for line in k.check(THREAD_NAMES_CELL).text().splitlines():
        if "@threads" in line:
            d = json.loads(line.split("@threads", 1)[1])
            out[int(d["pid"])] = {int(t): n for t, n in d["names"].items()}
    return out


_PYSPY_THREAD = re.compile(r'^Thread (\d+) \([^)]*\): "(.*)"$', re.M)


def pyspy_thread_names(pid: int) -> dict[int, dict[int, str]]:
    """{pid: {tid: Python thread name}} from ``py-spy dump`` where py-spy is installed (for the parent,
    which runs no user cell); empty without it. It pauses the process for a moment: call it before
    a measurement window, not during one."""
    exe = shutil.which("py-spy")
    if not exe:
        return {}
    try:
        out = subprocess.run([exe, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {pid: {int(tid): name for tid, name in _PYSPY_THREAD.findall(out)}}


def _stat_cpu(path: str) -> float:
    """utime + stime in seconds from a /proc .../stat file (fields 14 and 15, after the ``(comm)``)."""
    with open(path) as f:
        text = f.read()
    fields = text[text.rindex(")") + 2:].split()  # fields[0] is field 3 (state)
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def _schedstat_cpu(path: str) -> float:
    """Seconds on CPU from /proc .../schedstat (nanoseconds: far finer than stat's 10 ms ticks); nan
    where the kernel has no schedstat."""
    try:
        with open(path) as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return float("nan")


def thread_counters(pid: int) -> dict[int, tuple[str, float, float, int]]:
    """Per thread of ``pid``: (comm, CPU s from stat, CPU s from schedstat, voluntary +
    nonvoluntary context switches)."""
    out: dict[int, tuple[str, float, float, int]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{base}/comm") as f:
                comm = f.read().strip()
            switches = 0
            with open(f"{base}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                        switches += int(line.split()[1])
            out[int(tid)] = (comm, _stat_cpu(f"{base}/stat"), _schedstat_cpu(f"{base}/schedstat"), switches)
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread exited between listdir and the reads
    return out


def _snapshot(pid: int) -> tuple[float, dict[int, tuple[str, float, float, int]]]:
    # the process's own stat sums CPU over all its threads, exited ones included
    return _stat_cpu(f"/proc/{pid}/stat"), thread_counters(pid)


def idle_cost(procs: dict[str, int], window: float, names: dict[int, dict[int, str]] | None = None) -> dict:
    """CPU seconds per second and context switches (wakeups) per second of each process in
    ``procs`` ({label: pid}) over the same ``window`` seconds, in total and per thread.

    Every process is sampled at the same instants, so load on the machine hits all alike.
    A context switch is counted for each time a thread went off CPU (voluntary: it blocked,
    i.e. it had woken up before; nonvoluntary: preempted), summed over the threads.
    """
    names = names or {}
    t0 = time.perf_counter()
    before = {label: _snapshot(pid) for label, pid in procs.items()}
    time.sleep(window)
    after = {label: _snapshot(pid) for label, pid in procs.items()}
    dt = time.perf_counter() - t0
    out: dict[str, dict] = {}
    for label, pid in procs.items():
        (cpu0, th0), (cpu1, th1) = before[label], after[label]
        threads = []
        for tid, (comm, cpu, sched, sw) in sorted(th1.items()):
            _, c0, n0, s0 = th0.get(tid, (comm, 0.0, 0.0, 0))  # a thread born in the window counts from 0
            threads.append({"tid": tid, "comm": comm, "name": names.get(pid, {}).get(tid, ""),
                            "cpu_per_s": (cpu - c0) / dt, "sched_cpu_per_s": (sched - n0) / dt,
                            "wakeups_per_s": (sw - s0) / dt})
        out[label] = {"pid": pid, "cpu_per_s": (cpu1 - cpu0) / dt,
                      "sched_cpu_per_s": sum(t["sched_cpu_per_s"] for t in threads),
                      "wakeups_per_s": sum(t["wakeups_per_s"] for t in threads),
                      "threads": threads, "gone_threads": len(set(th0) - set(th1))}
    return {"window_s": dt, "procs": out}


def rank_pids(k: Kernel) -> dict[int, int]:
    """{rank: pid} of a distributed kernel's rank processes (children of its parent process)."""
    out: dict[int, int] = {}
    for child in k.proc().children(recursive=True):
        try:
            if "dist_kernel.rank" not in " ".join(child.cmdline()):
                continue
            rank = child.environ().get("DIST_KERNEL_RANK")
        except Exception:  # noqa: BLE001 - a child that exited or is not ours
            continue
        if rank is not None:
            out[int(rank)] = child.pid
    return out


def gloo_idle_process() -> tuple[subprocess.Popen, dict[int, dict[int, str]]]:
    """Start :data:`GLOO_IDLE_SCRIPT`; returns the process (idle once this returns; close its stdin
    to end it) and its thread names."""
    p = subprocess.Popen([sys.executable, "-c", GLOO_IDLE_SCRIPT], cwd=ROOT, env=_env(), stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    names: dict[int, dict[int, str]] = {}
    assert p.stdout is not None
    for line in p.stdout:  # ends at "ready", or at EOF if it failed (then it is reported as missing)
        if line.startswith("@threads"):
            d = json.loads(line[len("@threads"):])
            names[int(d["pid"])] = {int(t): n for t, n in d["names"].items()}
        elif line.strip() == "ready":
            break
    return p, names
