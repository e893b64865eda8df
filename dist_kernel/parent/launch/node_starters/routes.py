"""The parent's address as the nodes see it: this machine's address on its route to them.

Each node starter picks the host to find the route to (:meth:`NodeStarter.listen_address
<dist_kernel.parent.launch.node_starters.base.NodeStarter.listen_address>`); this module finds
the route and rejects one the nodes cannot use (loopback).
"""

from __future__ import annotations

import ipaddress
import socket

from dist_kernel.exceptions import ConfigError


def route_source(host: str) -> str:
    """This machine's address on the route to ``host`` (a UDP connect() sends no packet)."""
    error: OSError | None = None
    for family, _, _, _, addr in socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM):
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            try:
                s.connect(addr)
                return s.getsockname()[0].split("%", 1)[0]
            except OSError as e:
                error = e
    raise error or OSError(f"no address for {host}")


def this_host_names() -> set[str]:
    """This machine's names, short and lower case."""
    names = {socket.gethostname(), socket.getfqdn()}
    return {n.split(".", 1)[0].lower() for n in names if n}


def _listen_error(what: str, host: str, problem: str) -> ConfigError:
    return ConfigError(
        f"Cannot tell this machine's address on the cluster network: the route to {what} {host} "
        f"{problem}. Fix: pass --listen ADDR, an address of this machine that the nodes can reach "
        f"(see `ip -brief addr`), then restart the kernel.")


def checked_source(what: str, host: str) -> str:
    """The route to ``host`` (``what`` names it in the error): ConfigError if unknown or loopback."""
    try:
        source = route_source(host)
    except OSError as e:
        raise _listen_error(what, host, f"could not be found ({e.strerror or e})") from None
    if ipaddress.ip_address(source).is_loopback:
        raise _listen_error(what, host, f"is the loopback interface ({source}), which the nodes cannot reach")
    return source
