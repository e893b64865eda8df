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

import asyncio
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from dist_kernel.exceptions import RankDiedError
from dist_kernel.parent.merge import label_lines

if TYPE_CHECKING:
    from dist_kernel.parent.ranks import Ranks

#: how many request ids are remembered for translation
_RECENT = 256
#: comm messages (widgets): not in the base Kernel's message types, never merged
COMM_TYPES = ("comm_open", "comm_msg", "comm_close")
#: IOPub message types that are cell outputs
OUTPUT_TYPES = {"stream", "display_data", "execute_result", "update_display_data", "clear_output", "error"}

#: publishes on the frontend's IOPub: (parent request, msg_type, content, metadata, buffers)
Publish = Callable[[dict, str, dict, "dict | None", "list | None"], None]


class CommRouter:
    """Tracks which rank owns each comm, translates Output widgets' message ids, and carries
    comm messages both ways: rank to frontend (:meth:`relay`), frontend to rank (:meth:`forward`)."""

    def __init__(self, publish: Publish | None = None) -> None:
        self.publish = publish or (lambda parent, msg_type, content, metadata, buffers: None)
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

    # ------------------------------------------------------ rank -> frontend
    def relay(self, rank: int, msg: dict, parent: dict) -> None:
        """A comm message of ``rank`` to the frontend, under ``parent`` (``{}``: no request).

        Comms bypass merging: the frontend needs comm_open before the widget's display;
        message metadata carries the widget protocol version, buffers carry binary state."""
        msg_type = msg["header"]["msg_type"]
        content = self.from_rank(msg_type, msg["content"], rank)
        self.publish(parent, msg_type, content, msg.get("metadata"), msg.get("buffers"))

    def on_unrouted(self, rank: int, msg: dict) -> None:
        """IOPub messages no request listens for: comms are relayed, the rest (statuses) dropped."""
        if msg["header"]["msg_type"] in COMM_TYPES:
            self.relay(rank, msg, {})

    def callback_output(self, rank: int, parent: dict, msg: dict, labelled: bool) -> None:
        """Output of a comm callback (a widget's on_click), labelled with its rank when
        ``labelled`` (more than one rank)."""
        msg_type = msg["header"]["msg_type"]
        if msg_type in COMM_TYPES:
            self.relay(rank, msg, parent)
        elif msg_type in OUTPUT_TYPES:
            content = msg["content"]
            if msg_type == "stream" and labelled:
                content = dict(content, text=label_lines(content.get("text", ""), [rank]))
            self.publish(parent, msg_type, content, None, None)

    # ------------------------------------------------------ frontend -> rank
    def forward(self, ranks: Ranks | None, parent: dict) -> None:
        """A frontend comm message goes to the rank that owns the comm (rank 0 for new ones),
        in a task: waiting for the ranks to start never delays other requests."""
        if ranks is not None:
            asyncio.ensure_future(self._forward(ranks, parent))

    async def _forward(self, ranks: Ranks, parent: dict) -> None:
        await ranks.ready.wait()
        if ranks.start_error:
            return
        msg_type = parent["header"]["msg_type"]
        content = parent["content"]
        rank = self.rank_for(content.get("comm_id"))
        self.track(msg_type, content.get("comm_id"), rank)
        try:
            msg_id, _ = ranks.send(rank, msg_type, content, metadata=parent.get("metadata"),
                                   expect_reply=False, buffers=parent.get("buffers"))
        except RankDiedError:
            return
        labelled = ranks.config.world_size > 1
        ranks.listen(rank, msg_id, lambda msg: self.callback_output(rank, parent, msg, labelled))

    async def info(self, ranks: Ranks | None, content: dict) -> dict:
        """The comms of every live rank, merged (``comm_info_reply`` content)."""
        comms: dict[str, dict] = {}
        if ranks is not None and ranks.ready.is_set() and not ranks.start_error:
            live = ranks.live()
            replies = await asyncio.gather(*(ranks.shell_request(r, "comm_info_request", content, 5) for r in live),
                                           return_exceptions=True)
            for rank, reply in zip(live, replies, strict=True):
                if isinstance(reply, dict):
                    for comm_id, info in reply.get("comms", {}).items():
                        comms[comm_id] = info
                        self.owner.setdefault(comm_id, rank)
        return {"status": "ok", "comms": comms}
