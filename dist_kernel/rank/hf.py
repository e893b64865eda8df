"""The Hugging Face integration: accelerate and Transformers, unchanged, on the kernel's ranks.

Runs inside each rank. :func:`install` is called once, after the process group has formed, when
the kernel's ``--hf`` option is on. It imports neither library: import hooks
(:mod:`dist_kernel.rank.import_hook`) patch their modules when a cell imports them.

- :mod:`dist_kernel.rank.accelerate`: ``notebook_launcher(fn)`` runs ``fn`` on every rank in the
  existing group instead of forking; ``accelerator.print`` shows once, unlabelled.
- :mod:`dist_kernel.rank.transformers`: ``Trainer``'s progress bar, log table and save messages
  show once, unlabelled.

Training itself needs no patch: accelerate and ``Trainer`` find the group the kernel formed (and
``ACCELERATE_USE_CPU`` on CPU ranks, see :mod:`dist_kernel.placement`). ``%dist_hf on|off`` (the
parent's magic, sent to every rank) switches the patches at run time: they stay in place but
pass straight through while off.
"""

from __future__ import annotations

from dist_kernel.rank import import_hook
from dist_kernel.rank.integration import hf as switch

__all__ = ["install", "switch"]


def install() -> None:
    """Arrange for accelerate and Transformers to be patched when (and only when) imported."""
    from dist_kernel.rank import accelerate, transformers

    import_hook.patch_on_import("accelerate", accelerate.PATCHES)
    import_hook.patch_on_import("transformers", transformers.PATCHES)
