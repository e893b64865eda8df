"""The integration's run-time switch and the helpers every patch module consults.

A module of its own so that the patch modules (``training``, ``files``, ``figures``) and the
package's ``install`` depend on it, and not on each other: no import cycle.
"""

from __future__ import annotations

from dist_kernel.rank.integration import fastai as switch
from dist_kernel.rank.integration import rank, shows_output, wrap_once

__all__ = ["active", "rank", "shows_output", "switch", "wrap_once"]


def active() -> bool:
    """True when the patches should act: switched on (``%dist_fastai``, ``--fastai``) and inside
    a group of 2 or more ranks. The patched functions consult it on every call."""
    return switch.active()
