"""The cluster lane: the one ``lab`` fixture, the two-node lab of ``tests/cluster/lab.sh``."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cluster_lab import hold_lab, lab_env, release_lab

HERE = Path(__file__).resolve().parent

#: CI sets this: a lab that cannot come up is then a failure, never a skip
REQUIRED = os.environ.get("DIST_KERNEL_CLUSTER_TESTS") == "required"


@pytest.fixture(scope="session")
def lab() -> dict[str, str]:
    """The lab's environment (SLURM_CONF, LAB_SSH_OPTS, ...); brought up once, never torn down here."""
    try:
        env = lab_env()
    except pytest.skip.Exception as e:
        if REQUIRED:
            pytest.fail(f"cluster lab unavailable but DIST_KERNEL_CLUSTER_TESTS=required: {e}")
        raise
    if env is None:
        if REQUIRED:
            pytest.fail("cluster lab unavailable but DIST_KERNEL_CLUSTER_TESTS=required")
        pytest.skip("cluster lab unavailable")
    return env


def _in_lane(item: pytest.Item | None) -> bool:
    return item is not None and Path(str(item.path)).resolve().is_relative_to(HERE)


# The lab is one per machine: this session holds it from collection (no test's timeout runs
# while it waits for another session to be done with it) to the end of its last cluster test.
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    if any(_in_lane(i) for i in items):
        hold_lab()


def pytest_runtest_setup(item: pytest.Item) -> None:
    hold_lab()  # held already, unless the lane's tests were not run in one stretch


@pytest.hookimpl(trylast=True)  # after the lane's module fixtures (its kernels on the nodes) are torn down
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    if not _in_lane(nextitem):
        release_lab()
