"""One stub rank: what the parent hears from a real rank, without a kernel behind it.

A :class:`StubRank` takes the parent's Jupyter messages (checked against its own HMAC key)
and answers as ``dist_kernel.rank`` does (see docs/architecture.md, the parent–rank
protocol): ``kernel_info_reply`` and an ``idle``; for a cell, its outputs on IOPub, then the
``execute_reply`` carrying how many IOPub messages came before it (no ``busy``, no
``execute_input``, no ``idle``); a ``dist_reply`` to each typed request on control. The cell
is read in the stub's language (:mod:`dist_kernel.testing.cells`) and answered after the
node's delay. Where messages travel is the caller's: ``send(channel, frames)``.
"""

from __future__ import annotations

import functools
import heapq
import hmac
import itertools
import json
import random
import signal
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from hashlib import sha256

from dist_kernel import protocol
from dist_kernel.testing.cells import CellError, Step, parse, text_for

DELIM = b"<IDS|MSG>"
_KERNEL_INFO = {"status": "ok", "protocol_version": "5.3", "implementation": "dist_kernel.testing",
                "implementation_version": "1", "banner": "a stub rank",
                "language_info": {"name": "python", "version": "3", "mimetype": "text/x-python",
                                  "file_extension": ".py"}, "help_links": []}
#: replies to the shell requests the parent may pass to one rank (completion, history, ...)
_SHELL_REPLIES: dict[str, dict] = {"complete_request": {"matches": [], "cursor_start": 0, "cursor_end": 0, "metadata": {}},
                  "inspect_request": {"found": False, "data": {}, "metadata": {}},
                  "is_complete_request": {"status": "complete"}, "history_request": {"history": []},
                  "comm_info_request": {"comms": {}}}


class Timers:
    """Callbacks due at a time, run by the node's loop (:meth:`run_due`); no threads."""

    def __init__(self) -> None:
        self._heap: list[list] = []
        self._seq = itertools.count()

    def call_later(self, seconds: float, fn: Callable[[], None]) -> list:
        """Run ``fn`` in ``seconds``; the returned entry is cancelled with :meth:`cancel`."""
        entry = [time.monotonic() + seconds, next(self._seq), fn]
        heapq.heappush(self._heap, entry)
        return entry

    @staticmethod
    def cancel(entry: list | None) -> None:
        if entry is not None:
            entry[2] = None

    def wait(self, longest: float) -> float:
        """Seconds until the next callback is due, at most ``longest``."""
        while self._heap and self._heap[0][2] is None:
            heapq.heappop(self._heap)
        if not self._heap:
            return longest
        return max(0.0, min(longest, self._heap[0][0] - time.monotonic()))

    def run_due(self) -> None:
        now = time.monotonic()
        while self._heap and self._heap[0][0] <= now:
            _, _, fn = heapq.heappop(self._heap)
            if fn is not None:
                fn()


@dataclass
class StubBehaviour:
    """How a node's stub ranks answer: ``delay`` seconds before each cell's first step, plus up
    to ``jitter`` seconds at random (so the ranks finish out of order)."""

    delay: float = 0.0
    jitter: float = 0.0


@dataclass
class _Run:
    """One cell on one stub rank."""

    idents: list[bytes]
    parent: bytes  # the request's header, as sent: the parent header of every answer
    steps: deque[Step]
    count: int
    published: int = 0
    line: str = ""
    timer: list | None = field(default=None, repr=False)


@functools.lru_cache(maxsize=256)
def _steps(code: str) -> tuple[Step, ...]:
    """A cell's steps, read once per node (every rank of it gets the same code)."""
    try:
        return tuple(parse(code))
    except CellError as e:
        return (Step("error", text=str(e)),)


