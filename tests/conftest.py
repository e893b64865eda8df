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
from pathlib import Path

import pytest

# harness and cluster_lab (one module for every lane) are on sys.path through pyproject's pytest
# ``pythonpath``: the lanes are imported in importlib mode, which adds no test directory itself
from cluster_lab import hold_lab, release_lab
from harness import cpu_hogs, group_kernel_for_module, kernel_for_module

TESTS = Path(__file__).parent
#: the lanes whose tests start real kernels or processes
SLOW_LANES = ("kernel", "cluster")

ARTIFACTS = Path(os.environ.get("DIST_KERNEL_TEST_ARTIFACTS", Path(__file__).parent.parent / "test-artifacts"))


def _lane(item: pytest.Item) -> str:
    try:
        return Path(str(item.path)).resolve().relative_to(TESTS.resolve()).parts[0]
    except ValueError:
        return ""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test of a slow lane ``slow``, by its directory, and every cluster test ``lab``.
    A session that will use the cluster lab takes it now (see :func:`uses_lab`)."""
    for item in items:
        lane = _lane(item)
        if lane in SLOW_LANES:
            item.add_marker(pytest.mark.slow)
        if lane == "cluster":
            item.add_marker(pytest.mark.lab)
    # not in a pytest-xdist worker: the workers collect at once, and one holding the lab from its
    # collection would keep the other's collection, and so the whole session, waiting forever;
    # a worker takes the lab before its first lab test instead (pytest_runtest_setup)
    if not config.option.collectonly and not os.environ.get("PYTEST_XDIST_WORKER") \
            and any(uses_lab(i) for i in items):
        hold_lab()


# The cluster lab is one per machine: a session holds it from collection (no test's timeout runs
# while it waits for another session, a second copy of the suite, to be done with it) to the
# teardown of its last test marked ``lab``: the cluster lane, whose test_cluster_benchmark.py runs the
# benchmark's section 8 there (the kernel lane's smoke test runs the rest with --no-cluster).
# See tests/cluster/README.md.
def uses_lab(item: pytest.Item | None) -> bool:
    return item is not None and item.get_closest_marker("lab") is not None


def pytest_runtest_setup(item: pytest.Item) -> None:
    if uses_lab(item):
        hold_lab()  # held already, unless the lab's tests were not run in one stretch


@pytest.hookimpl(trylast=True)  # after the test's module fixtures (kernels on the nodes) are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if uses_lab(item) and not uses_lab(nextitem):
        release_lab()


@pytest.fixture(scope="module")
def kernel2():
    yield from kernel_for_module("--ranks", "2")


@pytest.fixture(scope="module")
def kernel3():
    yield from kernel_for_module("--ranks", "3")


@pytest.fixture
def busy_machine():
    """Every core kept busy by another process while the test runs (``harness.cpu_hogs``): the
    tests of hangs and races run beside it, as on a user's busy machine."""
    with cpu_hogs() as hogs:
        yield hogs


@pytest.fixture
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="module")
def group_kernel():
    """2 ranks, a 2 s hang grace, torch imported and ``kept`` defined: for group faults."""
    yield from group_kernel_for_module("--ranks", "2", "--hang-grace", "2")

