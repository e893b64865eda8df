"""The kernel's output log: every cell's merged output, as the notebook shows it, appended to one
file per kernel as it comes, for frontends that lose output while no page is open (VS Code, a
plain JupyterLab) and for people at a terminal (``tail -F``).

Each cell is framed by its number and times (``── In [3] · 2026-05-01 12:00:03 · for epoch in
range(3): ──`` ... ``── In [3] done in 12.3s · 12:00:15 ──``); between them its outputs are text as
:mod:`dist_kernel.text_output` makes them for ``python -m dist_kernel run`` (labels as in the
notebook, identical output once, a progress bar as a line every few seconds and its last frame).
Where the file lives, who may read it and how it is bounded: :mod:`dist_kernel.parent.log_file`.

The kernel's event loop only queues what it publishes (:meth:`OutputLog.output`: a tuple put on a
queue); a thread renders and writes it, at most every :data:`BATCH_EVERY` seconds, so a slow disk
never holds a cell up. Should the disk fall
far behind, outputs are left out of the log (never out of the notebook), and the log says how many.
:class:`OutputLogging` is the kernel's side: a mixin of :class:`~dist_kernel.parent.kernel.DistributedKernel`.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from ipykernel.kernelbase import Kernel

from dist_kernel import __version__
from dist_kernel.options import KernelConfig
from dist_kernel.output_kinds import KINDS, Text
from dist_kernel.parent.log_file import RotatingFile, log_path, prune
from dist_kernel.text_output import TextOutput, rule

_NO_TEXT = Text.NONE  # what the log leaves out (a clear, comms): written as no text (output_kinds)
#: outputs queued for the writer beyond which more are left out of the log (a disk that stalls)
MAX_QUEUED = 20_000
#: cells whose later output (a thread's, after the cell ended) is still put under their number
CELLS_KEPT = 64
#: how long the kernel's end waits for the writer to finish the log
CLOSE_WAIT = 2.0
#: the writer wakes at most this often while output flows: what came meanwhile is one write, and
#: the thread takes the interpreter's lock from the event loop a few times a second, not per output
BATCH_EVERY = 0.1
#: the first line of a cell shown in its header, at most this long
CODE_SHOWN = 60
#: the writer thread's name for the OS (at most 15 characters)
THREAD_NAME = "dk-output-log"

log = logging.getLogger(__name__)


def _clock(wall: float, date: bool = True) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S" if date else "%H:%M:%S", time.localtime(wall))


def first_line(code: str) -> str:
    """The cell's first line that is not blank, cut to :data:`CODE_SHOWN` characters."""
    line = next((s.strip() for s in code.splitlines() if s.strip()), "")
    return line if len(line) <= CODE_SHOWN else line[:CODE_SHOWN - 1] + "…"


class Recorder:
    """What the log says for each event of the kernel, as text (pure: the writer thread feeds it,
    tests call it directly)."""

    def __init__(self, text: TextOutput | None = None) -> None:
        self.text = text if text is not None else TextOutput(keep_cr=False)
        self.cells: OrderedDict[str, tuple[int, float]] = OrderedDict()  # msg_id -> (number, started)
        self.running: str | None = None  # the cell running now
        self.shown: str | None = None  # whose output was written last (its header is above it)

    def opened(self, name: str, describe: str, wall: float) -> str:
        return self.text.rule(f"dist_kernel {__version__} · {name} · {describe} · pid {os.getpid()} · "
                              f"started {_clock(wall)}")

    def started(self, msg_id: str, number: int, code: str, wall: float) -> str:
        """A cell starts (the frontend sent it; ``number`` is its execution count)."""
        self.cells[msg_id] = (number, wall)
        while len(self.cells) > CELLS_KEPT:
            self.cells.popitem(last=False)
        self.running = self.shown = msg_id
        head = f"In [{number}] · {_clock(wall)}" + (f" · {first_line(code)}" if code.strip() else "")
        flushed = self._flush()
        gap = "\n" if self.text.at_line_start else "\n\n"  # a blank line between cells
        self.text.at_line_start = True
        return flushed + gap + rule(head)

    def output(self, msg_id: str, request_type: str, msg_type: str, content: dict) -> str:
        """An output the kernel published for request ``msg_id`` (of ``request_type``)."""
        if msg_id not in self.cells and request_type != "comm_msg":
            return ""  # a silent request's: not a cell of the notebook
        before, head = self.text.at_line_start, ""
        if msg_id != self.shown:  # another request's output than the last: say whose
            head = self.text.rule(self._whose(msg_id))
        texts = self.text.feed(msg_type, content)
        if not texts:
            self.text.at_line_start = before  # nothing written, not even the header
            return ""
        self.shown = msg_id
        return head + "".join(text for _, text in texts)

    def ended(self, msg_id: str, status: str, wall: float) -> str:
        """A cell's reply (``status``: ok, error, aborted)."""
        if msg_id not in self.cells:
            return ""
        number, started = self.cells[msg_id]
        if msg_id == self.running:
            self.running = None
        self.shown = None
        how = {"ok": "done in", "error": "failed after"}.get(status, f"{status} after")
        return self._flush() + self.text.rule(f"In [{number}] {how} {wall - started:.1f}s · {_clock(wall, date=False)}")

    def tick(self) -> str:
        return "".join(text for _, text in self.text.tick())

    @property
    def waiting(self) -> bool:
        """Is a frame waiting to come due (the writer must wake to write it)?"""
        return self.text.has_waiting

    def closed(self, wall: float) -> str:
        return self._flush() + self.text.rule(f"kernel ended · {_clock(wall)}")

    def dropped(self, count: int) -> str:
        if not count:
            return ""
        return self.text.rule(f"{count} output{'s' if count != 1 else ''} left out of this log: "
                              "the disk did not keep up (the notebook has them)")

    def _flush(self) -> str:
        return "".join(text for _, text in self.text.finish())

    def _whose(self, msg_id: str) -> str:
        now = _clock(time.time(), date=False)
        if msg_id not in self.cells:
            return f"a widget's callback · {now}"
        number = self.cells[msg_id][0]
        return f"In [{number}], continued · {now}" if msg_id == self.running else f"In [{number}], after it ended · {now}"


