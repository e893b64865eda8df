"""Figures and tables from fastai's show/plot helpers: shown once, as one process shows them.

``dls.show_batch()``, ``learn.show_results()``, ``learn.recorder.plot_loss()``, the lr finder's
plot, ``Interpretation``'s plots ... run on every rank, and each rank draws its own: from its
own random batch, from its own recorder. Merged, that is one labelled figure per rank. So
while one of these helpers runs:

- every rank runs it (same code path, same random numbers drawn, same collectives, if any);
- the cell's first rank (:func:`state.shows_output`) shows what it displays, marked as its
  alone (``solo_output``: the parent shows it unlabelled); the figures it drew, which the
  inline backend shows at the end of the cell, are marked the same way;
- the other ranks show nothing: what they display is dropped, and the figures they drew are
  kept (``plt.gcf()``, ``plt.savefig`` after the call behave as in one process) but display
  as nothing, whether the inline backend flushes them or the cell returns one.

Figures are told apart by pyplot's figure list before and after the call: new ones, and
existing ones the call drew into (``show_batch(ctxs=axs)``).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import dist_kernel.rank.fastai.state as state
from dist_kernel.protocol import META_SOLO, with_meta
from dist_kernel.rank.fastai.state import wrap_once
from dist_kernel.rank.integration import is_marked, mark

_depth = 0  # > 0 while a wrapped helper runs: the helpers it calls pass straight through
#: figure -> shown by this rank (True) or by another rank (False)
_owner: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _figures() -> dict[Any, tuple]:
    """pyplot's open figures, each with a signature that changes when something is drawn in it."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return {}
    from matplotlib._pylab_helpers import Gcf

    figs = [m.canvas.figure for m in Gcf.get_all_fig_managers()]
    return {f: (len(f.get_children()), tuple(len(ax.get_children()) for ax in f.axes)) for f in figs}


def _mark_figures_on_display() -> None:
    """Have the display formatter honour :data:`_owner`: a figure this rank owns displays marked
    solo, one another rank owns displays as nothing. Covers the inline backend's flush at the
    end of the cell, ``plt.show()`` and a figure the cell returns (all format the figure)."""
    from IPython import get_ipython

    formatter = getattr(get_ipython(), "display_formatter", None)
    if formatter is None or is_marked(formatter.format):
        return
    original = formatter.format

    def format(obj: Any, *args: Any, **kwargs: Any) -> tuple[dict, dict]:
        owned = _owner.get(obj) if _is_figure(obj) else None
        if owned is None or not state.switch.enabled:  # `%dist_fastai off`: as fastai alone shows it
            return original(obj, *args, **kwargs)
        if not owned:
            return {}, {}  # display() and the displayhook publish nothing for empty data
        data, metadata = original(obj, *args, **kwargs)
        return data, with_meta(metadata, {META_SOLO: True})

    mark(format)
    formatter.format = format


def _is_figure(obj: Any) -> bool:
    figure = sys.modules.get("matplotlib.figure")
    return figure is not None and isinstance(obj, figure.Figure)


@contextlib.contextmanager
def shown_once() -> Iterator[None]:
    """Run a show/plot helper on every rank; only the cell's first rank shows what it draws."""
    global _depth
    if _depth or not state.active():
        yield
        return
    from dist_kernel.rank.agent import dropped_output, solo_output

    _depth += 1
    try:
        shows = state.shows_output()
        _mark_figures_on_display()
        before = _figures()
        try:
            with solo_output() if shows else dropped_output():
                yield
        finally:  # a helper that raised half-way leaves a figure behind: it is marked too
            for fig, sig in _figures().items():
                if before.get(fig) != sig:
                    _owner[fig] = shows
    finally:
        _depth -= 1


def _once(original: Callable) -> Callable:
    def method(*args: Any, **kwargs: Any) -> Any:
        with shown_once():
            return original(*args, **kwargs)

    return method


def _wrap(owner: Any, *names: str) -> None:
    for name in names:
        if hasattr(owner, name):
            wrap_once(owner, name, _once)


def _patch_data_core(mod: ModuleType) -> None:
    # DataLoaders.show_batch is the train DataLoader's (GetAttr); every fastai DataLoader with
    # a show_batch is a TfmdDL
    _wrap(mod.TfmdDL, "show_batch", "show_results")


def _patch_learner(mod: ModuleType) -> None:
    _wrap(mod.Learner, "show_results")
    _wrap(mod.Recorder, "plot_loss")


def _patch_schedule(mod: ModuleType) -> None:
    _wrap(mod.Recorder, "plot_sched", "plot_lr_find")  # lr_find(show_plot=True) calls the latter


def _patch_interpret(mod: ModuleType) -> None:
    _wrap(mod.Interpretation, "plot_top_losses", "show_results")
    _wrap(mod.ClassificationInterpretation, "plot_confusion_matrix")


def _patch_hook(mod: ModuleType) -> None:
    _wrap(mod.ActivationStats, "hist", "color_dim", "plot_layer_stats")


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "fastai.data.core": _patch_data_core,
    "fastai.learner": _patch_learner,
    "fastai.callback.schedule": _patch_schedule,
    "fastai.interpret": _patch_interpret,
    "fastai.callback.hook": _patch_hook,
}
