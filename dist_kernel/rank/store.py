"""Runs inside each rank: the rendezvous store, wrapped so that a wait in it can be ended.

Group creation (``new_group``, ``new_subgroups``, ``init_device_mesh`` on a subset) does not
wait in a collective but in torch's C++ store: the new group's ranks meet there. A rank whose
peers never call it waits up to the collective timeout (30 min), and neither the interrupt nor
a teardown reaches it, since C++ never returns to Python. So the store every formation uses
is this Python :class:`torch.distributed.Store`: C++ calls back into it, and it waits in
short slices (the main thread runs Python between them, so SIGINT raises there), and gives up
when :func:`release` is called from the control thread (a teardown). The state is module-level
and torch-free, so the agent can ask and release without importing torch.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

#: the longest slice of a wait: how soon an interrupt or a release takes effect
SLICE = 0.05

_lock = threading.Lock()
#: the port of rank 0's TCPStore across machines, once this rank reached it (set by rendezvous):
#: a teardown never cuts it, since every later formation meets there again
tcp_port: list[int] = []
_state = {"epoch": 0, "waiting": 0, "abandoned": False}


class WaitReleased(RuntimeError):
    """A wait in the rendezvous store was ended by the kernel (a teardown)."""


def waiting() -> bool:
    """Is a thread of this rank waiting in the store now?"""
    return bool(_state["waiting"])


def release() -> bool:
    """End every wait in the store that is under way (they raise :class:`WaitReleased`)."""
    with _lock:
        _state["epoch"] = int(_state["epoch"]) + 1
        return bool(_state["waiting"])


def abandoned() -> bool:
    """Did a wait end by an exception (a release, an interrupt) since the group formed? The
    ranks then disagree on what exists (one created a group the others never did): the group
    must be formed again."""
    return bool(_state["abandoned"])


def formed() -> None:
    """A group has just formed: earlier abandoned waits no longer matter."""
    _state["abandoned"] = False


def endable(inner: Any) -> Any:
    """``inner`` (a FileStore or TCPStore), with waits that an interrupt or :func:`release` ends."""
    return _kept(_store_class()(inner))


_classes: list[type] = []
#: every store made here. C++ (a PrefixStore, a process group) holds only the C++ half of a
#: Python store: once Python drops its object, the calls back find no method ("Not implemented")
_alive: list[Any] = []


def _kept(store: Any) -> Any:
    _alive.append(store)
    return store


def _store_class() -> type:
    """The Store subclass, defined once torch is imported (this module must not import it)."""
    if _classes:
        return _classes[0]
    import torch.distributed as dist

    class EndableStore(_Endable, dist.Store):
        """Delegates to ``inner``; blocking calls wait here, in slices (see the module doc)."""

    _classes.append(EndableStore)
    return EndableStore


class _Endable:
    """The methods of :func:`_store_class`'s ``torch.distributed.Store`` subclass, written here
    without torch; C++ finds them on the subclass (pybind11 looks the overrides up by name)."""

    timeout: timedelta  # torch's Store property

    def __init__(self, inner: Any) -> None:
        super().__init__()  # torch.distributed.Store's: pybind11 requires it
        self.inner = inner
        self.set_timeout(inner.timeout)  # type: ignore[attr-defined]  # torch's Store method: the base comes with the subclass

    # ---- blocking calls
    def get(self, key: str) -> bytes:
        self._wait([key], None)
        return self.inner.get(key)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._wait(keys, timeout)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._wait(keys, None)
        return self.inner.multi_get(keys)

    def _wait(self, keys: list[str], timeout: timedelta | None) -> None:
        if self.inner.check(keys):
            return
        import torch.distributed as dist  # imported already: this store exists only under torch

        limit = (timeout or self.timeout).total_seconds()
        _wait_in_slices(self.inner, keys, limit, dist.DistStoreError)

    # ---- the rest as is
    def set(self, key: str, value: Any) -> None:
        self.inner.set(key, value)

    def add(self, key: str, amount: int) -> int:
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self.inner.compare_set(key, expected, desired)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def check(self, keys: list[str]) -> bool:
        return self.inner.check(keys)

    def append(self, key: str, value: Any) -> None:
        self.inner.append(key, value)

    def multi_set(self, keys: list[str], values: list[Any]) -> None:
        self.inner.multi_set(keys, values)

    def clone(self) -> Any:
        try:
            return _kept(type(self)(self.inner.clone()))
        except (RuntimeError, NotImplementedError):  # a FileStore cannot be cloned: share it
            return self


def _wait_in_slices(inner: Any, keys: list[str], limit: float, timeout_error: type[Exception]) -> None:
    """Wait until ``inner`` holds ``keys``: in slices that grow to :data:`SLICE` (the main thread
    runs Python between them, so SIGINT raises), until :func:`release` or ``limit`` seconds (0:
    no limit), which raises ``timeout_error`` (torch's ``DistStoreError``: passed in, since this
    module does not import torch)."""
    started = time.monotonic()
    with _lock:
        epoch = _state["epoch"]
        _state["waiting"] = int(_state["waiting"]) + 1
    try:
        pause = 0.001
        while not inner.check(keys):
            if _state["epoch"] != epoch:
                raise WaitReleased(
                    f"dist_kernel ended this wait in the rendezvous store for {', '.join(keys)}: "
                    "the other ranks never entered the same group creation")
            if limit > 0 and time.monotonic() - started > limit:
                raise timeout_error(f"Timeout after {limit:.0f}s waiting in the rendezvous store for {', '.join(keys)}")
            time.sleep(pause)  # the main thread runs Python here: SIGINT raises
            pause = min(SLICE, pause * 2)
    except BaseException as e:
        if not isinstance(e, timeout_error):  # torch retries its own timed waits
            _state["abandoned"] = True
        raise
    finally:
        with _lock:
            _state["waiting"] = int(_state["waiting"]) - 1
