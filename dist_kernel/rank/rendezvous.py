"""Runs inside each rank: join the torch.distributed process group and define the names.

The parent sends each rank a typed ``join`` request (:class:`dist_kernel.protocol.Join`);
the rank kernel calls :func:`join` with it on the rank's main thread. On one machine,
rendezvous goes through a ``FileStore`` in the kernel's private runtime directory (mode
0700): no port is chosen, so there is no free-port race, two kernels never collide, and
nothing listens on the network (``TCPStore`` binds every interface). Across machines, rank 0
hosts a ``TCPStore`` on its node's cluster address (``MASTER_ADDR``, a port of its own), kept for
the kernel's life; each formation uses its own prefix in it. Either is wrapped by
:mod:`dist_kernel.rank.store`, so that a rank waiting there for peers that never come (group
creation on some ranks only) can be freed. The launcher sets the
interface gloo and NCCL use (loopback for local ranks, the cluster interface otherwise).
"""

from __future__ import annotations

from datetime import timedelta

from dist_kernel import placement
from dist_kernel.protocol import Join
from dist_kernel.rank import agent, nccl, store, switches


def join(req: Join) -> str:
    """Pin the device, form the group, define ``rank``/``world_size``/``local_rank``/``device``.

    Returns the device, for the kernel banner and ``%dist_status``.
    """
    rank, world_size, backend, local_rank = req.rank, req.world_size, req.backend, req.local_rank
    import torch
    import torch.distributed as dist

    if req.use_cuda:
        if not torch.cuda.is_available():
            raise RuntimeError(
                f"rank {rank}: CUDA was requested (--gpus) but torch.cuda.is_available() is False "
                f"in this environment (torch {torch.__version__}). Install a CUDA build of torch, "
                "or start the kernel with --gpus none --backend gloo.")
        index = placement.cuda_index(local_rank, torch.cuda.device_count())
        torch.cuda.set_device(index)
        device = torch.device("cuda", index)
    else:
        device = torch.device("cpu")

    if dist.is_initialized():  # re-forming after a failure: the old group is unusable
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - already torn down by a peer
            pass
    else:
        _unnamed_groups_from_zero()
    _torchrun_sizes(req)
    nccl.enable(backend)  # the flight recorder, which shows NCCL stalls (gloo's are seen without it)
    meeting = _store(req)
    dist.init_process_group(backend, store=meeting, rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=req.timeout),
                            device_id=device if backend == "nccl" else None)
    store.formed()
    nccl.formed(backend)
    _master_port(req, meeting)
    _define_names(rank=rank, world_size=world_size, local_rank=local_rank, device=device)
    agent.set_device(str(device))
    if req.first and req.seed is not None:
        seed_everything(req.seed)
    if req.first:  # later formations keep what %dist_empty_cache (set_option) chose
        switches.start(req.switches)
    return str(device)


def _unnamed_groups_from_zero() -> None:
    """Count the default group's name from 0 again, as ``destroy_process_group`` does. torch names
    the default group after a counter that each group creation raises, also one that failed
    (a formation whose wait the kernel ended): a rank that failed one would meet the others of
    the next formation under another name in the store, and wait for them for good."""
    from torch.distributed import distributed_c10d

    # private torch API (torch 2.x: _World.group_count, which destroy_process_group resets)
    distributed_c10d._world.group_count = 0


def _torchrun_sizes(req: Join) -> None:
    """Keep torchrun's variables true when ``%dist_ranks`` changed the world's size: code that
    reads ``WORLD_SIZE`` (accelerate, Lightning, a user's own ``init_process_group``) sees the new one."""
    import os

    os.environ["WORLD_SIZE"] = str(req.world_size)
    if req.local_world_size is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(req.local_world_size)


#: rank 0's TCPStore (server) or another rank's client of it, kept across formations
_tcp_store: list = []
#: how long a rank tries to reach rank 0's rendezvous before it names the address as unreachable
REACH_TIMEOUT = 20.0


def _store(req: Join):  # no return type: a torch.distributed Store (torch imported lazily)
    import torch.distributed as dist

    if not req.store.startswith("tcp://"):
        return store.endable(dist.FileStore(req.store, req.world_size))
    address, _, prefix = req.store[len("tcp://"):].partition("/")
    host, _, port = address.rpartition(":")
    if not _tcp_store:
        if req.rank != 0:
            _check_reachable(req.rank, host, int(port))
        _tcp_store.append(dist.TCPStore(host, int(port), req.world_size, is_master=req.rank == 0,
                                        timeout=timedelta(seconds=req.timeout), wait_for_workers=False))
        store.tcp_port[:] = [_tcp_store[0].port]
    return dist.PrefixStore(prefix, store.endable(_tcp_store[0]))


def store_port() -> int | None:
    """The port of rank 0's TCPStore across machines (None on one machine): not MASTER_PORT."""
    return _tcp_store[0].port if _tcp_store else None


#: MASTER_PORT, when this module set it (one machine): a new one at each formation
_port_set: list[str] = []


def _master_port(req: Join, meeting) -> None:  # meeting: a torch.distributed Store
    """Give the ranks a MASTER_PORT, so that ``dist.init_process_group("gloo")`` by hand (env://,
    as under torchrun) works after a cell destroyed the group. On one machine the ranks meet in a
    file and no port was given: rank 0 picks a free loopback port and the others read it from the
    store. Across machines MASTER_PORT is set already: a free port on node 0 that node 0's agent
    chose besides the one rank 0's TCPStore holds (see ``dist_kernel.node.agent``)."""
    import os
    import socket

    if req.store.startswith("tcp://") or (os.environ.get("MASTER_PORT") and not _port_set):
        return
    key = "dist_kernel/master_port"
    if req.rank == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            meeting.set(key, str(s.getsockname()[1]))
    port = meeting.get(key).decode()
    os.environ["MASTER_PORT"] = port
    _port_set[:] = [port]


def _check_reachable(rank: int, host: str, port: int) -> None:
    """A node that cannot reach rank 0's rendezvous is a wiring mistake: say so with the
    address, instead of waiting out the collective timeout."""
    import socket

    from dist_kernel.tunnel.link import reach

    error = reach(host, port, REACH_TIMEOUT)
    if error is None:
        return
    raise RuntimeError(
        f"rank {rank} on {socket.gethostname()} cannot reach rank 0's rendezvous at {host}:{port} ({error}) "
        f"within {REACH_TIMEOUT:.0f}s. Fix: let the nodes reach each other on the cluster network "
        "(firewall, --port-range), then restart the kernel.")


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
