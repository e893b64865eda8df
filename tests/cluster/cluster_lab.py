"""The two-node Slurm + SSH lab of ``tests/cluster/lab.sh``, for any test module.

    from cluster_lab import lab_env
    env = lab_env()   # {"SLURM_CONF": ..., "LAB_SSH_OPTS": ..., "LAB_NODE_ADDRS": ..., ...}

:func:`lab_env` runs ``lab.sh up`` (idempotent; the first call in a session brings the lab up,
later calls reuse the answer) and returns the variables of its generated ``env.sh``. Where the
lab cannot be made here (not root, no namespaces: ``lab.sh`` exits 77) it calls
``pytest.skip`` with the lab's ``SKIP: ...`` line, every time it is called. Any other failure of
``up`` fails the test with the lab's output. The lab is never torn down here: other tests reuse
it, and a CI machine is discarded after the run (``bash tests/cluster/lab.sh down`` by hand).
"""

from __future__ import annotations

import fcntl
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAB_SH = ROOT / "tests" / "cluster" / "lab.sh"

_cached: dict[str, str] | None = None
_skip_reason: str | None = None


def lab_dir() -> Path:
    return Path(os.environ.get("LAB_DIR", "/run/dk-cluster-lab"))


_held: dict[str, int] = {}  # "fd": the open lock file while this process holds the lab


def hold_lab() -> None:
    """Have the lab to this test session alone, waiting for any other session that has it (a
    second copy of the suite on the same machine, issue 20: its link-cut test would cut our
    nodes too, and ``lab.sh up`` needs them idle). ``lab.sh up`` and ``down`` take the same lock;
    ``LAB_LOCK_HELD`` tells the ones this session runs that it is held. Where the lock file
    cannot be made (not root: no lab either) nothing is held."""
    if "fd" in _held:
        return
    try:
        fd = os.open(f"{lab_dir()}.lock", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    except OSError:
        return
    fcntl.flock(fd, fcntl.LOCK_EX)
    _held["fd"] = fd
    os.environ["LAB_LOCK_HELD"] = "1"


def release_lab() -> None:
    """Let another session have the lab (this one's cluster tests are over)."""
    fd = _held.pop("fd", None)
    if fd is not None:
        os.environ.pop("LAB_LOCK_HELD", None)
        os.close(fd)


def lab_env() -> dict[str, str] | None:
    """Bring the lab up (once per session) and return env.sh's ``LAB_*`` and ``SLURM_CONF``."""
    global _cached, _skip_reason
    if _cached is not None:
        return dict(_cached)
    if _skip_reason is not None:
        pytest.skip(_skip_reason)
    p = subprocess.run(["bash", str(LAB_SH), "up"], capture_output=True, text=True, timeout=600)
    if p.returncode == 77:
        _skip_reason = next((ln for ln in (p.stdout + p.stderr).splitlines() if ln.startswith("SKIP:")),
                            "SKIP: tests/cluster/lab.sh up cannot make the lab here")
        pytest.skip(_skip_reason)
    if p.returncode != 0:
        pytest.fail(f"tests/cluster/lab.sh up failed (exit {p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    env_sh = lab_dir() / "env.sh"
    out = subprocess.run(["bash", "-c", 'set -a; . "$0"; env -0', str(env_sh)], capture_output=True,
                         check=True, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")}).stdout
    env = dict(kv.split("=", 1) for kv in out.decode().split("\0") if "=" in kv)
    _cached = {k: v for k, v in env.items() if k.startswith("LAB_") or k == "SLURM_CONF"}
    return dict(_cached)


def netns_pids(ns: str) -> set[int]:
    """The pids in a lab node's network namespace (``ip netns pids``)."""
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10).stdout
    return {int(p) for p in out.split()}


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""
