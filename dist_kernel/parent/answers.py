"""A cell's reply waits for the frontend's answers to the output an ``Output`` widget captured.

nbclient (and so papermill and ``nbconvert --execute``) stands in for the browser's ipywidgets
``Output``: each output it puts into a capturing widget it answers at once with a ``comm_msg``
that sends the widget's new ``outputs`` back, under the cell's request. It sends that on the
shell socket through a blocking shadow of the asyncio socket on which it awaits the cell's
``execute_reply``; the send can take the socket's wakeup for a reply that arrived a moment
before, and nbclient then waits for a reply it has until its timeout (jupyter/nbclient#312;
beside CPU hogs the plain python3 kernel hangs so too). A reply that arrives once the client
has nothing left to answer cannot be lost that way. So the kernel counts the outputs it
publishes inside a capture of the cell's request (what nbclient answers: an output, or a
``clear_output`` that does not wait), and sends the reply once the frontend answered them all.

Only a frontend that answers under the cell's request is waited for. One that never answered
is given :data:`FIRST_ANSWER` once, then not waited for again until it answers; one whose
answers carry no request (JupyterLab's widget manager, which has no such race) is not waited for.
"""

from __future__ import annotations

import asyncio
import functools
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from dist_kernel.output_kinds import KINDS, Shows
from dist_kernel.parent.merge.captures import widget_state

# what nbclient answers inside a capture: an output it adds to the widget, or a clear that does
# not wait (its row's ``shows``, :mod:`dist_kernel.output_kinds`)
_ADD, _CLEAR = Shows.ADD, Shows.CLEAR
#: how long a reply waits for the first answer of a frontend not yet heard to answer (seconds)
FIRST_ANSWER = 1.0
#: how long a reply waits for the next answer of a frontend that answers (seconds)
NEXT_ANSWER = 2.0
#: frontend sessions remembered (one per connected client)
_SESSIONS = 64


@dataclass
class _Cell:
    """What one running request's frontend owes it."""

    session: str
    capturing: set[str] = field(default_factory=set)  # comm ids capturing the request's output now
    sent: int = 0  # outputs published inside a capture: each one is answered
    answered: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class CaptureAnswers:
    """The outputs published inside ``Output`` captures of each running request, the frontend's
    answers to them, and whether each frontend session answers at all."""

    def __init__(self) -> None:
        self._cells: dict[str, _Cell] = {}  # request msg_id -> what its frontend owes
        self._answers: OrderedDict[str, bool] = OrderedDict()  # session -> answers under the request?

    def begin(self, request: dict) -> None:
        """A cell starts: count what its frontend will owe it."""
        header = request.get("header", {})
        self._cells[header.get("msg_id", "")] = _Cell(str(header.get("session", "")))

    def published(self, request: dict, msg_type: str, content: dict) -> None:
        """The kernel published this on IOPub under ``request`` (called for every message)."""
        cell = self._cells.get(request.get("header", {}).get("msg_id", "")) if request else None
        if cell is None:
            return
        kind = KINDS[msg_type] if msg_type in KINDS else None
        if kind is None:
            return
        if kind.capture:
            state = widget_state(content)
            if state is not None and "msg_id" in state:  # an Output widget starts or stops capturing
                if state["msg_id"] == request["header"]["msg_id"]:
                    cell.capturing.add(str(content.get("comm_id")))
                else:
                    cell.capturing.discard(str(content.get("comm_id")))
        elif cell.capturing and (kind.shows is _ADD or (kind.shows is _CLEAR and not content.get("wait"))):
            cell.sent += 1

    def answered(self, msg: dict) -> None:
        """A ``comm_msg`` from the frontend: an answer when it sends an ``Output``'s outputs."""
        state = widget_state(msg.get("content", {}))
        if state is None or "outputs" not in state:
            return
        session = str(msg.get("header", {}).get("session", ""))
        request = (msg.get("parent_header") or {}).get("msg_id")
        self._remember(session, bool(request))
        cell = self._cells.get(request) if request else None
        if cell is not None:
            cell.answered += 1
        for c in self._cells.values():
            if c is cell or c.session == session:
                c.changed.set()

    async def settle(self, request: dict) -> None:
        """Return once the frontend answered every captured output of ``request`` (or is not
        one to wait for, or stopped answering): its reply can go out."""
        msg_id = request.get("header", {}).get("msg_id", "")
        cell = self._cells.get(msg_id)
        try:
            while cell is not None and cell.answered < cell.sent:
                known = self._answers.get(cell.session)
                if known is False:
                    return
                cell.changed.clear()
                try:
                    await asyncio.wait_for(cell.changed.wait(), NEXT_ANSWER if known else FIRST_ANSWER)
                except asyncio.TimeoutError:
                    if known is None and cell.session not in self._answers:
                        self._remember(cell.session, False)  # never answered: not waited for again
                    return
        finally:
            self._cells.pop(msg_id, None)

    def _remember(self, session: str, answers: bool) -> None:
        self._answers[session] = answers
        self._answers.move_to_end(session)
        while len(self._answers) > _SESSIONS:
            self._answers.popitem(last=False)


Handler = TypeVar("Handler", bound=Callable[..., Awaitable[dict]])


def reply_after_answers(do_execute: Handler) -> Handler:
    """A kernel's ``do_execute`` whose reply waits for the frontend's answers to the output its
    cell's captures took (the kernel's ``answers``, a :class:`CaptureAnswers`, is told of every
    IOPub message it publishes and of the frontend's comm messages)."""
    @functools.wraps(do_execute)
    async def wrapped(kernel: Any, *args: Any, **kwargs: Any) -> dict:
        request = kernel.get_parent("shell")
        kernel.answers.begin(request)
        try:
            return await do_execute(kernel, *args, **kwargs)
        finally:
            await kernel.answers.settle(request)
    return cast(Handler, wrapped)
