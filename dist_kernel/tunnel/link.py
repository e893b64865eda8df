"""The node link's sockets and addresses: TCP tuned so that a cut link drops within about
``LOST_AFTER``, the agent's end of the link and its watch on the parent, and which address and
interface reach a host (also used by :mod:`dist_kernel.rank.rendezvous`: :func:`reach`).
"""

from __future__ import annotations

import socket
from typing import Any

from dist_kernel.tunnel import BEAT_INTERVAL, LOST_AFTER
from dist_kernel.tunnel.keys import Bootstrap


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
