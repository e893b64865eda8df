"""The wire between the parent and a node agent, spoken by both (ranks on other machines).

One ZMQ connection per node, opened by the node's agent towards the parent, so the nodes
open no Jupyter port. It is a CurveZMQ connection: encrypted, the parent's public key is
pinned on the node, and the parent's ZAP handler admits only the one client key that this
kernel start generated. Both ends receive their keys out of band: the parent made them,
and the agent reads them as one JSON line on the launcher's stdin (never argv, environment
or a file).

Frames, after the ROUTER's node identity on the parent's side:

- ``ctl``, payload, signature: a control event (hello, beat, start, started, exited, signal,
  stop; an agent's beat carries only the ranks whose state changed, and is sent only then), JSON, signed with the kernel's tunnel HMAC key as well (defence in depth: a frame
  that does not verify is dropped).
- ``msg``, rank, channel, *frames: one Jupyter message from a rank, relayed as is; it
  carries its own HMAC signature (each rank has its own key), checked by the parent.
- ``bat``, then for each message rank, channel, frame count, *frames: the messages of several of
  a node's ranks that the agent read in one turn, in one frame set (:func:`batch`), each as
  ``msg`` carries it: the parent reads one message per node and turn, not one per rank.
- ``fan``, channel, count, then rank and header per rank (or ``*``, the ranks' numbers and one
  header for them all), then parent header, metadata, content, *buffers: one Jupyter message to several ranks of the node, sent once (:func:`fan`). The
  parent sends every message to a remote rank so, unsigned; the agent signs each rank's copy
  with that rank's key (:class:`Signer`), which it holds anyway to start the rank, behind the
  CurveZMQ link that only this kernel's client key may open. A cell thus crosses the link once
  per node, with its code once.
- ``out``, payload, signature: consecutive IOPub messages (without buffers) of a node's ranks in
  one turn, each checked with its rank's key, as one JSON list of [rank, header, parent header,
  metadata, content] made from the messages' own JSON: the parent decodes one frame per turn
  instead of checking and decoding each message (:class:`Turn`).
- ``sum``, payload, signature: the ``execute_reply`` messages of a node's ranks that the agent
  read in one turn, checked with each rank's key and grouped by what they say (:class:`Replies`):
  JSON, signed with the tunnel key. A cell that ends alike on 64 ranks of a node is one entry
  with 64 rank numbers, decoded once by the parent instead of 64 signed messages. It follows
  the turn's ``bat``, so a rank's outputs always arrive before its reply.

Nothing here is ever unpickled: control payloads are JSON, Jupyter frames are passed through.

Over SSH the key line travels inside ssh's encryption. A Slurm job step's stdin (and its
environment) cross the cluster network in clear, so for Slurm the line is wrapped in MUNGE credentials,
which every Slurm cluster runs: the payload is encrypted with the cluster's MUNGE key and only
this user can decode it, once per node, within its lifetime (:func:`munge_wrap`).
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import os
import re
import secrets
import socket
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Any

CTL = b"ctl"
MSG = b"msg"
FAN = b"fan"
BATCH = b"bat"
SUMMARY = b"sum"
OUT = b"out"
#: the delimiter of a Jupyter message's frames (jupyter_client's ``DELIM``)
DELIM = b"<IDS|MSG>"
#: the Jupyter channels a rank's messages travel on
CHANNELS = (b"shell", b"control", b"stdin", b"iopub")
#: the IPC "ports" of a rank's channels on its node
IPC_PORTS = {b"shell": 1, b"iopub": 2, b"stdin": 3, b"control": 4, b"hb": 5}


def ipc_endpoint(ip: str, channel: bytes) -> str:
    """The ZMQ address of one channel of a kernel on IPC at ``ip`` (jupyter_client's naming)."""
    return f"ipc://{ip}-{IPC_PORTS[channel]}"


def ipc_ports() -> dict[str, int]:
    """The ``*_port`` entries of such a kernel's connection info."""
    return {f"{name.decode()}_port": num for name, num in IPC_PORTS.items()}
#: the parent beats to each agent this often; an agent calls the parent lost after LOST_AFTER
#: silent seconds. The agents beat only when a rank's state changed: the parent hears of a lost
#: node from its connection (TCP keepalives and a retransmission limit drop the link of a node cut
#: off within about LOST_AFTER, a killed agent's drops at once) and calls it lost once that
#: connection has been gone for RECONNECT_GRACE
BEAT_INTERVAL = 0.5
LOST_AFTER = 3.0
RECONNECT_GRACE = 1.0
#: the ZAP domain of the parent's listener
ZAP_DOMAIN = "dist_kernel"
#: control event types, by direction (``lost`` is the parent's own, when a node falls silent)
FROM_NODE = ("hello", "beat", "started", "exited", "failed", "ending", "respawned", "respawn_failed")
TO_NODE = ("beat", "start", "signal", "stop", "respawn")


class TunnelError(ValueError):
    """A control frame that is malformed or not signed with the kernel's key."""


@dataclass(frozen=True)
class Bootstrap:
    """What a node agent needs, sent as one JSON line on its stdin."""

    server_key: str  # the parent's CurveZMQ public key (z85), pinned by the node
    client_public: str  # the node's CurveZMQ key pair (the parent admits only this public key)
    client_secret: str
    hmac_key: str  # signs control frames
    rank_keys: dict[str, str]  # rank -> the HMAC key of its Jupyter session
    nodes: int
    ranks_per_node: int
    gpus: list[int] = field(default_factory=list)  # GPU ids on each node; local rank i uses the i-th
    port_range: list[int] | None = None
    extra_argv: list[str] = field(default_factory=list)  # for every rank kernel
    parent_pid: int = 0
    parent_host: str = ""
    #: the parent's working directory (ranks start there when the node has it, as a Slurm step does) and
    #: PYTHONPATH (ssh logins do not carry it): a notebook's relative paths and local imports work
    cwd: str = ""
    pythonpath: str = ""

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode() + b"\n"

    @classmethod
    def decode(cls, line: bytes | str) -> Bootstrap:
        try:
            data = json.loads(line)
            return cls(**data)
        except (ValueError, TypeError) as e:
            raise TunnelError(f"bad bootstrap line: {e}") from None


def new_secrets() -> dict[str, str]:
    """Fresh keys for one kernel start: the server's and the client's CurveZMQ pairs, the HMAC key."""
    import zmq

    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    return {"server_public": server_public.decode(), "server_secret": server_secret.decode(),
            "client_public": client_public.decode(), "client_secret": client_secret.decode(),
            "hmac_key": secrets.token_hex(32)}


MUNGE_PREFIX = b"MUNGE:"
#: a MUNGE credential's lifetime: the parent sends fresh ones when a queued job starts
MUNGE_TTL = 600


#: unmunge's exit statuses (munge.h), in words
_MUNGE_STATUS = {15: "the credential expired", 16: "the credential was rewound (clock skew)",
                 17: "the credential was replayed (decoded already)", 18: "the credential is not for this user"}


def _munge_argv(tool: str, socket_path: str | None) -> list[str]:
    return [tool, *(["--socket", socket_path] if socket_path else [])]


def munge_wrap(payload: bytes, socket_path: str | None, ttl: int = MUNGE_TTL) -> bytes:
    """``payload`` as one MUNGE credential line: encrypted (aes128), decodable only by this uid."""
    argv = [*_munge_argv("munge", socket_path), "--cipher", "aes128", "--restrict-uid", str(os.getuid()),
            "--ttl", str(ttl)]
    out = subprocess.run(argv, input=payload, capture_output=True, timeout=10, check=False)
    if out.returncode != 0 or not out.stdout.startswith(MUNGE_PREFIX):
        raise TunnelError(f"munge could not wrap the keys: {out.stderr.decode(errors='replace').strip()}")
    return out.stdout.strip() + b"\n"


def munge_unwrap(line: bytes, socket_path: str | None) -> bytes:
    """The payload of a MUNGE credential line; raises :class:`TunnelError` with munge's words
    (expired, replayed: the caller tries the next line)."""
    out = subprocess.run([*_munge_argv("unmunge", socket_path), "--metadata", "/dev/null"], input=line,
                         capture_output=True, timeout=10, check=False)
    if out.returncode != 0:  # a replayed credential still prints its payload: the status decides
        words = _MUNGE_STATUS.get(out.returncode, f"unmunge exited with status {out.returncode}")
        raise TunnelError(" ".join(filter(None, [words, out.stderr.decode(errors="replace").strip()])))
    return out.stdout


def sign(key: str, payload: bytes) -> bytes:
    return hmac.new(key.encode(), payload, hashlib.sha256).hexdigest().encode()


def pack_ctl(key: str, event: dict[str, Any]) -> list[bytes]:
    payload = json.dumps(event).encode()
    return [CTL, payload, sign(key, payload)]


def unpack_ctl(key: str, frames: list[bytes], allowed: tuple[str, ...]) -> dict[str, Any]:
    """The control event in ``frames`` (after the ``ctl`` frame); raises :class:`TunnelError`."""
    if len(frames) != 2:
        raise TunnelError(f"a control frame has 2 parts, got {len(frames)}")
    payload, signature = frames
    if not hmac.compare_digest(sign(key, payload), signature):
        raise TunnelError("a control frame's signature does not verify")
    try:
        event = json.loads(payload)
    except ValueError:
        raise TunnelError("a control frame is not JSON") from None
    if not isinstance(event, dict) or event.get("type") not in allowed:
        raise TunnelError(f"unknown control event {event.get('type') if isinstance(event, dict) else event!r}")
    return event


def fan(channel: bytes, headers: list[tuple[int, bytes]], shared: list[bytes]) -> list[bytes]:
    """One message to several ranks: each rank with its own header; ``shared``: the parent
    header, metadata, content and buffers, the same for every rank. When every rank has the same
    header (a cell: ``channels.shared_header``) it travels once, after the list of ranks."""
    first = headers[0][1] if headers else b""
    if len(headers) > 1 and len({h for _, h in headers}) == 1:  # bytes keep their hash: one pass in C
        return fan_one_header(channel, rank_list([r for r, _ in headers]), first, shared)
    frames = [FAN, channel, str(len(headers)).encode()]
    for rank, header in headers:
        frames += [str(rank).encode(), header]
    return frames + shared


def rank_list(ranks: list[int]) -> bytes:
    """The ranks of a one-header :func:`fan` message, as they travel."""
    return ",".join([str(r) for r in ranks]).encode()


def fan_one_header(channel: bytes, ranks: bytes, header: bytes, shared: list[bytes]) -> list[bytes]:
    """:func:`fan` of one header to several ranks (``ranks``: :func:`rank_list`), made once by a
    caller that sends the same ranks again and again (a cell to a node's ranks)."""
    return [FAN, channel, b"*", ranks, header, *shared]


def unfan(frames: list[bytes]) -> tuple[bytes, list[tuple[int, bytes]], list[bytes]]:
    """:func:`fan`'s frames (after the ``fan`` frame): the channel, (rank, header) per rank, the
    shared frames. Raises :class:`TunnelError` when malformed."""
    try:
        channel = frames[0]
        if frames[1] == b"*":  # one header for the listed ranks
            header = frames[3]
            headers = [(int(r), header) for r in frames[2].split(b",")]
            shared = frames[4:]
        else:
            count = int(frames[1])
            headers = [(int(frames[2 + 2 * i]), frames[3 + 2 * i]) for i in range(count)]
            shared = frames[2 + 2 * count:]
    except (IndexError, ValueError):
        raise TunnelError("a malformed fan message") from None
    if len(shared) < 3 or channel not in CHANNELS or channel == b"iopub":  # the parent never publishes
        raise TunnelError("a malformed fan message")
    return channel, headers, shared


class Signer:
    """Signs Jupyter messages for the ranks of one node, each with its own key (the agent's
    side of :func:`fan`), and checks what the ranks send back (:class:`Turn`)."""

    def __init__(self, rank_keys: dict[str, str]) -> None:
        self._macs = {int(r): hmac.new(k.encode(), digestmod=hashlib.sha256) for r, k in rank_keys.items()}

    def _signature(self, rank: int, parts: list[bytes]) -> bytes:
        """Jupyter's signature of a message of ``rank``: over header, parent header, metadata, content."""
        mac = self._macs[rank].copy()
        for part in parts[:4]:
            mac.update(part)
        return mac.hexdigest().encode()

    def message(self, rank: int, header: bytes, shared: list[bytes]) -> list[bytes]:
        """The frames a rank's socket takes: the delimiter, the signature, the message."""
        return [DELIM, self._signature(rank, [header, *shared[:3]]), header, *shared]

    def verified(self, rank: int, frames: list[bytes]) -> list[bytes] | None:
        """The header, parent header, metadata and content of a message of ``rank`` (its frames
        as the rank's socket gave them) when its signature is the rank's and it carries no
        buffers; None otherwise (it then travels as it came, and the parent judges it)."""
        try:
            i = frames.index(DELIM)
        except ValueError:
            return None
        if rank not in self._macs or len(frames) != i + 6:  # buffers (a widget's binary state) travel raw
            return None
        parts = frames[i + 2:i + 6]
        return parts if hmac.compare_digest(self._signature(rank, parts), frames[i + 1]) else None


class _Outputs:
    """A run of checked IOPub messages of a node's ranks, as ``out`` entries. The ranks that sent
    one same message (type, parent, metadata and content: ``print(1)`` on every rank, each rank's
    ``idle``) share one entry, sent once with their ranks (issue 26), where that keeps each rank's
    messages in order: a rank joins its message's latest entry if that comes after its own last
    one, or if that entry is the last one of each of its ranks (it then moves to the end)."""

    def __init__(self) -> None:
        self._entries: list[list] = []  # [order, ranks, ranks whose last entry it is, parts]
        self._latest: dict[tuple[bytes, ...], list] = {}  # a message's key -> its latest entry
        self._last: dict[int, list] = {}  # rank -> its last entry
        self._order = itertools.count()

    def add(self, rank: int, parts: list[bytes]) -> None:
        key = (_msg_type(parts[0]), *parts[1:])
        entry, last = self._latest.get(key), self._last.get(rank)
        after = last[0] if last is not None else -1
        if entry is not None and entry is not last and entry[0] < after and entry[2] == len(entry[1]):
            entry[0] = next(self._order)  # nothing of its ranks follows it: it may come last
        if entry is not None and entry[0] > after:
            entry[1].append(rank)
        else:
            entry = self._latest[key] = [next(self._order), [rank], 0, parts]
            self._entries.append(entry)
        entry[2] += 1
        if last is not None:
            last[2] -= 1
        self._last[rank] = entry

    def payload(self) -> bytes:
        """The ``out`` frame's JSON: [rank or [ranks], header, parent header, metadata, content] each."""
        return b"[" + b",".join(
            b"[%s,%s,%s,%s,%s]" % (b"%d" % ranks[0] if len(ranks) == 1 else b"[" + rank_list(ranks) + b"]", *parts)
            for _, ranks, _, parts in sorted(self._entries, key=lambda e: e[0])) + b"]"


_MSG_TYPE = re.compile(rb'"msg_type":\s*"([a-z_]+)"')


def _msg_type(header: bytes) -> bytes:
    """A message's type from its header (JSON the rank signed, read without decoding it all);
    the header itself when it names none, so that the message shares no entry."""
    found = _MSG_TYPE.search(header)
    return found.group(1) if found else header


class Turn:
    """What a node's ranks said in one turn of its agent, as the frame sets to send, in order (the
    real agent's and the stub agent's alike): IOPub messages checked and joined (``out``; the
    ranks that sent one same message share its entry, :class:`_Outputs`), anything else as it
    came (``bat``), the cells' replies summarised (``sum``, last: a rank's reply never overtakes
    its output). A rank's messages keep their order: consecutive messages of one kind share a
    frame set, and a change of kind starts the next."""

    def __init__(self, signer: Signer) -> None:
        self.signer = signer
        self.replies = Replies(signer)
        self._runs: list[_Outputs | list] = []  # checked IOPub (out) or messages as they came (bat), in order

    def add(self, rank: int, channel: bytes, frames: list[bytes]) -> None:
        """One message of ``rank`` on ``channel`` (its frames as the rank's socket gave them)."""
        if self.replies.take(rank, channel, frames):
            return
        # checked once its signature verifies; else it travels as it came, and the parent drops it
        parts = self.signer.verified(rank, frames) if channel == b"iopub" else None
        run = self._runs[-1] if self._runs else None
        if parts is not None:
            if not isinstance(run, _Outputs):
                run = _Outputs()
                self._runs.append(run)
            run.add(rank, parts)
        else:
            if not isinstance(run, list):
                run = []
                self._runs.append(run)
            run.append((str(rank).encode(), channel, frames))

    def pack(self, key: str) -> list[list[bytes]]:
        """The turn's frame sets, in order; empties the turn."""
        runs, self._runs = self._runs, []
        out = []
        for entries in runs:
            if isinstance(entries, _Outputs):
                payload = entries.payload()
                out.append([OUT, payload, sign(key, payload)])
            else:
                out.append(batch(entries))
        summary = self.replies.pack(key)
        if summary is not None:
            out.append(summary)
        return out


def _joined(key: str, frames: list[bytes], what: str) -> list:
    """The JSON list of a joined frame set (``out``, ``sum``: payload, signature) once it
    verifies with the tunnel key. Raises :class:`TunnelError` naming ``what``."""
    if len(frames) != 2 or not hmac.compare_digest(sign(key, frames[0]), frames[1]):
        raise TunnelError(f"{what}'s signature does not verify")
    try:
        entries = json.loads(frames[0])
    except ValueError:
        raise TunnelError(f"{what} is malformed") from None
    if not isinstance(entries, list):
        raise TunnelError(f"{what} is malformed")
    return entries


def unpack_out(key: str, frames: list[bytes]) -> list[list]:
    """An ``out`` frame set's entries (after the ``out`` frame): [rank, or the list of ranks that
    sent that same message, header, parent header, metadata, content]. Raises :class:`TunnelError`."""
    return _joined(key, frames, "an output frame")


class Replies:
    """The agent's side of ``sum``: its ranks' ``execute_reply`` messages of one turn, each checked
    with its rank's key (a message that does not verify, or carries buffers, travels as it came,
    and the parent drops it with a warning), grouped by request, content and dist_kernel's
    metadata (the only part of the metadata the parent reads)."""

    def __init__(self, signer: Signer) -> None:
        self.signer = signer
        self._groups: dict[tuple[str, bytes, str], list[int]] = {}

    def take(self, rank: int, channel: bytes, frames: list[bytes]) -> bool:
        """True when the message is an execute_reply, now held for :meth:`pack`."""
        parts = self.signer.verified(rank, frames) if channel == b"shell" else None
        if parts is None:
            return False
        header, parent, metadata, content = parts
        if b'"execute_reply"' not in header:  # other shell replies (kernel_info, completion) as they came
            return False
        try:
            if json.loads(header).get("msg_type") != "execute_reply":
                return False
            msg_id = json.loads(parent)["msg_id"]
            meta = json.loads(metadata).get("dist_kernel")
        except (ValueError, KeyError, TypeError, AttributeError):
            return False
        key = (str(msg_id), content, json.dumps(meta, sort_keys=True) if meta else "")
        self._groups.setdefault(key, []).append(rank)
        return True

    def pack(self, key: str) -> list[bytes] | None:
        """The held replies as one ``sum`` frame set (None when none are held); empties the hold."""
        if not self._groups:
            return None
        groups, self._groups = self._groups, {}
        entries = [[msg_id, json.loads(content), json.loads(meta) if meta else None, ranks]
                   for (msg_id, content, meta), ranks in groups.items()]
        payload = json.dumps(entries).encode()
        return [SUMMARY, payload, sign(key, payload)]


def unpack_replies(key: str, frames: list[bytes]) -> list[tuple[str, dict, dict | None, list[int]]]:
    """A ``sum`` frame set's groups (after the ``sum`` frame): (the request's msg_id, the reply
    content, dist_kernel's metadata or None, the ranks). Raises :class:`TunnelError`."""
    entries = _joined(key, frames, "a summary frame")
    try:
        return [(str(m), c, meta, [int(r) for r in ranks]) for m, c, meta, ranks in entries
                if isinstance(c, dict) and (meta is None or isinstance(meta, dict))]
    except (ValueError, TypeError):
        raise TunnelError("a summary frame is malformed") from None


def batch(messages: list[tuple[bytes, bytes, list[bytes]]]) -> list[bytes]:
    """Several ranks' messages, each (rank, channel, frames), as one frame set."""
    frames = [BATCH]
    for rank, channel, msg in messages:
        frames += [rank, channel, str(len(msg)).encode(), *msg]
    return frames


def unbatch(frames: list[bytes]) -> list[tuple[bytes, bytes, list[bytes]]]:
    """:func:`batch`'s messages (after the ``bat`` frame). Raises :class:`TunnelError` when malformed."""
    out = []
    i = 0
    try:
        while i < len(frames):
            n = int(frames[i + 2])
            out.append((frames[i], frames[i + 1], frames[i + 3:i + 3 + n]))
            i += 3 + n
    except (IndexError, ValueError):
        raise TunnelError("a malformed batch") from None
    if i != len(frames):
        raise TunnelError("a malformed batch")
    return out


def tune_link(sock: Any) -> None:
    """TCP keepalives and a retransmission limit on a ZMQ socket of the node link: the kernel
    drops a connection whose other end is cut off or down within about LOST_AFTER (a killed
    process's drops at once), with no beat on either side."""
    import zmq

    sock.tcp_keepalive = 1
    sock.tcp_keepalive_idle = sock.tcp_keepalive_intvl = 1
    sock.tcp_keepalive_cnt = max(1, int(LOST_AFTER) - 1)
    sock.setsockopt(zmq.TCP_MAXRT, int(LOST_AFTER * 1000))


def agent_socket(ctx: Any, boot: Bootstrap, node: int) -> Any:
    """A node agent's end of the link (the real agent's and the stub agent's alike): CurveZMQ with
    the kernel's keys, named after its node, never dropping a burst of output, tuned to drop a
    cut link (:func:`tune_link`); not yet connected."""
    import zmq

    sock = ctx.socket(zmq.DEALER)
    sock.curve_serverkey = boot.server_key.encode()
    sock.curve_publickey = boot.client_public.encode()
    sock.curve_secretkey = boot.client_secret.encode()
    sock.setsockopt(zmq.IDENTITY, f"node{node}".encode())
    sock.linger = 1000
    sock.sndhwm = sock.rcvhwm = 0
    tune_link(sock)
    return sock


class LinkWatch:
    """An agent's view of the parent (the real agent's and the stub agent's alike): whether its
    connection is up, from the socket's ZMQ monitor events (:attr:`monitor`, polled with the
    agent's other sockets), when the agent beats next, and when the parent counts as gone. While
    the link is up the parent counts as heard: it beats only to carry news, so an idle parent does
    no work per node."""

    def __init__(self, sock: Any) -> None:
        import time

        import zmq

        self.monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self.up = False
        self.last_heard = time.monotonic()
        self.next_beat = 0.0

    def heard(self) -> None:
        """A frame from the parent came."""
        import time

        self.last_heard = time.monotonic()

    def turn(self, beat: Any, stdin_closed: bool, stdin_words: str) -> str:
        """The end of one turn of the agent's loop: ``beat()`` when one is due; why the agent must
        end (the parent silent past LOST_AFTER, or its stdin closed: ``stdin_words``), or ""."""
        import time

        now = time.monotonic()
        if now >= self.next_beat:
            self.next_beat = now + BEAT_INTERVAL
            beat()
        if self.up:
            self.last_heard = now
        if now - self.last_heard > LOST_AFTER:
            return f"the parent has been silent for {LOST_AFTER:.0f}s"
        return f"its stdin closed ({stdin_words})" if stdin_closed else ""

    def read(self) -> None:
        """Take the monitor's events (call when :attr:`monitor` is readable)."""
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        while self.monitor.poll(0):
            try:
                event = recv_monitor_message(self.monitor, zmq.NOBLOCK)["event"]
            except zmq.ZMQError:
                return
            self.up = event == zmq.EVENT_HANDSHAKE_SUCCEEDED


def route_address(host: str, port: int = 9) -> str:
    """This machine's address on the route to ``host``: a UDP connect() sends no packet."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def reach(host: str, port: int, timeout: float) -> str | None:
    """None once a TCP connection to host:port opens within ``timeout`` (retrying: the other
    side may still be starting); else the last error, in words."""
    import time

    deadline = time.monotonic() + timeout
    error = "timed out"
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=min(3.0, max(0.1, deadline - time.monotonic()))):
                return None
        except OSError as e:
            error = e.strerror or str(e)
            time.sleep(0.3)
    return error


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds ``address`` (IPv4), or None."""
    import fcntl
    import struct

    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), siocgifaddr, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None


def parse_endpoint(endpoint: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> (host, port)."""
    if not endpoint.startswith("tcp://"):
        raise ValueError(f"{endpoint!r} is not tcp://HOST:PORT")
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    return host.strip("[]"), int(port)
