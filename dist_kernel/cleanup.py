"""Find and end every process a kernel left behind; make and sweep kernel runtime directories.

A kernel's processes are recognised by what they cannot lose, never by name:

- ``DIST_KERNEL_RUNTIME_DIR=<runtime dir>`` in ``/proc/PID/environ``: the supervisor puts it in
  every rank's environment, and everything a rank starts inherits it, including processes that
  left the rank's session (``os.setsid``, daemons) and were re-parented to init;
- the session or process group of a rank: Linux never reuses a pid while it is still the id of
  a session or group, so the members of a dead rank's session are that rank's leftovers, even
  those started with a scrubbed environment.

The owner pid in a runtime directory's name (``dist_kernel-<pid>-xxxxxxxx``) says whether its
kernel is alive; the same name is the value of the variable, so a process can be judged even
after its directory was removed. Only processes of this user are ever signalled, never this
process or its ancestors. Imports nothing heavy: the reaper runs this.

A kernel whose ranks run on other machines also records what its node starter started in
``launch.json`` (:data:`LAUNCH_FILE`, a :class:`LaunchRecord`): the starter's kind, its
processes on this machine, and an opaque record of anything else it started (a batch job). Only
the starter of that kind knows how to end it (``NodeStarter.end_recorded``, found by kind in
:mod:`dist_kernel.launchers`): the sweep and the reaper are handed that dispatch
(``end_launch``) and name no batch system. :func:`end_processes` is the part every starter
shares: its processes on this machine, SIGTERM first (a starter may end what it started on the
way out), then SIGKILL.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

ENV_VAR = "DIST_KERNEL_RUNTIME_DIR"
#: the rank a process belongs to (placement.rank_env sets it in each rank; what it starts inherits it)
RANK_VAR = "DIST_KERNEL_RANK"
_MARKER = ENV_VAR.encode() + b"="
_RANK = RANK_VAR.encode() + b"="
RUNTIME_PREFIX = "dist_kernel-"
PIDS_FILE = "ranks.pids"
#: what the node starter of a multi-node kernel started (a :class:`LaunchRecord`)
LAUNCH_FILE = "launch.json"
# Linux limits a unix socket path (sun_path) to 107 bytes. The ranks' IPC sockets are
# ``<runtime dir>/rank<N>-<port>``; leave room for 4-digit ranks and 5-digit ports.
SOCKET_PATH_MAX = 107
SOCKET_SUFFIX_MAX = len("/rank9999-99999")
_MKDTEMP_RANDOM = 8  # length of the random part tempfile.mkdtemp appends


@dataclass
class Proc:
    """One process, as read from /proc."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    marker: str | None  # the value of DIST_KERNEL_RUNTIME_DIR in its environment
    argv: list[str]
    rank: str | None = None  # the value of DIST_KERNEL_RANK in its environment: the rank that started it

    def describe(self) -> str:
        return f"pid {self.pid}: {' '.join(self.argv)[:120] or '?'}"


@dataclass
class SweepReport:
    """What a sweep ended and removed."""

    killed: list[Proc] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    #: what the node starters ended besides processes (a batch job cancelled), in their words
    released: list[str] = field(default_factory=list)


# ------------------------------------------------------------------ runtime directories
def owner_pid(runtime_dir: str) -> int | None:
    """The pid of the kernel that made ``runtime_dir`` (from its name), or None."""
    name = os.path.basename(os.path.normpath(runtime_dir))
    if not name.startswith(RUNTIME_PREFIX):
        return None
    pid = name[len(RUNTIME_PREFIX):].split("-", 1)[0]
    return int(pid) if pid.isdigit() else None


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def pid_alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie; another user's process counts as alive."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a SIGKILLed kernel stays a zombie until its own parent collects it: it is dead already
    return _state(pid) not in ("Z", "X")


def kernel_gone(runtime_dir: str) -> bool:
    """True when the kernel that owns ``runtime_dir`` has exited (False when unknown)."""
    pid = owner_pid(runtime_dir)
    return pid is not None and not pid_alive(pid)


