"""Runs inside each rank: ``%dist_sync NAME [NAME ...] [--from R]`` copies variables from rank R
to every other rank, over the process group.

Every rank of the group gets the parent's typed :class:`~dist_kernel.protocol.Sync` request at
once and runs :func:`sync` on its main thread; the steps are collectives, so every rank takes
them in the same order, and each rank decides before a step whether it can take it, so that no
rank ever waits in a collective another rank will not enter:

1. Every rank tells what it holds under each name (JSON, gathered): a rank that rebuilt its
   model or optimizer takes the source's ``state_dict`` into it.
2. The source decides, per name, how it travels and prepares every tensor it will send
   (:func:`~dist_kernel.rank.sync_values.plan`, which never raises), then broadcasts the plan
   (JSON): ``value`` (a tensor, a numpy array, or containers of them and plain data), ``state``
   (a module, optimizer or scheduler: its ``state_dict``, loaded into the object of that name
   every other rank holds), or ``error``, saying why that name cannot be copied.
3. Every other rank makes room for the tensors the plan names, and every rank says whether it
   could (gathered): if one could not, no tensor is sent, and the names that carry tensors fail,
   naming that rank and why.
4. The tensors are broadcast (as bytes); each other rank binds or loads what it received, and
   says per name what it did.

Nothing is pickled (:mod:`dist_kernel.rank.sync_values`). A rank copies tensors onto its own
``device`` when the source's were on a GPU, so a tensor from ``cuda:0`` lands on ``cuda:1`` on
rank 1. While it runs, the rank's ``where`` says which step it is at (``%dist_sync: copying
t``), and the stop button interrupts it as it does a cell.
"""

from __future__ import annotations

import json
from typing import Any

from dist_kernel.protocol import Sync, Synced
from dist_kernel.rank import agent
from dist_kernel.rank.sync_values import kind_of, nbytes, plan, tensor_specs, typed, unflatten


def sync(req: Sync) -> Synced:
    """Copy ``req.names`` from rank ``req.src`` to every rank (a collective: every rank calls it)."""
    import torch
    import torch.distributed as dist
    from IPython import get_ipython

    if not dist.is_initialized():
        raise RuntimeError("the process group is down on this rank: run %dist_respawn (or restart the kernel) first")
    shell = get_ipython()
    ns: dict = shell.user_ns if shell is not None else {}
    rank, src, names = dist.get_rank(), req.src, req.names
    wire = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    agent.doing("%dist_sync: telling what each rank holds")
    held = _all_json({n: _kind(ns, n) for n in names}, wire)
    sent: list = []
    mine: list[dict] = []
    if rank == src:
        agent.doing("%dist_sync: preparing " + ", ".join(names))
        mine = [plan(n, ns, held, src, sent, wire) for n in names]  # never raises
    agent.doing(f"%dist_sync: receiving the plan from rank {src}")
    plans = _json_from(src, mine if rank == src else None, wire)
    carried = [(n, tensor_specs(p["tree"])) for n, p in zip(names, plans, strict=True) if p["mode"] != "error"]
    specs = [s for _, ss in carried for s in ss]
    buffers, short = (sent, "") if rank == src else _room(specs, wire)
    agent.doing("%dist_sync: making room on every rank")
    shorts = _all_json(short, wire)
    if any(shorts):
        why = "; ".join(f"rank {r} could not make room for it ({s})" for r, s in enumerate(shorts) if s)
        plans = [{"mode": "error", "error": why} if tensor_specs(p.get("tree")) else p for p in plans]
    else:
        _broadcast(src, buffers, carried, wire)
    if rank == src:
        return Synced(copied={n: f"sent from rank {src}" for n, p in zip(names, plans, strict=True)
                              if p["mode"] != "error"},
                      failed={n: p["error"] for n, p in zip(names, plans, strict=True) if p["mode"] == "error"})
    received = [] if any(shorts) else _placed([typed(b, s) for b, s in zip(buffers, specs, strict=True)], specs)
    return _bind(names, plans, received, ns)


def _kind(ns: dict, name: str) -> str:
    return kind_of(ns[name]) if name in ns else ""


def _room(specs: list[dict], wire: Any) -> tuple[list, str]:
    """Buffers for the tensors to come, on ``wire``; or why there is no room ("" when there is)."""
    import torch

    try:
        return [torch.empty(nbytes(s), dtype=torch.uint8, device=wire) for s in specs], ""
    except (RuntimeError, MemoryError) as e:  # out of memory: said, and nobody sends
        return [], f"{type(e).__name__}: {e}".splitlines()[0]


