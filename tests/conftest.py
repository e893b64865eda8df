"""Shared fixtures: real Distributed Python kernels (real ipykernel ranks, real gloo group)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from harness import GROUP_SETUP, DistKernel, kernel_for_module  # noqa: E402

ARTIFACTS = Path(os.environ.get("DIST_KERNEL_TEST_ARTIFACTS", Path(__file__).parent.parent / "test-artifacts"))


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


@pytest.fixture(scope="module")
def group_kernel():
    """2 ranks, a 2 s hang grace, torch imported and ``kept`` defined: for group faults."""
    k = DistKernel("--ranks", "2", "--hang-grace", "2")
    k.execute(GROUP_SETUP)
    yield k
    k.shutdown()

