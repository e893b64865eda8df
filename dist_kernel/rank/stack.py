"""What the main thread's frames say, read from the control thread during a ``where`` look
(:func:`dist_kernel.rank.agent.where`): the torch.distributed call it is in, or the torch call
that started a collective in C++ when none is on the stack (DDP's constructor, its backward);
the group and sequence number of a call and the tensors it holds; which frames are the user's
(a cell's, shown as ``cell``).
"""

from __future__ import annotations

import contextlib
import linecache
import re
import sys
import traceback
from types import FrameType

from dist_kernel.protocol import Operand

#: torch.distributed functions that only wrap others (the innermost real call is reported)
_WRAPPERS = {"wrapper", "_wait", "wait"}


def dist_call(frame: FrameType) -> tuple[FrameType | None, str | None, bool]:
    """Walking out from ``frame``: the innermost torch.distributed call's frame (with its
    arguments), the outermost public torch.distributed function (``new_subgroups``, not its
    ``new_group``), and whether the thread is in autograd's backward pass (C++, where DDP starts
    its gradient all_reduce)."""
    dist_frame, public, backward = None, None, False
    f: FrameType | None = frame
    while f is not None:
        if f.f_code.co_name == "_engine_run_backward" and "/torch/autograd/" in f.f_code.co_filename:
            backward = True
        if f.f_code.co_filename.endswith("distributed_c10d.py") and f.f_code.co_name not in _WRAPPERS:
            dist_frame = f
        if "/torch/distributed/" in f.f_code.co_filename and not f.f_code.co_name.startswith("_") \
                and f.f_code.co_name not in _WRAPPERS:
            public = f.f_code.co_name
        f = f.f_back
    return dist_frame, public, backward


#: torch's code that starts collectives in C++, with no torch.distributed collective on the stack
#: (DDP's constructor verifies and broadcasts the parameters through dist._verify_params_across_processes
#: and dist._broadcast_coalesced)
_NATIVE_CODE = ("/torch/distributed/", "/torch/nn/parallel/")
#: the local names under which torch's code holds the process group it works on
_GROUP_NAMES = ("process_group", "group", "pg")
_CALLEE = re.compile(r"([A-Za-z_]\w*)\s*\(")


def native_call(frame: FrameType) -> tuple[str, object]:
    """The torch call the main thread is in when its innermost Python frame is torch's
    distributed code (so it is in a C++ call that code made), named from the outermost torch
    frame inwards: ``DistributedDataParallel(...) / _verify_param_shape_across_processes /
    _verify_params_across_processes``; and the process group found on the way (None: the
    default one). ``""`` when the main thread is elsewhere."""
    if not any(p in frame.f_code.co_filename for p in _NATIVE_CODE):
        return "", None
    group: object = None
    outer = frame
    f: FrameType | None = frame
    while f is not None and "/torch/" in f.f_code.co_filename:
        if group is None:
            group = _group_in(f.f_locals)
        outer, f = f, f.f_back
    names = [_frame_call(outer)]
    if frame is not outer:
        names.append(frame.f_code.co_name)
    callee = _callee(frame)
    if callee and callee not in names:
        names.append(callee)
    return " / ".join(names), group


