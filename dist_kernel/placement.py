"""Where each rank runs, and the environment it gets: one rule for one machine and for many.

Ranks are numbered node-major, as torchrun numbers them: the ranks of node 0 come first.
The environment holds what torchrun sets (``RANK``, ``LOCAL_RANK``, ``NODE_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), so accelerate and
fastai run unchanged, plus the kernel's own variables. Used by the parent's local launcher
and by each node's agent.
"""

from __future__ import annotations

import os


def rank_of(node: int, local_rank: int, ranks_per_node: int) -> int:
    return node * ranks_per_node + local_rank


def cuda_index(local_rank: int, gpus: int) -> int:
    """The CUDA device a rank uses among the ``gpus`` it sees: its local rank, wrapped round when
    a node has more ranks than GPUs (they share them, over gloo). The rank pins it; the parent
    says it (``KernelConfig.device_for``)."""
    return local_rank % gpus


def rank_env(base: dict[str, str], *, rank: int, ranks_per_node: int, world_size: int,
             master_addr: str, master_port: int | None, runtime_dir: str, parent_pid: int,
             gpus: tuple[int, ...] | list[int], ifname: str | None, cpu_count: int | None = None,
             kernel_pid: int | None = None) -> dict[str, str]:
    """A rank's whole environment (a child process gets exactly this).

    ``parent_pid`` is the rank's own parent (the kernel, or a node's agent), which it dies
    with; ``kernel_pid`` the parent kernel's, the same on every machine (cell file names).
    """
    node, local_rank = divmod(rank, ranks_per_node)
    env = dict(base)
    env.update({
        "RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(ranks_per_node), "GROUP_RANK": str(node), "NODE_RANK": str(node),
        "MASTER_ADDR": master_addr, "JPY_PARENT_PID": str(parent_pid),
        "DIST_KERNEL_PARENT_PID": str(kernel_pid or parent_pid),
        "DIST_KERNEL_RANK": str(rank), "PYTHONUNBUFFERED": "1",
        # inherited by everything a rank starts (DataLoader workers, subprocesses): lets a
        # clean-up find them even after the rank, its parent and the reaper are gone
        "DIST_KERNEL_RUNTIME_DIR": runtime_dir,
    })
    if master_port is not None:
        env["MASTER_PORT"] = str(master_port)
    if ifname:
        # gloo and NCCL would otherwise pick the address the hostname resolves to, which is
        # often loopback; a user's own choice wins
        env.setdefault("GLOO_SOCKET_IFNAME", ifname)
        env.setdefault("NCCL_SOCKET_IFNAME", ifname)
    # as torchrun does: N ranks each using every core would oversubscribe the CPU N-fold
    cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // ranks_per_node)))
    if gpus:
        # the same mask for every rank of a node, so LOCAL_RANK indexes it (what accelerate expects)
        parent_mask = [p.strip() for p in base.get("CUDA_VISIBLE_DEVICES", "").split(",") if p.strip()]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(parent_mask[g] if parent_mask else str(g) for g in gpus)
    else:
        env["CUDA_VISIBLE_DEVICES"] = ""
        # accelerate (and fastai's distrib_ctx, built on it) only trains data-parallel on CPU
        # when told to; otherwise it would see "no GPU" and train each rank alone
        env.setdefault("ACCELERATE_USE_CPU", "true")
        # DeepSpeed (which accelerate and Transformers import when it is installed) would log a
        # timestamped "Setting accelerator to CPU" warning per rank: one labelled line each
        env.setdefault("DS_ACCELERATOR", "cpu")
    return env
