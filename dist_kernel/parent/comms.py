"""Comms (ipywidgets, ``tqdm.notebook``) between the frontend and the ranks.

A comm lives in the ranks that opened it. Ranks name the comms they open after the cell and
what the comm opens with (:mod:`dist_kernel.rank.widgets`), so a widget that every rank creates
the same way is one comm with the same id on each of them: the frontend sees one widget.

- **Rank to frontend.** The first ``comm_open`` of an id is relayed; the same id opened by more
  ranks adds them to the comm's owners and is not relayed again. The owner that opened it first
  leads: its ``comm_msg`` and ``comm_close`` are relayed, the others' (the same state changes,
  made again on each rank) are not, since the frontend can show one state per widget. Once the
  leader closed the comm, the other owners' ``comm_close`` (the same ``close()`` on each rank) is
  dropped too, whichever order they come in: the frontend hears of the close once. A comm
  opened by one rank only (a widget that differs between ranks) has that rank alone as owner.
- **Frontend to rank.** A message for a comm goes to every rank that owns it, so moving a shared
  slider changes the value on every rank; a comm the frontend opens goes to rank 0. What the
  owners' callbacks print is merged as a cell's output is (an ``OutputRelay``, which sends nothing).

One translation is needed: an ipywidgets ``Output`` widget captures output by message id.
Its state holds the ``msg_id`` of the request it captures for, and the frontend routes into
the widget the IOPub messages whose parent has that id. A rank knows only the id of the
request the parent sent it, while the frontend knows only its own: the widget's ``msg_id``
is translated to the frontend's (JupyterLab hooks messages by the ids of its own requests).
"""

from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from dist_kernel.exceptions import RankDiedError
from dist_kernel.output_kinds import COMM_TYPES, KINDS, Route
from dist_kernel.parent.answers import CaptureAnswers
from dist_kernel.parent.merge import label_lines, unmarked
from dist_kernel.parent.merge.captures import sets_capture
from dist_kernel.protocol import META_CELL, with_meta

if TYPE_CHECKING:
    from dist_kernel.parent.ranks import Ranks

#: how many request ids are remembered for translation
_RECENT = 256

#: publishes on the frontend's IOPub: (parent request, msg_type, content, metadata, buffers)
Publish = Callable[[dict, str, dict, "dict | None", "list | None"], None]


class CallbackRun(Protocol):
    """What merges the output of one frontend comm message on several ranks
    (:class:`~dist_kernel.parent.relay.OutputRelay`, which sends nothing)."""

    def on_iopub(self, rank: int, msg: dict) -> None: ...
    def on_reply(self, rank: int, content: dict, metadata: dict | None = None) -> None: ...
    async def wait(self) -> dict | None: ...


#: (the owner ranks, the frontend's comm message) -> the run that merges what they print
MergedRun = Callable[[list[int], dict], CallbackRun]


