"""A cell's ``busy`` and ``execute_input``, held back until the cell is on its way to the ranks.

ipykernel publishes ``busy`` (and then ``execute_input``) before it calls ``do_execute``. The
parent holds both until the cell's requests are sent, so the ranks start sooner; they go out
the moment anything else is published for the cell, so nothing ever precedes them.

:class:`HoldsBusy` is the kernel's side: a mixin of
:class:`~dist_kernel.parent.kernel.DistributedKernel`, over ipykernel's publishing of both.

Also here: when the frontend sent a request (its header's date), which tells the stop button
meant for a cell from one pressed before that cell was sent.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import datetime
from typing import Any, Protocol

from ipykernel.kernelbase import Kernel


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


class _Running(Protocol):
    @property
    def parent(self) -> dict:
        """The frontend's request the cell answers."""


class HoldsBusy(Kernel):
    """The kernel's hooks: ipykernel's ``busy`` and ``execute_input`` for a cell go through
    :attr:`_held`; the kernel releases it once the cell is sent (and :meth:`_publish` before
    anything else it publishes)."""

    _current: _Running | None  # the cell running now (the kernel's)

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        base = super()
        # private ipykernel API, written for ipykernel 7.4 (pyproject caps it below 8)
        self._held = HeldBusy(lambda request: base._publish_status("busy", "shell", request),  # type: ignore[attr-defined]
                              base._publish_execute_input)  # type: ignore[attr-defined]

    # private ipykernel API, written for ipykernel 7.4 (pyproject caps it below 8)
    def _publish_execute_input(self, code: str, parent: dict, execution_count: int) -> None:
        if not self._held.hold_input(code, parent, execution_count):  # held: it follows the busy
            super()._publish_execute_input(code, parent, execution_count)

    # private ipykernel API, written for ipykernel 7.4 (pyproject caps it below 8)
    def _publish_status(self, status: str, channel: str, parent: dict | None = None) -> None:
        if channel == "shell" and parent is None and threading.current_thread() is threading.main_thread():
            if status == "busy" and self.get_parent("shell").get("header", {}).get("msg_type") == "execute_request":
                # held until the cell's requests are sent to the ranks (do_execute), or until
                # anything else is published for it (_publish), whichever comes first
                self._held.hold(self.get_parent("shell"))
                return
            self._held.release()
        # jupyter_client's KernelManager and its client share a session id but count messages
        # separately, so an interrupt_request can carry the very msg_id of the running cell:
        # its busy/idle would read, to nbclient, as the cell's idle. Such a pair is not sent.
        if channel == "control" and parent is None and self._current is not None:
            control_id = self.get_parent("control").get("header", {}).get("msg_id")
            if control_id == self._current.parent.get("header", {}).get("msg_id"):
                return
        super()._publish_status(status, channel, parent)
