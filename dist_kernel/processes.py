"""Process helpers shared by the parent and the node agent: an exit status or a /proc state in
words, the end of a log file, and a signal to a process's main thread.

Both sides start rank processes (the parent on one machine, each node agent on its node) and
describe them the same way; this module imports nothing of either, so the node agent never
loads the parent's kernel (jupyter_client's manager) to describe a process.
"""

from __future__ import annotations

import signal
import sys


def describe_exit(code: int | None, *, oom_hint: bool = True) -> str:
    """Human words for a process exit status (negative: the signal that ended it).

    ``oom_hint``: add that a SIGKILL is often the out-of-memory killer (true of a rank, not of a node starter's process)."""
    if code is None:
        return "exited"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (often the out-of-memory killer)" if oom_hint and -code == signal.SIGKILL else ""
        return f"was killed by {name}{hint}"
    return f"exited with code {code}"


#: /proc/PID/stat states, in words
_STATES = {"R": "running", "S": "sleeping", "D": "in uninterruptible I/O (D)", "T": "stopped",
           "t": "stopped by a debugger", "Z": "a zombie", "X": "dead"}


def state_words(letter: str) -> str:
    """A /proc state letter in words ("stopped" for ``T``)."""
    return _STATES.get(letter, f"state {letter}" if letter else "state unknown")


def proc_state(pid: int | None) -> str:
    """A process's state letter from /proc (``T`` when stopped); "" when unknown."""
    if pid is None:
        return ""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # the command name (in parentheses) may hold spaces and ")": split after the last one
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def file_tail(path: str, lines: int = 30) -> str:
    """The last lines of a log file ("" when it cannot be read)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


#: the tgkill system call's number, by machine (Python has no os.tgkill)
_TGKILL = {"x86_64": 234, "aarch64": 131}


def signal_main_thread(pid: int, signum: int) -> bool:
    """Send ``signum`` to the main thread of process ``pid`` (Linux ``tgkill``); False where that
    cannot be done.

    A signal sent to a process goes to any of its threads that can take it. While the process is
    stopped (SIGSTOP, a debugger), none can: the signal waits, and on SIGCONT the thread that
    runs first takes it, often not the main thread. Python then only sets a flag, and a main thread
    asleep in C (``time.sleep(40)``) sees it when it wakes by itself: the stop button seemed lost.
    A signal sent to the main thread wakes it."""
    import ctypes
    import platform

    number = _TGKILL.get(platform.machine())
    if number is None or not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.syscall(number, pid, pid, signum) == 0
