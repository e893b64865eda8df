"""Which notebooks have a cell running on the server, so that their documents are kept.

jupyter-server-ydoc forgets a notebook's shared document ``document_cleanup_delay`` seconds
(60 by default) after its last page closed. A cell that runs on the server (jupyter-server-nbmodel)
keeps writing into that document: once it is forgotten, what the cell prints after goes nowhere.
Keeping every document forever (``document_cleanup_delay=None``) costs every notebook ever opened
its memory and its file watcher until the server stops; :class:`RunningDocuments` keeps exactly
the documents that have a cell running, and the usual delay runs from when the last one ended.
"""

from __future__ import annotations

import asyncio
from collections import Counter


class RunningDocuments:
    """The running cells of each document (by its collaboration room id), and waits for none."""

    def __init__(self) -> None:
        self._running: Counter[str] = Counter()
        self._idle: dict[str, asyncio.Event] = {}

    def started(self, room: str) -> None:
        self._running[room] += 1
        self._event(room).clear()

    def ended(self, room: str) -> None:
        self._running[room] -= 1
        if self._running[room] <= 0:
            del self._running[room]
            self._event(room).set()

    def running(self, room: str) -> bool:
        return self._running[room] > 0

    async def until_idle(self, room: str) -> None:
        """Return once ``room`` has no running cell (at once when it has none)."""
        while self.running(room):
            await self._event(room).wait()

    async def forget_when_idle(self, room: str, delay: float) -> None:
        """Return when the document may be forgotten: ``delay`` seconds after its last running
        cell ended, counted again whenever a cell started meanwhile (a queue of cells, "Run All")."""
        while True:
            await self.until_idle(room)
            await asyncio.sleep(delay)
            if not self.running(room):
                return

    def _event(self, room: str) -> asyncio.Event:
        event = self._idle.get(room)
        if event is None:
            event = self._idle[room] = asyncio.Event()
            event.set()
        return event
