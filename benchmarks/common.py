"""Shared helpers: start kernels through jupyter_client, time cells, summarise samples."""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psutil
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpec, KernelSpecManager

from dist_kernel.runner import spec_manager

ROOT = Path(os.path.abspath(__file__)).parent.parent


class _PlainSpecManager(KernelSpecManager):
    """A stock ipykernel bound to this interpreter (the baseline every section compares to)."""

    def get_kernel_spec(self, kernel_name: str) -> KernelSpec:
        return KernelSpec(argv=[sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                          display_name="plain ipykernel", language="python", interrupt_mode="signal")


def percentile(xs: list[float], q: float) -> float:
    """The q-th percentile (0-100), linear interpolation; nan for no samples."""
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    # tools that spawn a bare "python" (nbdistributed) must find this venv's
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


@dataclass
class CellTiming:
    """One executed cell as the client saw it."""

    elapsed: float  # send -> parent's idle, seconds
    reply: dict
    outputs: list[tuple[float, str, dict]] = field(default_factory=list)  # (time.time() at receipt, type, content)

    def stdout(self) -> str:
        return "".join(c.get("text", "") for _, t, c in self.outputs if t == "stream" and c.get("name") == "stdout")

    def text(self) -> str:
        parts = []
        for _, t, c in self.outputs:
            if t == "stream":
                parts.append(c.get("text", ""))
            elif t in ("execute_result", "display_data"):
                parts.append(c.get("data", {}).get("text/plain", ""))
            elif t == "error":
                parts.append(f"{c.get('ename')}: {c.get('evalue')}")
        return "".join(parts)


def _over_ipc(km: KernelManager) -> KernelManager:
    """``km`` with its client sockets on IPC, in a private folder (removed with ``km``).

    Over TCP, jupyter_client picks five free ports and the kernel binds them later: a process of a
    parallel test or benchmark can take one in between, and the kernel dies at start with "ZMQError:
    Address already in use" (seen in the GPU-proof rehearsal beside the kernel lane's other worker).
    A socket file in a folder of our own cannot be taken. Plain and distributed kernels alike: the
    pairs of each section stay like for like."""
    folder = tempfile.mkdtemp(prefix="dk-bench-")  # short: a unix socket path is limited to 107 bytes
    km.transport = "ipc"
    km.ip = os.path.join(folder, "kernel")
    weakref.finalize(km, shutil.rmtree, folder, True)
    return km


class Kernel:
    """A started kernel (plain or distributed) with a blocking client; ``started`` is the start time."""

    def __init__(self, kind: str, ranks: int = 1, options: tuple[str, ...] = (), ready_timeout: float = 180) -> None:
        self.kind, self.ranks = kind, ranks
        if kind == "dist":
            ksm = spec_manager(["--ranks", str(ranks), *options])
            self.km = _over_ipc(KernelManager(kernel_name="distributed-python", kernel_spec_manager=ksm))
        else:
            self.km = _over_ipc(KernelManager(kernel_name="python3", kernel_spec_manager=_PlainSpecManager()))
        self.started = time.perf_counter()
        self.km.start_kernel(env=_env(), cwd=str(ROOT))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=ready_timeout)

    @property
    def pid(self) -> int:
        return self.km.provisioner.process.pid

    def proc(self) -> psutil.Process:
        return psutil.Process(self.pid)

    def execute(self, code: str, timeout: float = 300, keep_outputs: bool = True) -> CellTiming:
        """Run ``code``; time from sending the request to the kernel's idle status on IOPub."""
        t0 = time.perf_counter()
        msg_id = self.kc.execute(code, store_history=True, silent=False)  # as JupyterLab sends every cell
        outputs: list[tuple[float, str, dict]] = []
        while True:
            msg = self.kc.get_iopub_msg(timeout=timeout)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            mt = msg["msg_type"]
            if mt == "status":
                if msg["content"]["execution_state"] == "idle":
                    elapsed = time.perf_counter() - t0
                    break
                continue
            if keep_outputs and mt in ("stream", "execute_result", "display_data", "error"):
                outputs.append((time.time(), mt, msg["content"]))
        while True:
            reply = self.kc.get_shell_msg(timeout=timeout)
            if reply["parent_header"].get("msg_id") == msg_id:
                return CellTiming(elapsed, reply["content"], outputs)

    def check(self, code: str, timeout: float = 300) -> CellTiming:
        """Run ``code`` and raise if it failed."""
        res = self.execute(code, timeout=timeout)
        if res.reply.get("status") != "ok":
            raise RuntimeError(f"{self.kind} kernel: cell failed: {res.reply.get('ename')}: "
                               f"{res.reply.get('evalue')}\n{res.text()[-2000:]}")
        return res

    def shutdown(self) -> None:
        try:
            self.kc.stop_channels()
        finally:
            if self.km.has_kernel:
                try:
                    self.km.shutdown_kernel(now=False)
                except Exception:  # noqa: BLE001
                    self.km.shutdown_kernel(now=True)


@contextmanager
def kernel(kind: str, ranks: int = 1, options: tuple[str, ...] = ()):
    k = Kernel(kind, ranks, options)
    try:
        yield k
    finally:
        k.shutdown()


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def write_block(path: Path, text: str, markers: tuple[str, str]) -> None:
    """Put ``text`` between ``markers`` (begin, end) in ``path``, or append it there: each
    benchmark owns its block of a results page, and the prose around the blocks stays."""
    begin, end = markers
    old = path.read_text() if path.exists() else ""
    block = f"{begin}\n{text}{end}\n"
    if begin in old and end in old:
        head, rest = old.split(begin, 1)
        tail = rest.split(end, 1)[1].lstrip("\n")
        new = head + block + ("\n" + tail if tail else "")
    else:
        new = (old.rstrip("\n") + "\n\n" if old.strip() else "") + block
    path.write_text(new)
