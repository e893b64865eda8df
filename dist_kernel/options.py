"""Kernel configuration: one source of truth.

Options come from the kernel's argv (written into kernel.json by ``python -m dist_kernel
install``). Each option may be overridden by one environment variable, ``DIST_KERNEL_`` + its
name in capitals. :data:`OPTIONS` is the only place options are defined; the README's
Configuration table documents it.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
from dataclasses import dataclass, field

from dist_kernel.exceptions import ConfigError

BACKENDS = ("gloo", "nccl")

#: each option's default, written once: the help text, :class:`KernelConfig` and
#: :func:`resolve` read it from here (None: decided from the machine, see the help text)
DEFAULTS: dict[str, object] = {
    "ranks": None, "gpus": None, "backend": None, "timeout": 1800.0, "startup_timeout": 120.0,
    "merge_window_ms": 100.0, "fastai": True, "seed": None, "hang_grace": 10.0, "empty_cache": True,
    "rich_output": "all",
}


def _default(name: str) -> str:
    value = DEFAULTS[name]
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


#: option name (``--name-with-dashes``) -> help text
OPTIONS: dict[str, str] = {
    "ranks": "number of ranks (default: one per GPU, else 2)",
    "gpus": "comma list of physical GPU ids, rank i on the i-th",
    "backend": "gloo or nccl (default: nccl when GPUs are used)",
    "timeout": f"collective timeout in seconds (default {_default('timeout')})",
    "startup_timeout": f"seconds for ranks to start and form the group (default {_default('startup_timeout')})",
    "merge_window_ms": f"ms to wait for identical output from other ranks (default {_default('merge_window_ms')})",
    "fastai": f"on|off: fastai integration inside the ranks (default {_default('fastai')})",
    "seed": "random seed shared by every rank (default: random)",
    "hang_grace": f"seconds a rank may wait in a collective the others never entered (default {_default('hang_grace')})",
    "empty_cache": f"on|off: gc + torch.cuda.empty_cache() after each cell (default {_default('empty_cache')})",
    "rich_output": f"all|rank0: rich output from every rank (merged) or from rank 0 only (default {_default('rich_output')})",
}

#: option name -> environment variable that overrides it
ENV_OVERRIDES: dict[str, str] = {name: "DIST_KERNEL_" + name.upper() for name in OPTIONS}

OUTPUT_POLICIES = ("all", "rank0")

FIX_HINT = (
    "Fix the option in the kernelspec (reinstall with `python -m dist_kernel install ...`) "
    "or unset the environment override, then restart the kernel."
)


@dataclass(frozen=True)
class KernelConfig:
    """Validated settings for one distributed kernel."""

    world_size: int
    backend: str
    gpus: tuple[int, ...] = ()  # physical GPU ids; empty on CPU
    timeout: float = DEFAULTS["timeout"]  # type: ignore[assignment]
    startup_timeout: float = DEFAULTS["startup_timeout"]  # type: ignore[assignment]
    merge_window: float = DEFAULTS["merge_window_ms"] / 1000  # type: ignore[operator]
    fastai: bool = DEFAULTS["fastai"]  # type: ignore[assignment]
    seed: int | None = None  # None: the parent draws one per start, shared by every rank
    hang_grace: float = DEFAULTS["hang_grace"]  # type: ignore[assignment]
    empty_cache: bool = DEFAULTS["empty_cache"]  # type: ignore[assignment]
    rich_output: str = DEFAULTS["rich_output"]  # type: ignore[assignment]
    warnings: tuple[str, ...] = field(default=(), compare=False)

    @property
    def uses_cuda(self) -> bool:
        return bool(self.gpus)

    def device_for(self, rank: int) -> str:
        """Device string a rank will use, as seen inside the rank (CUDA ids are remapped)."""
        if not self.gpus:
            return "cpu"
        return f"cuda:{rank % len(self.gpus)}"

    def describe(self) -> str:
        devices = ", ".join(f"physical GPU {g}" for g in self.gpus) if self.gpus else "CPU"
        return f"{self.world_size} ranks, backend {self.backend}, devices: {devices}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the kernel options to a parser (shared by `kernel`, `install` and `run`)."""
    for name, text in OPTIONS.items():
        parser.add_argument("--" + name.replace("_", "-"), dest=name, default=None, help=text)


def option_argv(ns: argparse.Namespace) -> list[str]:
    """The flags of `ns` that were given, as argv (to write them into kernel.json)."""
    argv: list[str] = []
    for name in OPTIONS:
        value = getattr(ns, name, None)
        if value is not None:
            argv += ["--" + name.replace("_", "-"), str(value)]
    return argv


def visible_gpus(environ: dict[str, str] | None = None) -> list[int]:
    """GPU ids this process may use, found without importing torch (the parent stays light).

    Honours CUDA_VISIBLE_DEVICES; otherwise asks ``nvidia-smi -L``.
    """
    env = os.environ if environ is None else environ
    mask = env.get("CUDA_VISIBLE_DEVICES")
    if mask is not None:
        ids = [p.strip() for p in mask.split(",") if p.strip()]
        if not ids or ids[0].startswith("-"):
            return []
        return list(range(len(ids)))
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [i for i, line in enumerate(x for x in out.splitlines() if x.startswith("GPU "))]


