"""The parent's connection to one rank: its Jupyter channels, on raw ZMQ sockets.

Replies (shell and control) resolve the future of the request they answer. IOPub messages
go to the listener registered for the request that caused them (a cell's run, a frontend's
comm message); what no listener claims goes to one fallback (late output of a finished
cell, comm messages). Typed requests of :mod:`dist_kernel.protocol` travel on the control
channel, which the rank answers from its own thread while its shell is busy.

A rank's frames travel on a :class:`~dist_kernel.parent.wire.Wire`: on this machine its own sockets, read from the
event loop (``add_reader`` on each socket's ZMQ file descriptor); on another machine its node
agent's connection (listener.py), which hands the frames over directly and sends a request to
several of a node's ranks once, for the agent to sign per rank (outbox.py). Messages are decoded only as far as routing needs (issue 14): every
message's HMAC signature is checked, headers are plain JSON (only the date is parsed, for
:class:`SendClock`), and a
``status`` other than ``idle``, an ``execute_input``, or an ``idle`` nobody listens for is
dropped before its metadata is read. jupyter_client's channels would parse every header's
dates, wake one ZMQ context thread per rank and pass each message through two futures.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from jupyter_client.session import DELIM, Session

from dist_kernel import protocol
from dist_kernel.exceptions import RankDiedError, RankRequestError
from dist_kernel.output_kinds import KINDS
from dist_kernel.parent.wire import SocketWire, Wire

IOPubHandler = Callable[[dict], None]

#: signatures remembered to refuse a replayed message (jupyter_client keeps as many)
_DIGESTS = 2**16
#: jupyter message protocol version of the requests sent to the ranks
_PROTOCOL_VERSION = "5.3"

#: a stream chunk at least this large is decoded once when several ranks send the same bytes
_SHARED_ABOVE = 65_536
_last_stream: list = [b"", None]  # the last large stream content: its bytes, decoded


def _content(msg_type: str, raw: bytes) -> dict:
    """The content of an IOPub message. Identical output of N ranks (a large print on every
    rank) is decoded once: the content is read-only downstream (merging copies what it changes)."""
    kind = KINDS.get(msg_type) if len(raw) >= _SHARED_ABOVE else None
    if kind is None or not kind.lines:  # a flood of one large print: stream text
        return json.loads(raw)
    if raw == _last_stream[0]:
        return _last_stream[1]
    content = json.loads(raw)
    _last_stream[:] = [raw, content]
    return content


_last_request: list = [None, None, None, []]  # the last cell sent: its metadata, content, buffers, packed


def _packed_once(session: Session, metadata: dict | None, content: dict, buffers: list | None) -> list[bytes]:
    """The frames after the header of a cell's execute_request, packed once for all its ranks:
    a cell sends the same metadata and content objects to each (and never changes them), so
    the wire sees the same frames and a node's agent gets them once (outbox.py)."""
    last = _last_request
    if metadata is not last[0] or content is not last[1] or buffers is not last[2]:
        last[:] = [metadata, content, buffers,
                   [b"{}", session.pack(metadata or {}), session.pack(content), *(buffers or ())]]
    return last[3]


_SHARED_SESSION = f"{os.urandom(8).hex()}_{os.getpid()}"
_shared_ids = itertools.count()


def shared_header(msg_type: str) -> tuple[str, bytes]:
    """A request's header, packed once for every rank it goes to (a cell: :meth:`RankChannel.send`
    with ``header``): its msg_id is the same on each rank, which answers on channels of its own.
    Its node's agent then fans out one header, and groups the ranks' replies by it (:mod:`dist_kernel.tunnel`)."""
    msg_id = f"{_SHARED_SESSION}_{next(_shared_ids)}"
    return msg_id, json.dumps(_header(msg_id, msg_type, os.environ.get("USER", "username"), _SHARED_SESSION)).encode()


