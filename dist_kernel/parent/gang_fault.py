"""A fault that takes the whole gang, heard for a moment before its cause is named once
(:mod:`~dist_kernel.parent.fault_policy` rule 6).

On other machines one fault arrives as several words: a Slurm step SIGTERMs the other nodes'
ranks when one node is lost, an agent says it is ending, and only then is the link's loss
confirmed. The first word starts a settling moment (:func:`~dist_kernel.parent.fault_policy.settle_for`);
what else is heard meanwhile joins it, and at its end the culprit is named
(:func:`~dist_kernel.parent.fault_policy.remote_culprit`), once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from dist_kernel.parent.fault_policy import RemoteCause, remote_culprit, settle_for


class GangFault:
    """``first``: called at the first word of a fault (the supervisor holds the ranks' replies
    from then); ``named``: called once with the cause, when the moment has settled."""

    def __init__(self, first: Callable[[], None], named: Callable[[RemoteCause], None]) -> None:
        self._first = first
        self._named = named
        self.causes: list[RemoteCause] = []
        self.named = False

    @property
    def settling(self) -> bool:
        """Did word of a fault come (it settles now, or was named)?"""
        return bool(self.causes)

    def heard(self, cause: RemoteCause) -> None:
        """One word of a fault; the first starts the settling moment."""
        if self.named or cause in self.causes:
            return
        self.causes.append(cause)
        if len(self.causes) == 1:
            self._first()
            asyncio.get_running_loop().call_later(settle_for(cause), self._name)

    def _name(self) -> None:
        if not self.named:
            self.named = True
            self._named(remote_culprit(self.causes))