def _int(name: str, raw: str, minimum: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"--{name.replace('_', '-')} {raw!r} is not a whole number. {FIX_HINT}") from None
    if value < minimum:
        raise ConfigError(f"--{name.replace('_', '-')} {value} must be at least {minimum}. {FIX_HINT}")
    return value


def _float(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"--{name.replace('_', '-')} {raw!r} is not a number. {FIX_HINT}") from None
    if value <= 0:
        raise ConfigError(f"--{name.replace('_', '-')} {value} must be positive. {FIX_HINT}")
    return value


def resolve(ns: argparse.Namespace, environ: dict[str, str] | None = None,
            available_gpus: list[int] | None = None) -> KernelConfig:
    """Turn flags (+ environment overrides) into a validated :class:`KernelConfig`.

    Raises :class:`ConfigError` with a message naming the option and the fix.
    """
    env = os.environ if environ is None else environ
    raw: dict[str, str | None] = {}
    for name, var in ENV_OVERRIDES.items():
        raw[name] = env.get(var) or getattr(ns, name, None)

    gpus_avail = visible_gpus(env) if available_gpus is None else available_gpus
    warnings: list[str] = []

    gpus: list[int] = []
    if raw["gpus"] not in (None, ""):
        text = str(raw["gpus"]).strip()
        if text.lower() in ("none", "cpu"):
            gpus = []
        else:
            try:
                gpus = [int(p) for p in text.split(",") if p.strip()]
            except ValueError:
                raise ConfigError(f"--gpus {text!r} must be a comma list of GPU ids like 0,1. {FIX_HINT}") from None
            missing = [g for g in gpus if g not in gpus_avail]
            if missing:
                have = ", ".join(map(str, gpus_avail)) or "none"
                raise ConfigError(
                    f"--gpus {text}: GPU {', '.join(map(str, missing))} does not exist on this machine "
                    f"(visible GPUs: {have}). {FIX_HINT}")
            if len(set(gpus)) != len(gpus):
                raise ConfigError(f"--gpus {text} lists a GPU twice. {FIX_HINT}")
    else:
        gpus = list(gpus_avail)

    backend = (raw["backend"] or ("nccl" if gpus else "gloo")).lower()
    if backend not in BACKENDS:
        raise ConfigError(f"--backend {raw['backend']!r} is unknown; use one of {', '.join(BACKENDS)}. {FIX_HINT}")
    if backend == "nccl" and not gpus:
        raise ConfigError(f"--backend nccl needs GPUs, and none is visible; use --backend gloo. {FIX_HINT}")

    if raw["ranks"] is not None:
        world = _int("ranks", str(raw["ranks"]), 1)
    else:
        world = len(gpus) if gpus else 2
    if backend == "nccl" and world > len(gpus):
        raise ConfigError(
            f"--ranks {world} with nccl needs {world} GPUs but only {len(gpus)} are selected "
            f"(NCCL cannot put two ranks on one GPU); use fewer ranks or --backend gloo. {FIX_HINT}")
    if gpus and world < len(gpus):
        gpus = gpus[:world]
    if gpus and world > len(gpus):
        warnings.append(f"{world} ranks share {len(gpus)} GPU(s) over gloo.")

    timeout = _float("timeout", raw["timeout"]) if raw["timeout"] else KernelConfig.timeout
    startup = _float("startup_timeout", raw["startup_timeout"]) if raw["startup_timeout"] else KernelConfig.startup_timeout
    window = _float("merge_window_ms", raw["merge_window_ms"]) / 1000 if raw["merge_window_ms"] else KernelConfig.merge_window
    seed = _int("seed", str(raw["seed"]), 0) if raw["seed"] not in (None, "") else None
    grace = _float("hang_grace", raw["hang_grace"]) if raw["hang_grace"] else KernelConfig.hang_grace
    output = str(raw["rich_output"] or KernelConfig.rich_output).lower()
    if output not in OUTPUT_POLICIES:
        raise ConfigError(f"--rich-output {raw['rich_output']!r} must be one of {', '.join(OUTPUT_POLICIES)}. {FIX_HINT}")
    return KernelConfig(world_size=world, backend=backend, gpus=tuple(gpus), timeout=timeout,
                        startup_timeout=startup, merge_window=window,
                        fastai=_switch("fastai", raw["fastai"], KernelConfig.fastai), seed=seed, hang_grace=grace,
                        empty_cache=_switch("empty_cache", raw["empty_cache"], KernelConfig.empty_cache),
                        rich_output=output,
                        warnings=tuple(warnings))


def _switch(name: str, raw: str | None, default: bool) -> bool:
    if raw in (None, ""):
        return default
    value = str(raw).lower()
    if value not in ("on", "off", "true", "false", "1", "0"):
        raise ConfigError(f"--{name.replace('_', '-')} {raw!r} must be on or off. {FIX_HINT}")
    return value in ("on", "true", "1")
