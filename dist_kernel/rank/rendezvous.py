"""Runs inside each rank: join the torch.distributed process group and define the names.

The parent never imports this module's torch parts; it only sends each rank a line of code
that calls :func:`join`. Rendezvous goes through a ``FileStore`` in the kernel's private
runtime directory (mode 0700): no port is chosen, so there is no free-port race, two kernels
never collide, and nothing listens on the network (``TCPStore`` binds every interface).
Gloo and NCCL are kept on loopback.
"""

from __future__ import annotations

import os
from datetime import timedelta

LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}


def store_path(runtime_dir: str, generation: int) -> str:
    """One store file per formation of the group, so a re-formed group never reads stale keys."""
    return os.path.join(runtime_dir, f"store-{generation}")


def join(rank: int, world_size: int, backend: str, store: str, timeout: float,
         use_cuda: bool, local_rank: int | None = None, seed: int | None = None,
         fastai: bool = False) -> str:
    """Pin the device, form the group, define ``rank``/``world_size``/``local_rank``/``device``.

    Returns a short description of the device, for the kernel banner.
    """
    for key, value in LOOPBACK_ENV.items():
        os.environ.setdefault(key, value)
    import torch
    import torch.distributed as dist

    local_rank = rank if local_rank is None else local_rank
    if use_cuda:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"rank {rank}: CUDA was requested (--gpus) but torch.cuda.is_available() is False "
                f"in this environment (torch {torch.__version__}). Install a CUDA build of torch, "
                "or start the kernel with --gpus none --backend gloo.")
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")

    kwargs = {"device_id": device} if backend == "nccl" else {}
    if dist.is_initialized():  # re-forming after a failure: the old group is unusable
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - already torn down by a peer
            pass
    dist.init_process_group(backend, store=dist.FileStore(store, world_size), rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=timeout), **kwargs)
    _define_names(rank=rank, world_size=world_size, local_rank=local_rank, device=device)
    if seed is not None:
        seed_everything(seed)
    if fastai:
        from dist_kernel.rank import fastai as fastai_integration

        fastai_integration.install()
    return str(device)


def seed_everything(seed: int) -> None:
    """Give every rank the same seed, so unseeded random splits agree across ranks."""
    import random

    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:
        return
    np.random.seed(seed % 2**32)


def _define_names(**names: object) -> None:
    from IPython import get_ipython

    shell = get_ipython()
    if shell is not None:
        shell.user_ns.update(names)