def runtime_bases() -> list[str]:
    """Where runtime directories are made, in order of preference (the sweep looks in all)."""
    bases = [tempfile.gettempdir(), os.environ.get("XDG_RUNTIME_DIR") or "", "/tmp"]
    out: list[str] = []
    for b in bases:
        if b and os.path.isabs(b) and b not in out:
            out.append(b)
    return out


def make_runtime_dir() -> str:
    """A new private (0700) runtime directory for this kernel, named for the sweep.

    ``$TMPDIR`` first; when it is too long for the ranks' IPC socket paths (107 bytes, a raw
    ``ZMQError: File name too long`` otherwise), ``$XDG_RUNTIME_DIR`` then ``/tmp``.
    """
    prefix = f"{RUNTIME_PREFIX}{os.getpid()}-"
    fits = SOCKET_PATH_MAX - SOCKET_SUFFIX_MAX - len(prefix) - _MKDTEMP_RANDOM - 1
    tried = []
    for base in runtime_bases():
        if len(os.fsencode(base)) > fits:
            tried.append(f"{base!r} (too long)")
            continue
        try:
            return tempfile.mkdtemp(prefix=prefix, dir=base)  # mode 0700
        except OSError as e:
            tried.append(f"{base!r} ({e.strerror})")
    raise OSError(
        f"no directory for the kernel's IPC sockets: a unix socket path is limited to "
        f"{SOCKET_PATH_MAX} bytes, so the directory must be at most {fits} characters long. "
        f"Tried {', '.join(tried)}. Fix: set TMPDIR to a short writable directory "
        f"(TMPDIR is {os.environ.get('TMPDIR', 'unset')!r}).")


def read_pids(runtime_dir: str) -> list[int]:
    """The rank pids recorded in ``runtime_dir`` (see reaper.write_pids); [] when unknown."""
    try:
        with open(os.path.join(runtime_dir, PIDS_FILE)) as f:
            return [int(p) for p in json.load(f)]
    except (OSError, ValueError, TypeError):
        return []


def stale_runtime_dirs(bases: Iterable[str] | None = None) -> list[str]:
    """This user's runtime directories whose kernel has exited."""
    found = []
    for base in bases if bases is not None else runtime_bases():
        try:
            names = os.listdir(base)
        except OSError:
            continue
        for name in sorted(names):
            path = os.path.join(base, name)
            if owner_pid(path) is None or path in found:
                continue
            try:
                st = os.lstat(path)
            except OSError:
                continue
            # a directory (not a link planted by someone) of ours, whose kernel is gone
            if os.path.isdir(path) and not os.path.islink(path) and st.st_uid == os.getuid() \
                    and kernel_gone(path):
                found.append(path)
    return found


