"""The wire between the parent and a node agent, spoken by both (ranks on other machines).

One ZMQ connection per node, opened by the node's agent towards the parent, so the nodes
open no Jupyter port. It is a CurveZMQ connection: encrypted, the parent's public key is
pinned on the node, and the parent's ZAP handler admits only the one client key that this
kernel start generated. Both ends receive their keys out of band: the parent made them,
and the agent reads them as one JSON line on the launcher's stdin (never argv, environment
or a file).

Frames, after the ROUTER's node identity on the parent's side:

- ``ctl``, payload, signature: a control event (hello, beat, start, started, exited, signal,
  stop), JSON, signed with the kernel's tunnel HMAC key as well (defence in depth: a frame
  that does not verify is dropped).
- ``msg``, rank, channel, *frames: one Jupyter message to or from a rank, relayed as is; it
  carries its own HMAC signature (each rank has its own key), checked at the ends.

Nothing here is ever unpickled: control payloads are JSON, Jupyter frames are passed through.

Over SSH the key line travels inside ssh's encryption. srun's stdin (and its environment)
cross the cluster network in clear, so for Slurm the line is wrapped in MUNGE credentials,
which every Slurm cluster runs: the payload is encrypted with the cluster's MUNGE key and only
this user can decode it, once per node, within its lifetime (:func:`munge_wrap`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import socket
import subprocess
from dataclasses import asdict, dataclass, field
from typing import Any

CTL = b"ctl"
MSG = b"msg"
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
#: both ends send a beat this often, and call the other side lost after LOST_AFTER silent seconds
BEAT_INTERVAL = 0.5
LOST_AFTER = 3.0
#: the ZAP domain of the parent's listener
ZAP_DOMAIN = "dist_kernel"
#: control event types, by direction (``lost`` is the parent's own, when a node falls silent)
FROM_NODE = ("hello", "beat", "started", "exited", "failed", "ending")
TO_NODE = ("beat", "start", "signal", "stop")


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
    #: the parent's working directory (ranks start there when the node has it, as srun does) and
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
