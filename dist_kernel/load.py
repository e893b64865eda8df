"""A rank process's load, sampled from outside it: CPU and memory with psutil, its GPU with NVML.

Used by the parent for the ranks on its own machine and by each node agent for its node's ranks
(``%dist_top``, ``%dist_status``): nothing runs inside the ranks. NVML comes from the optional
``nvidia-ml-py`` package (``pip install dist-kernel[gpu]``), imported the first time a GPU is
sampled; without it, without GPUs, or with GPUs hidden by ``CUDA_VISIBLE_DEVICES``, the GPU
fields stay None ("n/a" in the tables), never an error.

A sample is a plain dict (it crosses the wire from the agents), with these keys, each None when
unknown: ``cpu`` (percent of one core since the previous sample), ``rss`` (bytes),
``gpu_util`` (percent), ``gpu_used`` and ``gpu_total`` (bytes), ``gpu_temp`` (degrees C).
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Mapping
from typing import Any

import psutil

from dist_kernel import placement

#: every key of a sample
KEYS = ("cpu", "rss", "gpu_util", "gpu_used", "gpu_total", "gpu_temp")

#: an NVML device as ``CUDA_VISIBLE_DEVICES`` names it: an index (int) or a UUID (str)
Target = int | str


def gpu_target(gpus: tuple[int, ...] | list[int], local_rank: int, mask: str | None) -> Target | None:
    """The NVML device of a rank: the GPU it pins (:func:`placement.cuda_index` among ``gpus``, ids
    into this machine's visible GPUs), mapped through this process's ``CUDA_VISIBLE_DEVICES``
    (``mask``) onto NVML's, which ignores that variable. None on CPU, or for a mask entry NVML
    cannot name (a MIG instance)."""
    if not gpus:
        return None
    gpu = gpus[placement.cuda_index(local_rank, len(gpus))]
    if mask is None:
        return gpu
    entries = [p.strip() for p in mask.split(",") if p.strip()]
    if gpu >= len(entries):
        return None
    entry = entries[gpu]
    if entry.isdigit():
        return int(entry)
    return entry if entry.startswith("GPU-") else None


class Nvml:
    """NVML, initialised on first use; every failure (no package, no driver, no such GPU) is None."""

    def __init__(self) -> None:
        self._mod: Any = None
        self._failed = False
        self._handles: dict[Target, Any] = {}

    def _lib(self) -> Any:
        if self._mod is None and not self._failed:
            try:
                mod = importlib.import_module("pynvml")  # nvidia-ml-py: optional
                mod.nvmlInit()
                self._mod = mod
            except Exception:  # noqa: BLE001 - missing package or driver: GPU columns say n/a
                self._failed = True
        return self._mod

    def sample(self, target: Target | None) -> dict[str, float | int | None]:
        """The device's utilisation, memory and temperature (None each where unknown)."""
        out: dict[str, float | int | None] = {"gpu_util": None, "gpu_used": None, "gpu_total": None, "gpu_temp": None}
        nv = self._lib() if target is not None else None
        if nv is None or target is None:
            return out
        try:
            handle = self._handles.get(target)
            if handle is None:
                handle = (nv.nvmlDeviceGetHandleByIndex(target) if isinstance(target, int)
                          else nv.nvmlDeviceGetHandleByUUID(target))
                self._handles[target] = handle
        except Exception:  # noqa: BLE001 - no such device
            return out
        with contextlib.suppress(Exception):
            out["gpu_util"] = float(nv.nvmlDeviceGetUtilizationRates(handle).gpu)
        with contextlib.suppress(Exception):
            mem = nv.nvmlDeviceGetMemoryInfo(handle)
            out["gpu_used"], out["gpu_total"] = int(mem.used), int(mem.total)
        with contextlib.suppress(Exception):
            out["gpu_temp"] = float(nv.nvmlDeviceGetTemperature(handle, nv.NVML_TEMPERATURE_GPU))
        return out


class LoadSampler:
    """Samples processes by pid. The CPU percentage is over the time since the same pid's
    previous sample (psutil keeps that per ``Process``), so the processes are kept."""

    def __init__(self, nvml: Nvml | None = None) -> None:
        self.nvml = nvml if nvml is not None else Nvml()
        self._procs: dict[int, psutil.Process] = {}

    def sample(self, pid: int | None, target: Target | None) -> dict[str, float | int | None]:
        """One process's sample (see the module's docstring)."""
        out: dict[str, float | int | None] = {"cpu": None, "rss": None}
        proc = self._procs.get(pid) if pid else None
        first = proc is None
        if pid and proc is None:
            with contextlib.suppress(psutil.Error):
                proc = self._procs[pid] = psutil.Process(pid)
        if proc is not None:
            try:
                with proc.oneshot():
                    cpu = proc.cpu_percent(None)
                    out["cpu"] = None if first else cpu  # the first call only starts the count
                    out["rss"] = proc.memory_info().rss
            except psutil.Error:  # it ended meanwhile
                self._procs.pop(pid or 0, None)
        out.update(self.nvml.sample(target))
        return out

    def forget(self, keep: set[int]) -> None:
        """Drop the processes not in ``keep`` (ended ranks)."""
        for pid in [p for p in self._procs if p not in keep]:
            del self._procs[pid]


def clean(sample: object) -> dict[str, float | int | None]:
    """A sample that came over the wire, reduced to :data:`KEYS` with numbers or None."""
    src = sample if isinstance(sample, Mapping) else {}
    return {k: v if isinstance(v, (int, float)) and not isinstance(v, bool) else None
            for k, v in ((k, src.get(k)) for k in KEYS)}