class StubRank:
    """One stub rank. ``send(channel, frames)`` carries its messages to the parent;
    ``on_exit(rank, code)`` is told when it dies (``die_on``, a SIGKILL)."""

    def __init__(self, rank: int, world_size: int, key: bytes, host: str, pid: int,
                 send: Callable[[bytes, list[bytes]], None], on_exit: Callable[[StubRank, int], None],
                 timers: Timers, behaviour: StubBehaviour) -> None:
        self.rank = rank
        self.world_size = world_size
        self.host = host
        self.pid = pid
        self._send = send
        self._on_exit = on_exit
        self._timers = timers
        self._behaviour = behaviour
        self._auth = hmac.new(key, digestmod=sha256)
        self._session = uuid.uuid4().hex
        self._ids = itertools.count()
        self._digests: set[bytes] = set()
        self._queue: deque[_Run] = deque()
        self._running: _Run | None = None
        self._count = 0
        self.exit_code: int | None = None

    # ------------------------------------------------------------------ messages in
    def take(self, channel: bytes, frames: list[bytes]) -> None:
        """One message from the parent on ``channel``; a bad signature is dropped, as a rank does."""
        if self.exit_code is not None:
            return
        try:
            i = frames.index(DELIM)
        except ValueError:
            return
        idents, signature, parts = frames[:i], frames[i + 1], frames[i + 2:i + 6]
        if len(parts) < 4 or not self._signed(signature, parts):
            return
        header = json.loads(parts[0])
        content = json.loads(parts[3])
        msg_type = header["msg_type"]
        if channel == b"shell":
            self._shell(idents, msg_type, parts[0], content)
        elif channel == b"control":
            self._control(idents, msg_type, parts[0], content)

    def _signed(self, signature: bytes, parts: list[bytes]) -> bool:
        mac = self._auth.copy()
        for part in parts:
            mac.update(part)
        if not hmac.compare_digest(signature, mac.hexdigest().encode()) or signature in self._digests:
            return False
        self._digests.add(signature)
        return True

    def _shell(self, idents: list[bytes], msg_type: str, parent: bytes, content: dict) -> None:
        if msg_type == "execute_request":
            self._execute(idents, parent, content)
            return
        if msg_type == "kernel_info_request":
            self._reply(b"shell", idents, "kernel_info_reply", parent, _KERNEL_INFO)
        else:
            reply = _SHELL_REPLIES.get(msg_type, {"status": "error", "ename": "StubError",
                                                  "evalue": f"a stub rank does not answer {msg_type}"})
            self._reply(b"shell", idents, msg_type.replace("_request", "_reply"), parent, {"status": "ok", **reply})
        self._publish("status", parent, {"execution_state": "idle"})

    def _control(self, idents: list[bytes], msg_type: str, parent: bytes, content: dict) -> None:
        if msg_type == protocol.REQUEST:
            op = str(content.get("op", "?")) if isinstance(content, dict) else "?"
            try:
                result = self._answer(protocol.parse_request(content))
            except protocol.ProtocolError as e:
                result = protocol.ErrorReply("ProtocolError", str(e))
            self._reply(b"control", idents, protocol.REPLY, parent, protocol.reply_content(op, result))
        elif msg_type == "interrupt_request":
            self._reply(b"control", idents, "interrupt_reply", parent, {"status": "ok"})
            self.signal(signal.SIGINT)
        elif msg_type == "shutdown_request":
            self._reply(b"control", idents, "shutdown_reply", parent, {"status": "ok", "restart": False})
            self.die(0)
        else:
            self._reply(b"control", idents, msg_type.replace("_request", "_reply"), parent,
                        {"status": "error", "ename": "StubError", "evalue": f"a stub rank does not answer {msg_type}"})

    def _answer(self, req: protocol.Request) -> object:
        """The reply to one typed request (see dist_kernel.protocol)."""
        run = self._running
        if isinstance(req, protocol.Join):
            return protocol.Joined(device="cpu")
        if isinstance(req, protocol.Where):
            return protocol.Place(collective=None, group_ranks=[], peer=None, seq=None,
                                  stack=[f"  Cell In[{run.count}], in <module>\n    {run.line}"] if run else [],
                                  line=run.line if run else "", busy=run is not None, group_seq=0)
        if isinstance(req, protocol.Status):
            return protocol.RankStatus(pid=self.pid, host=self.host, device="cpu", rss_mb=None, empty_cache=False,
                                       busy=run is not None, line=run.line if run else "")
        if isinstance(req, protocol.Teardown):
            return protocol.Done("a stub rank has no group to tear down")
        if isinstance(req, protocol.SetOption):
            return protocol.Done(f"{req.name} {'on' if req.on else 'off'}")
        return protocol.ErrorReply("StubError", f"a stub rank does not do {req.op}")

    # ------------------------------------------------------------------ cells
    def _execute(self, idents: list[bytes], parent: bytes, content: dict) -> None:
        if content.get("store_history", True) and not content.get("silent", False):
            self._count += 1
        self._queue.append(_Run(idents, parent, deque(_steps(str(content.get("code", "")))), self._count))
        if self._running is None:
            self._next()

    def _next(self) -> None:
        if not self._queue or self.exit_code is not None:
            return
        run = self._running = self._queue.popleft()
        wait = self._behaviour.delay + random.uniform(0.0, self._behaviour.jitter)
        if wait > 0:
            run.timer = self._timers.call_later(wait, self._advance)
        else:
            self._advance()

    def _advance(self) -> None:
        """Run the cell's steps up to its next wait, or to its end."""
        run = self._running
        while run is not None and run.steps:
            step = run.steps.popleft()
            run.line = step.text if step.kind == "print" else step.kind
            if step.kind == "print":
                self._output(run, "stream", {"name": "stdout", "text": text_for(step, self.rank, self.world_size)})
            elif step.kind == "sleep":
                run.line = f"sleep({step.seconds:g})"
                run.timer = self._timers.call_later(step.seconds, self._advance)
                return
            elif step.kind == "error":
                return self._finish("StubError", step.text)
            elif self.rank in step.ranks and step.kind == "fail":
                return self._finish("StubError", f"failed on rank {self.rank}")
            elif self.rank in step.ranks and step.kind == "die":
                return self.die(1)
        if run is not None:
            self._finish()

    def _finish(self, ename: str = "", evalue: str = "") -> None:
        """The cell's error output (if any), then its reply with the IOPub count."""
        run = self._running
        assert run is not None
        self._running = None
        Timers.cancel(run.timer)
        if ename:
            error = {"ename": ename, "evalue": evalue,
                     "traceback": [f"Cell In[{run.count}], line 1", f"{ename}: {evalue}"]}
            self._output(run, "error", error)
            reply = {"status": "error", "execution_count": run.count, **error}
        else:
            reply = {"status": "ok", "execution_count": run.count, "user_expressions": {}, "payload": []}
        self._reply(b"shell", run.idents, "execute_reply", run.parent, reply,
                    {protocol.META: {protocol.META_IOPUB: run.published}})
        self._next()

    def _output(self, run: _Run, msg_type: str, content: dict) -> None:
        run.published += 1
        self._publish(msg_type, run.parent, content)

    # ------------------------------------------------------------------ signals, death
    def signal(self, signum: int) -> None:
        """A signal from the node agent (the stop button's SIGINT, a kill)."""
        if self.exit_code is not None:
            return
        if signum == signal.SIGINT:
            if self._running is not None:
                self._finish("KeyboardInterrupt", "")
        elif signum in (signal.SIGKILL, signal.SIGTERM):
            self.die(-signum)

    def die(self, code: int) -> None:
        """The rank's process is gone: nothing more is answered."""
        if self.exit_code is not None:
            return
        self.exit_code = code
        if self._running is not None:
            Timers.cancel(self._running.timer)
        self._running = None
        self._queue.clear()
        self._on_exit(self, code)

    # ------------------------------------------------------------------ messages out
    def _message(self, msg_type: str, parent: bytes, content: dict, metadata: dict | None = None) -> list[bytes]:
        header = {"msg_id": f"{self._session}_{next(self._ids)}", "msg_type": msg_type, "username": "stub",
                  "session": self._session, "version": "5.3",
                  "date": datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")}
        parts = [json.dumps(header).encode(), parent, json.dumps(metadata or {}).encode(), json.dumps(content).encode()]
        mac = self._auth.copy()
        for part in parts:
            mac.update(part)
        return [DELIM, mac.hexdigest().encode(), *parts]

    def _reply(self, channel: bytes, idents: list[bytes], msg_type: str, parent: bytes, content: dict,
               metadata: dict | None = None) -> None:
        self._send(channel, [*idents, *self._message(msg_type, parent, content, metadata)])

    def _publish(self, msg_type: str, parent: bytes, content: dict) -> None:
        self._send(b"iopub", [f"stub.{self.rank}.{msg_type}".encode(), *self._message(msg_type, parent, content)])
