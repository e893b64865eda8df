"""What the parent process may open for its local ranks: file descriptors and ZMQ sockets.

Each local rank costs the parent about :data:`FDS_PER_LOCAL_RANK` file descriptors (its four
ZMQ sockets with their IPC connections and mailboxes, jupyter_client's control socket, its log
file, its pidfd) and one socket of jupyter_client's shared ZMQ context, which ZMQ caps at 1,023
sockets. Many ranks on one machine would otherwise fail half-way through their start with
"Too many open files". Before any rank starts, :func:`make_room` raises the soft limit on open
files as far as needed (up to the hard limit, as ``ulimit -n`` would), or refuses the rank count
with a :class:`~dist_kernel.exceptions.ConfigError` that names the limit and the fix.
"""

from __future__ import annotations

import resource

from dist_kernel.exceptions import ConfigError
from dist_kernel.launchers import KINDS

#: descriptors the parent holds per local rank: 86 at 2 ranks, 118 at 4 (measured, Linux)
FDS_PER_LOCAL_RANK = 16
#: descriptors the parent holds with no rank: its own Jupyter sockets, the reaper, libraries
FDS_BASE = 128
#: sockets of jupyter_client's shared context per rank (the kernel manager's control socket)
SHARED_SOCKETS_PER_RANK = 1
#: sockets the parent's own kernel and its client library keep in that context besides
SHARED_SOCKETS_BASE = 32
#: the --launcher kinds that put ranks on other machines, for the fix in the error
_REMOTE_KINDS = "/".join(k.name for k in KINDS if k.remote and not k.for_tests)


def fds_needed(local_ranks: int) -> int:
    return FDS_BASE + FDS_PER_LOCAL_RANK * local_ranks


def most_local_ranks(fd_limit: int, zmq_sockets: int) -> int:
    """The most local ranks a parent with these limits can hold (0 when none)."""
    by_fds = (fd_limit - FDS_BASE) // FDS_PER_LOCAL_RANK
    by_sockets = (zmq_sockets - SHARED_SOCKETS_BASE) // SHARED_SOCKETS_PER_RANK
    return max(0, min(by_fds, by_sockets))


def plan(local_ranks: int, soft: int, hard: int, zmq_sockets: int) -> int:
    """The soft limit on open files to set for ``local_ranks`` (``soft`` when it suffices).

    Raises :class:`ConfigError` naming the limit when even ``hard`` (or ZMQ's ``zmq_sockets``)
    cannot hold them. ``hard`` is ``resource.RLIM_INFINITY`` when unlimited.
    """
    need = fds_needed(local_ranks)
    unlimited = soft == resource.RLIM_INFINITY
    ceiling = need if unlimited or hard == resource.RLIM_INFINITY else hard
    most = most_local_ranks(ceiling, zmq_sockets)
    if local_ranks > most:
        if need > ceiling:
            why = (f"about {need} open files in the kernel process, but its hard limit is {hard} "
                   "(`ulimit -Hn`)")
            fix = ("raise the hard limit where the kernel is started (`ulimit -Hn`, `LimitNOFILE=` of a "
                   "systemd unit, /etc/security/limits.conf), or use")
        else:
            why = (f"{local_ranks * SHARED_SOCKETS_PER_RANK + SHARED_SOCKETS_BASE} ZMQ sockets in "
                   f"jupyter_client's context, whose limit is {zmq_sockets}")
            fix = "use"
        raise ConfigError(f"--ranks {local_ranks} on this machine needs {why}. Fix: {fix} at most "
                          f"{most} ranks on this machine, or spread them over several (--launcher {_REMOTE_KINDS}).")
    return soft if unlimited else max(soft, need)


def make_room(local_ranks: int) -> None:
    """Raise this process's soft limit on open files for ``local_ranks`` ranks, or refuse them."""
    import zmq

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = plan(local_ranks, soft, hard, zmq.Context.instance().get(zmq.MAX_SOCKETS))
    if want > soft:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
