"""What each section measures on one started kernel (plain or distributed)."""

from __future__ import annotations

import os
import re
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


def train_torchrun(ranks: int, **kw: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           os.path.join("benchmarks", "ddp_train.py")] + [f"--{k}={v}" for k, v in kw.items()]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
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
