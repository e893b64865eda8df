"""The three test lanes, and the shared fixtures of real Distributed Python kernels.

- ``tests/unit``: pure modules, and the parent kernel in-process against fake ranks. No
  process is started there (``tests/unit/conftest.py`` fails a test that tries) and torch is
  never imported: the inner loop, ``pytest tests/unit``, takes seconds.
- ``tests/kernel``: real kernels, real ipykernel ranks and a real gloo group on this machine.
- ``tests/cluster``: ranks on the two-node lab of ``tests/cluster/lab.sh`` (one ``lab`` fixture).

Every test under ``tests/kernel`` and ``tests/cluster`` is marked ``slow`` by its directory, so
``-m "not slow"`` never starts a kernel.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from harness import kernel_for_module  # noqa: E402

TESTS = Path(__file__).parent
#: the lanes whose tests start real kernels or processes
SLOW_LANES = ("kernel", "cluster")

ARTIFACTS = Path(os.environ.get("DIST_KERNEL_TEST_ARTIFACTS", Path(__file__).parent.parent / "test-artifacts"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test of a slow lane ``slow``, by its directory."""
    for item in items:
        try:
            lane = Path(str(item.path)).resolve().relative_to(TESTS.resolve()).parts[0]
        except ValueError:
            continue
        if lane in SLOW_LANES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="module")
def kernel2():
    yield from kernel_for_module("--ranks", "2")


@pytest.fixture(scope="module")
def kernel3():
    yield from kernel_for_module("--ranks", "3")


@pytest.fixture
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS
