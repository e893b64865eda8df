"""What every library integration inside a rank shares: its on/off switch, which rank shows
what one process would show, and wrapping a library's function once.

The integrations (:mod:`dist_kernel.rank.fastai`, :mod:`dist_kernel.rank.lightning`,
:mod:`dist_kernel.rank.hf`) patch the library when it is imported
(:mod:`dist_kernel.rank.import_hook`); the patched functions consult their :class:`Switch` on
every call and pass straight through to the library while it is off.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any


class Switch:
    """An integration's run-time switch. The parent flips it on every rank at once
    (``%dist_<name> on|off``, sent as ``set_option``: :mod:`dist_kernel.rank.switches`); a rank
    never flips it alone."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.enabled = True

    def set(self, on: bool) -> None:
        self.enabled = bool(on)

    def active(self) -> bool:
        """Should the patches act: switched on, and inside a group of 2 or more ranks?"""
        return self.enabled and world_size() > 1


# Every integration's switch lives here, so that an integration's package and the patch modules
# it installs all read it without an import cycle, and ``set_option`` (dist_kernel.rank.switches)
# reaches it without importing the integration.
#: ``--fastai``, ``%dist_fastai``
fastai = Switch("fastai")
#: ``--lightning``, ``%dist_lightning``
lightning = Switch("lightning")
#: ``--hf``, ``%dist_hf``
hf = Switch("hf")


def in_group() -> bool:
    """Has the kernel formed this rank's process group (of any size)?"""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """The group's size (1 without one)."""
    import torch.distributed as dist

    return dist.get_world_size() if in_group() else 1


def rank() -> int:
    """This process's rank in the group (0 without one)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def shows_output() -> bool:
    """Is this rank the one that shows what a single process would show once? The lowest rank
    running the current cell: rank 0 usually, rank 1 in a ``%%rank 1`` cell."""
    from dist_kernel.rank.agent import cell_ranks

    return rank() == min(cell_ranks())


_MARK = "__dist_kernel__"


def mark(fn: Any) -> Any:
    """Mark ``fn`` as one of ours, so that it is never wrapped twice (:func:`is_marked`)."""
    setattr(fn, _MARK, True)
    return fn


def is_marked(fn: Any) -> bool:
    return bool(getattr(fn, _MARK, False))


def wrap_once(owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` by ``make(original)``, unless that was done already."""
    original = getattr(owner, name)
    if is_marked(original):
        return
    setattr(owner, name, mark(wraps(original)(make(original))))
