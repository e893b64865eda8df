"""The cluster lane: the one ``lab`` fixture, the two-node lab of ``tests/cluster/lab.sh``."""

from __future__ import annotations

import os

import pytest
from cluster_lab import lab_env

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
