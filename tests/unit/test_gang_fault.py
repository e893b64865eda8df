"""A fault that takes the whole gang (rule 6): the first word holds the ranks' replies, what
follows in the settling moment joins it, and the culprit is named once, whatever comes after."""

from __future__ import annotations

import asyncio

import pytest

from dist_kernel.parent import gang_fault
from dist_kernel.parent.fault_policy import RemoteCause


def test_the_cause_is_named_once_from_every_word_heard_while_it_settled(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gang_fault, "settle_for", lambda first: 0.0)  # the moment, without waiting for it
    held, named = [], []
    fault = gang_fault.GangFault(lambda: held.append(True), named.append)
    ending = RemoteCause("ending", "node 1's agent is ending")
    lost = RemoteCause("lost", "node 1 is lost", (2, 3))

    async def hear() -> None:
        assert not fault.settling
        fault.heard(ending)
        fault.heard(lost)
        fault.heard(ending)  # heard again: one word
        assert fault.settling and held == [True] and named == []
        await asyncio.sleep(0.01)
        fault.heard(RemoteCause("exited", "rank 0 exited"))  # after it was named: not a new fault
        await asyncio.sleep(0.01)

    asyncio.run(hear())
    assert held == [True] and named == [lost] and fault.causes == [ending, lost]
