"""Downloads and file side effects: done once, by rank 0, while the other ranks wait.

``untar_data``, ``download_url``, ``download_images``, ``resize_images`` and
``verify_images`` write to the filesystem the ranks share. Run on N ranks at once they race
(half-written archives, files resized twice, ranks listing different images), and
fastai's ``DistributedDL`` needs every rank to see the same item list. So each call runs on
rank 0 only; rank 0 then publishes its return value (as JSON: paths, lists, plain values) in the
process group's key value store, and the other ranks return that value.

The other ranks wait by polling the store, not in a collective: a download may take longer
than the group's collective timeout, and a sleeping poll stays interruptible.

``verify_images(...)`` is usually followed by ``.map(Path.unlink)``: its result is a list
whose ``map`` with a deleting function deletes on rank 0 only and makes the other ranks
wait until the files are gone, so a following ``get_image_files`` agrees on every rank.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from functools import wraps
from types import ModuleType
from typing import Any

import dist_kernel.rank.fastai.state as state
from dist_kernel.rank.integration import is_marked, mark

PREFIX = "dist_kernel/fastai"
_calls: dict[str, int] = {}  # per function: how many calls this rank made (same order on every rank)
_inside = False  # rank 0 is running a wrapped function: nested wrapped calls run plainly
_pid = os.getpid()  # worker processes forked by fastcore's `parallel` run calls plainly


def _store() -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def wait_for(key: str, poll: float = 0.02, max_poll: float = 0.5) -> bytes:
    """Wait (without any timeout, interruptibly) until ``key`` is in the store; its value."""
    store = _store()
    while not store.check([key]):
        time.sleep(poll)
        poll = min(poll * 1.5, max_poll)
    return store.get(key)


def _encode(status: str, value: Any = None) -> bytes | None:
    """JSON for what these helpers return (paths, lists of paths, plain values); None if other.
    Never pickle: the store is shared by processes and pickles execute code when loaded."""
    from pathlib import Path

    def enc(v: Any) -> Any:
        if v is None or isinstance(v, (bool, int, float, str)):
            return v
        if isinstance(v, Path):
            return {"path": str(v)}
        if isinstance(v, (list, tuple)) or type(v).__name__ == "L":
            return {"list": [enc(x) for x in v]}
        raise TypeError(type(v).__name__)

    try:
        return json.dumps({"status": status, "value": enc(value)}).encode()
    except TypeError:
        return None


def _decode(raw: bytes) -> tuple[str, Any]:
    from pathlib import Path

    from fastcore.foundation import L

    def dec(v: Any) -> Any:
        if isinstance(v, dict) and "path" in v:
            return Path(v["path"])
        if isinstance(v, dict) and "list" in v:
            return L([dec(x) for x in v["list"]])
        return v

    msg = json.loads(raw)
    return msg["status"], dec(msg["value"])


def rank0_once(name: str, fn: Callable, post: Callable[[Any, str], Any] | None = None) -> Callable:
    """``fn`` run by rank 0 alone; every rank returns rank 0's result (``post(result, key)`` if given)."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        global _inside
        if _inside or os.getpid() != _pid or not state.active():
            return fn(*args, **kwargs)
        _calls[name] = n = _calls.get(name, 0) + 1
        key = f"{PREFIX}/{name}/{n}"
        finish = post or (lambda result, _key: result)
        if state.rank() == 0:
            _inside = True
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:
                _store().set(key, _encode("error", f"{type(e).__name__}: {e}"))
                raise
            finally:
                _inside = False
            # a result JSON cannot carry: the other ranks compute their own (the files exist now)
            _store().set(key, _encode("ok", result) or _encode("rerun"))
            return finish(result, key)
        status, value = _decode(wait_for(key))
        if status == "error":
            raise RuntimeError(f"{name} failed on rank 0 ({value}); see rank 0's error above.")
        if status == "rerun":
            value = fn(*args, **kwargs)
        return finish(value, key)

    mark(wrapper)
    return wrapper


def _deleters() -> tuple:
    from pathlib import Path

    return (Path.unlink, os.remove, os.unlink)


def _shared_failures(result: Any, key: str) -> Any:
    """Wrap ``verify_images``' list so that deleting its files happens once (see module doc)."""
    from fastcore.foundation import L

    class SharedFailures(L):
        def map(self, f: Any, *args: Any, **kwargs: Any) -> Any:
            if f not in _deleters() or not state.active():
                return super().map(f, *args, **kwargs)
            done = f"{key}/deleted"
            if state.rank() == 0:
                res = super().map(f, *args, **kwargs)
                _store().set(done, b"1")
                return res
            wait_for(done)
            return L([None] * len(self))

    return SharedFailures(result)


def _wrap(mod: ModuleType, name: str, post: Callable[[Any, str], Any] | None = None) -> None:
    fn = getattr(mod, name, None)
    if fn is not None and not is_marked(fn):
        setattr(mod, name, rank0_once(f"{mod.__name__}.{name}", fn, post))


def _patch_external(mod: ModuleType) -> None:
    _wrap(mod, "untar_data")


def _patch_fastdownload(mod: ModuleType) -> None:
    _wrap(mod, "download_url")  # before fastdownload/__init__ and fastai re-export it


def _patch_vision_utils(mod: ModuleType) -> None:
    for name in ("download_images", "resize_images"):
        _wrap(mod, name)
    _wrap(mod, "verify_images", _shared_failures)


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "fastai.data.external": _patch_external,
    "fastdownload.core": _patch_fastdownload,
    "fastai.vision.utils": _patch_vision_utils,
}
