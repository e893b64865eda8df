"""``python -m benchmarks.gpu [--out DIR]``: prove the GPU paths on a real GPU (issue 7).

Each check starts real kernels through jupyter_client and writes one row of DIR/gpu.md and
DIR/gpu.json (default DIR: benchmarks/results):

1. ``backend``: nccl at 1 rank and gloo at 2 ranks sharing GPU 0: ``device`` is ``cuda:N``,
   tensors land there, an all_reduce of CUDA tensors gives the right sum.
2. ``gpus``: ``--gpus 0`` is physical GPU 0 (UUID against nvidia-smi); accelerate's and fastai's
   own device choice agree with ``device``; a GPU that does not exist is a clear ConfigError.
3. ``empty_cache``: ``torch.cuda.memory_reserved()`` after a cell that allocated and freed a
   large tensor, with the after-cell cache freeing on and off.
4. ``fastai``: a vision epoch (resnet34 at 224 px, fp16) in the kernel against the same code
   run as a plain script: seconds per epoch and their ratio.
5. ``ddp``: a DDP training step in the kernel against the same function under torchrun.
6. ``lifecycle``: GPU memory in use (nvidia-smi) after restart, shutdown and a SIGKILLed parent.
7. ``faults`` (issue 29), NCCL at world size 1: the NCCL communicators aborted as a teardown
   aborts them, then the group re-formed with a CUDA tensor kept; a CUDA out-of-memory error, then
   the next cell works; the stop button in a busy CUDA loop answered within seconds, variables kept.

``--rehearse`` runs the same checks on a machine without a GPU (``--gpus none``, gloo, small
images): the harness is exercised end to end, the CUDA-only numbers are reported as not run.
The device machine lacks fastai and Jupyter: bring them as wheels (benchmarks/gpu_wheels.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from benchmarks import measure
from benchmarks.common import ROOT, Kernel, _env, log

DEFAULT_OUT = ROOT / "benchmarks" / "results"
GIB = 2**30


@dataclass
class Check:
    name: str
    ok: bool | None  # None: not run here (needs CUDA)
    summary: str
    data: dict = field(default_factory=dict)


# ------------------------------------------------------------------ what the cells print
def records(text: str) -> dict[int, dict]:
    """Per-rank JSON records printed as ``@@{...}`` (merged output may label them ``[rank N]``)."""
    out = {}
    for line in text.splitlines():
        m = re.match(r"^(?:\[rank [\d,\-]+\] )?@@(\{.*\})\s*$", line)
        if m:
            rec = json.loads(m.group(1))
            out[int(rec.get("rank", 0))] = rec
    return out


PROBE = """\
import json as _j, os as _os, torch as _t, torch.distributed as _d
_x = _t.full((4,), float(rank + 1), device=device)
_d.all_reduce(_x)
_r = dict(rank=rank, device=str(device), tensor_device=str(_x.device), sum=_x.tolist(),
          backend=str(_d.get_backend()), world=_d.get_world_size(), local_rank=local_rank,
          LOCAL_RANK=_os.environ.get('LOCAL_RANK'), CUDA_VISIBLE_DEVICES=_os.environ.get('CUDA_VISIBLE_DEVICES'))
if _t.cuda.is_available():
    _p = _t.cuda.get_device_properties(device)
    _r.update(current_device=_t.cuda.current_device(), device_count=_t.cuda.device_count(),
              name=_p.name, uuid=str(getattr(_p, 'uuid', '')))
print('@@' + _j.dumps(_r))
"""

AGREE = """\
import json as _j, torch as _t
from accelerate import PartialState as _PS
import fastai.distributed as _fd
from fastai.torch_core import default_device as _dd
_s = _PS()
_where = lambda d: str(_t.empty(0, device=d).device)  # where a tensor really lands
print('@@' + _j.dumps(dict(rank=rank, device=str(device), accelerate=_where(_s.device),
      accelerate_local_index=_s.local_process_index, accelerate_processes=_s.num_processes,
      fastai=_where(_dd()), fastai_rank=_fd.rank_distrib(), fastai_world=_fd.num_distrib())))
