"""fastai integration: runs inside each rank (placeholder; see issue 5)."""

from __future__ import annotations


def install() -> None:
    """Arrange for fastai to train data-parallel when (and only when) it is imported."""
