"""The integration's run-time switch and the helpers every patch module consults.

A module of its own so that the patch modules (``training``, ``files``, ``figures``) and the
package's ``install`` depend on it, and not on each other: no import cycle.
"""

from __future__ import annotations

from dist_kernel.rank.integration import rank, shows_output, wrap_once

__all__ = ["active", "dist_fastai", "enabled", "rank", "set_enabled", "shows_output", "wrap_once"]

#: the run-time switch (``%dist_fastai on|off``); the patched functions consult it on every call
enabled: bool = True


def active() -> bool:
    """True when the patches should act: switched on and inside a group of 2 or more ranks."""
    if not enabled:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def set_enabled(on: bool) -> None:
    """The switch, for the magic below and the parent's ``set_option`` request."""
    global enabled
    enabled = bool(on)


def dist_fastai(line: str = "") -> None:
    """``%dist_fastai on|off``: switch the fastai integration; no argument shows the state."""
    arg = line.strip().lower()
    if arg in ("on", "true", "1"):
        set_enabled(True)
    elif arg in ("off", "false", "0"):
        set_enabled(False)
    elif arg:
        raise ValueError(f"%dist_fastai {line.strip()!r}: use `%dist_fastai on` or `%dist_fastai off`.")
    print(f"dist_kernel fastai integration: {'on' if enabled else 'off'}")
