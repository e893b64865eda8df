"""Runs inside each rank: what ``%dist_sync`` copies, and how each value travels (the copy
itself, over the process group, is :mod:`dist_kernel.rank.sync`).

A value travels as a JSON tree whose tensors are replaced by their index in a list of tensors
sent alongside: tensors and numpy arrays as tensors, plain data (numbers, strings, lists,
dicts, tuples) as JSON, a module or optimizer as its ``state_dict`` the same way. Nothing is
pickled: unpickling what crosses the network runs code.

The source prepares everything it will send before any rank enters a collective: each tensor
is made dense, contiguous, in this machine's byte order and on the wire's device, then sent as
its bytes (so that every dtype travels, ``uint16`` included, which gloo cannot broadcast as
such). A value that cannot be prepared is refused by name, with why, in the plan every rank
receives: no rank is ever left waiting for a tensor the source cannot send.

- A numpy view (``a[::-1]``, a slice) arrives as the array it shows; a big-endian array arrives
  with the same values and type in this machine's byte order (``>f4`` as ``float32``).
- A sparse COO tensor arrives as the same sparse tensor (coalesced); other sparse layouts, meta
  tensors (no data) and quantized tensors are refused, naming the way round.
- A container that holds itself (a cycle) is refused, naming it.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

#: JSON keys of the tree that carries a value's structure; a tensor's place holds its index
_TENSOR, _DICT, _TUPLE, _SPARSE = "__dist_tensor__", "__dist_dict__", "__dist_tuple__", "__dist_sparse__"

#: what can travel, said with every refusal of something that cannot
TRAVELS = ("only tensors, numpy arrays, plain data (numbers, strings, lists, dicts, tuples) and the state of "
           "modules and optimizers travel (the kernel never unpickles what crosses the network); rebuild it on "
           "each rank from what can be copied")


class CannotCopy(Exception):
    """A value that neither JSON nor tensors can carry: ``what`` it is, ``fix`` (the way round),
    and the object itself (``obj``: the whole value, or a part of it)."""

    def __init__(self, what: str, fix: str = TRAVELS, obj: Any = None) -> None:
        super().__init__(what)
        self.what, self.fix, self.obj = what, fix, obj


# ------------------------------------------------------------------ structure
def flatten(value: Any, tensors: list, wire: Any = None, _path: frozenset[int] = frozenset()) -> Any:
    """``value`` as a JSON tree whose tensors are replaced by their index in ``tensors``, to
    which each is appended ready to send (:func:`wire_form`, on ``wire``: the CPU by default).
    Dict keys keep their type (an optimizer's state is keyed by int). Raises :class:`CannotCopy`."""
    import torch

    if isinstance(value, torch.Tensor):
        return _tensor(value, tensors, wire)
    if type(value).__module__ == "numpy" and type(value).__name__ == "ndarray":
        return {**_tensor(_from_numpy(value), tensors, wire), "numpy": True}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (dict, tuple, list)):
        if id(value) in _path:
            raise CannotCopy(f"{type(value).__name__} that holds itself", "copy the data without the cycle "
                             "(a value inside it is one of its containers)", value)
        inner = _path | {id(value)}
        if isinstance(value, dict):
            return {_DICT: [[flatten(k, tensors, wire, inner), flatten(v, tensors, wire, inner)]
                            for k, v in value.items()]}
        items = [flatten(v, tensors, wire, inner) for v in value]
        return {_TUPLE: items} if isinstance(value, tuple) else items
    raise CannotCopy(type(value).__name__, obj=value)


def _from_numpy(value: Any) -> Any:
    """A numpy array as a tensor: a view made whole (negative strides: ``a[::-1]``) and a
    foreign byte order made native first, which ``torch.from_numpy`` refuses."""
    import numpy as np
    import torch

    try:
        native = np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("="))
        with warnings.catch_warnings():  # a read-only array: the tensor is only read, then sent
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(native)
    except (TypeError, ValueError) as e:  # an object array, strings: not numbers
        raise CannotCopy(f"numpy array of {value.dtype}", obj=value) from e


def _tensor(t: Any, tensors: list, wire: Any) -> dict:
    """One tensor's place in the tree, its data appended to ``tensors`` ready to send."""
    import torch

    if t.device.type == "meta":
        raise CannotCopy("meta tensor", "a tensor on the meta device has a shape but no data; create it on each "
                         "rank, or copy a tensor that holds data", t)
    if t.is_quantized:
        raise CannotCopy("quantized tensor", "copy t.dequantize() and quantize it again on each rank", t)
    if t.layout == torch.sparse_coo:
        t = t.detach().coalesce()
        return {_SPARSE: [_tensor(t.indices(), tensors, wire), _tensor(t.values(), tensors, wire)],
                "shape": list(t.shape)}
    if t.layout != torch.strided:
        layout = str(t.layout).removeprefix("torch.")
        raise CannotCopy(f"{layout} tensor", "only dense and sparse COO tensors travel: copy t.to_dense() or "
                         "t.to_sparse() (COO)", t)
    tensors.append(wire_form(t, wire))
    return {_TENSOR: len(tensors) - 1, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape),
            "gpu": t.device.type != "cpu"}


