"""A rank's TCP connections to its peers, cut at a teardown (Linux: ``/proc``): what a dead
peer looks like to gloo, so a collective blocked on this rank itself raises
(:func:`dist_kernel.rank.agent.teardown_group`).
"""

from __future__ import annotations

import os
import socket


def cut_connections(peer_pids: list[int], peer_hosts: list[str] = (),  # type: ignore[assignment]
                    keep_port: int | None = None) -> int:
    """Shut down this process's established TCP connections to the given processes on this
    machine, and to every process on the given other machines (IPv4 addresses; Linux); those
    from or to ``keep_port`` (the rendezvous store) stay."""
    kept = f":{keep_port:04X}" if keep_port else None
    table = _tcp_table()
    peers: set[str] = set()
    for pid in peer_pids:
        peers.update(table[i][0] for i in _socket_inodes(pid) if i in table)
    hosts = {_proc_net_host(h) for h in peer_hosts if h}
    cut = 0
    for inode, fd in _socket_inodes(os.getpid()).items():
        local, remote, state = table.get(inode, ("", "", ""))
        if kept and (local.endswith(kept) or remote.endswith(kept)):
            continue
        if state == "01" and (remote in peers or remote.rsplit(":", 1)[0] in hosts):  # 01: ESTABLISHED
            try:
                with socket.socket(fileno=os.dup(fd)) as sock:
                    sock.shutdown(socket.SHUT_RDWR)
                cut += 1
            except OSError:
                continue
    return cut


def _proc_net_host(address: str) -> str:
    """An IPv4 address as /proc/net/tcp writes it (hex, host byte order: little-endian here)."""
    try:
        return socket.inet_aton(address)[::-1].hex().upper()
    except OSError:
        return address


def _socket_inodes(pid: int) -> dict[int, int]:
    """Socket inode -> file descriptor, for one process."""
    found: dict[int, int] = {}
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return found
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            found[int(link[8:-1])] = int(fd)
    return found


def _tcp_table() -> dict[int, tuple[str, str, str]]:
    """Socket inode -> (local address, remote address, state), from /proc/net/tcp and tcp6."""
    table: dict[int, tuple[str, str, str]] = {}
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/net/{name}") as f:
                next(f)
                for line in f:
                    parts = line.split()
                    table[int(parts[9])] = (parts[1], parts[2], parts[3])
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    return table