# ------------------------------------------------------------------ processes
def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _pid_ns(pid: int | str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return None


def processes() -> dict[int, Proc]:
    """This user's live processes in this pid namespace (zombies left out: they are dead
    already; another namespace's, a container's, judge their owner pids by other pids)."""
    uid, ns = os.getuid(), _pid_ns("self")
    procs: dict[int, Proc] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            if os.stat(f"/proc/{pid}").st_uid != uid:
                continue
            fields = _read(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()
            if fields[0] in (b"Z", b"X") or _pid_ns(pid) != ns:
                continue
            marker = rank = None
            try:
                for var in _read(f"/proc/{pid}/environ").split(b"\0"):
                    if var.startswith(_MARKER):
                        marker = os.fsdecode(var[len(_MARKER):])
                    elif var.startswith(_RANK):
                        rank = os.fsdecode(var[len(_RANK):])
            except OSError:  # not readable (a setuid program): judged by its session only
                pass
            argv = [os.fsdecode(a) for a in _read(f"/proc/{pid}/cmdline").split(b"\0") if a]
            procs[pid] = Proc(pid, int(fields[1]), int(fields[2]), int(fields[3]), marker, argv, rank)
        except (OSError, IndexError, ValueError):
            continue  # exited while we looked
    return procs


def _protected(procs: dict[int, Proc]) -> set[int]:
    """This process and its ancestors (``clean`` run from a shell inside a kernel, say)."""
    keep, pid = set(), os.getpid()
    while pid > 1 and pid not in keep:
        keep.add(pid)
        p = procs.get(pid)
        if p is None:
            try:
                pid = int(_read(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                break
        else:
            pid = p.ppid
    return keep


def select(procs: dict[int, Proc], dead: Callable[[str], bool],
           rank_pids: Iterable[int] = (), trust_rank_sessions: bool = False) -> list[Proc]:
    """The processes that belong to kernels for which ``dead(runtime_dir)`` is true.

    A process belongs to such a kernel when its environment names the kernel's runtime dir,
    or when it is in the session or group of one that does, or in a session or group that one
    that does is in and whose leader is gone (a dead rank's), or of a rank of the kernel
    (``rank_pids``) that is alive, or dead and still holding a member that names the dir: a
    child with a scrubbed environment. Those ids cannot have been reused: Linux never gives
    out a pid that is still a session or group id. With ``trust_rank_sessions`` the sessions
    and groups of dead ranks count in any case (the reaper's case: right after the ranks died).
    Long after, a daemon may have been given a dead rank's pid and left a session of its own
    behind, so the sweep does not trust those without a member that names the kernel.
    """
    mine = {p.pid for p in procs.values() if p.marker and dead(p.marker)}
    held = {i for pid in mine for i in (procs[pid].sid, procs[pid].pgid)}
    # a session or group held by such a process whose leader is gone (or going: an exiting
    # process's environment and command line read empty) is a dead rank's, as ranks lead their
    # own sessions: every member is the rank's, named or not. Ended now, by any sweep: once the
    # members that name the kernel are gone, nothing would find the others
    leaders = set(mine) | {i for i in held if _leader_gone(i, procs)}
    for pid in rank_pids:
        leader = procs.get(pid)
        if leader is None:
            if pid in held or trust_rank_sessions and not pid_alive(pid):
                leaders.add(pid)
        elif leader.marker is not None and dead(leader.marker) or \
                leader.marker is None and any(dead(d) for d in _dirs_named(leader.argv)):
            leaders.add(pid)  # a live rank: its environment, or its connection file, says so
    keep = _protected(procs)
    return [p for p in procs.values()
            if p.pid not in keep and (p.pid in leaders or p.sid in leaders or p.pgid in leaders)]


def _leader_gone(pid: int, procs: dict[int, Proc]) -> bool:
    """Has the leader of session or group ``pid`` exited, or is it exiting (its memory, and with
    it its environment and command line, freed already)? Another user's live process is not."""
    p = procs.get(pid)
    return not pid_alive(pid) if p is None else p.marker is None and not p.argv


def _dirs_named(argv: list[str]) -> list[str]:
    """Directories of the files a command line names (a rank's names its connection file)."""
    return [os.path.dirname(arg) for arg in argv if os.path.isabs(arg)]


def kill_selected(choose: Callable[[dict[int, Proc]], list[Proc]], timeout: float = 2.0) -> list[Proc]:
    """SIGKILL what ``choose`` picks, again and again until nothing is picked: a process may
    fork between a look and the kill, and its child is picked up by the next look."""
    killed: dict[int, Proc] = {}
    deadline = time.monotonic() + timeout
    while True:
        targets = choose(processes())
        if not targets or time.monotonic() > deadline:
            return list(killed.values())
        for p in targets:
            try:
                os.kill(p.pid, signal.SIGKILL)
                killed.setdefault(p.pid, p)
            except OSError:
                pass
        time.sleep(0.02)  # let the kills land before looking again


def kill_kernel_processes(runtime_dir: str, rank_pids: Iterable[int] | None = None,
                          trust_rank_sessions: bool = True) -> list[Proc]:
    """End every process of the kernel whose runtime dir is ``runtime_dir``: its ranks, their
    sessions and groups (DataLoader workers), and whatever escaped them (``setsid``).

    For the supervisor at shutdown and the reaper when the parent died; the caller knows the
    kernel is ending. ``rank_pids`` defaults to those recorded in the directory.
    """
    target = os.path.normpath(runtime_dir)
    pids = list(rank_pids) if rank_pids is not None else read_pids(runtime_dir)
    return kill_selected(lambda procs: select(procs, lambda d: os.path.normpath(d) == target,
                                              pids, trust_rank_sessions))


def select_rank(procs: dict[int, Proc], runtime_dir: str, rank: int, pid: int | None,
                spare: Iterable[int] = ()) -> list[Proc]:
    """What a dead rank of a live kernel left: the processes that name the kernel's runtime dir
    and the rank (what it started, also those that left its session: ``os.setsid``), the
    members of its session and group (a child with a scrubbed environment), and of sessions and
    groups those hold whose leader is gone. Never the sessions of ``spare`` (the live ranks).
    The rank's own pid counts as a session only while no live process holds it (Linux never
    reuses a pid that is still a session or group id; once none is left, it may be reused)."""
    target = os.path.normpath(runtime_dir)
    named = {p.pid for p in procs.values()
             if p.rank == str(rank) and p.marker is not None and os.path.normpath(p.marker) == target}
    held = {i for q in named for i in (procs[q].sid, procs[q].pgid)}
    leaders = named | {i for i in held if _leader_gone(i, procs)}
    if pid is not None and pid not in procs:
        leaders.add(pid)
    keep = _protected(procs) | set(spare)
    return [p for p in procs.values() if p.pid not in keep and p.sid not in keep and p.pgid not in keep
            and (p.pid in leaders or p.sid in leaders or p.pgid in leaders)]


def kill_rank_processes(runtime_dir: str, rank: int, pid: int | None, spare: Iterable[int] = ()) -> list[Proc]:
    """End what a rank that died left behind while its kernel lives on (:func:`select_rank`),
    as shutdown ends every rank's: called before a rank of that number starts again."""
    spared = list(spare)
    return kill_selected(lambda procs: select_rank(procs, runtime_dir, rank, pid, spared))


# ------------------------------------------------------------------ what node starters started
def start_time(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks since boot, ``/proc/PID/stat`` field 22): with
    the pid it names one process for good, whatever pid is reused later."""
    try:
        return int(_read(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


#: the launch record's format; a file without a version was written before kinds (version 1)
LAUNCH_VERSION = 2


@dataclass(frozen=True)
class LaunchRecord:
    """What one node starter started, as ``launch.json`` keeps it for the reaper and the sweep.

    ``kind``: the ``--launcher`` kind whose starter wrote it (and ends it); ``pids``: its
    processes on this machine, each with its start time (a reused pid is never signalled);
    ``started``: anything else it started (a batch job), opaque here: only the starter of that
    kind reads it. Like a jupyter_client provisioner's ``get_provisioner_info``.
    """

    kind: str
    pids: tuple[tuple[int, int | None], ...] = ()
    started: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, kind: str, pids: Iterable[int], started: dict[str, Any] | None = None) -> LaunchRecord:
        """The record of these live processes (their start times read now)."""
        return cls(kind, tuple((pid, start_time(pid)) for pid in pids), dict(started or {}))

    def to_json(self) -> dict[str, Any]:
        return {"version": LAUNCH_VERSION, "kind": self.kind, "pids": [list(p) for p in self.pids],
                "started": self.started}

    @classmethod
    def from_json(cls, raw: object) -> LaunchRecord | None:
        """A record as written by this version or the one before, or None for anything else.

        Version 1 (no ``version`` key) had no kind: ``{"pids": [...], KIND: {...} or null}``, where
        the one starter that started more than processes kept that under its kind's name. Read
        so, a kernel killed before an upgrade is still cleaned after it; without such a key only
        its processes are recorded (kind "")."""
        if not isinstance(raw, dict):
            return None
        pids: list[tuple[int, int | None]] = []
        for entry in raw.get("pids") or []:
            try:
                pids.append((int(entry[0]), None if entry[1] is None else int(entry[1])))
            except (TypeError, ValueError, IndexError):
                continue
        if "version" not in raw:
            kept = [(k, v) for k, v in raw.items() if k != "pids" and isinstance(v, dict)]
            return cls(kept[0][0], tuple(pids), kept[0][1]) if kept else cls("", tuple(pids))
        kind, started = raw.get("kind"), raw.get("started")
        if not isinstance(kind, str) or not isinstance(started, dict):
            return None
        return cls(kind, tuple(pids), started)

    def write(self, runtime_dir: str) -> None:
        """Write ``launch.json`` in ``runtime_dir``, atomically (the reaper never reads half a file)."""
        path = os.path.join(runtime_dir, LAUNCH_FILE)
        with open(path + ".tmp", "w") as f:
            json.dump(self.to_json(), f)
        os.replace(path + ".tmp", path)


#: ends what a launch record names: its kind's ``NodeStarter.end_recorded``, picked by the launch
#: package (dist_kernel.parent.launch.node_starters.end_launch); returns the processes ended and
#: what else it ended, in words
EndLaunch = Callable[[LaunchRecord], tuple[list[Proc], list[str]]]


def read_launch(runtime_dir: str) -> LaunchRecord | None:
    """The :class:`LaunchRecord` in ``runtime_dir``; None when absent or unreadable."""
    try:
        with open(os.path.join(runtime_dir, LAUNCH_FILE)) as f:
            return LaunchRecord.from_json(json.load(f))
    except (OSError, ValueError):
        return None


def _live(pids: Iterable[tuple[int, int | None]]) -> list[int]:
    """The recorded pids that still are the processes recorded (same start time)."""
    return [pid for pid, started in pids
            if pid > 1 and pid != os.getpid() and start_time(pid) == started and pid_alive(pid)]


def end_processes(pids: Iterable[tuple[int, int | None]], term_wait: float = 2.0) -> list[Proc]:
    """End a starter's recorded processes: SIGTERM first (``ssh`` then closes its session, so
    the node agents read EOF; a batch system's client ends its step), up to ``term_wait``
    seconds, then SIGKILL. A pid is only signalled while its start time is the recorded one.
    Returns the processes ended."""
    live = _live(pids)
    procs = processes() if live else {}
    ended = [procs.get(pid) or Proc(pid, 0, 0, 0, None, []) for pid in live]
    for pid in live:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + term_wait
    while live and time.monotonic() < deadline:
        live = [pid for pid in live if pid_alive(pid)]
        if live:
            time.sleep(0.05)
    for pid in live:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return ended


def sweep(bases: Iterable[str] | None = None, *, end_launch: EndLaunch) -> SweepReport:
    """End the processes of every kernel of this user that has exited, and what their node
    starters started (``end_launch``, by kind), and remove their runtime directories. Safe at
    any time: a live kernel is never touched.

    Run at every kernel start and by ``python -m dist_kernel clean``. Finds leftovers of
    kernels whose directory is gone too, by the variable in their environment.
    """
    stale = stale_runtime_dirs(bases)
    report = SweepReport()
    for d in stale:  # the starters first: theirs must get SIGTERM (not SIGKILL) to end what they started
        record = read_launch(d)
        if record is not None:
            ended, released = end_launch(record)
            report.killed += ended
            report.released += released
    rank_pids = [pid for d in stale for pid in read_pids(d)]
    verdicts: dict[str, bool] = {os.path.normpath(d): True for d in stale}

    def dead(runtime_dir: str) -> bool:
        key = os.path.normpath(runtime_dir)
        if key not in verdicts:
            verdicts[key] = kernel_gone(key)
        return verdicts[key]

    report.killed += kill_selected(lambda procs: select(procs, dead, rank_pids))
    for d in stale:
        shutil.rmtree(d, ignore_errors=True)
        if not os.path.exists(d):
            report.removed.append(d)
    return report
