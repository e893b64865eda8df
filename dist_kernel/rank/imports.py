"""Patch a library's modules the moment they are imported, and not before.

The integrations inside the ranks (fastai, Lightning) import nothing from their library: each
puts one :class:`PatchOnImport` finder on ``sys.meta_path`` that patches a listed module right
after it has executed (and before any other module can copy its names with ``from x import *``).
A rank that never imports the library pays one dict lookup per import.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType


class PatchingLoader(importlib.abc.Loader):
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


class PatchOnImport(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that only wraps the loader of the modules it patches.

    ``name`` says whose finder it is (``fastai``, ``lightning``): one per integration."""

    def __init__(self, name: str, patches: dict[str, Callable[[ModuleType], None]]) -> None:
        self.name = name
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
                    spec.loader = PatchingLoader(spec.loader, patch)
                return spec
        return None


def installed(name: str) -> bool:
    """Is ``name``'s finder already on ``sys.meta_path``?"""
    return any(isinstance(f, PatchOnImport) and f.name == name for f in sys.meta_path)


def patch_on_import(name: str, patches: dict[str, Callable[[ModuleType], None]]) -> None:
    """Apply ``patches`` (module name -> patch) to each module when it is imported; modules
    already imported (unusual: the library in a startup file) are patched in place now.
    Once per ``name``: a re-formed group installs again, and one finder is enough."""
    if installed(name):
        return
    for module, patch in patches.items():
        if module in sys.modules:
            patch(sys.modules[module])
    sys.meta_path.insert(0, PatchOnImport(name, patches))
