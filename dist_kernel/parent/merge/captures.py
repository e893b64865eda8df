"""ipywidgets ``Output`` captures in a cell of several ranks (issue 30).

An ``Output`` widget captures by message id: while its state holds the id of the cell's request
(``with out:`` sets it, leaving unsets it), the frontend puts every output of that request into
the widget. The ranks' outputs are published under the one request, so while a rank captures,
whatever the other ranks print would land in the widget too (and the next ``clear_output`` in it
would erase it). So the merger knows which items a rank made inside a capture (``Item.captured``),
and the frontend's capture is paused, with the widget's own state message, around output made
outside it, and resumed for output made inside.

A capture change reaches the merger as an in-order item whose content is ``{"rank": r, "msg":
the comm message}`` (the parent relays it through its comm router, which sends the frontend the
leading owner's changes only: a paused capture is resumed with the message that started it).
"""

from __future__ import annotations

from collections.abc import Hashable

from dist_kernel.output_kinds import OutputKind

Emit = tuple[str, dict]


def widget_state(content: dict) -> dict | None:
    """The ``state`` a widget's comm message sets (``data.state``), or None. The capture's
    ``msg_id`` lives there: the merger, the relay and the capture answers all read it here."""
    data = content.get("data")
    state = data.get("state") if isinstance(data, dict) else None
    return state if isinstance(state, dict) else None


def sets_capture(kind: OutputKind | None, content: dict) -> bool:
    """Is this comm message (of row ``kind``, None for no output kind) an ``Output`` widget
    starting or stopping a capture (its ``msg_id``)? Only a kind that may
    (``OutputKind.capture``: ``comm_msg``) is looked into."""
    return kind is not None and kind.capture and _sets_msg_id(content)


def _sets_msg_id(content: dict) -> bool:
    state = widget_state(content)
    return state is not None and "msg_id" in state


def capture_change(content: dict) -> tuple[Hashable, bool] | None:
    """(the widget's comm id, whether it now captures) of an in-order item's content; None when
    the item is not an ``Output`` widget's capture change."""
    msg = content.get("msg")
    body = msg.get("content") if isinstance(msg, dict) else None
    if not isinstance(body, dict) or not _sets_msg_id(body):  # a comm_msg: the relay keeps no other comm in order
        return None
    return body.get("comm_id"), bool(body["data"]["state"]["msg_id"])


def _with_msg_id(content: dict, msg_id: str) -> dict:
    """A copy of a capture change's content that sets the widget's ``msg_id`` to ``msg_id``."""
    msg = content["msg"]
    body = msg["content"]
    state = dict(body["data"]["state"], msg_id=msg_id)
    return dict(content, msg=dict(msg, content=dict(body, data=dict(body["data"], state=state))))


class FrontendCaptures:
    """The captures the frontend has been told of, in the order they started, with the ranks
    that capture into each: one widget, however many of its owners enter ``with out:``; and the
    messages that pause them around output made outside them and resume them."""

    def __init__(self) -> None:
        self._on: dict[Hashable, dict[int, tuple[str, dict]]] = {}  # comm id -> rank -> (kind, its start)
        self._paused = False

    def change(self, kind: str, content: dict) -> list[Emit]:
        """What to send for a rank's in-order capture change: the frontend hears when a widget's
        capture starts (the first rank) and stops (the last), never of a capture it has not."""
        change = capture_change(content)
        rank = content.get("rank")
        if change is None or not isinstance(rank, int):
            return [(kind, content)]
        out = self.around(inside=True)  # the frontend's captures are the ranks' again first
        comm_id, on = change
        ranks = self._on.get(comm_id)
        if on:
            if ranks is None:
                ranks = self._on[comm_id] = {}
                out.append((kind, content))
            ranks[rank] = (kind, content)
        elif ranks is not None and ranks.pop(rank, None) is not None and not ranks:
            del self._on[comm_id]
            out.append((kind, content))
        return out

    def around(self, inside: bool) -> list[Emit]:
        """What must go out before an output made inside (``inside``) or outside every capture:
        the messages resuming the paused captures, or pausing the open ones (innermost first)."""
        if not self._on or inside != self._paused:
            return []
        self._paused = not inside
        starts = [next(iter(ranks.values())) for ranks in self._on.values()]
        if inside:
            return starts
        return [(kind, _with_msg_id(content, "")) for kind, content in reversed(starts)]
