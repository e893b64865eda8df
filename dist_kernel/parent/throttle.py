"""Keep a cell's stream output under what frontends accept, without losing any of it.

jupyter_server drops IOPub stream data above 1 MB/s (and N ranks multiply a flood). Past a
byte budget, stream text goes to a spill file instead of the frontend; the frontend is told
once where the full text is, and at the end of the cell it gets the last lines.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import deque
from collections.abc import Callable

Publish = Callable[[str, dict], None]

RATE = 400_000  # bytes per second shown live, well under jupyter_server's 1 MB/s
BURST = 1_000_000  # bytes a cell may show at once before the rate applies
TAIL_LINES = 20


class StreamThrottle:
    """Wraps a publish function; see the module docstring."""

    def __init__(self, publish: Publish, rate: float = RATE, burst: float = BURST,
                 clock: Callable[[], float] = time.monotonic, spill_dir: str | None = None) -> None:
        self._publish = publish
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens = burst
        self._last = clock()
        self.spill_dir = spill_dir or tempfile.gettempdir()
        self.spill_path: str | None = None
        self._spill = None
        self.skipped_bytes = 0
        self.skipped_lines = 0
        self._tails: dict[str, deque[str]] = {}

    def publish(self, msg_type: str, content: dict) -> None:
        if msg_type != "stream":
            self._publish(msg_type, content)
            return
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self._last) * self.rate)
        self._last = now
        text = content["text"]
        if self._spill is None and len(text) <= self.tokens:
            self.tokens -= len(text)
            self._publish(msg_type, content)
            return
        self._divert(content["name"], text)

    def _divert(self, name: str, text: str) -> None:
        if self._spill is None:
            fd, self.spill_path = tempfile.mkstemp(prefix="dist_kernel-output-", suffix=".txt", dir=self.spill_dir)
            self._spill = os.fdopen(fd, "w", encoding="utf-8", errors="replace")
            self._publish("stream", {"name": "stderr", "text": (
                f"[dist_kernel] output arrives faster than a notebook can show; the rest of this cell's "
                f"output is saved in full to {self.spill_path} and its last lines are shown at the end.\n")})
        self._spill.write(text)
        self.skipped_bytes += len(text)
        self.skipped_lines += text.count("\n")
        tail = self._tails.setdefault(name, deque(maxlen=TAIL_LINES))
        tail.extend(text.splitlines(keepends=True)[-TAIL_LINES:])

    def close(self) -> None:
        """The cell ended: say what was not shown, then show the last lines."""
        if self._spill is None:
            return
        self._spill.close()
        self._publish("stream", {"name": "stderr", "text": (
            f"[dist_kernel] {self.skipped_lines:,} lines ({self.skipped_bytes / 2**20:.1f} MiB) were not shown; "
            f"full output: {self.spill_path}\n[dist_kernel] last lines:\n")})
        for name, tail in self._tails.items():
            self._publish("stream", {"name": name, "text": "".join(tail)})
