"""The ranks' seam stays one seam: the unit tests' :class:`FakeRanks` implements every member of
the :class:`~dist_kernel.parent.ranks.Ranks` protocol with the protocol's parameters, as
:class:`~dist_kernel.parent.ranks.SupervisedRanks` does (mypy holds that one to it where the
kernel attaches it), so the fake cannot drift from what the kernel calls."""

from __future__ import annotations

import inspect

from dist_kernel.parent.ranks import CellRanks, Ranks
from tests.unit.fake_ranks import FakeRanks


def _members() -> dict[str, object]:
    """The protocols' own members (CellRanks' and Ranks'), by name."""
    return {name: value for proto in (CellRanks, Ranks) for name, value in vars(proto).items()
            if not name.startswith("_")}


def _params(fn: object) -> list[tuple[str, object]]:
    """A method's parameters after ``self``: name and default (annotations aside: the fake has none)."""
    return [(p.name, p.default) for p in list(inspect.signature(fn).parameters.values())[1:]]  # type: ignore[arg-type]


def test_the_fake_ranks_have_every_member_of_the_seam_with_its_parameters() -> None:
    fake = FakeRanks(kernel=None)
    missing, differ = [], []
    for name, member in _members().items():
        if not hasattr(fake, name):
            missing.append(name)
        elif inspect.isfunction(member):
            ours = getattr(FakeRanks, name, None)
            if not inspect.isfunction(ours) or _params(ours) != _params(member) \
                    or inspect.iscoroutinefunction(ours) != inspect.iscoroutinefunction(member):
                differ.append(name)
    assert (missing, differ) == ([], [])

