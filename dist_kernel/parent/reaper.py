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

With ranks on other machines it first ends what the node starter recorded in
``RUNTIME_DIR/launch.json`` (a :class:`~dist_kernel.cleanup.LaunchRecord`), through the starter
of the record's kind (``node_starters.end_launch``: its processes, SIGTERM, 2 s, SIGKILL, then
whatever else it started, such as a batch job). That dispatch is imported when a record first
appears, while the parent lives: a kernel on this machine alone never pays for it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

from dist_kernel.cleanup import (
    LAUNCH_FILE,
    PIDS_FILE,
    EndLaunch,
    LaunchRecord,
    end_processes,
    kill_kernel_processes,
    make_runtime_dir,
    read_launch,
    read_pids,
    sweep,
)


def write_pids(runtime_dir: str, pids: list[int]) -> None:
    """Record the rank pids for the reaper (atomically: it never reads half a file)."""
    path = os.path.join(runtime_dir, PIDS_FILE)
    with open(path + ".tmp", "w") as f:
        json.dump(pids, f)
    os.replace(path + ".tmp", path)


def launch_ender() -> EndLaunch:
    """How a recorded start is ended, by its kind: the launch package's dispatch (heavy to
    import, so only for a kernel that recorded one)."""
    try:
        from dist_kernel.parent.launch.node_starters import end_launch
    except Exception:  # noqa: BLE001 - the last one left to clean ends the starter's processes at least
        return lambda record: (end_processes(record.pids), [])
    return end_launch


class RuntimeDir:
    """A kernel's private runtime directory, guarded by its reaper: made after a sweep of what
    kernels that exited left behind (their reapers killed too), owner-only (0700), named after
    the kernel's pid so that a later sweep can judge it, short enough for the IPC socket paths
    even under a long TMPDIR. The reaper (this module, as a process of its own) ends what the
    kernel left if the kernel is SIGKILLed; :meth:`end` does it at a normal end."""

    def __init__(self) -> None:
        sweep(end_launch=launch_ender())
        self.path = make_runtime_dir()
        self._reaper = subprocess.Popen(
            [sys.executable, "-m", "dist_kernel.parent.reaper", str(os.getpid()), self.path],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)

    def end(self, rank_pids: list[int]) -> None:
        """End every process of the kernel (the ranks' sessions and groups, what left them), then
        remove the directory; the reaper sees it gone within 0.1 s and exits, and is collected
        here (no zombie)."""
        kill_kernel_processes(self.path, rank_pids)
        shutil.rmtree(self.path, ignore_errors=True)
        try:
            self._reaper.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self._reaper.kill()
            self._reaper.wait()


def reap(runtime_dir: str, rank_pids: list[int] | None = None, launch: LaunchRecord | None = None,
         end_launch: EndLaunch | None = None) -> None:
    """End what the node starter started (if anything), SIGKILL every process of the kernel,
    then remove its runtime directory."""
    record = read_launch(runtime_dir) or launch
    if record is not None:
        (end_launch or launch_ender())(record)
    pids = read_pids(runtime_dir) or (rank_pids or [])
    # the ranks died a moment ago (or are alive and verified): their sessions are theirs
    kill_kernel_processes(runtime_dir, pids, trust_rank_sessions=True)
    shutil.rmtree(runtime_dir, ignore_errors=True)


def main(parent_pid: int, runtime_dir: str, interval: float = 0.1) -> None:
    """Reap when the parent is gone; exit when the directory is gone while the parent lives
    (a normal shutdown). The parent is checked first, and the rank pids are remembered: a
    sweep by another kernel may remove the directory the moment the parent dies."""
    pids: list[int] = []
    launch: LaunchRecord | None = None
    ender: EndLaunch | None = None
    seen = seen_launch = None
    while True:
        if os.getppid() != parent_pid:
            reap(runtime_dir, pids, launch, ender)
            return
        stamp, launch_stamp = _stamp(runtime_dir, PIDS_FILE), _stamp(runtime_dir, LAUNCH_FILE)
        if stamp != seen:
            pids, seen = read_pids(runtime_dir) or pids, stamp
        # gone with the dir: remembered (a sweep may remove the dir the moment the parent dies);
        # gone from a dir that is still there: a launcher's stop() ended everything already
        if launch_stamp != seen_launch and (launch_stamp or os.path.isdir(runtime_dir)):
            launch, seen_launch = read_launch(runtime_dir) if launch_stamp else None, launch_stamp
            if launch is not None and ender is None:
                ender = launch_ender()  # now, while the parent lives, not once it is gone
        if not os.path.isdir(runtime_dir):
            if os.getppid() != parent_pid:  # the parent died since the check above
                reap(runtime_dir, pids, launch, ender)
            return
        time.sleep(interval)


def _stamp(runtime_dir: str, name: str) -> tuple[int, int] | None:
    """Changes with every atomic rewrite (a new inode), even within one mtime tick."""
    try:
        st = os.stat(os.path.join(runtime_dir, name))
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the parent is not for us
    main(int(sys.argv[1]), sys.argv[2])
