"""The integration's run-time switch and the helpers every patch module consults.

A module of its own so that the patch modules (``training``, ``files``, ``figures``) and the
package's ``install`` depend on it, and not on each other: no import cycle.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any

#: the run-time switch (``%dist_fastai on|off``); the patched functions consult it on every call
enabled: bool = True


def active() -> bool:
    """True when the patches should act: switched on and inside a group of 2 or more ranks."""
    if not enabled:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank() -> int:
    """This process's rank in the group (0 without one)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def shows_output() -> bool:
    """Is this rank the one that shows what a single process would show once? The lowest rank
    running the current cell: rank 0 usually, rank 1 in a ``%%rank 1`` cell."""
    from dist_kernel.rank.agent import cell_ranks

    return rank() == min(cell_ranks())


def wrap_once(owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` by ``make(original)``, unless that was done already."""
    original = getattr(owner, name)
    if getattr(original, "__dist_kernel__", False):
        return
    new = wraps(original)(make(original))
    new.__dist_kernel__ = True
    setattr(owner, name, new)


def set_enabled(on: bool) -> None:
    """The switch, for the magic below and the parent's ``set_option`` request."""
    global enabled
    enabled = bool(on)


def dist_fastai(line: str = "") -> None:
    """``%dist_fastai on|off``: switch the fastai integration; no argument shows the state."""
    from dist_kernel.rank.switch import switch_magic

    switch_magic(line, "fastai", "dist_fastai", lambda: enabled, set_enabled)
