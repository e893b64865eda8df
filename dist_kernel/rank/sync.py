"""Runs inside each rank: ``%dist_sync NAME [NAME ...] [--from R]`` copies variables from rank R
to every other rank, over the process group.

Every rank of the group gets the parent's typed :class:`~dist_kernel.protocol.Sync` request at
once and runs :func:`sync` on its main thread; the steps are collectives, so every rank takes
them in the same order:

1. Every rank tells what it holds under each name (JSON, gathered): a rank that rebuilt its
   model or optimizer takes the source's ``state_dict`` into it.
2. The source decides, per name, how it travels (JSON, broadcast): ``value`` (a tensor, a numpy
   array, or containers of them and plain data: the tensors go as tensors, the rest as JSON), or
   ``state`` (a module, optimizer or scheduler: its ``state_dict``, the same way, loaded into the
   object of that name every other rank holds), or why it cannot.
3. The tensors are broadcast; each other rank binds or loads what it received, and says per
   name what it did.

Nothing is pickled: unpickling what crosses the network runs code, and the kernel never does it
(an object that is neither tensors nor plain data is named, with how to bring it over). A rank
copies tensors onto its own ``device`` when the source's were on a GPU, so a tensor from
``cuda:0`` lands on ``cuda:1`` on rank 1.
"""

from __future__ import annotations

import json
from typing import Any

from dist_kernel.protocol import Sync, Synced

#: JSON keys of the tree that carries a value's structure; a tensor's place holds its index
_TENSOR, _DICT, _TUPLE = "__dist_tensor__", "__dist_dict__", "__dist_tuple__"


class CannotCopy(Exception):
    """A value that neither JSON nor tensors can carry (said with the reason)."""


# ------------------------------------------------------------------ structure
def flatten(value: Any, tensors: list) -> Any:
    """``value`` as a JSON tree whose tensors are replaced by their index in ``tensors``
    (appended). Dict keys keep their type (an optimizer's state is keyed by int)."""
    import torch

    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return {_TENSOR: len(tensors) - 1, "dtype": str(value.dtype).removeprefix("torch."),
                "shape": list(value.shape), "gpu": value.device.type != "cpu"}
    if type(value).__module__ == "numpy" and type(value).__name__ == "ndarray":
        try:
            tree = flatten(torch.from_numpy(value), tensors)
        except TypeError as e:  # an object array, strings: not numbers
            raise CannotCopy(f"numpy array of {value.dtype}") from e
        return {**tree, "numpy": True}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {_DICT: [[flatten(k, tensors), flatten(v, tensors)] for k, v in value.items()]}
    if isinstance(value, tuple):
        return {_TUPLE: [flatten(v, tensors) for v in value]}
    if isinstance(value, list):
        return [flatten(v, tensors) for v in value]
    raise CannotCopy(type(value).__name__)


def unflatten(tree: Any, tensors: list) -> Any:
    """The inverse of :func:`flatten`, with ``tensors`` as received."""
    if isinstance(tree, list):
        return [unflatten(v, tensors) for v in tree]
    if isinstance(tree, dict):
        if _TENSOR in tree:
            t = tensors[tree[_TENSOR]]
            return t.cpu().numpy() if tree.get("numpy") else t
        if _TUPLE in tree:
            return tuple(unflatten(v, tensors) for v in tree[_TUPLE])
        return {unflatten(k, tensors): unflatten(v, tensors) for k, v in tree[_DICT]}
    return tree


def tensor_specs(tree: Any) -> list[dict]:
    """The tensors a tree names, in index order (dtype, shape, whether on a GPU)."""
    found: list[dict] = []

    def walk(node: Any) -> None:
        if isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, dict):
            if _TENSOR in node:
                found.append(node)
            else:
                walk(node[_TUPLE] if _TUPLE in node else node[_DICT])

    walk(tree)
    return sorted(found, key=lambda t: t[_TENSOR])


def kind_of(value: Any) -> str:
    """What a rank holds under a name, as the plan needs it: ``module``, ``optimizer``, the
    class name of another object with ``load_state_dict``, or ``""``."""
    import torch

    if isinstance(value, torch.nn.Module):
        return "module"
    if isinstance(value, torch.optim.Optimizer):
        return "optimizer"
    if callable(getattr(value, "load_state_dict", None)) and callable(getattr(value, "state_dict", None)):
        return type(value).__qualname__
    return ""


