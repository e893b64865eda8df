"""Patch a library's modules right after they are imported, and never import them ourselves.

An integration (``dist_kernel.rank.fastai``, ``dist_kernel.rank.accelerate``, ...) names, per
module of its library, a function that patches that module. :func:`patch_on_import` puts one
finder on ``sys.meta_path`` per integration; it wraps only the loaders of those modules, so each
is patched right after it has executed (and before any other module can copy its names with
``from x import *``). Modules imported before the hook was installed are patched in place. A rank
that never imports the library pays one dict lookup per import.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Iterable, Sequence
from types import ModuleType

Patch = Callable[[ModuleType], None]


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then the patch, so the module is patched before anyone uses it."""

    def __init__(self, loader: importlib.abc.Loader, patch: Patch) -> None:
        self._loader = loader
        self._patch = patch

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        self._patch(module)

    def __getattr__(self, name: str) -> object:  # get_source, get_filename, ... for inspect/pickle
        return getattr(self._loader, name)


class PatchOnImport(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that only wraps the loader of the modules it patches."""

    def __init__(self, owner: str, patches: dict[str, Patch]) -> None:
        self.owner = owner  # the integration that installed it: one finder each
        self.patches = patches

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
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


def combine(*tables: dict[str, Patch]) -> dict[str, Patch]:
    """One patch per module from several tables of patches (applied in the tables' order)."""
    by_module: dict[str, list[Patch]] = {}
    for table in tables:
        for name, patch in table.items():
            by_module.setdefault(name, []).append(patch)
    return {name: _chain(fns) for name, fns in by_module.items()}


def _chain(fns: Iterable[Patch]) -> Patch:
    fns = tuple(fns)

    def patch(mod: ModuleType) -> None:
        for fn in fns:
            fn(mod)

    return patch


def installed(owner: str) -> bool:
    """Has ``owner`` put its finder on ``sys.meta_path`` already?"""
    return any(isinstance(f, PatchOnImport) and f.owner == owner for f in sys.meta_path)


def patch_on_import(owner: str, patches: dict[str, Patch]) -> bool:
    """Patch each named module when it is imported (now, for those already imported).

    False when ``owner``'s finder is in place already (a re-formed group installs again)."""
    if installed(owner):
        return False
    for name, patch in patches.items():
        if name in sys.modules:
            patch(sys.modules[name])
    sys.meta_path.insert(0, PatchOnImport(owner, patches))
    return True
