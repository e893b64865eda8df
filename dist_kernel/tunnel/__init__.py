"""The wire between the parent and a node agent, spoken by both (ranks on other machines).

One ZMQ connection per node, opened by the node's agent towards the parent, so the nodes
open no Jupyter port. It is a CurveZMQ connection: encrypted, the parent's public key is
pinned on the node, and the parent's ZAP handler admits only the one client key that this
kernel start generated. Both ends receive their keys out of band (:mod:`.keys`).

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
  with that rank's key (:class:`.turns.Signer`), which it holds anyway to start the rank, behind the
  CurveZMQ link that only this kernel's client key may open. A cell thus crosses the link once
  per node, with its code once.
- ``out``, payload, signature: consecutive IOPub messages (without buffers) of a node's ranks in
  one turn, each checked with its rank's key, as one JSON list of [rank, header, parent header,
  metadata, content] made from the messages' own JSON: the parent decodes one frame per turn
  instead of checking and decoding each message (:class:`.turns.Turn`).
- ``sum``, payload, signature: the ``execute_reply`` messages of a node's ranks that the agent
  read in one turn, checked with each rank's key and grouped by what they say (:class:`.turns.Replies`):
  JSON, signed with the tunnel key. A cell that ends alike on 64 ranks of a node is one entry
  with 64 rank numbers, decoded once by the parent instead of 64 signed messages. It follows
  the turn's ``bat``, so a rank's outputs always arrive before its reply.

Nothing here is ever unpickled: control payloads are JSON, Jupyter frames are passed through.

This module holds the frame sets and control events; beside it, :mod:`.keys` (the keys and the
line that carries them to a node), :mod:`.turns` (what a node's ranks said in one turn of its
agent: ``out`` and ``sum``, checked, joined and summarised) and :mod:`.link` (the link's sockets
and addresses).
"""

from __future__ import annotations

import hashlib
import hmac
import json
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
