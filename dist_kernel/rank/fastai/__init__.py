"""fastai integration: unchanged fastai notebooks train data-parallel on the kernel's ranks.

Runs inside each rank. :func:`install` is called once, after the process group has formed,
when the kernel's ``--fastai`` option is on. It imports nothing from fastai: it puts an
import hook on ``sys.meta_path`` that patches each fastai module right after that module
has executed (and before any other module can copy its names with ``from x import *``).
A rank that never imports fastai pays one dict lookup per import.

What gets patched, and why, lives in modules named by domain:

- :mod:`dist_kernel.rank.fastai.training`: ``Learner.fit`` under DDP, inference and ``lr_find``
  that agree on every rank, one progress bar;
- :mod:`dist_kernel.rank.fastai.files`: downloads and file side effects run once, on rank 0;
- :mod:`dist_kernel.rank.fastai.figures`: figures and tables drawn from random batches
  (``show_batch``, ``show_results``, ``plot_loss``, ...) shown once, not once per rank.

``%dist_fastai on|off`` (an IPython line magic in the ranks) switches the behaviour at run
time: the patches stay in place but pass straight through to fastai while it is off. The
switch and the helpers the patches share live in :mod:`dist_kernel.rank.fastai.state`, which
imports none of the others.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType

from dist_kernel.rank.fastai.state import dist_fastai


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then the patch, so the module is patched before anyone uses it."""

    def __init__(self, loader: importlib.abc.Loader, patch: Callable[[ModuleType], None]) -> None:
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name: str) -> object:  # get_source, get_filename, ... for inspect/pickle
        return getattr(self._loader, name)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that only wraps the loader of the modules it patches."""

    def __init__(self, patches: dict[str, Callable[[ModuleType], None]]) -> None:
        self.patches = patches

    def find_spec(self, fullname: str, path: object, target: ModuleType | None = None) -> object:
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def _patches() -> dict[str, Callable[[ModuleType], None]]:
    """Per fastai module, one function applying every patch module's patches for it."""
    from dist_kernel.rank.fastai import figures, files, training

    by_module: dict[str, list[Callable[[ModuleType], None]]] = {}
    for patches in (training.PATCHES, files.PATCHES, figures.PATCHES):
        for name, patch in patches.items():
            by_module.setdefault(name, []).append(patch)
    return {name: _chain(fns) for name, fns in by_module.items()}


def _chain(fns: list[Callable[[ModuleType], None]]) -> Callable[[ModuleType], None]:
    def patch(mod: ModuleType) -> None:
        for fn in fns:
            fn(mod)

    return patch


def install() -> None:
    """Arrange for fastai to train data-parallel when (and only when) it is imported."""
    if any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        return  # a re-formed group calls install() again: one hook is enough
    patches = _patches()
    # modules imported before us (unusual: fastai in a startup file) are patched in place
    for name, patch in patches.items():
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, _PatchOnImport(patches))
    _register_magic()


def _register_magic() -> None:
    from IPython import get_ipython

    shell = get_ipython()
    if shell is not None:
        shell.register_magic_function(dist_fastai, "line", "dist_fastai")
