"""``python -m pytest tests``, what a newcomer types first, collects every lane (issue 36).

The lanes hold test modules of one name (``tests/unit/test_top.py`` and ``tests/kernel/test_top.py``).
pytest's default import mode imports a test module by its bare name, so the second of a name failed
at collection; ``--import-mode=importlib`` (pyproject's pytest options) imports each under its path.
That mode puts no test directory on ``sys.path``: the helpers the tests import by name (``harness``,
``fake_ranks``, ``cluster_lab``, ...) must then come from the ``pythonpath`` directories, each from
exactly one. Read from the files, without running pytest (the unit lane starts no process).
"""

from __future__ import annotations

import ast
import shlex
import sys
from collections import Counter
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest itself needs tomli before 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def _pytest_options() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]


def _test_modules() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def test_test_modules_that_share_a_name_are_imported_by_their_path() -> None:
    names = Counter(path.name for path in _test_modules())
    shared = sorted(name for name, count in names.items() if count > 1)
    assert shared, "no two test modules share a name any more: this check has nothing left to hold"
    addopts = shlex.split(_pytest_options().get("addopts", ""))
    assert "--import-mode=importlib" in addopts, (
        f"{shared} are in more than one lane: `python -m pytest tests` fails at collection unless "
        "pyproject's [tool.pytest.ini_options] addopts sets --import-mode=importlib")


def _local_imports(path: Path, local: set[str]) -> set[str]:
    """The modules of the tests' tree that ``path`` imports by their bare name."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found & local


def test_every_helper_a_test_imports_by_name_is_in_exactly_one_pythonpath_directory() -> None:
    path_dirs = [ROOT / entry for entry in _pytest_options().get("pythonpath", [])]
    local = {p.stem for p in TESTS.rglob("*.py") if p.stem != "conftest"}
    wanted = {name for path in TESTS.rglob("*.py") for name in _local_imports(path, local)}
    assert {"harness", "fake_ranks", "cluster_lab"} <= wanted  # the check reads the imports at all
    for name in sorted(wanted):
        homes = [d for d in path_dirs if (d / f"{name}.py").is_file()]
        assert len(homes) == 1, (
            f"the tests import {name!r} by its name, and pyproject's pytest pythonpath has it in "
            f"{[str(d.relative_to(ROOT)) for d in homes] or 'no directory'}: it must be in exactly one")
