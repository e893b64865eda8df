"""A tiny process that outlives the parent kernel by a moment, to clean up after it.

    python -m dist_kernel.parent.reaper PARENT_PID RUNTIME_DIR

A SIGKILLed parent cannot stop its ranks or remove its runtime directory, and a rank stuck
in C code that holds the GIL (a CUDA synchronisation, a C extension) cannot run a watchdog
thread either. This process imports nothing heavy and waits on neither: it polls every 0.1 s,
and when the parent is gone it SIGKILLs each rank's whole process group (DataLoader workers
included; the pids are in ``RUNTIME_DIR/ranks.pids``) and removes the directory. It exits by
itself once the directory is gone, which is how a normal shutdown ends it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time

PIDS_FILE = "ranks.pids"


def write_pids(runtime_dir: str, pids: list[int]) -> None:
    """Record the rank pids for the reaper (atomically: it never reads half a file)."""
    path = os.path.join(runtime_dir, PIDS_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(pids, f)
    os.replace(path + ".tmp", path)


def reap(runtime_dir: str) -> None:
    """SIGKILL every recorded rank's process group, then remove the runtime directory."""
    try:
        with open(os.path.join(runtime_dir, PIDS_FILE)) as f:
            pids = [int(p) for p in json.load(f)]
    except (OSError, ValueError):
        pids = []
    for pid in pids:
        if not _still_ours(pid, runtime_dir):
            continue
        for kill in (os.killpg, os.kill):  # each rank leads its own session
            try:
                kill(pid, signal.SIGKILL)
            except OSError:
                pass
    shutil.rmtree(runtime_dir, ignore_errors=True)


def _still_ours(pid: int, runtime_dir: str) -> bool:
    """False when ``pid`` now belongs to an unrelated process (a rank died long ago and its
    pid was reused). A rank's command line names its connection file in ``runtime_dir``. If
    the rank is gone, its process group may still hold its children; Linux never reuses a pid
    that is still a group id, so killing that group is safe."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return runtime_dir.encode() in f.read()
    except FileNotFoundError:
        return True  # process gone (its group, if any, is the rank's), or no /proc on this system
    except OSError:
        return False


def main(parent_pid: int, runtime_dir: str, interval: float = 0.1) -> None:
    while os.path.isdir(runtime_dir):
        if os.getppid() != parent_pid:
            reap(runtime_dir)
            return
        time.sleep(interval)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the parent is not for us
    main(int(sys.argv[1]), sys.argv[2])
