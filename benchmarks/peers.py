"""The tools users would pick instead, driven from a plain ipykernel the way a user would."""

from __future__ import annotations

import importlib.util
import time

from benchmarks.common import Kernel, log
from benchmarks.measure import roundtrip


def available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def ipyparallel(engines: int, reps: int) -> dict:
    """``%px x = 1`` round trip with ``engines`` engines; also engines start + ``%px import torch``."""
    with_k = Kernel("plain")
    try:
        t0 = time.perf_counter()
        with_k.check(f"import ipyparallel as ipp\ncluster = ipp.Cluster(n={engines}, log_level=40)\n"
                     "rc = cluster.start_and_connect_sync()\nrc[:].activate()\nrc[:].block = True",
                     timeout=180)
        with_k.check("%px import torch, torch.distributed", timeout=180)
        startup = time.perf_counter() - t0
        rt = roundtrip(with_k, reps, code="%px x = 1")
        rt["startup"] = startup
        try:
            with_k.execute("cluster.stop_cluster_sync()", timeout=60)
        except Exception as e:  # noqa: BLE001
            log(f"ipyparallel: stopping the cluster failed: {e}")
        return rt
    finally:
        with_k.shutdown()


def nbdistributed(ranks: int, reps: int) -> dict:
    """nbdistributed's auto-distributed cell ``x = 1`` with ``ranks`` workers."""
    k = Kernel("plain")
    try:
        t0 = time.perf_counter()
        k.check("%load_ext nbdistributed", timeout=120)
        res = k.check(f"%dist_init -n {ranks}", timeout=180)
        if "Successfully started" not in res.text():
            raise RuntimeError(f"nbdistributed did not start: {res.text()[-1000:]}")
        k.check("import torch", timeout=180)  # the first distributed cell (peers saw it lost)
        startup = time.perf_counter() - t0
        rt = roundtrip(k, reps, warmup=2)
        rt["startup"] = startup
        try:
            k.execute("%dist_shutdown", timeout=60)
        except Exception as e:  # noqa: BLE001
            log(f"nbdistributed: shutdown failed: {e}")
        return rt
    finally:
        k.shutdown()