def _header(msg_id: str, msg_type: str, username: str, session: str) -> dict:
    """A request's Jupyter header, dated now."""
    return {"msg_id": msg_id, "msg_type": msg_type, "username": username, "session": session,
            "version": _PROTOCOL_VERSION, "date": datetime.now(timezone.utc).isoformat().replace("+00:00", "Z")}


class SendClock:
    """When a rank sent its messages, in the parent's clock (``time.monotonic``).

    A message's header ``date`` is the rank's wall clock when it made the message. The offset
    to the parent's clock is the smallest ``arrival - date`` seen so far: the rank's clock
    skew (another machine) plus the quickest delivery. A message read later than that
    waited somewhere between the rank and the merger (the rank's IOPub thread, the sockets,
    a parent reading 8 ranks' floods on 2 cores), and the merger must not count that wait as
    the rank's silence (issue 19).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._offset: float | None = None

    def sent(self, date: object) -> float:
        """When the message dated ``date`` was sent, in the parent's clock (now, if undated)."""
        now = self.clock()
        if not isinstance(date, str):
            return now
        try:
            # Python 3.10's fromisoformat does not read the 'Z' that Jupyter writes
            wall = datetime.fromisoformat(date[:-1] + "+00:00" if date.endswith("Z") else date).timestamp()
        except ValueError:
            return now
        delay = now - wall
        if self._offset is None or delay < self._offset:
            self._offset = delay
        return wall + self._offset


@dataclass
class Routes:
    """The handlers of requests sent to many ranks at once (a cell, with one shared header),
    shared by the ranks' channels: one entry per request, not one per rank (issue 26)."""

    #: msg_id -> the handler of its IOPub messages, called with the rank
    iopub: dict[str, Callable[[int, dict], None]] = field(default_factory=dict)
    #: msg_id -> the handler of its replies, called with the ranks that sent that same reply:
    #: one rank on this machine, or a node's group (its agent's summary, listener.py), at once
    replies: dict[str, Callable[[list[int], dict], None]] = field(default_factory=dict)
    #: msg_id -> the handler of an IOPub message that a node's ranks sent alike, with the ranks
    iopub_groups: dict[str, Callable[[list[int], dict], None]] = field(default_factory=dict)


class BadMessage(ValueError):
    """A message that is unsigned, wrongly signed, replayed or malformed: dropped."""


