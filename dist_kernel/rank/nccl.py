"""Runs inside each rank: what NCCL stalls need, read from torch's flight recorder.

NCCL starts every collective asynchronously: a rank whose peer never enters a collective does
not block in it; its Python thread runs on and blocks later, in a CUDA synchronisation
(``loss.item()``), with no torch.distributed call on the stack. torch's flight recorder
(``TORCH_FR_BUFFER_SIZE``) names what it waits for: each collective the rank started, its
group, sequence number and tensors, and whether it has completed. :func:`enable` switches it on
for NCCL groups (a small ring buffer); a ``where`` look in a CUDA synchronisation reads the
pending collectives (:func:`pending`, from the recorder's JSON dump: never a pickle), and the
parent's fault policy compares them with the idle ranks' counts (rule 8). A teardown aborts the
communicators (:func:`abort`): nothing else frees a GPU waiting for a peer. gloo groups are left
exactly as they were: nothing here runs for them.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import threading
import time
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FrameType

from dist_kernel.protocol import Pending

#: the recorder's ring buffer for NCCL ranks, in collectives: the pending ones are the newest, and
#: a look only needs those (torch's own default, 2000, is meant for post-mortem dumps)
BUFFER = 64
_BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


@dataclass
class _Group:
    """This rank's group, as the recorder sees it."""

    backend: str | None = None
    since_ns: int = 0  # when it began to form: older entries belong to a group that is gone


_group = _Group()

#: calls that make the CPU wait for the GPU (a device-to-host copy, or a wait for the stream)
_SYNC = re.compile(r"[\w.\[\]()]*?\b(item|cpu|tolist|numpy|synchronize|to|wait)\s*\(|"
                   r"\b(float|int|bool|print)\s*\(")


class GroupAborted(RuntimeError):
    """Raised in a rank's cell once the kernel aborted its NCCL communicators, so that the cell
    stops there instead of computing on with the partial results of the aborted collectives."""

    def __init__(self, *args: object) -> None:
        super().__init__(*args or ("the kernel aborted this rank's NCCL communicators: a collective it "
                                   "started could not complete (the parent's error says which)",))


# ------------------------------------------------------------------ switched on
def enable(backend: str) -> None:
    """Before a group forms: switch the flight recorder on for NCCL (a user's own size wins), and
    forget what an aborted group left in it."""
    if backend != "nccl":
        return
    _group.since_ns = time.time_ns()  # entries older than this belong to a group that is gone
    if not any(os.environ.get(v) for v in _BUFFER_VARS):
        os.environ["TORCH_FR_BUFFER_SIZE"] = str(BUFFER)  # read when the first NCCL group forms
    if _group.backend == "nccl":  # a re-formation: the old group's entries never retire
        with contextlib.suppress(Exception):
            _c10d().__dict__["_reset_fr_recording_nccl"]()


def formed(backend: str) -> None:
    """The group formed, over this backend."""
    _group.backend = backend


def in_use() -> bool:
    """Is this rank's group an NCCL one?"""
    return _group.backend == "nccl"


def recording() -> bool:
    """Is this rank's group an NCCL one with the flight recorder on?"""
    return in_use() and any(_size(os.environ.get(v)) > 0 for v in _BUFFER_VARS)


def _c10d() -> types.ModuleType:
    """torch's C++ c10d module: its flight-recorder functions are private (not in its stubs)."""
    import torch._C._distributed_c10d as c10d

    return c10d