def plan(name: str, ns: dict, held: list[dict[str, str]], src: int, tensors: list) -> dict:
    """The source's decision for one name: how it travels, or why it cannot (``error``).
    ``held``: what every rank holds under each name (index = rank)."""
    if name not in ns:
        return {"mode": "error", "error": f"not defined on rank {src}"}
    value = ns[name]
    kind = kind_of(value)
    others = [r for r in range(len(held)) if r != src]
    if kind and all(held[r].get(name) == kind for r in others):
        mark = len(tensors)
        try:
            return {"mode": "state", "kind": kind, "tree": flatten(value.state_dict(), tensors)}
        except CannotCopy as e:
            del tensors[mark:]
            return {"mode": "error", "error": f"its state_dict holds a {e}, which cannot be copied"}
    if kind:
        missing = [r for r in others if held[r].get(name) != kind]
        return {"mode": "error", "error": f"a {kind} copies into the {kind} of that name on each rank, and rank "
                f"{','.join(map(str, missing))} has none: build it there first (the same architecture; an "
                "optimizer over that rank's own model), then run %dist_sync again"}
    try:
        return {"mode": "value", "tree": flatten(value, tensors)}
    except CannotCopy as e:
        what = f"a {type(value).__name__}" + ("" if str(e) == type(value).__name__ else f" holding a {e}")
        return {"mode": "error", "error": f"{what}, which cannot be copied: only tensors, "
                "numpy arrays, plain data (numbers, strings, lists, dicts, tuples) and the state of modules and "
                "optimizers travel (the kernel never unpickles what crosses the network); rebuild it on each "
                "rank from what can be copied"}


# ------------------------------------------------------------------- the copy
def sync(req: Sync) -> Synced:
    """Copy ``req.names`` from rank ``req.src`` to every rank (a collective: every rank calls it)."""
    import torch
    import torch.distributed as dist
    from IPython import get_ipython

    if not dist.is_initialized():
        raise RuntimeError("the process group is down on this rank: run %dist_respawn (or restart the kernel) first")
    shell = get_ipython()
    ns: dict = shell.user_ns if shell is not None else {}
    rank, src = dist.get_rank(), req.src
    wire = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    held = _all_json({n: kind_of(ns[n]) for n in req.names if n in ns}, wire)
    sent: list = []
    plans = _json_from(src, [plan(n, ns, held, src, sent) for n in req.names] if rank == src else None, wire)
    specs = [s for p in plans if p["mode"] in ("value", "state") for s in tensor_specs(p["tree"])]
    received = _tensors_from(src, sent if rank == src else None, specs, wire)
    if rank == src:
        return Synced(copied={n: f"sent from rank {src}" for n, p in zip(req.names, plans, strict=True)
                              if p["mode"] != "error"},
                      failed={n: p["error"] for n, p in zip(req.names, plans, strict=True) if p["mode"] == "error"})
    return _bind(req.names, plans, _placed(received, specs), ns)


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
        return f"tensor {'x'.join(map(str, value.shape)) or 'scalar'} {str(value.dtype).removeprefix('torch.')}"
    return f"a {type(value).__name__}"


def _placed(tensors: list, specs: list[dict]) -> list:
    """Each received tensor on the device it should live on here: this rank's ``device``
    where the source's was on a GPU, else the CPU."""
    import torch

    here = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return [t.to(here if s["gpu"] and here.type == "cuda" else "cpu") for t, s in zip(tensors, specs, strict=True)]


# --------------------------------------------------------------- collectives
def _tensors_from(src: int, sent: list | None, specs: list[dict], wire: Any) -> list:
    """Broadcast the source's tensors, in order; every rank gets them on ``wire``'s device."""
    import torch
    import torch.distributed as dist

    out = []
    for i, spec in enumerate(specs):
        if sent is not None:
            t = sent[i].detach().to(wire).contiguous()
        else:
            t = torch.empty(spec["shape"], dtype=getattr(torch, spec["dtype"]), device=wire)
        dist.broadcast(t, src=src)
        out.append(t)
    return out


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
