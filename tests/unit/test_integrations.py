"""What the library integrations inside a rank share (import hooks, switches) and the pure
decisions of the Hugging Face one, as fast unit tests; the real-kernel tests are in
tests/kernel/test_fastai.py and tests/kernel/test_ecosystem_hf.py."""

from __future__ import annotations

import sys

import pytest

from dist_kernel.options import RANK_SWITCHES
from dist_kernel.rank import import_hook, integration, switches
from dist_kernel.rank.accelerate import check_processes
from dist_kernel.rank.integration import Switch


@pytest.fixture
def library(tmp_path, monkeypatch):
    """A tiny importable package ``toylib`` with a module ``toylib.core``."""
    pkg = tmp_path / "toylib"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .core import greet\n")
    (pkg / "core.py").write_text("def greet():\n    return 'hello'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "toylib"
    for name in [n for n in sys.modules if n == "toylib" or n.startswith("toylib.")]:
        del sys.modules[name]
    sys.meta_path[:] = [f for f in sys.meta_path if getattr(f, "owner", None) != "toy"]


def _shout(mod):
    original = mod.greet
    mod.greet = lambda: original().upper()


def test_a_module_is_patched_when_imported_before_its_package_copies_its_names(library):
    assert import_hook.patch_on_import("toy", {"toylib.core": _shout})
    import toylib

    assert toylib.greet() == "HELLO"  # the package's copy is the patched one


def test_a_module_imported_before_the_hook_is_patched_in_place_and_installing_twice_does_nothing(library):
    import toylib.core

    assert import_hook.patch_on_import("toy", {"toylib.core": _shout})
    assert toylib.core.greet() == "HELLO"
    assert not import_hook.patch_on_import("toy", {"toylib.core": _shout})
    assert sum(getattr(f, "owner", None) == "toy" for f in sys.meta_path) == 1


def test_patch_tables_combine_per_module_in_order():
    calls = []
    patch = import_hook.combine({"m": lambda mod: calls.append("a")}, {"m": lambda mod: calls.append("b")})
    patch["m"](None)
    assert calls == ["a", "b"]


def test_a_switch_turns_off_and_on():
    s = Switch("toy")
    s.set(False)
    assert not s.enabled and not s.active()
    s.set(True)
    assert s.enabled


def test_a_rank_refuses_every_switchs_magic_and_points_at_the_kernels(monkeypatch):
    """``%dist_fastai off`` below code, or in ``run_line_magic``, reaches a rank: it never flips
    that rank alone (the ranks would disagree), it says where the magic goes."""
    import IPython
    from IPython.core.error import UsageError

    registered: dict[str, object] = {}

    class Shell:
        def register_magic_function(self, fn, kind, name):
            assert kind == "line"
            registered[name] = fn

    monkeypatch.setattr(IPython, "get_ipython", lambda: Shell())
    before = {name: s.enabled for name, s in (("fastai", integration.fastai), ("hf", integration.hf))}
    switches._register_stand_ins()
    assert sorted(registered) == sorted(f"dist_{name}" for name in RANK_SWITCHES)
    with pytest.raises(UsageError) as e:
        registered["dist_fastai"]("off")
    assert "%dist_fastai off reached a rank, and a rank never switches fastai alone" in str(e.value)
    assert "put `%dist_fastai off` at the top of a cell, before any code and without %%rank" in str(e.value)
    with pytest.raises(UsageError, match="`%dist_empty_cache` at the top of a cell"):
        registered["dist_empty_cache"]("")
    assert {name: s.enabled for name, s in (("fastai", integration.fastai), ("hf", integration.hf))} == before


def test_notebook_launcher_takes_every_rank_or_exactly_their_number():
    check_processes(None, 1, 2)
    check_processes(2, 1, 2)
    check_processes(2, 2, 4)  # 2 per node on 2 nodes
    with pytest.raises(ValueError, match=r"asks for 8 processes, but this Distributed Python kernel has 2 ranks") as e:
        check_processes(8, 1, 2)
    assert "num_processes=2" in str(e.value) and "--ranks 8" in str(e.value)
