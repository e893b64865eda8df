"""A cell's ``busy`` and ``execute_input``, held back until the cell is on its way to the ranks.

ipykernel publishes ``busy`` (and then ``execute_input``) before it calls ``do_execute``. The
parent holds both until the cell's requests are sent, so the ranks start sooner; they go out
the moment anything else is published for the cell, so nothing ever precedes them.

Also here: when the frontend sent a request (its header's date), which tells the stop button
meant for a cell from one pressed before that cell was sent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import datetime


class HeldBusy:
    """The held ``busy`` of one request and the ``execute_input`` that follows it."""

    def __init__(self, publish_busy: Callable[[dict], None],
                 publish_input: Callable[[str, dict, int], None]) -> None:
        self._publish_busy = publish_busy  # (request) -> busy status on IOPub
        self._publish_input = publish_input  # (code, request, execution_count) -> execute_input
        self._busy: dict | None = None
        self._input: tuple[str, dict, int] | None = None
        self._lock = threading.RLock()  # the control thread publishes too

    def __bool__(self) -> bool:
        return self._busy is not None

    def hold(self, request: dict) -> None:
        """Hold the busy of ``request`` (publishing whatever was held before)."""
        with self._lock:
            self.release()
            self._busy = request

    def hold_input(self, code: str, request: dict, execution_count: int) -> bool:
        """Hold the execute_input behind a held busy; False when no busy is held (publish it now)."""
        with self._lock:
            if self._busy is None:
                return False
            self._input = (code, request, execution_count)
            return True

    def release(self) -> None:
        """Publish what is held, busy first."""
        with self._lock:
            busy, given = self._busy, self._input
            self._busy = self._input = None
            if busy is not None:
                self._publish_busy(busy)
            if given is not None:
                self._publish_input(*given)


def sent_at(msg: dict) -> datetime | None:
    """When the frontend sent a request (its header's date), if it says."""
    date = msg.get("header", {}).get("date")
    return date if isinstance(date, datetime) else None


def pressed_before(pressed: datetime | None, request: dict) -> bool:
    """Was the stop button pressed before the frontend sent ``request``? (Both dates are the
    frontend's own clock; unknown dates count as not before.)"""
    sent = sent_at(request)
    try:
        return pressed is not None and sent is not None and pressed < sent
    except TypeError:  # one naive, one aware
        return False
