"""A tiny process that outlives the parent kernel by a moment, to clean up after it.

    python -m dist_kernel.parent.reaper PARENT_PID RUNTIME_DIR

A SIGKILLed parent cannot stop its ranks or remove its runtime directory, and a rank stuck
in C code that holds the GIL (a CUDA synchronisation, a C extension) cannot run a watchdog
thread either. This process imports nothing heavy and waits on neither: it polls every 0.1 s,
and when the parent is gone it SIGKILLs every process of the kernel (see cleanup.py): each
rank's session and process group (DataLoader workers; the rank pids are in
``RUNTIME_DIR/ranks.pids``) and whatever a rank started that left its session (``os.setsid``,
found by ``DIST_KERNEL_RUNTIME_DIR`` in its environment); then it removes the directory. It
exits by itself once the directory is gone, which is how a normal shutdown ends it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time

from dist_kernel.parent.cleanup import PIDS_FILE, kill_kernel_processes, read_pids


def write_pids(runtime_dir: str, pids: list[int]) -> None:
    """Record the rank pids for the reaper (atomically: it never reads half a file)."""
    path = os.path.join(runtime_dir, PIDS_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(pids, f)
    os.replace(path + ".tmp", path)


def reap(runtime_dir: str, rank_pids: list[int] | None = None) -> None:
    """SIGKILL every process of the kernel, then remove its runtime directory."""
    pids = read_pids(runtime_dir) or (rank_pids or [])
    # the ranks died a moment ago (or are alive and verified): their sessions are theirs
    kill_kernel_processes(runtime_dir, pids, trust_rank_sessions=True)
    shutil.rmtree(runtime_dir, ignore_errors=True)


def main(parent_pid: int, runtime_dir: str, interval: float = 0.1) -> None:
    """Reap when the parent is gone; exit when the directory is gone while the parent lives
    (a normal shutdown). The parent is checked first, and the rank pids are remembered: a
    sweep by another kernel may remove the directory the moment the parent dies."""
    pids: list[int] = []
    seen = None
    while True:
        if os.getppid() != parent_pid:
            reap(runtime_dir, pids)
            return
        try:
            stamp = os.stat(os.path.join(runtime_dir, PIDS_FILE)).st_mtime_ns
        except OSError:
            stamp = None
        if stamp != seen:
            pids, seen = read_pids(runtime_dir) or pids, stamp
        if not os.path.isdir(runtime_dir):
            if os.getppid() != parent_pid:  # the parent died since the check above
                reap(runtime_dir, pids)
            return
        time.sleep(interval)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the parent is not for us
    main(int(sys.argv[1]), sys.argv[2])
