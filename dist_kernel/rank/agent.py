"""Runs inside each rank: what the parent needs from a rank besides running cells.

- a watchdog thread that answers "where is the cell?" requests: the main thread may be
  blocked in a C++ collective, but its Python frames can still be read from another thread;
- PR_SET_PDEATHSIG, so the OS ends the rank with the parent even when the rank is stuck
  holding the GIL (the parent's reaper process also kills it and removes the runtime dir);
- the after-cell hook that frees the CUDA cache;
- small queries and actions the parent runs silently (status, group teardown).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Iterator

_state: dict[str, object] = {"empty_cache": True}


def probe_paths(runtime_dir: str, rank: int) -> tuple[str, str]:
    """Request and answer files of a rank's "where is the cell?" probe."""
    return os.path.join(runtime_dir, f"rank{rank}.probe"), os.path.join(runtime_dir, f"rank{rank}.where")


def setup(rank: int, parent_pid: int, runtime_dir: str, empty_cache: bool = True) -> None:
    """Start the watchdog thread and the after-cell hook (idempotent)."""
    if _state.get("rank") is not None:
        return
    _state.update(rank=rank, empty_cache=empty_cache)
    _die_with_parent(parent_pid)
    threading.Thread(target=_watch, args=probe_paths(runtime_dir, rank),
                     daemon=True, name="dist_kernel-watchdog").start()
    from IPython import get_ipython

    shell = get_ipython()
    if shell is not None:
        shell.events.register("post_run_cell", after_cell)


def _die_with_parent(parent_pid: int) -> None:
    """Have Linux SIGKILL this rank when the parent dies (PR_SET_PDEATHSIG).

    Needs no GIL, so it also ends a rank stuck in C code that holds it (a CUDA sync inside
    ``.item()``, a C extension). The reaper process does the same on every system, and
    removes the runtime dir; this is the OS-level guard should the reaper itself be killed.
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before the request took hold
        os._exit(1)


def _watch(request: str, answer: str, interval: float = 0.1) -> None:
    while True:
        if os.path.exists(request):
            try:
                os.unlink(request)
                tmp = answer + ".tmp"
                with open(tmp, "w") as f:
                    json.dump(where(), f)
                os.replace(tmp, answer)  # the parent never reads half a file
            except Exception:  # noqa: BLE001 - the watchdog must not die
                pass
        time.sleep(interval)


def where() -> dict:
    """Where the main thread is: its cell frames, and the collective it waits in, if any."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    if frame is None:
        return {"collective": None, "world": False, "stack": []}
    summary = traceback.extract_stack(frame)
    collective, world = None, False
    f = frame
    while f is not None:  # innermost torch.distributed call and the group it was given
        if f.f_code.co_filename.endswith("distributed_c10d.py") and f.f_code.co_name not in ("wrapper",):
            collective = f.f_code.co_name
            world = _is_world(f.f_locals.get("group"))
        f = f.f_back
    stack = [f'  File "{_short(fs.filename)}", line {fs.lineno}, in {fs.name}\n    {fs.line or ""}'
             for fs in summary if _user_frame(fs.filename)]
    return {"collective": collective, "world": world, "stack": stack}


def _is_world(group: object) -> bool:
    if group is None:
        return True
    try:
        import torch.distributed as dist

        return group is dist.GroupMember.WORLD or dist.get_world_size(group) == dist.get_world_size()
    except Exception:  # noqa: BLE001
        return False


def _user_frame(filename: str) -> bool:
    return not any(p in filename for p in ("site-packages/IPython", "site-packages/ipykernel", "asyncio",
                                           "site-packages/tornado", "site-packages/traitlets", "<frozen",
                                           "threading.py", "runpy.py", "ipykernel_launcher"))


def _short(filename: str) -> str:
    return "cell" if ("/ipykernel_" in filename or filename.startswith("<ipython-input")) else filename


def after_cell(result: object = None) -> None:
    """Return cached CUDA memory after each cell, so long sessions don't run out through the cache."""
    if not _state.get("empty_cache"):
        return
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    gc.collect()
    torch.cuda.empty_cache()


@contextlib.contextmanager
def solo_output() -> Iterator[None]:
    """Rich output shown while this is active is this rank's alone (say, rank 0's progress bar
    while the other ranks hide theirs): the parent shows it unlabelled, as one process would."""
    from IPython import get_ipython

    shell = get_ipython()
    pub = getattr(shell, "display_pub", None)
    if pub is None:
        yield
        return
    original = pub.publish

    def publish(data: dict, metadata: dict | None = None, *args: object, **kwargs: object) -> None:
        metadata = dict(metadata or {}, dist_kernel={"solo": True})
        original(data, metadata, *args, **kwargs)

    pub.publish = publish
    try:
        yield
    finally:
        pub.publish = original


def cell_ranks() -> tuple[int, ...]:
    """The ranks that run the current cell (a ``%%rank`` line may name fewer than all).

    The parent puts them in the execute_request's metadata (``dist_kernel.ranks``); outside a
    cell, or from an older parent, every rank of the group.
    """
    from IPython import get_ipython

    shell = get_ipython()
    kernel = getattr(shell, "kernel", None)
    try:
        meta = kernel.get_parent("shell").get("metadata") or {} if kernel is not None else {}
    except Exception:  # noqa: BLE001 - no request in this context
        meta = {}
    ranks = (meta.get("dist_kernel") or {}).get("ranks")
    if isinstance(ranks, list) and all(isinstance(r, int) for r in ranks) and ranks:
        return tuple(ranks)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return tuple(range(world))


def set_empty_cache(on: bool) -> None:
    _state["empty_cache"] = bool(on)


def status() -> dict:
    """What ``%dist_status`` shows for this rank."""
    info: dict[str, object] = {"pid": os.getpid(), "host": socket.gethostname(),
                               "empty_cache": bool(_state.get("empty_cache"))}
    try:
        with open(f"/proc/{os.getpid()}/status") as f:
            rss = next((line.split()[1] for line in f if line.startswith("VmRSS:")), "0")
        info["rss_mb"] = round(int(rss) / 1024, 1)
    except OSError:
        info["rss_mb"] = None
    ns = _user_ns()
    info["device"] = str(ns.get("device", "?"))
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        info["cuda_allocated_mb"] = round(torch.cuda.memory_allocated() / 2**20, 1)
        info["cuda_reserved_mb"] = round(torch.cuda.memory_reserved() / 2**20, 1)
    return info


def teardown_group() -> str:
    """Destroy this rank's process group: peers blocked in a collective with it raise at once."""
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
            return "destroyed"
    except Exception as e:  # noqa: BLE001 - a broken group may refuse; that is fine too
        return f"{type(e).__name__}: {e}"
    return "none"


def _user_ns() -> dict:
    from IPython import get_ipython

    shell = get_ipython()
    return shell.user_ns if shell is not None else {}
