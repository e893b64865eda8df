"""Comms (ipywidgets, ``tqdm.notebook``) between the frontend and the ranks.

A comm lives in one rank. Messages from the frontend go to the rank that owns the comm (rank
0 for a comm the frontend opens); messages from a rank go to the frontend as they are.

One translation is needed: an ipywidgets ``Output`` widget captures output by message id.
Its state holds the ``msg_id`` of the request it captures for, and the frontend routes into
the widget the IOPub messages whose parent has that id. A rank knows only the id of the
request the parent sent it, while the frontend knows only its own: the widget's ``msg_id``
is translated to the frontend's (JupyterLab hooks messages by the ids of its own requests).
"""

from __future__ import annotations

from collections import OrderedDict

#: how many request ids are remembered for translation
_RECENT = 256


class CommRouter:
    """Tracks which rank owns each comm, and translates Output widgets' message ids."""

    def __init__(self) -> None:
        self.owner: dict[str, int] = {}  # comm_id -> the rank that holds the comm
        self._frontend_id: OrderedDict[str, str] = OrderedDict()  # id sent to a rank -> frontend id

    def sent(self, child_msg_id: str, frontend_msg_id: str) -> None:
        """The parent sent ``child_msg_id`` to a rank on behalf of ``frontend_msg_id``."""
        self._frontend_id[child_msg_id] = frontend_msg_id
        while len(self._frontend_id) > _RECENT:
            self._frontend_id.popitem(last=False)

    def track(self, msg_type: str, comm_id: str | None, rank: int) -> None:
        """comm_open (from either side) sets the owner; comm_close forgets it."""
        if comm_id is None:
            return
        if msg_type == "comm_open":
            self.owner[comm_id] = rank
        elif msg_type == "comm_close":
            self.owner.pop(comm_id, None)

    def rank_for(self, comm_id: str | None) -> int:
        return self.owner.get(comm_id or "", 0)

    def from_rank(self, msg_type: str, content: dict, rank: int) -> dict:
        """A comm message of ``rank``, ready for the frontend."""
        self.track(msg_type, content.get("comm_id"), rank)
        data = content.get("data")
        state = data.get("state") if isinstance(data, dict) else None
        if isinstance(state, dict) and state.get("msg_id") in self._frontend_id:
            state = dict(state, msg_id=self._frontend_id[state["msg_id"]])
            content = dict(content, data=dict(data, state=state))
        return content