class OutputLog:
    """One kernel's log: events queued from the kernel, written by a thread. Off (``path`` None,
    every method returns at once) when the option says so or the file cannot be made."""

    def __init__(self, path: str | None = None, max_bytes: int = 0, note: str = "off",
                 describe: str = "") -> None:
        self.path = path
        self.note = note  # what %dist_status says
        self.dropped = 0
        self._queue: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None
        if path is None:
            return
        self._file = RotatingFile(path, max_bytes)
        self._recorder = Recorder()
        self._file.write(self._recorder.opened(os.path.basename(path), describe, time.time()))
        self._queue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="dist_kernel output log", daemon=True)
        self._thread.start()
        atexit.register(self.close)

    @classmethod
    def open(cls, connection_file: str, config: Any) -> OutputLog:
        """The log of the kernel of ``connection_file`` (``config``: its KernelConfig, or the
        ConfigError it was given: then the default size)."""
        if isinstance(config, KernelConfig):
            size, describe = config.output_log, config.describe()
        else:
            size, describe = KernelConfig.output_log, "configuration error"
        if not size:
            return cls(note="off (--output-log off)")
        try:
            path = log_path(connection_file)
            log = cls(path, size, f"{path} (rotated at {_size(size)} into .1; follow it with tail -F)", describe)
        except Exception as e:  # noqa: BLE001 - the kernel starts without its log, saying why
            return cls(note=f"off: {e}")
        prune(os.path.dirname(path))
        return log

    # ----------------------------------------------- the kernel's side (its event loop)
    def cell_starts(self, request: dict, number: int, code: str) -> None:
        if self._queue is not None:
            self._queue.put(("started", request["header"]["msg_id"], number, code, time.time()))

    def output(self, request: dict, msg_type: str, content: dict) -> None:
        q = self._queue
        if q is None or msg_type not in KINDS or KINDS[msg_type].text is _NO_TEXT:
            return
        if q.qsize() >= MAX_QUEUED:
            self.dropped += 1
            return
        header = request.get("header") or {}
        q.put(("output", header.get("msg_id", ""), header.get("msg_type", ""), msg_type, content))

    def cell_ends(self, request: dict, reply: dict) -> None:
        if self._queue is not None:
            self._queue.put(("ended", request["header"]["msg_id"], reply.get("status", ""), time.time()))

    def close(self) -> None:
        """Write what is queued and end the log (the kernel is ending)."""
        q, thread = self._queue, self._thread
        if q is None or thread is None:
            return
        self._queue = None
        q.put(("closed", time.time()))
        thread.join(CLOSE_WAIT)

    # ------------------------------------------------------------- the writer thread
    def _run(self) -> None:
        q, rec = self._queue, self._recorder
        assert q is not None
        with contextlib.suppress(OSError):  # its name in top -H, py-spy and the benchmark (Linux)
            with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
                f.write(THREAD_NAME)
        reported = 0
        while True:
            try:
                events = [q.get(timeout=rec.text.redraw_every if rec.waiting else None)]
            except queue.Empty:
                self._write(rec.tick())
                continue
            while True:  # whatever else is queued goes out in the same write
                try:
                    events.append(q.get_nowait())
                except queue.Empty:
                    break
            dropped, reported = self.dropped - reported, self.dropped
            self._write(rec.dropped(dropped) + "".join(self._render(event) for event in events))
            if events[-1][0] == "closed":
                self._file.close()
                return
            time.sleep(BATCH_EVERY)

    def _render(self, event: tuple) -> str:
        kind, *args = event
        rec = self._recorder
        handlers: dict[str, Callable[..., str]] = {"started": rec.started, "output": rec.output,
                                                   "ended": rec.ended, "closed": rec.closed}
        return handlers[kind](*args)

    def _write(self, text: str) -> None:
        if not text:
            return
        try:
            self._file.write(text)
        except OSError as e:  # a full disk: the kernel goes on, this text is not in the log
            log.warning("output log %s: %s", self.path, e)


class OutputLogging(Kernel):
    """The kernel's hooks: a cell starts (its ``execute_input``) and ends (its reply's metadata);
    the kernel's ``_publish`` hands each output to :attr:`output_log`."""

    output_log = OutputLog()

    # private ipykernel API, written for ipykernel 7.4 (pyproject caps it below 8)
    def _publish_execute_input(self, code: str, parent: dict, execution_count: int) -> None:
        self.output_log.cell_starts(parent, execution_count, code)
        super()._publish_execute_input(code, parent, execution_count)

    def finish_metadata(self, parent: dict, metadata: dict, reply_content: dict) -> dict:
        self.output_log.cell_ends(parent, reply_content)
        return super().finish_metadata(parent, metadata, reply_content)


def _size(n: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{n} bytes"
