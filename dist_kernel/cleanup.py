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

A kernel whose ranks run on other machines (``--launcher slurm|ssh``, see parent/launch/node_starters/)
also records its starter processes (``srun``, ``ssh``) and its Slurm job in ``launch.json``
(:data:`LAUNCH_FILE`): :func:`end_launch` ends those (SIGTERM first, so that ``srun`` cancels
its step) and cancels the job; the reaper and the sweep call it for a kernel that is gone.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

ENV_VAR = "DIST_KERNEL_RUNTIME_DIR"
#: the rank a process belongs to (placement.rank_env sets it in each rank; what it starts inherits it)
RANK_VAR = "DIST_KERNEL_RANK"
_MARKER = ENV_VAR.encode() + b"="
_RANK = RANK_VAR.encode() + b"="
RUNTIME_PREFIX = "dist_kernel-"
PIDS_FILE = "ranks.pids"
#: the starter processes (srun, ssh) and Slurm job of a multi-node kernel (see :func:`end_launch`)
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
    #: Slurm jobs and steps cancelled (``scancel`` arguments, one string per call)
    cancelled: list[str] = field(default_factory=list)


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


# ------------------------------------------------------------------ launchers (srun, ssh)
def start_time(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks since boot, ``/proc/PID/stat`` field 22): with
    the pid it names one process for good, whatever pid is reused later."""
    try:
        return int(_read(f"/proc/{pid}/stat").rsplit(b")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def read_launch(runtime_dir: str) -> dict | None:
    """What ``launch.json`` in ``runtime_dir`` records (see reaper.write_launch); None when absent."""
    try:
        with open(os.path.join(runtime_dir, LAUNCH_FILE)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _launch_pids(record: dict) -> list[int]:
    """The recorded launcher pids that still are the processes recorded (same start time)."""
    out = []
    for entry in record.get("pids") or []:
        try:
            pid, started = int(entry[0]), entry[1]
        except (TypeError, ValueError, IndexError):
            continue
        if pid > 1 and pid != os.getpid() and start_time(pid) == started and pid_alive(pid):
            out.append(pid)
    return out


def _slurm_run(argv: list[str], slurm_conf: str | None, timeout: float = 5.0) -> subprocess.CompletedProcess | None:
    env = dict(os.environ)
    if slurm_conf:
        env["SLURM_CONF"] = slurm_conf
    try:
        return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout, env=env)
    except (OSError, subprocess.SubprocessError):
        return None


def cancel_slurm(slurm: dict) -> list[str]:
    """Cancel what a launcher's Slurm record names; returns the ``scancel`` calls made.

    The kernel's own job (``own_job``): ``scancel --user U --name NAME [JOB]``, filters that
    Slurm ANDs, so only a job of this user with the kernel's unique name is ever cancelled
    (also one whose id was never learnt). Inside the user's allocation only the steps of that
    job with the kernel's name are cancelled, never the allocation.
    """
    name, job = slurm.get("name"), slurm.get("job")
    user = slurm.get("user") or user_name()
    conf = slurm.get("slurm_conf")
    if not name:
        return []
    calls: list[list[str]] = []
    if slurm.get("own_job"):
        calls.append(["scancel", f"--user={user}", f"--name={name}", *([str(job)] if job else [])])
    elif job:
        listed = _slurm_run(["squeue", "-h", "-s", "-j", str(job), "-o", "%i %j"], conf)
        for line in (listed.stdout.splitlines() if listed and listed.returncode == 0 else []):
            parts = line.split(None, 1)
            if len(parts) == 2 and parts[1].strip() == name and parts[0].startswith(f"{job}."):
                calls.append(["scancel", parts[0]])
    for argv in calls:
        _slurm_run(argv, conf)
    return [" ".join(argv[1:]) for argv in calls]


def user_name() -> str:
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def end_launch(record: dict | None, term_wait: float = 2.0) -> tuple[list[Proc], list[str]]:
    """End a launcher's processes and cancel its Slurm job or steps, from its ``launch.json``.

    SIGTERM first (``srun`` then cancels its step, ``ssh`` closes the session so the node
    agents read EOF), up to ``term_wait`` seconds, then SIGKILL; then ``scancel``. A recorded
    pid is only signalled while its start time is the recorded one. Returns the processes
    ended and the ``scancel`` calls made.
    """
    if not record:
        return [], []
    pids = _launch_pids(record)
    procs = processes() if pids else {}
    ended = [procs.get(pid) or Proc(pid, 0, 0, 0, None, []) for pid in pids]
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.monotonic() + term_wait
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if pid_alive(pid)]
        if pids:
            time.sleep(0.05)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    slurm = record.get("slurm")
    cancelled = cancel_slurm(slurm) if isinstance(slurm, dict) else []
    return ended, cancelled


def sweep(bases: Iterable[str] | None = None) -> SweepReport:
    """End the processes of every kernel of this user that has exited, and remove their
    runtime directories. Safe at any time: a live kernel is never touched.

    Run at every kernel start and by ``python -m dist_kernel clean``. Finds leftovers of
    kernels whose directory is gone too, by the variable in their environment.
    """
    stale = stale_runtime_dirs(bases)
    report = SweepReport()
    for d in stale:  # the launchers first: srun must see SIGTERM (not SIGKILL) to cancel its step
        ended, cancelled = end_launch(read_launch(d))
        report.killed += ended
        report.cancelled += cancelled
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
