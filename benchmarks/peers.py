"""The tools users would pick instead, driven from a plain ipykernel the way a user would."""

from __future__ import annotations

import importlib.util
import time
from collections.abc import Callable

from benchmarks.common import Kernel, log
from benchmarks.measure import roundtrip


def available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def ipyparallel(engines: int, reps: int) -> dict:
    """``%px x = 1`` round trip with ``engines`` engines; also engines start + ``%px import torch``."""
    def start(k: Kernel) -> None:
        k.check(f"import ipyparallel as ipp\ncluster = ipp.Cluster(n={engines}, log_level=40)\n"
                "rc = cluster.start_and_connect_sync()\nrc[:].activate()\nrc[:].block = True", timeout=180)
        k.check("%px import torch, torch.distributed", timeout=180)

    return _from_plain_kernel("ipyparallel", start, "cluster.stop_cluster_sync()", reps, code="%px x = 1")


def nbdistributed(ranks: int, reps: int) -> dict:
    """nbdistributed's auto-distributed cell ``x = 1`` with ``ranks`` workers."""
    def start(k: Kernel) -> None:
        k.check("%load_ext nbdistributed", timeout=120)
        res = k.check(f"%dist_init -n {ranks}", timeout=180)
        if "Successfully started" not in res.text():
            raise RuntimeError(f"nbdistributed did not start: {res.text()[-1000:]}")
        k.check("import torch", timeout=180)  # the first distributed cell (peers saw it lost)

    return _from_plain_kernel("nbdistributed", start, "%dist_shutdown", reps, warmup=2)


def _from_plain_kernel(name: str, start: Callable[[Kernel], None], stop: str, reps: int, **roundtrip_kw) -> dict:
    """A peer driven from a plain ipykernel, as its users run it: ``start`` (timed as its
    startup, torch imported on the workers), the round trip, then ``stop``."""
    k = Kernel("plain")
    try:
        t0 = time.perf_counter()
        start(k)
        startup = time.perf_counter() - t0
        rt = roundtrip(k, reps, **roundtrip_kw)
        rt["startup"] = startup
        try:
            k.execute(stop, timeout=60)
        except Exception as e:  # noqa: BLE001
            log(f"{name}: {stop} failed: {e}")
        return rt
    finally:
        k.shutdown()
