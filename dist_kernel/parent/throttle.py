"""Keep output under what frontends accept, without losing any of it.

jupyter_server silently drops IOPub messages above 1000 messages/s and stream data above
1 MB/s (each averaged over 3 s), and N ranks multiply a flood. :class:`OutputBudget` is the
kernel's allowance for its whole lifetime, shared by every cell and by output printed after
its cell ended (a background thread): bytes of stream text per second and messages of any
output type per second, each with a burst. Past it, output goes to a spill file instead of
the frontend: stream text as it is, rich outputs as their ``text/plain``. The frontend is told
once where the file is; when the cell ends it learns how much was not shown and gets the
cell's last lines (bounded in bytes) and the newest state of every display updated meanwhile.
A cell's result and its errors are never held back: they are what the user asked for, and
one message each. How each kind of output is counted is its row's ``budget`` in
:mod:`dist_kernel.output_kinds`. No stream message is longer than :data:`MAX_MESSAGE` bytes.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TextIO

from dist_kernel.output_kinds import KINDS, Budget, Shows, Text

Publish = Callable[[str, dict], None]

RATE = 400_000  # stream bytes per second shown live, well under jupyter_server's 1 MB/s
BURST = 1_000_000  # stream bytes that may be shown at once before the rate applies
MSG_RATE = 200  # output messages per second, well under jupyter_server's 1000/s
MSG_BURST = 1000  # output messages that may be shown at once before the rate applies
MAX_MESSAGE = 256 * 1024  # bytes of stream text in one message at most
TAIL_LINES = 20  # the last lines shown when a cell ends after a flood ...
TAIL_BYTES = 16_384  # ... at most this many bytes of them per stream
TAIL_LINE_CHARS = 2_000  # a longer last line is cut, saying how much of it is in the file
MAX_FINAL_UPDATES = 100  # displays whose newest state is shown when a flood ends

# the values of the table's ``budget`` column, as globals: faster than off the class
_TEXT, _CLEAR, _ALWAYS, _FREE = Budget.TEXT, Budget.CLEAR, Budget.ALWAYS, Budget.FREE


def _nbytes(text: str) -> int:
    return len(text.encode("utf-8", "surrogatepass"))


class OutputBudget:
    """Token buckets for the kernel's lifetime: stream bytes/s and output messages/s."""

    def __init__(self, rate: float = RATE, burst: float = BURST, msg_rate: float = MSG_RATE,
                 msg_burst: float = MSG_BURST, clock: Callable[[], float] = time.monotonic,
                 spill_dir: str | None = None) -> None:
        self.rate, self.burst, self.msg_rate, self.msg_burst, self.clock = rate, burst, msg_rate, msg_burst, clock
        self.bytes, self.msgs = float(burst), float(msg_burst)
        self._last = clock()
        # given a directory (the kernel's private runtime dir), spill files go there and
        # nowhere else: they are removed with it at shutdown
        self.spill_dir = spill_dir

    def refill(self) -> None:
        now = self.clock()
        dt, self._last = now - self._last, now
        self.bytes = min(self.burst, self.bytes + dt * self.rate)
        self.msgs = min(self.msg_burst, self.msgs + dt * self.msg_rate)

    @property
    def full(self) -> bool:
        """Has output been quiet long enough for the whole burst to be available again?"""
        return self.bytes >= self.burst and self.msgs >= self.msg_burst

    def spend(self, nbytes: int = 0) -> None:
        self.bytes -= nbytes
        self.msgs -= 1

    def new_spill_file(self) -> str:
        fd, path = tempfile.mkstemp(prefix="dist_kernel-output-", suffix=".txt",
                                    dir=self.spill_dir or tempfile.gettempdir())
        os.close(fd)
        return path


class _Tail:
    """The last lines of one stream, bounded in lines and in bytes."""

    def __init__(self) -> None:
        self.lines: deque[list] = deque(maxlen=TAIL_LINES)  # [text kept, characters cut, complete]

    def add(self, text: str) -> None:
        # lines end at "\n" only: a "\r" progress line stays one line, as a frontend shows it
        pieces = [p + "\n" for p in text.split("\n")]
        pieces[-1] = pieces[-1][:-1]
        if not pieces[-1]:
            pieces.pop()
        if self.lines and not self.lines[-1][2] and pieces:  # continues an unfinished line
            self._extend(self.lines[-1], pieces.pop(0))
        for piece in pieces[-TAIL_LINES:]:
            entry = ["", 0, False]
            self._extend(entry, piece)
            self.lines.append(entry)

    @staticmethod
    def _extend(entry: list, piece: str) -> None:
        room = TAIL_LINE_CHARS - len(entry[0])
        body = piece[:-1] if piece.endswith("\n") else piece
        entry[0] += body[:max(room, 0)]
        entry[1] += max(len(body) - max(room, 0), 0)
        entry[2] = piece.endswith("\n")

    def text(self) -> str:
        out: list[str] = []
        size = 0
        for kept, cut, complete in reversed(self.lines):
            line = kept + (f" [... {cut:,} more characters in the file]" if cut else "") + ("\n" if complete else "")
            size += _nbytes(line)
            if size > TAIL_BYTES:
                break
            out.append(line)
        return "".join(reversed(out))


