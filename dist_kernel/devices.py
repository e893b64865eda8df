"""Which GPUs the ranks use, and over which backend: ``--gpus`` and ``--backend`` resolved.

Found without importing torch (the parent stays light): this machine's GPUs come from
``CUDA_VISIBLE_DEVICES`` or ``nvidia-smi``; the nodes' GPUs (``--launcher slurm|ssh``) cannot
be seen from here, so ``--gpus`` names them. :func:`dist_kernel.options.resolve` calls these
once the rank counts are known; the rule that maps a rank to its GPU is
:func:`dist_kernel.placement.cuda_index`, shared with the ranks.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping

from dist_kernel.exceptions import FIX_HINT, ConfigError
from dist_kernel.launchers import is_remote


def visible_gpus(environ: Mapping[str, str] | None = None) -> list[int]:
    """GPU ids this process may use, found without importing torch.

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


def selected_gpus(raw: str | None, remote: bool, available: list[int]) -> list[int]:
    """The GPU ids ``--gpus`` selects (``raw``: its text, None when not given).

    On this machine they are checked against ``available``, and default to all of them. On
    other machines they are ids on each node, which this machine cannot check; without
    ``--gpus`` those ranks use the CPU.
    """
    if remote:
        return _gpu_list(raw, " on each node") or []
    gpus = _gpu_list(raw, "")
    if gpus is None:
        return list(available)
    missing = [g for g in gpus if g not in available]
    if missing:
        have = ", ".join(map(str, available)) or "none"
        raise ConfigError(
            f"--gpus {str(raw).strip()}: GPU {', '.join(map(str, missing))} does not exist on this machine "
            f"(visible GPUs: {have}). {FIX_HINT}")
    return gpus


def _gpu_list(raw: str | None, where: str) -> list[int] | None:
    """--gpus as ids; None when not given, [] for ``none``/``cpu``; an error names ``where``."""
    if raw in (None, ""):
        return None
    text = str(raw).strip()
    if text.lower() in ("none", "cpu"):
        return []
    try:
        gpus = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        gpus = [-1]
    if not gpus or any(g < 0 for g in gpus):
        raise ConfigError(f"--gpus {text!r} must be a comma list of GPU ids{where} like 0,1. {FIX_HINT}")
    if len(set(gpus)) != len(gpus):
        raise ConfigError(f"--gpus {text} lists a GPU twice. {FIX_HINT}")
    return gpus


def check_nccl_has_gpus(chosen: str | None, gpus: list[int], launcher: str) -> None:
    """A ``--backend nccl`` without GPUs is an error, said before any rank count is checked."""
    if chosen != "nccl" or gpus:
        return
    if is_remote(launcher):
        raise ConfigError(
            f"--backend nccl needs GPUs: with --launcher {launcher}, name the GPU ids on each node "
            f"with --gpus (e.g. --gpus 0,1,2,3), or use --backend gloo. {FIX_HINT}")
    raise ConfigError(f"--backend nccl needs GPUs, and none is visible; use --backend gloo. {FIX_HINT}")


def pick_backend(chosen: str | None, gpus: list[int], per_node: int, remote: bool,
                 warnings: list[str]) -> str:
    """The backend: the one the user chose (checked: NCCL cannot put two ranks on one GPU), else
    nccl on GPUs and gloo on the CPU, or where ranks must share GPUs (said in ``warnings``)."""
    backend = chosen or ("nccl" if gpus else "gloo")
    if chosen is None and backend == "nccl" and per_node > len(gpus):
        # one GPU and ``--ranks 2`` is the common workstation: said once, in the first cell
        warnings.append(f"backend gloo, not nccl: {per_node} ranks on {len(gpus)} GPU(s) must share them, and "
                        "NCCL cannot put two ranks on one GPU. For nccl, use one rank per GPU "
                        f"(--ranks {len(gpus)}); pass --backend gloo to choose gloo yourself and drop this line.")
        return "gloo"
    if backend == "nccl" and per_node > len(gpus):
        if not remote:
            raise ConfigError(
                f"--ranks {per_node} with nccl needs {per_node} GPUs but only {len(gpus)} are selected "
                f"(NCCL cannot put two ranks on one GPU); use fewer ranks or --backend gloo. {FIX_HINT}")
        raise ConfigError(
            f"--ranks-per-node {per_node} with nccl needs {per_node} GPUs on each node but only "
            f"{len(gpus)} are selected with --gpus (NCCL cannot put two ranks on one GPU); use fewer "
            f"ranks per node, more --gpus or --backend gloo. {FIX_HINT}")
    return backend


def fit_gpus(gpus: list[int], per_node: int, remote: bool, warnings: list[str]) -> list[int]:
    """The GPUs a node's ranks use: no more than its ranks; fewer means sharing, said in ``warnings``."""
    if gpus and per_node < len(gpus):
        gpus = gpus[:per_node]
    if gpus and per_node > len(gpus):
        warnings.append(shared_gpu_warning(per_node, len(gpus), " on each node" if remote else ""))
    return gpus


def shared_gpu_warning(per_node: int, gpus: int, where: str = "") -> str:
    """What ranks that share GPUs over gloo mean for the user's code, with what to do."""
    # seen on an H100 at 2 ranks: accelerate's DistributedDataParallel gets device_ids=[LOCAL_RANK],
    # and rank 1 fails in the first forward pass with IndexError, as it does under torchrun
    return (f"{per_node} ranks share {gpus} GPU(s){where} over gloo. Code that puts rank LOCAL_RANK on GPU "
            "LOCAL_RANK fails on the ranks past the last GPU: accelerate and Transformers' Trainer do "
            "(IndexError in the first forward pass). With them, use one rank per GPU "
            f"({'--ranks-per-node' if where else '--ranks'} {gpus}), or train on CPU: Accelerator(cpu=True), "
            "TrainingArguments(use_cpu=True). Plain DDP on `device` works as it is.")