class CommRouter:
    """Tracks which ranks own each comm, translates Output widgets' message ids, and carries
    comm messages both ways: rank to frontend (:meth:`relay`), frontend to ranks (:meth:`forward`)."""

    def __init__(self, publish: Publish | None = None, merged: MergedRun | None = None) -> None:
        self.publish = publish or (lambda parent, msg_type, content, metadata, buffers: None)
        self.merged = merged  # makes the run that merges the output of a callback on several ranks
        self.owners: dict[str, list[int]] = {}  # comm_id -> the ranks that hold it; the first leads
        self._frontend_id: OrderedDict[str, str] = OrderedDict()  # id sent to a rank -> frontend id
        # comm_id -> owners yet to close it, after its leader's close was relayed (bounded: a rank
        # that never closes its copy must not make this grow)
        self._closing: OrderedDict[str, set[int]] = OrderedDict()

    def sent(self, child_msg_id: str, frontend_msg_id: str) -> None:
        """The parent sent ``child_msg_id`` to a rank on behalf of ``frontend_msg_id``."""
        self._frontend_id[child_msg_id] = frontend_msg_id
        while len(self._frontend_id) > _RECENT:
            self._frontend_id.popitem(last=False)

    def ranks_for(self, comm_id: str | None) -> list[int]:
        """The ranks a frontend message for ``comm_id`` goes to (rank 0 for a comm nobody opened)."""
        return list(self.owners.get(comm_id or "", [0]))

    def from_rank(self, msg_type: str, content: dict, rank: int) -> dict | None:
        """A comm message of ``rank``, ready for the frontend; None when the frontend must not
        get it (another rank opened the same comm first, and leads it)."""
        comm_id = content.get("comm_id")
        if comm_id is not None:
            owners = self.owners.get(comm_id)
            if msg_type == "comm_open":
                self._closing.pop(comm_id, None)
                if owners is not None:
                    if rank not in owners:
                        owners.append(rank)
                    return None
                self.owners[comm_id] = [rank]
            elif owners is None and rank in self._closing.get(comm_id, ()):
                if msg_type == "comm_close":  # the leader's close went out already
                    self._closing[comm_id].discard(rank)
                    if not self._closing[comm_id]:
                        del self._closing[comm_id]
                return None
            elif owners is not None and rank in owners and owners[0] != rank and not sets_capture(KINDS.get(msg_type), content):
                # an Output widget's capture is relayed from whichever owner enters `with out:`
                # (the cell's merger sends each start and stop once)
                if msg_type == "comm_close":
                    owners.remove(rank)
                return None
            elif msg_type == "comm_close":
                rest = set(self.owners.pop(comm_id, None) or ()) - {rank}
                if rest:
                    self._closing[comm_id] = rest
                    while len(self._closing) > _RECENT:
                        self._closing.popitem(last=False)
        data = content.get("data")
        state = data.get("state") if isinstance(data, dict) else None
        if isinstance(data, dict) and isinstance(state, dict) and state.get("msg_id") in self._frontend_id:
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
        if content is not None:
            self.publish(parent, msg_type, content, msg.get("metadata"), msg.get("buffers"))

    def on_unrouted(self, rank: int, msg: dict) -> None:
        """IOPub messages no request listens for: comms are relayed, the rest (statuses) dropped."""
        if msg["header"]["msg_type"] in COMM_TYPES:
            self.relay(rank, msg, {})

    def callback_output(self, rank: int, parent: dict, msg: dict, labelled: bool) -> None:
        """Output of a comm callback (a widget's on_click), labelled with its rank when
        ``labelled`` (more than one rank)."""
        msg_type = msg["header"]["msg_type"]
        kind = KINDS.get(msg_type)
        if kind is None:
            return
        if kind.route is Route.COMM:
            self.relay(rank, msg, parent)
        elif kind.route is Route.OUTPUT:
            content = unmarked(msg_type, msg["content"])
            if kind.lines and labelled:
                content = dict(content, text=label_lines(content.get("text", ""), [rank]))
            self.publish(parent, msg_type, content, None, None)

    # ------------------------------------------------------ frontend -> rank
    def forward(self, ranks: Ranks | None, parent: dict) -> None:
        """A frontend comm message goes to every rank that owns the comm (rank 0 for new ones),
        in a task: waiting for the ranks to start never delays other requests."""
        if ranks is not None:
            asyncio.ensure_future(self._forward(ranks, parent))

    async def _forward(self, ranks: Ranks, parent: dict) -> None:
        await ranks.ready.wait()
        if ranks.start_error:
            return
        msg_type = parent["header"]["msg_type"]
        content = parent["content"]
        comm_id = content.get("comm_id")
        targets = [r for r in self.ranks_for(comm_id) if ranks.alive(r)]
        if comm_id is not None and msg_type == "comm_open":
            self.owners[comm_id] = targets
        elif comm_id is not None and msg_type == "comm_close":
            self.owners.pop(comm_id, None)
        # the frontend's msg_id: a comm a callback opens is named after it on every rank
        metadata = with_meta(parent.get("metadata"), {META_CELL: parent["header"]["msg_id"]})
        sent: list[tuple[int, str]] = []
        for rank in targets:
            try:
                msg_id, _ = ranks.send(rank, msg_type, content, metadata=metadata,
                                       expect_reply=False, buffers=parent.get("buffers"))
            except RankDiedError:
                continue
            sent.append((rank, msg_id))
        if len(sent) == 1 or self.merged is None:
            labelled = ranks.config.world_size > 1
            for rank, msg_id in sent:
                ranks.listen(rank, msg_id, functools.partial(self.callback_output, rank, parent, labelled=labelled))
        elif sent:
            # a shared widget's callback runs on every owner: its output is merged as a cell's
            run = self.merged([rank for rank, _ in sent], parent)
            for rank, msg_id in sent:
                ranks.listen(rank, msg_id, functools.partial(run.on_iopub, rank))
                run.on_reply(rank, {"status": "ok"})  # a comm message has no reply: its idle ends it
            await run.wait()

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
                        owners = self.owners.setdefault(comm_id, [])
                        if rank not in owners:
                            owners.append(rank)
        return {"status": "ok", "comms": comms}


class CommRequests:
    """The kernel's handlers of the frontend's comm messages, for
    :class:`~dist_kernel.parent.kernel.DistributedKernel`: each goes to the ranks that own its
    comm; an ``Output`` widget's new outputs are also an answer the running cell's reply may
    wait for (:mod:`dist_kernel.parent.answers`)."""

    comms: CommRouter
    answers: CaptureAnswers
    ranks: Ranks | None

    async def comm_open(self, stream: Any, ident: Any, parent: dict) -> None:
        self.comms.forward(self.ranks, parent)

    async def comm_msg(self, stream: Any, ident: Any, parent: dict) -> None:
        self.answers.answered(parent)
        self.comms.forward(self.ranks, parent)

    async def comm_close(self, stream: Any, ident: Any, parent: dict) -> None:
        self.comms.forward(self.ranks, parent)
