"""Transformers' ``Trainer`` on the kernel's ranks: training, ``evaluate`` and ``predict`` need no
patch (``Trainer`` runs on accelerate, which finds the kernel's group; evaluation gathers every
rank's predictions, in order). What one process would show once is shown once, unlabelled
(see :mod:`dist_kernel.rank.hf`):

- the progress callbacks (``NotebookProgressCallback`` in a notebook: the progress bar and the
  log table; ``ProgressCallback``/``PrinterCallback`` when tqdm or printing is chosen) show on
  the cell's first rank, marked as its output alone; the other ranks run them with their displays
  dropped (in a notebook each rank would otherwise draw its own bar, each labelled with its rank);
- ``save_model``'s progress and messages, which only the main process prints, are shown unlabelled.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType
from typing import Any

from dist_kernel.rank.integration import hf, shows_output, wrap_once


def _shown_once(original: Callable) -> Callable:
    """A progress callback's event: every rank runs it (``NotebookProgressCallback.on_evaluate``
    trims the metrics dict ``evaluate()`` returns: it must do so everywhere), the rank that shows
    output marks what it shows as its alone, the other ranks' displays are dropped."""

    def event(*args: Any, **kwargs: Any) -> Any:
        if not hf.active():
            return original(*args, **kwargs)
        from dist_kernel.rank.agent import dropped_output, flush_streams, solo_output

        if shows_output():
            with solo_output(streams=True):
                return original(*args, **kwargs)
        flush_streams()  # as the rank that shows it does
        with dropped_output():
            return original(*args, **kwargs)

    return event


def _main_output_solo(original: Callable) -> Callable:
    """Run on every rank; what the rank that shows output prints is marked as its alone."""

    def method(*args: Any, **kwargs: Any) -> Any:
        if not hf.active():
            return original(*args, **kwargs)
        from dist_kernel.rank.agent import flush_streams, solo_output

        if not shows_output():
            flush_streams()  # as the rank that shows it does
            return original(*args, **kwargs)

        with solo_output(streams=True):
            return original(*args, **kwargs)

    return method


def _patch_events(cls: type) -> None:
    for name in [n for n in vars(cls) if n.startswith("on_") and callable(vars(cls)[n])]:
        wrap_once(cls, name, _shown_once)


def _patch_callbacks(mod: ModuleType) -> None:
    for name in ("ProgressCallback", "PrinterCallback"):
        _patch_events(getattr(mod, name))


def _patch_notebook(mod: ModuleType) -> None:
    _patch_events(mod.NotebookProgressCallback)


def _patch_trainer(mod: ModuleType) -> None:
    wrap_once(mod.Trainer, "save_model", _main_output_solo)


#: Transformers module -> its patch
PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "transformers.trainer_callback": _patch_callbacks,
    "transformers.utils.notebook": _patch_notebook,
    "transformers.trainer": _patch_trainer,
}