class StreamThrottle:
    """Wraps one cell's publish function with the kernel's :class:`OutputBudget`; see the
    module docstring. After :meth:`close`, what comes is output printed after the cell ended:
    it spends the same budget, and a quiet spell ends its spill."""

    def __init__(self, publish: Publish, rate: float = RATE, burst: float = BURST,
                 clock: Callable[[], float] = time.monotonic, spill_dir: str | None = None,
                 budget: OutputBudget | None = None) -> None:
        self._publish = publish
        self.budget = budget or OutputBudget(rate, burst, clock=clock, spill_dir=spill_dir)
        self.spill_path: str | None = None
        self.spilling = False
        self.closed = False
        self._file: TextIO | None = None
        self.skipped_bytes = self.skipped_lines = self.skipped_outputs = 0
        self._mid_line: dict[str, bool] = {}  # stream -> the text diverted last ended inside a line
        self._tails: dict[str, _Tail] = {}
        self._kept: list[tuple[str, dict]] = []  # results and errors that wait for the spill's end
        self._updates: OrderedDict[str, dict] = OrderedDict()  # display_id -> newest update not shown

    def publish(self, msg_type: str, content: dict) -> None:
        budget = KINDS[msg_type].budget if msg_type in KINDS else _FREE  # no method call: cheaper than .get
        if budget is _FREE:  # comms, statuses: not cell output
            self._publish(msg_type, content)
            return
        b = self.budget
        b.refill()
        if self.spilling and self.closed and b.full:
            self._end_spill()  # late output slowed down: show it again
        if budget is _ALWAYS:
            # sent even past the budget: while a spill lasts it waits for its end (after the
            # notice and the last lines, where a plain kernel shows it: after the cell's prints)
            self._always(msg_type, content)
            return
        if self.spilling:
            self._divert(msg_type, content)
            return
        if budget is not _TEXT:
            if b.msgs >= 1:
                b.spend()
                self._publish(msg_type, content)
            else:
                self._start_spill()
                self._divert(msg_type, content)
            return
        text = content["text"]
        # publish what fits, in messages of at most MAX_MESSAGE bytes, cut after a newline
        # where there is one; the rest goes to the file
        while text and b.msgs >= 1 and b.bytes >= 1:
            n = _nbytes(text)
            limit = int(min(b.bytes, MAX_MESSAGE))
            if n <= limit:
                head, text = text, ""
            else:
                cut = max(1, limit * len(text) // n)  # characters, from bytes ...
                while cut > 1 and (head_bytes := _nbytes(text[:cut])) > limit:  # ... even where wide
                    cut = max(1, cut * limit // head_bytes)
                nl = text.rfind("\n", 0, cut)
                cut = nl + 1 if nl >= 0 else cut
                head, text = text[:cut], text[cut:]
                if n > b.bytes and nl < 0 and head:  # not even one whole line fits: spill it all
                    text = head + text
                    break
            b.spend(_nbytes(head))
            self._publish("stream", dict(content, text=head))
        if text:
            self._start_spill()
            self._divert("stream", dict(content, text=text))

    def _always(self, msg_type: str, content: dict) -> None:
        """A result or an error: sent now, or after the spill that is under way ends."""
        self.budget.spend()  # counted, though never refused: the rate recovers from it
        if self.spilling and not self.closed:
            self._write(_as_text(msg_type, content))  # the file stays the cell's full output, in order
            self._kept.append((msg_type, content))
            return
        self._publish(msg_type, content)

    # ------------------------------------------------------------ spilling
    def _start_spill(self) -> None:
        self.spilling = True
        try:
            if self.spill_path is None:
                self.spill_path = self.budget.new_spill_file()
            self._file = open(self.spill_path, "a", encoding="utf-8", errors="replace")
        except OSError as e:
            self._file = None
            where = f"could not be saved ({e})"
        else:
            where = f"saved in full to {self.spill_path}"
        if self.closed:
            note = (f"[dist_kernel] output printed after its cell ended arrives faster than a notebook can "
                    f"show; it is {where} and shown again once it slows down.\n")
        else:
            note = (f"[dist_kernel] output arrives faster than a notebook can show; the rest of this cell's "
                    f"output is {where} and its last lines are shown at the end.\n")
        self._publish("stream", {"name": "stderr", "text": note})
        if self.closed:
            self._close_file()  # late output may never end: keep no file open between messages

    def _divert(self, msg_type: str, content: dict) -> None:
        kind = KINDS[msg_type]
        if kind.budget is _CLEAR:
            self._tails.clear()  # a frontend would show only what follows it
            return
        if kind.budget is _TEXT:
            text = content["text"]
            name = content["name"]
            self.skipped_bytes += _nbytes(text)
            if text:
                # lines begun here: each newline ends one, an unfinished end begins one, and a
                # line the previous text left unfinished was counted already
                ends_open = not text.endswith("\n")
                self.skipped_lines += text.count("\n") + ends_open - self._mid_line.get(name, False)
                self._mid_line[name] = ends_open
            self._tails.setdefault(name, _Tail()).add(text)
        else:
            self.skipped_outputs += 1
            text = _as_text(msg_type, content)
            display_id = (content.get("transient") or {}).get("display_id")
            if kind.shows is Shows.UPDATE and display_id:
                self._updates[display_id] = content
                self._updates.move_to_end(display_id)
                while len(self._updates) > MAX_FINAL_UPDATES:
                    self._updates.popitem(last=False)
        self._write(text)

    def _write(self, text: str) -> None:
        if self.spill_path is None:
            return
        if self._file is None:
            try:
                self._file = open(self.spill_path, "a", encoding="utf-8", errors="replace")
            except OSError:
                return
        self._file.write(text)
        if self.closed:
            self._close_file()

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _end_spill(self) -> None:
        """Say what was not shown, then show the last lines and the displays' newest state."""
        self._close_file()
        self.spilling = False
        tails = {name: t.text() for name, t in self._tails.items()}
        tails = {name: text for name, text in tails.items() if text}
        note = not_shown_note(self.skipped_lines, self.skipped_bytes, self.skipped_outputs, self.spill_path)
        if tails:
            note += "[dist_kernel] last lines:\n"
        self._publish("stream", {"name": "stderr", "text": note})
        for name, text in tails.items():
            self._publish("stream", {"name": name, "text": text})
        for content in self._updates.values():
            self._publish("update_display_data", content)
        for msg_type, content in self._kept:
            self._publish(msg_type, content)
        self.budget.spend(sum(_nbytes(t) for t in tails.values()))
        self.skipped_bytes = self.skipped_lines = self.skipped_outputs = 0
        self._mid_line.clear()
        self._tails.clear()
        self._updates.clear()
        self._kept.clear()

    def close(self) -> None:
        """The cell ended: end its spill, if any. What comes later is late output."""
        if self.spilling:
            self._end_spill()
        self.closed = True


def not_shown_note(lines: int, nbytes: int, outputs: int, spill_path: str | None) -> str:
    """``[dist_kernel] 3 lines (2.9 MiB) and 1 output were not shown; full output: PATH``."""
    what = []
    if lines or nbytes:
        what.append(f"{lines:,} line{'s' if lines != 1 else ''} ({nbytes / 2**20:.1f} MiB)")
    if outputs:
        what.append(f"{outputs:,} output{'s' if outputs != 1 else ''}")
    if not what:
        return f"[dist_kernel] full output: {spill_path}\n"
    single = len(what) == 1 and (outputs == 1 if outputs else lines == 1)
    return f"[dist_kernel] {' and '.join(what)} {'was' if single else 'were'} not shown; full output: {spill_path}\n"


def _as_text(msg_type: str, content: dict) -> str:
    """A rich output, as the spill file holds it: its text, one line, or delimited if longer."""
    if KINDS[msg_type].text is Text.TRACEBACK:
        text = f"{content.get('ename')}: {content.get('evalue')}"
    else:
        text = str((content.get("data") or {}).get("text/plain", f"<{msg_type} without text/plain>"))
    if "\n" in text.rstrip("\n"):
        return f"----- {msg_type} -----\n{text.rstrip(chr(10))}\n----- end of {msg_type} -----\n"
    return text.rstrip("\n") + "\n"