"""

RESERVED = """\
import json as _j, torch as _t
{alloc}print('@@' + _j.dumps(dict(rank=rank, reserved=_t.cuda.memory_reserved(device), free=_t.cuda.mem_get_info(device)[0])))
"""


# ------------------------------------------------------------------ the machine
def nvidia_smi(query: str, kind: str = "gpu") -> list[list[str]]:
    """Rows of ``nvidia-smi --query-<kind>=<query>``; [] without nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return []
    out = subprocess.run([smi, f"--query-{kind}={query}", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=30).stdout
    return [[c.strip() for c in line.split(",")] for line in out.strip().splitlines() if line.strip()]


def gpu_used_mib(index: int = 0) -> float | None:
    rows = nvidia_smi("index,memory.used")
    return next((float(r[1]) for r in rows if r[0] == str(index)), None)


def machine() -> dict:
    info = {"python": platform.python_version(), "cpus": os.cpu_count(), "platform": platform.platform()}
    rows = nvidia_smi("index,name,uuid,memory.total,driver_version")
    info["gpus"] = [dict(zip(("index", "name", "uuid", "memory_mib", "driver"), r, strict=False)) for r in rows]
    probe = subprocess.run([sys.executable, "-c", "import torch, json; print(json.dumps(dict(torch=torch.__version__, "
                            "cuda=torch.version.cuda, available=torch.cuda.is_available())))"],
                           capture_output=True, text=True, timeout=120)
    info.update(json.loads(probe.stdout) if probe.returncode == 0 else {"torch": probe.stderr[-300:]})
    return info


def _uuid(text: str) -> str:
    """nvidia-smi says GPU-xxxxxxxx-..., torch says xxxxxxxx-...: compare the hex digits."""
    return text.lower().removeprefix("gpu-").replace("-", "")


# ------------------------------------------------------------------ checks
class Proof:
    def __init__(self, cuda: bool, args: argparse.Namespace) -> None:
        self.cuda, self.args = cuda, args
        self.gpu_opt = ("--gpus", "0") if cuda else ("--gpus", "none")
        self.device0 = "cuda:0" if cuda else "cpu"

    def kernel(self, ranks: int, *options: str) -> Kernel:
        return Kernel("dist", ranks, (*self.gpu_opt, *options))

    def backend(self) -> Check:
        runs = {}
        cases = [("nccl", 1), ("gloo", 2)] if self.cuda else [("gloo", 1), ("gloo", 2)]
        for backend, ranks in cases:
            k = self.kernel(ranks, "--backend", backend)
            try:
                runs[f"{backend}@{ranks}"] = records(k.check(PROBE).stdout())
            finally:
                k.shutdown()
        problems = []
        for case, recs in runs.items():
            ranks = int(case.split("@")[1])
            want_sum = [float(ranks * (ranks + 1) // 2)] * 4
            if sorted(recs) != list(range(ranks)):
                problems.append(f"{case}: records from ranks {sorted(recs)}")
            for r, rec in recs.items():
                if (rec["device"], rec["tensor_device"], rec["sum"], rec["backend"]) != (
                        self.device0, self.device0, want_sum, case.split("@")[0]):
                    problems.append(f"{case} rank {r}: {rec}")
                if self.cuda and rec.get("current_device") != 0:
                    problems.append(f"{case} rank {r}: current_device {rec.get('current_device')}")
        summary = "; ".join(f"{c}: device {sorted({r['device'] for r in v.values()})}, all_reduce sum "
                            f"{next(iter(v.values()))['sum'][0]:g}" for c, v in runs.items() if v)
        return Check("backend", not problems, "; ".join(problems) or summary, {"runs": runs})

    def gpus(self) -> Check:
        problems, data = [], {}
        k = self.kernel(1)
        try:
            data["probe"] = rec = records(k.check(PROBE).stdout()).get(0, {})
            data["agree"] = agree = records(k.check(AGREE).stdout()).get(0, {})
        finally:
            k.shutdown()
        if self.cuda:
            smi = {r[0]: r[1] for r in nvidia_smi("index,uuid")}
            data["nvidia_smi_uuid_0"] = smi.get("0")
            if not rec.get("uuid") or _uuid(rec["uuid"]) != _uuid(smi.get("0", "")):
                problems.append(f"rank 0 runs on {rec.get('uuid')}, physical GPU 0 is {smi.get('0')}")
            if rec.get("CUDA_VISIBLE_DEVICES") != "0":
                problems.append(f"CUDA_VISIBLE_DEVICES={rec.get('CUDA_VISIBLE_DEVICES')!r}")
        if rec.get("LOCAL_RANK") != str(rec.get("local_rank")):
            problems.append(f"LOCAL_RANK {rec.get('LOCAL_RANK')} != local_rank {rec.get('local_rank')}")
        for lib in ("accelerate", "fastai"):
            if agree.get(lib) != agree.get("device"):
                problems.append(f"{lib} puts tensors on {agree.get(lib)}, the kernel's device is {agree.get('device')}")
        if (agree.get("fastai_rank"), agree.get("fastai_world"), agree.get("accelerate_local_index")) != (0, 1, 0):
            problems.append(f"rank/world as fastai and accelerate see them: {agree}")
        # a GPU that does not exist: a clear error in the first cell, naming the option and the fix
        missing = str(len(nvidia_smi("index")))
        bad = Kernel("dist", 1, ("--gpus", missing))
        try:
            res = bad.execute("1")
            data["missing_gpu_error"] = err = f"{res.reply.get('ename')}: {res.reply.get('evalue')}"
        finally:
            bad.shutdown()
        if not ("ConfigError" in err and f"--gpus {missing}" in err and "Fix" in err):
            problems.append(f"--gpus {missing} gave {err!r}")
        summary = (f"--gpus 0 -> {rec.get('device')} ({rec.get('name', 'CPU')}), CUDA_VISIBLE_DEVICES="
                   f"{rec.get('CUDA_VISIBLE_DEVICES')!r}, LOCAL_RANK={rec.get('LOCAL_RANK')}; accelerate -> "
                   f"{agree.get('accelerate')}, fastai -> {agree.get('fastai')}; --gpus {missing} -> ConfigError")
        return Check("gpus", not problems, "; ".join(problems) or summary, data)

    def empty_cache(self) -> Check:
        if not self.cuda:
            return Check("empty_cache", None, "not run: needs CUDA")
        size = self.args.alloc_gib * GIB
        alloc = f"_big = _t.empty({size}, dtype=_t.uint8, device=device); del _big\n"
        k = self.kernel(1)
        data = {}
        try:
            for mode in ("on", "off"):
                k.check(f"%dist_empty_cache {mode}")
                inside = records(k.check(RESERVED.format(alloc=alloc + "_t.cuda.synchronize()\n")).stdout())[0]
                after = records(k.check(RESERVED.format(alloc="")).stdout())[0]
                data[mode] = {"reserved_in_cell_mib": inside["reserved"] / 2**20,
                              "reserved_next_cell_mib": after["reserved"] / 2**20,
                              "free_next_cell_mib": after["free"] / 2**20}
        finally:
            k.shutdown()
        on, off = data["on"], data["off"]
        ok = (on["reserved_in_cell_mib"] >= size / 2**20 and on["reserved_next_cell_mib"] < 0.05 * size / 2**20
              and off["reserved_next_cell_mib"] >= size / 2**20)
        summary = (f"{self.args.alloc_gib} GiB allocated and freed: reserved {on['reserved_in_cell_mib']:.0f} MiB in the "
                   f"cell, {on['reserved_next_cell_mib']:.0f} MiB in the next (empty_cache on), "
                   f"{off['reserved_next_cell_mib']:.0f} MiB with it off")
        return Check("empty_cache", ok, summary, data)

    def fastai(self) -> Check:
        a = self.args
        data_dir = Path(tempfile.mkdtemp(prefix="dk-gpu-images-"))
        try:
            subprocess.run([sys.executable, "-c", DRAW, str(data_dir), str(a.images), str(a.image_size + 32)],
                           check=True, timeout=600)
            code = FASTAI.format(path=str(data_dir), size=a.image_size, bs=a.bs, epochs=a.epochs,
                                 arch=a.arch, fp16=self.cuda, workers=min(8, os.cpu_count() or 1))
            script = data_dir / "train.py"
            script.write_text(code)
            t0 = time.perf_counter()
            p = subprocess.run([sys.executable, str(script)], cwd=ROOT, env=_env(),
                               capture_output=True, text=True, timeout=1800)
            if p.returncode != 0:
                raise RuntimeError(f"script failed:\n{p.stderr[-3000:]}")
            script_run = records(p.stdout)[0]
            script_run["wall_s"] = time.perf_counter() - t0
            k = self.kernel(1)
            try:
                kernel_run = records(k.check(code, timeout=1800).stdout())[0]
            finally:
                k.shutdown()
        finally:
            shutil.rmtree(data_dir, ignore_errors=True)
        ks, ss = statistics.median(kernel_run["epochs_s"]), statistics.median(script_run["epochs_s"])
        data = {"kernel": kernel_run, "script": script_run, "ratio_kernel_over_script": ks / ss,
                "images": a.images, "image_size": a.image_size, "arch": a.arch, "bs": a.bs}
        ok = kernel_run["device"] == script_run["device"] == self.device0
        return Check("fastai", ok, f"{a.arch} {a.image_size}px, {a.images} images: epoch {ks:.2f} s in the kernel, "
                     f"{ss:.2f} s as a script on {script_run['device']} (ratio {ks / ss:.3f})", data)

    def ddp(self) -> Check:
        kw = dict(steps=50, warmup=10, batch=256, width=4096, depth=4) if self.cuda else \
            dict(steps=5, warmup=2, batch=16, width=64, depth=2)
        k = self.kernel(1)
        try:
            kernel_run = measure.train_in_kernel(k, **kw)
        finally:
            k.shutdown()
        torchrun = measure.train_torchrun(1, **kw)
        ratio = kernel_run["median_step_s"] / torchrun["median_step_s"]
        ok = kernel_run["device"] == torchrun["device"] == self.device0
        return Check("ddp", ok, f"DDP step (MLP width {kw['width']}, batch {kw['batch']}, 1 rank, "
                     f"{kernel_run['backend']}): {kernel_run['median_step_s'] * 1e3:.2f} ms in the kernel, "
                     f"{torchrun['median_step_s'] * 1e3:.2f} ms under torchrun (ratio {ratio:.3f})",
                     {"kernel": kernel_run, "torchrun": torchrun, "ratio": ratio, **kw})

    def faults(self) -> Check:
        if not self.cuda:
            return Check("faults", None, "not run: needs CUDA (NCCL)")
        k = self.kernel(1, "--backend", "nccl")
        data: dict = {}
        problems = []
        try:
            k.check("import torch, threading\nimport torch.distributed as dist\n"
                    "x = torch.arange(4.0, device=device)\na = torch.randn(2048, 2048, device=device)")
            # a teardown's NCCL abort, as the kernel runs it on a rank blocked behind a stall
            res = k.execute("from dist_kernel.rank import nccl\nnccl.abort(interrupt_main=True)\n"
                            "for _ in range(10**6):\n    pass")
            data["abort"] = text = res.text()
            if "GroupAborted" not in text or "re-formed" not in text:
                problems.append(f"abort: {text[-400:]!r}")
            after = k.execute("t = torch.ones(1, device=device)\ndist.all_reduce(t)\n"
                              "print(x.sum().item(), t.item(), x.device, dist.get_backend())").stdout()
            data["after_abort"] = after
            if after.strip() != "6.0 1.0 cuda:0 nccl":
                problems.append(f"after the abort: {after!r}")
            oom = k.execute("_huge = torch.empty(2**44, dtype=torch.uint8, device=device)")
            data["oom"] = f"{oom.reply.get('ename')}: {oom.reply.get('evalue', '')[:200]}"
            if oom.reply.get("ename") != "OutOfMemoryError":
                problems.append(f"out of memory: {data['oom']}")
            timer = threading.Timer(2.0, k.km.interrupt_kernel)
            timer.start()
            busy = k.execute("while True:\n    a = a @ a\n    a = a / a.norm()", timeout=60)
            data["stop_s"] = round(busy.elapsed - 2.0, 2)
            if busy.reply.get("ename") != "KeyboardInterrupt" or busy.elapsed > 12:
                problems.append(f"stop in a CUDA loop: {busy.reply.get('ename')} after {busy.elapsed:.1f} s")
            kept = k.execute("print(x.sum().item(), torch.isfinite(a).all().item())").stdout()
            if kept.strip() != "6.0 True":
                problems.append(f"after the stop: {kept!r}")
        finally:
            k.shutdown()
        summary = (f"NCCL abort then re-form: {data.get('after_abort', '').strip()!r} (x kept on the GPU); "
                   f"out of memory: {data.get('oom', '')[:60]}; stop in a busy CUDA loop answered "
                   f"{data.get('stop_s')} s after it")
        return Check("faults", not problems, "; ".join(problems) or summary, data)

    def lifecycle(self) -> Check:
        hold = (f"_keep = torch.empty({self.args.alloc_gib * GIB}, dtype=torch.uint8, device=device)\n"
                "torch.cuda.synchronize()" if self.cuda else "_keep = bytearray(2**28)")
        used: dict[str, float | None] = {"before": gpu_used_mib()}
        problems = []
        ends: list[tuple[str, Callable[[Kernel], Kernel | None]]] = [
            ("restart", _restart), ("shutdown", Kernel.shutdown), ("the parent's SIGKILL", _kill_parent)]
        k: Kernel | None = None
        for when, end in ends:  # each time a rank holds memory, then the kernel ends that rank
            k = k or self.kernel(1)
            k.check("import torch\n" + hold)
            used.setdefault("holding", gpu_used_mib())
            family = psutil.Process(k.pid).children(recursive=True)  # ranks and the reaper
            k = end(k)  # the kernel, if it lives on
            _, alive = psutil.wait_procs(family, timeout=10)
            problems += [f"after {when}, process {p.pid} still runs" for p in alive]
            time.sleep(1)
            used[f"after {when}"] = gpu_used_mib()
        if k is not None:
            k.shutdown()
        if self.cuda:
            base, size = used["before"] or 0.0, self.args.alloc_gib * 1024
            if (used["holding"] or 0) - base < size:
                problems.append(f"holding {self.args.alloc_gib} GiB did not show in nvidia-smi: {used}")
            for when, _ in ends:
                limit = base + (2048 if when == "restart" else 256)  # a fresh rank's CUDA context
                if (used[f"after {when}"] or 0) > limit:
                    problems.append(f"after {when}: {used[f'after {when}']:.0f} MiB in use, {base:.0f} before")
        summary = ("nvidia-smi MiB used: " + ", ".join(f"{k_} {v:.0f}" for k_, v in used.items() if v is not None)
                   if self.cuda else "rank processes end on restart, shutdown and parent SIGKILL (no GPU memory to read)")
        return Check("lifecycle", not problems, "; ".join(problems) or summary, {"gpu_used_mib": used})


def _restart(k: Kernel) -> Kernel:
    k.km.restart_kernel(now=False)
    k.kc.wait_for_ready(timeout=180)
    return k


def _kill_parent(k: Kernel) -> None:
    os.kill(k.pid, signal.SIGKILL)
    k.kc.stop_channels()
    k.km.cleanup_resources()


DRAW = """\
import sys, numpy as np
from pathlib import Path
from PIL import Image, ImageDraw
dest, n, size = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rng = np.random.default_rng(0)
for i in range(n):  # round 'cats' (upper-case names) and long 'dogs', as in examples/fastai_pets_tiny
    cat = i % 2 == 0
    img = Image.new('RGB', (size, size), tuple(int(c) for c in rng.integers(0, 110, 3)))
    r = int(rng.integers(size // 5, size // 3)); x, y = (int(v) for v in rng.integers(r, size - r, 2))
    fill = tuple(int(c) for c in rng.integers(140, 256, 3))
    d = ImageDraw.Draw(img)
    if cat: d.ellipse([x - r, y - r, x + r, y + r], fill=fill)
    else: d.rectangle([x - r, y - r // 3, x + r, y + r // 3], fill=fill)
    img.save(dest / f"{'Cat' if cat else 'dog'}_{i}.jpg", quality=90)
"""

# the same code in the kernel's cell and in the script (the script has no `rank`)
FASTAI = """\
from fastai.vision.all import *
import json, os, time
def is_cat(x): return x[0].isupper()
dls = ImageDataLoaders.from_name_func({path!r}, get_image_files({path!r}), valid_pct=0.2, seed=42,
    label_func=is_cat, item_tfms=Resize({size}), batch_tfms=aug_transforms(), bs={bs}, num_workers={workers})
learn = vision_learner(dls, {arch}, pretrained=False, metrics=error_rate)
if {fp16}: learn = learn.to_fp16()
with learn.no_bar(): learn.fit(1)  # warm-up: cudnn autotuning, worker start
epochs = []
for _ in range({epochs}):
    t0 = time.perf_counter(); learn.fit(1); epochs.append(time.perf_counter() - t0)
print('@@' + json.dumps(dict(rank=int(os.environ.get('RANK', 0)), epochs_s=epochs, device=str(dls.device),
                             error_rate=float(learn.validate()[1]))))
"""


# ------------------------------------------------------------------ report
def write(out: Path, info: dict, checks: list[Check], argv: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu.json").write_text(json.dumps({"machine": info, "argv": argv, "checks": [asdict(c) for c in checks]},
                                             indent=2, default=str))
    gpu = info["gpus"][0] if info.get("gpus") else None
    head = (f"{gpu['name']} ({gpu['memory_mib']} MiB, driver {gpu['driver']})" if gpu else "no GPU (rehearsal on CPU)")
    lines = ["# GPU proof (issue 7)", "",
             f"Machine: {head}; torch {info.get('torch')} (CUDA {info.get('cuda')}); Python {info['python']}; "
             f"{info['cpus']} CPUs.", "",
             f"Command: `python -m benchmarks.gpu {' '.join(argv)}` (see benchmarks/README.md, GPU section).", "",
             "| check | result | what was seen |", "| --- | --- | --- |"]
    for c in checks:
        mark = {True: "ok", False: "FAILED", None: "not run"}[c.ok]
        lines.append(f"| {c.name} | {mark} | {c.summary.replace('|', '/')} |")
    (out / "gpu.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--rehearse", action="store_true", help="no GPU here: run the checks on CPU")
    p.add_argument("--only", nargs="+", default=None, help="run only these checks")
    p.add_argument("--images", type=int, default=2000)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--bs", type=int, default=64)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--arch", default="resnet34")
    p.add_argument("--alloc-gib", type=int, default=4)
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)
    info = machine()
    cuda = bool(info.get("available"))
    if not cuda and not args.rehearse:
        print("No CUDA GPU here (torch.cuda.is_available() is False). Run this on a GPU machine, or pass "
              "--rehearse to check the harness on CPU.", file=sys.stderr)
        return 2
    proof = Proof(cuda, args)
    order: list[tuple[str, Callable[[], Check]]] = [
        ("backend", proof.backend), ("gpus", proof.gpus), ("empty_cache", proof.empty_cache),
        ("fastai", proof.fastai), ("ddp", proof.ddp), ("lifecycle", proof.lifecycle), ("faults", proof.faults)]
    checks = []
    for name, run in order:
        if args.only and name not in args.only:
            continue
        log(f"gpu check {name}")
        t0 = time.monotonic()
        try:
            check = run()
        except Exception as e:  # noqa: BLE001 - one broken check must not cost the others
            check = Check(name, False, f"{type(e).__name__}: {str(e)[:300]}", {"traceback": traceback.format_exc()})
        check.data["seconds"] = round(time.monotonic() - t0, 1)
        log(f"  {check.ok}: {check.summary}")
        checks.append(check)
        write(args.out, info, checks, argv)  # partial results survive a timeout
    return 0 if all(c.ok is not False for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