def _size(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0


# ------------------------------------------------------------- what is pending
def pending() -> list[Pending]:
    """This rank's collectives that have not completed, the oldest first ([] when the recorder
    cannot be read)."""
    try:
        dump = json.loads(_c10d().__dict__["_dump_nccl_trace_json"](includeCollectives=True, onlyActive=True))
    except Exception:  # noqa: BLE001 - no recorder, or a torch that dumps otherwise: nothing known
        return []
    return parse_pending(dump, ranks_of=_group_ranks, since_ns=_group.since_ns)


def parse_pending(dump: Mapping, ranks_of: Callable[[str], list[int]] | None = None,
                  since_ns: int = 0) -> list[Pending]:
    """The collectives of a flight-recorder dump (its JSON, parsed) that have not completed:
    not retired, and not ``completed``; entries created before ``since_ns`` (a group aborted
    since) are left out. A group's ranks come from the dump's ``pg_config`` (NCCL's), else from
    ``ranks_of`` (its name -> global ranks)."""
    config = {str(name): c for name, c in (dump.get("pg_config") or {}).items() if isinstance(c, dict)}
    found = []
    for e in dump.get("entries") or []:
        if e.get("retired") or e.get("state") == "completed" or int(e.get("time_created_ns", 0)) < since_ns:
            continue
        name, desc = (list(e.get("process_group") or []) + ["", ""])[:2]
        p2p = bool(e.get("is_p2p"))
        found.append(Pending(
            op=str(e.get("profiling_name", "?")).split(":", 1)[-1], group=str(name),
            default=desc == "default_pg", group_ranks=_ranks(config.get(str(name)), str(name), ranks_of),
            seq=int(e.get("p2p_seq_id" if p2p else "collective_seq_id", 0)), p2p=p2p,
            state=str(e.get("state", "")), output_sizes=[[int(d) for d in s] for s in e.get("output_sizes") or []],
            output_dtypes=[str(d) for d in e.get("output_dtypes") or []]))
    return found


def enqueued(dump: Mapping) -> dict[str, int]:
    """How many collectives each group (by name) has started, as a dump's ``pg_status`` says."""
    return {str(name): int(s.get("last_enqueued_collective", 0))
            for name, s in (dump.get("pg_status") or {}).items() if isinstance(s, dict)}


def _ranks(config: Mapping | None, name: str, ranks_of: Callable[[str], list[int]] | None) -> list[int]:
    with contextlib.suppress(ValueError, TypeError):
        if config is not None and config.get("ranks"):
            return [int(r) for r in json.loads(str(config["ranks"]))]
    return ranks_of(name) if ranks_of is not None else []


def _group_ranks(name: str) -> list[int]:
    """The global ranks of the live group of that name (gloo's recorder does not write them)."""
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        pg = next(pg for pg, n in c10d._world.pg_names.items() if n == name)
        return list(dist.get_process_group_ranks(pg))
    except Exception:  # noqa: BLE001 - a group that is gone: no ranks to name
        return []


# -------------------------------------------------------------- the CUDA wait
def cuda_wait(frame: FrameType) -> str:
    """The call in which the main thread waits for the GPU, named as the code wrote it
    (``loss.item()``, ``torch.cuda.synchronize()``), or "". Its innermost Python frame shows it:
    torch's CUDA or tensor-printing code, or a line calling what copies a tensor to the host."""
    if _torch_waits(frame):
        user = frame
        while user.f_back is not None and "/torch/" in user.f_code.co_filename:
            user = user.f_back
        call = _sync_call(user) if user is not frame else ""
        return call or f"torch's {frame.f_code.co_name}()"
    return _sync_call(frame)


def _torch_waits(frame: FrameType) -> bool:
    """Is this torch's Python code that waits for the GPU (a synchronize, or formatting a tensor,
    which copies it to the host)?"""
    name = frame.f_code.co_filename
    return ("/torch/cuda/" in name and "synchronize" in frame.f_code.co_name) or name.endswith("/torch/_tensor_str.py")


def _sync_call(frame: FrameType) -> str:
    import linecache

    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
    found = _SYNC.search(line)
    return f"{found[0].strip()})" if found else ""


# ------------------------------------------------------------------ the abort
def abort(interrupt_main: bool) -> str:
    """Abort every NCCL communicator of this rank (the default group and the others), which
    ends the kernels waiting for a peer, so that the main thread's CUDA synchronisation returns;
    with ``interrupt_main``, the cell then stops (:class:`GroupAborted`) rather than going on
    with partial results. The group is formed again before the next cell."""
    from torch.distributed import distributed_c10d as c10d

    try:
        c10d._abort_process_group()
        outcome = "aborted the NCCL communicators"
    except Exception as e:  # noqa: BLE001 - torch's bookkeeping refused: abort each group itself
        for pg in list(c10d._world.pg_names):
            with contextlib.suppress(Exception):
                pg.abort()
        outcome = f"aborted the NCCL communicators one by one ({type(e).__name__}: {e})"
    if interrupt_main and _raise_in_main(GroupAborted):
        outcome += ", stopped the cell"
    return outcome


def _raise_in_main(exc: type[BaseException]) -> bool:
    """Have the main thread raise ``exc`` at its next Python instruction (once the C call it is
    blocked in returns: SIGINT cannot reach a CUDA synchronisation)."""
    main = threading.main_thread().ident
    if main is None:
        return False
    return ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(main), ctypes.py_object(exc)) == 1
