"""The parent's listener for the node agents (:class:`AgentListener`), on the kernel's event loop.

It listens on ``--listen`` (CurveZMQ, one admitted client key; the wire format is
:mod:`dist_kernel.tunnel`). Each remote rank's channel hands its messages to it (sent once per
node and turn of the loop: :mod:`~dist_kernel.parent.launch.outbox`) and gets the rank's frames
straight from it (a :class:`~dist_kernel.parent.launch.remote_rank.RemoteWire`), with no socket
or thread in between. It hears when a node's connection drops, and calls that node lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.auth.thread

from dist_kernel import protocol, tunnel
from dist_kernel.exceptions import RankStartError
from dist_kernel.options import KernelConfig
from dist_kernel.parent.launch.outbox import Outbox
from dist_kernel.parent.wire import pending, zmq_fd
from dist_kernel.tunnel.link import tune_link
from dist_kernel.tunnel.turns import unpack_out, unpack_replies

#: messages read from the listener per turn of the loop (a flood must not starve the rest)
_BATCH = 200


class _Admit:
    """ZAP: admit exactly the client key this kernel start made."""

    def __init__(self, public: str) -> None:
        self.public = public.encode()

    def callback(self, domain: str, key: bytes) -> bool:  # domain unused; key: z85, from pyzmq's ZAP
        return hmac.compare_digest(key, self.public)


@dataclass
class Node:
    """One node, as the parent knows it."""

    index: int
    host: str = ""
    address: str = ""
    pid: int = 0
    last_heard: float = 0.0
    hello: dict = field(default_factory=dict)
    lost: str = ""


class AgentListener:
    """The parent's listener for the node agents, read on the kernel's event loop (named apart
    from :mod:`dist_kernel.tunnel`, the wire format that both ends share)."""

    def __init__(self, config: KernelConfig, keys: dict[str, str],
                 on_event: Callable[[int, dict], None], log: logging.Logger,
                 on_replies: Callable[[list[int], dict], bool] = lambda ranks, msg: False,
                 on_outputs: Callable[[list[int], dict], bool] = lambda ranks, msg: False) -> None:
        self.config = config
        self.keys = keys
        self.on_event = on_event
        #: a node's group of ranks with one same reply, taken at once (True), or not (False: then
        #: each rank's channel gets it); likewise a group's one same IOPub message
        self.on_replies = on_replies
        self.on_outputs = on_outputs
        self.log = log
        self.ctx = zmq.Context()
        self.auth = zmq.auth.thread.ThreadAuthenticator(self.ctx)
        self.auth.start()
        self.auth.configure_curve_callback(tunnel.ZAP_DOMAIN, _Admit(keys["client_public"]))
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.curve_server = True
        self.router.curve_secretkey = keys["server_secret"].encode()
        self.router.curve_publickey = keys["server_public"].encode()
        self.router.zap_domain = tunnel.ZAP_DOMAIN.encode()
        # a message to a node whose connection is gone fails (EHOSTUNREACH) rather than vanish:
        # that is how the beat learns a node is lost (_tick). The kernel's TCP keepalives (idle
        # links) and retransmission limit (unanswered beats) drop the connection of a node cut off
        # or down within about LOST_AFTER, a killed agent's drops at once: the agents need not
        # beat, and neither this loop nor ZMQ's IO thread wakes per node while idle
        self.router.router_mandatory = True
        tune_link(self.router)
        #: a connection that dropped: the beats probe every node for a while (_on_link_event)
        self.link_events = self.router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._probe_until = 0.0
        self._sampled = False  # the sample flag the nodes last heard
        self.router.sndhwm = self.router.rcvhwm = 0
        self.router.linger = 0
        self.nodes: dict[int, Node] = {}
        #: rank -> where its channel takes its frames (channel name, frames)
        self._wires: dict[int, Callable[[str, list[bytes]], None]] = {}
        #: rank -> where its channel takes a message its agent checked and decoded (a summary)
        self._checked: dict[int, Callable[[str, dict], None]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._beat: asyncio.TimerHandle | None = None
        self._closed = False
        #: messages to remote ranks, sent once per turn of the loop as one per node (outbox.py)
        self.outbox = Outbox(self._to_node)
        self._flush_soon = False
        self._drain_soon = False
        self.sampling = False  # the beats ask the agents for their ranks' load (%dist_top)

    def bind(self, address: str) -> int:
        """Listen on ``address`` (a port from --port-range if given); the port."""
        rng = self.config.port_range
        if rng is None:
            return self.router.bind_to_random_port(f"tcp://{address}")
        for port in range(rng[0], rng[1] + 1):
            try:
                self.router.bind(f"tcp://{address}:{port}")
                return port
            except zmq.ZMQError:
                continue
        raise RankStartError(f"no free port in --port-range {rng[0]}-{rng[1]} on {address}. Fix: widen "
                             "--port-range (the parent needs one port, rank 0's rendezvous another), then restart.")

    def start(self) -> None:
        """Read the listener and beat, on the running event loop."""
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(zmq_fd(self.router), self._drain)
        self._loop.add_reader(zmq_fd(self.link_events), self._on_link_event)
        self._loop.call_soon(self._on_link_event)  # ZMQ's descriptor signals edges: take what waits
        self._loop.call_soon(self._drain)
        self._tick()

    # ------------------------------------------------------- a remote rank's wire
    def attach(self, rank: int, deliver: Callable[[str, list[bytes]], None],
               checked: Callable[[str, dict], None]) -> None:
        self._wires[rank] = deliver
        self._checked[rank] = checked

    def detach(self, rank: int) -> None:
        self._wires.pop(rank, None)
        self._checked.pop(rank, None)

    def send_parts(self, rank: int, channel: str, header: bytes, shared: list[bytes]) -> None:
        """One Jupyter message to a rank, unsigned (its agent signs it), sent at the end of this
        turn of the loop together with the messages to the node's other ranks."""
        self.outbox.put(self.config.node_of(rank), rank, channel.encode(), header, shared)
        self._flush_at_end_of_turn()

    def send_to_nodes(self, nodes: list[tuple[int, bytes]], channel: str, header: bytes, shared: list[bytes]) -> None:
        """One request to many ranks with one header (a cell): to each node (index, its ranks as
        :func:`~dist_kernel.tunnel.rank_list` made them), one message, as :meth:`send_parts`
        would make of a message per rank, without the work per rank."""
        name = channel.encode()
        for node, ranks in nodes:
            self.outbox.put_fan(node, tunnel.fan_one_header(name, ranks, header, shared))
        self._flush_at_end_of_turn()

    def _flush_at_end_of_turn(self) -> None:
        if not self._flush_soon and self._loop is not None:
            self._flush_soon = True
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_soon = False
        self.outbox.flush()

    # ------------------------------------------------------- control
    def send_ctl(self, node: int, event: dict) -> None:
        """A control event for a node; from another thread it is handed to the loop."""
        frames = tunnel.pack_ctl(self.keys["hmac_key"], event)
        loop = self._loop
        if loop is not None and loop.is_running() and not _in_loop(loop):
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(self._ctl_to_node, node, frames)
            return
        self._ctl_to_node(node, frames)

    def _ctl_to_node(self, node: int, frames: list) -> None:
        """A control event after the messages held for this turn: a signal never overtakes the
        cell it is meant for."""
        if self.outbox:
            self.outbox.flush()
        self._to_node(node, frames)

    def close(self) -> None:
        """Stop reading and beating, close the listener; from any thread."""
        loop = self._loop
        if loop is not None and loop.is_running() and not _in_loop(loop):
            done = threading.Event()

            def close_there() -> None:
                self._close()
                done.set()

            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(close_there)
                done.wait(2)
        self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._beat is not None:
            self._beat.cancel()
        loop = self._loop
        if loop is not None and not loop.is_closed() and _in_loop(loop):
            with contextlib.suppress(Exception):
                loop.remove_reader(zmq_fd(self.router))
            with contextlib.suppress(Exception):
                loop.remove_reader(zmq_fd(self.link_events))
        with contextlib.suppress(Exception):
            self.auth.stop()
        with contextlib.suppress(Exception):
            self.ctx.destroy(linger=0)

    # ------------------------------------------------------- on the loop
    def _tick(self) -> None:
        """Every BEAT_INTERVAL, while there is news (the sample flag) or a connection dropped
        lately: beat to each node, and call a node lost whose connection has been gone for
        RECONNECT_GRACE (a killed agent; a node cut off or down, whose link TCP drops). What
        waits in the listener is read first: a loop that was busy for a moment heard nothing."""
        if self._closed:
            return
        self._drain(again=False)
        if self.outbox:
            self.outbox.flush()  # the beat after what this turn sent
        now = time.monotonic()
        if not (self.sampling or self._sampled or now < self._probe_until):
            # nothing to say, and no connection dropped lately: the agents count the parent as
            # heard while their link is up (tunnel.link.LinkWatch), so an idle parent sends nothing
            self._again()
            return
        self._sampled = self.sampling
        beat = tunnel.pack_ctl(self.keys["hmac_key"], {"type": "beat", "sample": self.sampling})
        for node in self.nodes.values():
            if node.lost:
                continue
            if self._reaches(node.index, beat):
                node.last_heard = now
            elif now - node.last_heard > tunnel.RECONNECT_GRACE:
                node.lost = f"silent for {now - node.last_heard:.1f}s"
                self.on_event(node.index, {"type": "lost", "silent": now - node.last_heard})
        self._again()

    def _again(self) -> None:
        assert self._loop is not None
        self._beat = self._loop.call_later(tunnel.BEAT_INTERVAL, self._tick)

    def _on_link_event(self) -> None:
        """A node's connection dropped (or a stranger's was refused): probe every node with the
        beats until a dropped one has had RECONNECT_GRACE to come back, or is called lost."""
        dropped = False
        while True:
            try:
                self.link_events.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                break
            dropped = True
        if dropped:
            now = time.monotonic()
            self._probe_until = now + tunnel.RECONNECT_GRACE + 2 * tunnel.BEAT_INTERVAL
            for node in self.nodes.values():
                node.last_heard = max(node.last_heard, now)

    def _drain(self, again: bool = True) -> None:
        """Handle what the listener holds, at most ``_BATCH`` messages per turn of the loop."""
        if self._closed:
            return
        try:
            for _ in range(_BATCH):
                if not pending(self.router):
                    return
                frames = self.router.recv_multipart(zmq.NOBLOCK)
                try:
                    self._from_node(frames)
                except Exception:  # one bad frame never stops the reading
                    self.log.exception("listener: dropped a frame")
        except zmq.ZMQError:
            return
        if again and self._loop is not None:  # more may wait: ZMQ's descriptor signals edges
            self._loop.call_soon(self._drain)

    def _to_node(self, node: int, frames: list) -> None:
        if self._closed:
            return
        with contextlib.suppress(zmq.ZMQError):
            self.router.send_multipart([f"node{node}".encode(), *frames])
        if not self._drain_soon and self._loop is not None and _in_loop(self._loop):
            self._drain_soon = True  # a send can swallow the descriptor's edge: read once after this turn
            self._loop.call_soon(self._drain_after_send)

    def _reaches(self, node: int, frames: list) -> bool:
        """Send to a node; False when its connection is gone (a ROUTER_MANDATORY refusal)."""
        try:
            self.router.send_multipart([f"node{node}".encode(), *frames])
        except zmq.ZMQError as e:
            return e.errno != zmq.EHOSTUNREACH
        return True

    def _heard_from(self, index: int, unpack: Callable[[str, list[bytes]], Any], frames: list[bytes]) -> Any:
        """A node's joined frame (``out`` or ``sum``) checked and decoded by ``unpack``; None,
        logged, when it does not verify."""
        try:
            decoded = unpack(self.keys["hmac_key"], frames)
        except tunnel.TunnelError as e:
            self.log.warning("listener: node %d: %s", index, e)
            return None
        node = self.nodes.get(index)
        if node is not None:
            node.last_heard = time.monotonic()
        return decoded

    def _own(self, index: int, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` that node ``index`` holds and whose channel takes checked messages
        (an agent speaks for its own ranks only). TypeError for a rank that is not a number."""
        per_node, checked = self.config.ranks_per_node, self._checked
        return [r for r in ranks if r // per_node == index and r in checked]

    def _outputs(self, index: int, frames: list[bytes]) -> None:
        """IOPub messages of a node's ranks that its agent checked and joined: one decode for all.
        An entry that several ranks sent alike goes on at once (:attr:`on_outputs`: a cell's
        relay), or else to each rank's channel, as one message object (read-only downstream)."""
        for entry in self._heard_from(index, unpack_out, frames) or ():
            try:
                rank, header, parent, metadata, content = entry
                own = self._own(index, rank if isinstance(rank, list) else [rank])
            except (ValueError, TypeError):
                self.log.warning("listener: node %d: a malformed output entry", index)
                continue
            msg = {"header": header, "parent_header": parent, "metadata": metadata, "content": content, "buffers": []}
            if len(own) > 1 and self.on_outputs(own, msg):
                continue
            for r in own:
                self._checked[r]("iopub", msg)

    def _replies(self, index: int, frames: list[bytes]) -> None:
        """A node's summary of its ranks' cell replies: each group decoded once, and handed on
        at once (:attr:`on_replies`: a cell's run), or else to each of its ranks, as the reply
        message (one object, read-only downstream)."""
        for msg_id, content, meta, ranks in self._heard_from(index, unpack_replies, frames) or ():
            msg = {"header": {"msg_type": "execute_reply"}, "msg_id": "", "msg_type": "execute_reply",
                   "parent_header": {"msg_id": msg_id}, "metadata": {protocol.META: meta} if meta else {},
                   "content": content, "buffers": []}
            own = self._own(index, ranks)
            if self.on_replies(own, msg):
                continue
            for rank in own:
                self._checked[rank]("shell", msg)

    def _drain_after_send(self) -> None:
        self._drain_soon = False
        self._drain()

    def _from_node(self, frames: list[bytes]) -> None:
        ident, kind, *rest = frames
        try:
            index = int(ident.decode().removeprefix("node"))
        except ValueError:
            return
        if kind == tunnel.BATCH:
            node = self.nodes.get(index)
            if node is not None:
                node.last_heard = time.monotonic()
            try:
                messages = tunnel.unbatch(rest)
            except tunnel.TunnelError as e:
                self.log.warning("listener: node %d: %s", index, e)
                return
            for rank, name, msg in messages:
                deliver = self._wires.get(int(rank))
                if deliver is not None and name in tunnel.CHANNELS:
                    deliver(name.decode(), msg)
            return
        if kind == tunnel.SUMMARY:
            self._replies(index, rest)
            return
        if kind == tunnel.OUT:
            self._outputs(index, rest)
            return
        if kind == tunnel.MSG and len(rest) >= 2:
            node = self.nodes.get(index)
            if node is not None:
                node.last_heard = time.monotonic()
            rank, name, *msg = rest
            deliver = self._wires.get(int(rank))
            if deliver is not None and name in tunnel.CHANNELS:
                deliver(name.decode(), msg)
            return
        if kind != tunnel.CTL:
            return
        try:
            event = tunnel.unpack_ctl(self.keys["hmac_key"], rest, tunnel.FROM_NODE)
        except tunnel.TunnelError as e:
            self.log.warning("listener: node %d: %s", index, e)
            return
        node = self.nodes.setdefault(index, Node(index))
        node.last_heard = time.monotonic()
        if event["type"] == "hello":
            node.host, node.address, node.pid, node.hello = (str(event.get("host", "")), str(event.get("address", "")),
                                                             int(event.get("pid", 0)), event)
            # one beat in answer (heard; the sample flag): later ones only carry news (_tick)
            self._to_node(index, tunnel.pack_ctl(self.keys["hmac_key"], {"type": "beat", "sample": self.sampling}))
        self.on_event(index, event)


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
