"""What a node's ranks said in one turn of its agent, sent as few frame sets as keep its order.

The agent's side checks each rank's messages with that rank's key (:class:`Signer`, which also
signs the parent's ``fan`` messages per rank), joins the IOPub messages into ``out`` frames and
summarises the cells' replies into a ``sum`` frame (:class:`Turn`, :class:`Replies`); the parent's
side unpacks them (:func:`unpack_out`, :func:`unpack_replies`). The frames themselves are
described in :mod:`dist_kernel.tunnel`.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import re

from dist_kernel.tunnel import DELIM, OUT, SUMMARY, TunnelError, batch, rank_list, sign


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