def wire_form(t: Any, wire: Any = None) -> Any:
    """A dense tensor as it is sent: its bytes, contiguous, on ``wire`` (the CPU by default).
    Conjugate and negative views are resolved first, so the bytes are the values shown."""
    import torch

    flat = t.detach().resolve_conj().resolve_neg().to(wire or "cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8)


def typed(buffer: Any, spec: dict) -> Any:
    """A received tensor's bytes as the tensor they were (dtype and shape from the tree)."""
    import torch

    return buffer.view(getattr(torch, spec["dtype"])).reshape(spec["shape"])


def unflatten(tree: Any, tensors: list) -> Any:
    """The inverse of :func:`flatten`, with ``tensors`` as received and typed (:func:`typed`)."""
    if isinstance(tree, list):
        return [unflatten(v, tensors) for v in tree]
    if isinstance(tree, dict):
        if _TENSOR in tree:
            t = tensors[tree[_TENSOR]]
            return t.cpu().numpy() if tree.get("numpy") else t
        if _SPARSE in tree:
            import torch

            indices, values = (unflatten(part, tensors) for part in tree[_SPARSE])
            # checked: indices out of its shape would be memory errors later, not an error now
            return torch.sparse_coo_tensor(indices, values, tree["shape"], check_invariants=True).coalesce()
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
                walk(node.get(_SPARSE) or node.get(_TUPLE) or node.get(_DICT) or [])

    walk(tree)
    return sorted(found, key=lambda t: t[_TENSOR])


def nbytes(spec: dict) -> int:
    """How many bytes a tensor of the tree takes on the wire."""
    import torch

    count = 1
    for n in spec["shape"]:
        count *= n
    return count * getattr(torch, spec["dtype"]).itemsize


# ----------------------------------------------------------------------- plan
def kind_of(value: Any) -> str:
    """What a rank holds under a name, as the plan needs it: ``module``, ``optimizer``, the
    class name of another object with ``load_state_dict``, or ``""``."""
    import torch

    try:
        if isinstance(value, torch.nn.Module):
            return "module"
        if isinstance(value, torch.optim.Optimizer):
            return "optimizer"
        if callable(getattr(value, "load_state_dict", None)) and callable(getattr(value, "state_dict", None)):
            return type(value).__qualname__
    except Exception:  # noqa: BLE001 - an object whose attributes raise: plain, as far as the plan goes
        return ""
    return ""


def plan(name: str, ns: dict, held: list[dict[str, str]], src: int, tensors: list, wire: Any = None) -> dict:
    """The source's decision for one name: how it travels, or why it cannot (``error``); the
    tensors it sends are appended to ``tensors``, ready (:func:`wire_form`). Never raises: the
    source must reach the broadcast of the plan whatever a value holds. ``held``: what every
    rank holds under each name (index = rank)."""
    mark = len(tensors)
    try:
        decided = _plan(name, ns, held, src, tensors, wire)
        json.dumps(decided)  # it must cross as JSON: checked here, per name, not in the broadcast
    except CannotCopy as e:
        decided = {"mode": "error", "error": _refusal(ns.get(name), e)}
    except Exception as e:  # noqa: BLE001 - whatever a value's own code raises is that name's failure
        decided = {"mode": "error", "error": f"it could not be prepared for copying: {type(e).__name__}: {e}"}
    if decided["mode"] == "error":
        del tensors[mark:]
    return decided


def _plan(name: str, ns: dict, held: list[dict[str, str]], src: int, tensors: list, wire: Any) -> dict:
    if name not in ns:
        return {"mode": "error", "error": f"not defined on rank {src}"}
    value = ns[name]
    kind = kind_of(value)
    others = [r for r in range(len(held)) if r != src]
    if kind and all(held[r].get(name) == kind for r in others):
        try:
            return {"mode": "state", "kind": kind, "tree": flatten(value.state_dict(), tensors, wire)}
        except CannotCopy as e:
            return {"mode": "error", "error": f"its state_dict holds a {e.what}, which cannot be copied: {e.fix}"}
    if kind:
        missing = [r for r in others if held[r].get(name) != kind]
        return {"mode": "error", "error": f"a {kind} copies into the {kind} of that name on each rank, and rank "
                f"{','.join(map(str, missing))} has none: build it there first (the same architecture; an "
                "optimizer over that rank's own model), then run %dist_sync again"}
    return {"mode": "value", "tree": flatten(value, tensors, wire)}


def _refusal(value: Any, e: CannotCopy) -> str:
    """Why a value cannot be copied, in words: what it is (or holds) and the way round."""
    if e.obj is value:
        what = f"a {e.what}"
    else:
        what = f"a {type(value).__name__} holding a {e.what}"
    return f"{what}, which cannot be copied: {e.fix}"
