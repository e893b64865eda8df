"""The keys of one kernel start and the line that carries them to a node agent.

The parent makes every key (:func:`new_secrets`); a node agent reads its share as one JSON line
on the launcher's stdin (:class:`Bootstrap`: never argv, environment or a file).

Over SSH the key line travels inside ssh's encryption. A Slurm job step's stdin (and its
environment) cross the cluster network in clear, so for Slurm the line is wrapped in MUNGE credentials,
which every Slurm cluster runs: the payload is encrypted with the cluster's MUNGE key and only
this user can decode it, once per node, within its lifetime (:func:`munge_wrap`).
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from dataclasses import asdict, dataclass, field

from dist_kernel.tunnel import TunnelError


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