def _callee(frame: FrameType) -> str:
    """The function a frame is calling now, read from its source: the call expression of the
    instruction it is at (``self.reducer._rebuild_buckets()`` in ``if torch.is_grad_enabled()
    and self.reducer._rebuild_buckets():``), else the first call on its line; "" when neither is
    known."""
    source = ""
    positions = getattr(frame.f_code, "co_positions", None)  # Python 3.11+
    try:
        if positions is None or frame.f_lasti < 0:  # not started: no instruction
            raise IndexError
        line, end, col, end_col = list(positions())[frame.f_lasti // 2]
        if line is not None and line == end and col is not None and end_col is not None:
            source = linecache.getline(frame.f_code.co_filename, line)[col:end_col]
    except (IndexError, ValueError):
        pass
    # f_lineno is None while a frame runs an instruction that has no line (seen once, in a look
    # at a rank in DDP's code): no callee to name then, never a failed look
    found = _CALLEE.search(source) or _CALLEE.search(linecache.getline(frame.f_code.co_filename,
                                                                       frame.f_lineno or 0))
    return found[1] if found else ""


#: nn.Module's frames that call a module (``model(x)``): named after the module's forward
_MODULE_CALLS = ("_wrapped_call_impl", "_call_impl")


def _frame_call(f: FrameType) -> str:
    """What the user called to enter this frame: a class's name for its constructor, a
    module's forward for a call of the module."""
    if f.f_code.co_name == "__init__" and "self" in f.f_locals:
        return f"{type(f.f_locals['self']).__name__}(...)"
    if f.f_code.co_name in _MODULE_CALLS and "self" in f.f_locals:
        return f"{type(f.f_locals['self']).__name__}.forward"
    return f"{f.f_code.co_name}(...)"


def operands(frame: FrameType) -> list[Operand]:
    """The tensors a torch.distributed call holds (its frame's tensor arguments and locals, in
    their order), by name, dtype and shape: what the fault policy compares between ranks blocked
    in the same collective (rule 3). Read only in a ``where`` look, never on a cell's way."""
    torch = sys.modules.get("torch")
    kind = getattr(torch, "Tensor", None)
    if kind is None:
        return []
    found = []
    for name, value in list(frame.f_locals.items()):
        if isinstance(value, kind):
            found.append(Operand(name=name, dtype=str(value.dtype).removeprefix("torch."), shape=list(value.shape)))
    return found


def _group_in(names: dict) -> object:
    """A process group held under one of :data:`_GROUP_NAMES`, or None."""
    dist = sys.modules.get("torch.distributed")
    kind = getattr(dist, "ProcessGroup", None)
    for name in _GROUP_NAMES:
        value = names.get(name)
        if kind is not None and isinstance(value, kind):
            return value
    return None


def group_info(group: object) -> tuple[list[int], int | None]:
    """The global ranks of a collective's group (the world for None) and its sequence number."""
    try:
        import torch.distributed as dist

        pg = group if group is not None else dist.GroupMember.WORLD
        assert pg is None or isinstance(pg, dist.ProcessGroup)  # _group_in found it by this type
        ranks = list(dist.get_process_group_ranks(pg))
    except Exception:  # noqa: BLE001 - a torn-down group: no ranks to name
        return [], None
    seq = None
    if pg is not None:
        with contextlib.suppress(Exception):
            seq = int(pg._get_sequence_number_for_group())  # type: ignore[attr-defined]  # private torch API, not in its stubs
    return ranks, seq


def _user_frame(filename: str) -> bool:
    return not any(p in filename for p in ("site-packages/IPython", "site-packages/ipykernel", "asyncio",
                                           "site-packages/tornado", "site-packages/traitlets", "<frozen",
                                           "threading.py", "runpy.py", "ipykernel_launcher",
                                           "dist_kernel/rank/"))


def _shown_file(filename: str) -> str:
    return "cell" if ("/ipykernel_" in filename or filename.startswith("<ipython-input")) else filename


def user_frames(frame: FrameType) -> tuple[list[str], str]:
    """The user's frames from the outermost in (formatted as a traceback shows them), and the
    innermost cell line (``line 3: dist.all_reduce(t)``; "" when no cell is on the stack)."""
    summary = [fs for fs in traceback.extract_stack(frame) if _user_frame(fs.filename)]
    shown = [f'  File "{_shown_file(fs.filename)}", line {fs.lineno}, in {fs.name}\n    {fs.line or ""}'
             for fs in summary]
    cell = [fs for fs in summary if _shown_file(fs.filename) == "cell"]
    return shown, (f"line {cell[-1].lineno}: {cell[-1].line}" if cell else "")