def _bind(names: list[str], plans: list[dict], tensors: list, ns: dict) -> Synced:
    """Bind or load what arrived, name by name; a failure is that name's alone."""
    copied: dict[str, str] = {}
    failed: dict[str, str] = {}
    for name, p in zip(names, plans, strict=True):
        mode = p["mode"]
        if mode == "error":
            failed[name] = p["error"]
            continue
        try:
            if mode == "value":
                ns[name] = unflatten(p["tree"], tensors)
                copied[name] = _described(ns[name])
            else:
                ns[name].load_state_dict(_for(ns[name], unflatten(p["tree"], tensors)))
                copied[name] = f"state_dict into this rank's {p['kind']}"
        except Exception as e:  # noqa: BLE001 - reported per name: the others are copied
            failed[name] = f"{type(e).__name__}: {e}"
    return Synced(copied=copied, failed=failed)


def _for(target: Any, state: Any) -> Any:
    """A module's state_dict with or without DDP's ``module.`` prefix, as ``target`` wants it."""
    import torch

    if not isinstance(target, torch.nn.Module) or not isinstance(state, dict):
        return state
    want = next(iter(target.state_dict()), "")
    have = next(iter(state), "")
    if want.startswith("module.") and not have.startswith("module."):
        return {f"module.{k}": v for k, v in state.items()}
    if have.startswith("module.") and not want.startswith("module."):
        return {k.removeprefix("module."): v for k, v in state.items()}
    return state


def _described(value: Any) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        sparse = "sparse " if value.layout == torch.sparse_coo else ""
        return f"{sparse}tensor {'x'.join(map(str, value.shape)) or 'scalar'} {str(value.dtype).removeprefix('torch.')}"
    if type(value).__module__ == "numpy" and type(value).__name__ == "ndarray":
        return f"numpy array {'x'.join(map(str, value.shape)) or 'scalar'} {value.dtype}"
    return f"a {type(value).__name__}"


def _placed(tensors: list, specs: list[dict]) -> list:
    """Each received tensor on the device it should live on here: this rank's ``device``
    where the source's was on a GPU, else the CPU."""
    import torch

    here = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return [t.to(here if s["gpu"] and here.type == "cuda" else "cpu") for t, s in zip(tensors, specs, strict=True)]


# --------------------------------------------------------------- collectives
def _broadcast(src: int, buffers: list, carried: list[tuple[str, list[dict]]], wire: Any) -> None:
    """Broadcast the source's prepared tensors into every rank's buffers, name by name (an empty
    one is not sent: every rank knows its size from the plan)."""
    import torch.distributed as dist

    pending = iter(buffers)
    for name, specs in carried:
        agent.doing(f"%dist_sync: copying {name}")
        for _ in specs:
            buf = next(pending)
            if buf.numel():
                dist.broadcast(buf, src=src)


def _json_from(src: int, value: Any, wire: Any) -> Any:
    """Broadcast a JSON value from ``src`` (as bytes in a tensor: nothing is unpickled)."""
    import torch
    import torch.distributed as dist

    data = json.dumps(value).encode() if value is not None else b""
    size = torch.tensor([len(data)], dtype=torch.int64, device=wire)
    dist.broadcast(size, src=src)
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(wire) if data else \
        torch.empty(int(size.item()), dtype=torch.uint8, device=wire)
    dist.broadcast(buf, src=src)
    return json.loads(bytes(buf.cpu().tolist()).decode())


def _all_json(value: Any, wire: Any) -> list:
    """Every rank's JSON value, by rank."""
    import torch
    import torch.distributed as dist

    data = json.dumps(value).encode()
    n = dist.get_world_size()
    sizes = [torch.zeros(1, dtype=torch.int64, device=wire) for _ in range(n)]
    dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64, device=wire))
    most = max(int(s.item()) for s in sizes)
    mine = torch.zeros(most, dtype=torch.uint8, device=wire)
    mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
    bufs = [torch.zeros(most, dtype=torch.uint8, device=wire) for _ in range(n)]
    dist.all_gather(bufs, mine)
    return [json.loads(bytes(b[:int(s.item())].cpu().tolist()).decode()) for b, s in zip(bufs, sizes, strict=True)]