class RankChannel:
    """Talks to one rank kernel over its shell, control, IOPub and stdin channels.

    ``connection``: the rank's Jupyter connection info (its HMAC key and signature scheme;
    where its sockets are, unless ``wire`` says how to reach them). ``alive``: whether the rank
    process still runs, asked while waiting for it to start (default: assume so). ``routes``:
    handlers of requests sent to many ranks at once (a cell: one handler for all its ranks,
    for its IOPub and for its replies), shared by the ranks' channels.
    """

    def __init__(self, rank: int, connection: dict, log: logging.Logger,
                 on_unrouted: Callable[[int, dict], None], on_stdin: Callable[[int, dict], None],
                 wire: Wire | None = None, alive: Callable[[], Awaitable[bool]] | None = None,
                 routes: Routes | None = None) -> None:
        self.rank = rank
        self.log = log
        self._on_unrouted = on_unrouted
        self._on_stdin = on_stdin
        self.info = dict(connection)
        key = self.info.get("key", b"")
        self.session = Session(key=key.encode() if isinstance(key, str) else key,
                               signature_scheme=self.info.get("signature_scheme", "hmac-sha256"))
        self.wire: Wire = wire if wire is not None else SocketWire(self.info)
        self._alive = alive
        self._auth = self.session.auth  # None: no key, messages are not signed (as jupyter_client)
        self._digests: set[bytes] = set()
        self._ids = itertools.count()
        self._id_prefix = f"{self.session.session}_{os.getpid()}"
        self._listeners: dict[str, IOPubHandler] = {}
        self._routes = routes if routes is not None else Routes()
        self._pending: dict[str, asyncio.Future] = {}
        self._handlers: dict[str, Callable[[dict], None]] = {
            "iopub": self._on_iopub, "shell": self._resolve_shell, "control": self._resolve, "stdin": self._route_stdin}
        self._replies_held = False
        self._heard_iopub: asyncio.Event | None = None
        self.send_clock = SendClock()
        self.closing = False
        self.dead: Exception | None = None

    # ------------------------------------------------------------- connecting
    def start(self) -> None:
        """Connect (messages wait on the wire until :meth:`wait_for_ready` reads them)."""
        self.wire.connect(self.session.bsession)

    async def wait_for_ready(self, timeout: float) -> None:
        """Read from now on, and wait until the rank answers ``kernel_info`` on its shell and
        its IOPub is heard (a SUB socket misses what is published before it has joined).
        RuntimeError if the rank dies first or does not answer in ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        self._heard_iopub = asyncio.Event()
        self.wire.open(self._take, self._take_checked)
        deadline = loop.time() + timeout
        while True:
            self._heard_iopub.clear()
            msg_id, fut = self.send("kernel_info_request", {})
            assert fut is not None  # expect_reply: a future for the reply
            try:
                msg = await asyncio.wait_for(fut, 1.0)
                if msg.get("msg_type") == "kernel_info_reply":
                    await asyncio.wait_for(self._heard_iopub.wait(), 0.2)
                    return
            except asyncio.TimeoutError:
                pass
            finally:
                self._pending.pop(msg_id, None)
            if not await self._is_alive():
                raise RuntimeError("Kernel died before replying to kernel_info")
            if loop.time() > deadline:
                raise RuntimeError(f"Kernel didn't respond in {timeout:g} seconds")

    async def _is_alive(self) -> bool:
        return True if self._alive is None else bool(await self._alive())

    # ------------------------------------------------------------- sending
    def listen(self, msg_id: str, handler: IOPubHandler) -> None:
        """IOPub messages caused by request ``msg_id`` go to ``handler``."""
        self._listeners[msg_id] = handler

    def unlisten(self, msg_id: str) -> None:
        self._listeners.pop(msg_id, None)

    def send(self, msg_type: str, content: dict, metadata: dict | None = None, buffers: list | None = None,
             expect_reply: bool = True, channel: str = "shell",
             header: tuple[str, bytes] | None = None) -> tuple[str, asyncio.Future | None]:
        """Send one request; its msg_id, and a future for its reply (None if none is expected).
        ``header``: its msg_id and packed header, shared with the other ranks it goes to
        (:func:`shared_header`); by default one of this channel's own."""
        if self.dead is not None:
            raise self.dead
        if self.closing:
            raise RankDiedError(f"rank {self.rank}: the kernel is shutting down")
        msg_id = header[0] if header is not None else f"{self._id_prefix}_{next(self._ids)}"
        fut = None
        if expect_reply:
            fut = asyncio.get_running_loop().create_future()
            self._pending[msg_id] = fut
        self._send(channel, msg_id, msg_type, content, metadata, buffers, header[1] if header is not None else None)
        return msg_id, fut

    def _send(self, channel: str, msg_id: str, msg_type: str, content: dict, metadata: dict | None = None,
              buffers: list | None = None, packed: bytes | None = None) -> None:
        session = self.session
        if packed is None:
            packed = session.pack(_header(msg_id, msg_type, session.username, session.session))
        if msg_type == "execute_request":
            shared = _packed_once(session, metadata, content, buffers)
        else:
            shared = [b"{}", session.pack(metadata or {}), session.pack(content), *(buffers or ())]
        self.wire.send(channel, packed, shared, session.sign)

    async def shell_request(self, msg_type: str, content: dict, timeout: float = 10.0,
                            channel: str = "shell") -> dict:
        """Round trip of one shell request (completion, inspection, ...), or of a control one
        (``debug_request``); the reply content."""
        msg_id, fut = self.send(msg_type, content, channel=channel)
        assert fut is not None  # expect_reply: a future for the reply
        try:
            return (await asyncio.wait_for(fut, timeout))["content"]
        finally:
            self._pending.pop(msg_id, None)

    async def request(self, req: protocol.Request, timeout: float = 5.0) -> Any:
        """One typed request on the control channel; the validated reply.

        Raises :class:`RankRequestError` when the rank answers with an error, and
        ``asyncio.TimeoutError`` when it does not answer in time (stopped, or stuck in C code
        that holds the GIL).
        """
        msg_id, fut = self.send(protocol.REQUEST, protocol.request_content(req), channel="control")
        assert fut is not None  # expect_reply: a future for the reply
        try:
            msg = await asyncio.wait_for(fut, timeout)
        finally:
            self._pending.pop(msg_id, None)
        reply = protocol.parse_reply(msg["content"], req.op)
        if isinstance(reply, protocol.ErrorReply):
            raise RankRequestError(f"rank {self.rank}: {req.op} failed: {reply.ename}: {reply.evalue}", reply.ename,
                                   reply.evalue)
        return reply

    def input(self, value: str) -> None:
        """Answer the rank's ``input()`` (an ``input_reply`` on its stdin channel)."""
        if self.dead is None and not self.closing:
            self._send("stdin", f"{self._id_prefix}_{next(self._ids)}", "input_reply", {"value": value})

    # ------------------------------------------------------------- reading
    def _take(self, channel: str, frames: list[bytes]) -> None:
        """One message from the wire: checked, decoded as far as routing needs, handled.
        A message with a bad HMAC signature (or malformed) is dropped, and one bad message
        never stops the reading."""
        if self.closing:
            return
        try:
            msg = self._decode_iopub(frames) if channel == "iopub" else self._decode(frames)
        except (BadMessage, ValueError, KeyError, TypeError, IndexError) as e:
            self.log.warning("rank %d: dropped a %s message: %s", self.rank, channel, e)
            return
        if msg is None:
            return
        try:
            self._handlers[channel](msg)
        except Exception:
            self.log.exception("rank %d: error handling %s %s", self.rank, channel, msg.get("msg_type"))

    def _take_checked(self, channel: str, msg: dict) -> None:
        """A message its node agent checked (the rank's signature) and decoded: handled as one
        that came whole (an IOPub message is filtered and dated as :meth:`_decode_iopub` does)."""
        if self.closing:
            return
        try:
            if channel == "iopub":
                checked = self.checked_iopub(msg)
                if checked is None:
                    return
                msg = checked
            self._handlers[channel](msg)
        except Exception:
            self.log.exception("rank %d: error handling %s %s", self.rank, channel, msg.get("msg_type"))

    def _verify(self, frames: list[bytes]) -> int:
        """Check the signature of a message; the index of its header frame."""
        try:
            i = frames.index(DELIM)
        except ValueError:
            raise BadMessage("no delimiter") from None
        if len(frames) < i + 6:
            raise BadMessage("malformed message, too few parts")
        if self._auth is not None:
            signature = frames[i + 1]
            if not signature:
                raise BadMessage("Unsigned Message")
            mac = self._auth.copy()
            for part in frames[i + 2:i + 6]:
                mac.update(part)
            if not hmac.compare_digest(signature, mac.hexdigest().encode()):
                raise BadMessage(f"Invalid Signature: {signature!r}")
            if signature in self._digests:
                raise BadMessage(f"Duplicate Signature: {signature!r}")
            self._digests.add(signature)
            if len(self._digests) > _DIGESTS:
                for _ in range(_DIGESTS // 10):
                    self._digests.pop()
        return i + 2

    def _decode(self, frames: list[bytes]) -> dict:
        i = self._verify(frames)
        header = json.loads(frames[i])
        return {"header": header, "msg_id": header["msg_id"], "msg_type": header["msg_type"],
                "parent_header": json.loads(frames[i + 1]), "metadata": json.loads(frames[i + 2]),
                "content": json.loads(frames[i + 3]), "buffers": frames[i + 4:]}

    def _decode_iopub(self, frames: list[bytes]) -> dict | None:
        """An IOPub message, or None for one the parent does not need (busy, execute_input,
        an idle no one waits for)."""
        i = self._verify(frames)
        header = json.loads(frames[i])
        return self._iopub(header, json.loads(frames[i + 1]), lambda: _content(header["msg_type"], frames[i + 3]),
                           lambda: json.loads(frames[i + 2]), frames[i + 4:])

    def _iopub(self, header: dict, parent: dict, content: Callable[[], dict], metadata: Callable[[], dict],
               buffers: list[bytes]) -> dict | None:
        """An IOPub message from its decoded header and parent header (its content and metadata
        decoded only when needed), or None for one the parent does not need."""
        if self._heard_iopub is not None:
            self._heard_iopub.set()
        msg_type = header["msg_type"]
        sent = self.send_clock.sent(header.get("date"))  # every message teaches it the offset
        if msg_type == "execute_input":
            return None
        body = content()
        if msg_type == "status" and (body.get("execution_state") != "idle"
                                     or (parent.get("msg_id") not in self._listeners
                                         and parent.get("msg_id") not in self._routes.iopub)):
            return None
        return {"header": header, "msg_id": header["msg_id"], "msg_type": msg_type, "parent_header": parent,
                "metadata": metadata(), "content": body, "buffers": buffers, "sent": sent}

    def _on_iopub(self, msg: dict) -> None:
        parent_id = msg["parent_header"].get("msg_id")
        handler = self._listeners.get(parent_id) if parent_id is not None else None
        if handler is not None:
            handler(msg)
            return
        route = self._routes.iopub.get(parent_id) if parent_id is not None else None
        if route is not None:
            route(self.rank, msg)
        else:
            self._on_unrouted(self.rank, msg)

    def _resolve(self, msg: dict) -> None:
        fut = self._pending.pop(msg["parent_header"].get("msg_id"), None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def _resolve_shell(self, msg: dict) -> None:
        if self._replies_held:
            return
        route = self._routes.replies.get(msg["parent_header"].get("msg_id"))
        if route is not None:  # a cell's reply: to the cell's run, with no future per rank
            route([self.rank], msg)
        else:
            self._resolve(msg)

    def checked_iopub(self, msg: dict) -> dict | None:
        """An IOPub message its node agent checked, as this channel hands one on (dated by its
        clock), or None for one the parent does not need; for a group of ranks that sent it alike."""
        return self._iopub(msg["header"], msg["parent_header"], lambda: msg["content"], lambda: msg["metadata"], [])

    @property
    def takes_replies(self) -> bool:
        """Are its replies handed on (the rank is not being declared gone, the kernel not closing)?"""
        return not (self._replies_held or self.closing)

    def cell_frames(self, content: dict, metadata: dict | None) -> list[bytes]:
        """The frames after the header of a cell's execute_request, packed once for all its ranks."""
        return _packed_once(self.session, metadata, content, None)

    def hold_replies(self) -> None:
        """Shell replies from now on are not handed on: the rank is about to be declared gone
        (:meth:`fail_pending` then fails what waits on them, naming why). A fault that takes
        every rank is settling, and this rank's own error (a broken connection to the rank that
        died) is not what happened."""
        self._replies_held = True

    def _route_stdin(self, msg: dict) -> None:
        if msg["msg_type"] == "input_request":
            self._on_stdin(self.rank, msg)

    # ------------------------------------------------------------- ending
    def fail_pending(self, reason: str) -> None:
        """The rank is gone: every request still waiting fails now, naming it."""
        self.dead = RankDiedError(reason)
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(self.dead)
        self._pending.clear()

    def close(self) -> None:
        self.closing = True
        self.wire.close()
