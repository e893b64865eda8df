"""Displays updated in place, for a frontend that writes a cell's outputs into the notebook itself.

Under server-side execution (jupyter-server-nbmodel) the server, not the page, turns a cell's
IOPub messages into the notebook's outputs. nbmodel 0.2 appends ``display_data``, ``stream``,
``execute_result`` and ``error``, clears at once on ``clear_output`` even with ``wait=True``, and
ignores ``update_display_data``: every display updated in place (a progress bar, a ``\\r`` line
the kernel shows as one display, a ``display_id`` update) would stay at its first frame.

:class:`CellDisplays` is what a browser's output area keeps for one cell (JupyterLab's
``OutputArea``: which outputs each display id made, and a ``clear_output(wait=True)`` that waits
for the next output), as pure decisions: for each message, a :class:`Step` says what to do with
it. The server side (:mod:`dist_kernel.lab.nbmodel`) does it to the shared document.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dist_kernel.output_kinds import KINDS, Merge, Shows


@dataclass(frozen=True)
class Step:
    """What to do with one message of the cell."""

    #: clear the cell first: a ``clear_output(wait=True)`` was waiting for this output
    clear_first: bool = False
    #: hand the message on as it is (append it, or clear now)
    forward: bool = False
    #: after forwarding, remember the output it added as this display id's
    remember: str | None = None
    #: replace the outputs this display id made with this output (``update_display_data``)
    replace: tuple[str, dict] | None = None


@dataclass
class Place:
    """Where one output of a display id is: its index in the frontend's list of the cell's
    messages (one per message) and in the notebook cell's outputs (streams joined), or None."""

    message: int
    output: int | None


@dataclass
class CellDisplays:
    """One cell's displays while it runs (see the module doc)."""

    places: dict[str, list[Place]] = field(default_factory=dict)
    clear_pending: bool = False

    def step(self, msg_type: str, content: dict) -> Step:
        """What to do with a message of type ``msg_type`` for this cell (its row's ``shows``)."""
        kind = KINDS.get(msg_type)
        shows = kind.shows if kind is not None else Shows.NONE
        if shows is Shows.CLEAR:
            if content.get("wait"):
                self.clear_pending = True  # cleared by the next output, as in a browser
                return Step()
            self._cleared()
            return Step(forward=True)
        if shows is Shows.UPDATE:
            display_id = _display_id(content)
            if display_id is None or display_id not in self.places:
                return Step()  # a display of another cell, or none: nothing of this cell shows it
            return Step(replace=(display_id, _display_output(content)))
        if kind is None or shows is not Shows.ADD:
            return Step(forward=True)
        clear_first = self.clear_pending
        if clear_first:
            self._cleared()
        remember = _display_id(content) if kind.merge is Merge.RICH else None  # a display id is a rich output's
        return Step(clear_first=clear_first, forward=True, remember=remember)

    def remember(self, display_id: str, place: Place) -> None:
        """The output a display id's message just added is at ``place``."""
        self.places.setdefault(display_id, []).append(place)

    def where(self, display_id: str) -> list[Place]:
        return list(self.places.get(display_id, ()))

    def _cleared(self) -> None:
        self.clear_pending = False
        self.places.clear()


def _display_id(content: dict) -> str | None:
    transient = content.get("transient") or {}
    display_id = transient.get("display_id") if isinstance(transient, dict) else None
    return display_id if isinstance(display_id, str) and display_id else None


def _display_output(content: dict) -> dict:
    """The notebook output an ``update_display_data`` makes (nbformat 4: a ``display_data``)."""
    return {"output_type": "display_data", "data": dict(content.get("data") or {}),
            "metadata": dict(content.get("metadata") or {})}
