"""fastai integration: unchanged fastai notebooks train data-parallel on the kernel's ranks.

Runs inside each rank. :func:`install` is called once, after the process group has formed,
when the kernel's ``--fastai`` option is on. It imports nothing from fastai: an import hook
(:mod:`dist_kernel.rank.import_hook`) patches each fastai module right after that module has
executed.

What gets patched, and why, lives in modules named by domain:

- :mod:`dist_kernel.rank.fastai.training`: ``Learner.fit`` under DDP, inference and ``lr_find``
  that agree on every rank, one progress bar;
- :mod:`dist_kernel.rank.fastai.files`: downloads and file side effects run once, on rank 0;
- :mod:`dist_kernel.rank.fastai.figures`: figures and tables drawn from random batches
  (``show_batch``, ``show_results``, ``plot_loss``, ...) shown once, not once per rank.

``%dist_fastai on|off`` (the parent's magic, sent to every rank) switches the behaviour at run
time: the patches stay in place but pass straight through to fastai while it is off. The
switch and the helpers the patches share live in :mod:`dist_kernel.rank.fastai.state`, which
imports none of the others.
"""

from __future__ import annotations

from dist_kernel.rank import import_hook


def install() -> None:
    """Arrange for fastai to train data-parallel when (and only when) it is imported."""
    from dist_kernel.rank.fastai import figures, files, training

    import_hook.patch_on_import("fastai", import_hook.combine(training.PATCHES, files.PATCHES, figures.PATCHES))

