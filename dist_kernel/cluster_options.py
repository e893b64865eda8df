"""The options that say how the ranks spread over machines, read and checked (for
:func:`dist_kernel.options.resolve`): the rank counts as (nodes, ranks per node) on this machine
or on several, and the options of ranks on other machines (``--hosts``, ``--slurm-args``,
``--listen``, ``--port-range``). Each error names the option and the fix.
"""

from __future__ import annotations

import ipaddress
import re
import shlex
from dataclasses import dataclass

from dist_kernel.exceptions import FIX_HINT, ConfigError


@dataclass(frozen=True)
class RankCounts:
    """The rank counts as given (None: not given), and ``--nodes`` with its default."""

    ranks: int | None
    per_node: int | None
    nodes: int | None
    nodes_or_default: int


def local_layout(counts: RankCounts, gpus: list[int]) -> tuple[int, int]:
    """(nodes, ranks per node) for ranks on this machine: one node, whose ranks are the world."""
    if counts.nodes is not None and counts.nodes != 1:
        raise ConfigError(
            f"--nodes {counts.nodes} needs ranks on other machines; use --launcher slurm or ssh "
            f"(the local launcher runs every rank on this machine). {FIX_HINT}")
    if counts.per_node is not None and counts.ranks is not None and counts.per_node != counts.ranks:
        raise ConfigError(
            f"--ranks-per-node {counts.per_node} differs from --ranks {counts.ranks}; with the local "
            f"launcher there is one node, so give only --ranks. {FIX_HINT}")
    return 1, counts.ranks or counts.per_node or (len(gpus) if gpus else 2)


def remote_layout(counts: RankCounts, launcher: str, hosts: tuple[str, ...],
                   gpus: list[int]) -> tuple[int, int]:
    """(nodes, ranks per node) for ranks on other machines: ssh has one node per host."""
    if launcher == "ssh":
        if counts.nodes is not None and counts.nodes != len(hosts):
            raise ConfigError(
                f"--nodes {counts.nodes} does not match the {len(hosts)} host(s) in --hosts "
                f"({','.join(hosts)}); with --launcher ssh each host is one node, so drop --nodes "
                f"or list {counts.nodes} hosts. {FIX_HINT}")
        nodes = len(hosts)
    else:
        nodes = counts.nodes_or_default
    if counts.per_node is not None:
        if counts.ranks is not None and counts.ranks != nodes * counts.per_node:
            raise ConfigError(
                f"--ranks {counts.ranks} is not --nodes {nodes} x --ranks-per-node {counts.per_node} "
                f"= {nodes * counts.per_node}; give only --nodes and --ranks-per-node. {FIX_HINT}")
        return nodes, counts.per_node
    if counts.ranks is not None:
        if counts.ranks % nodes:
            raise ConfigError(
                f"--ranks {counts.ranks} cannot be split evenly over {nodes} nodes; give "
                f"--ranks-per-node instead (ranks = nodes x ranks per node). {FIX_HINT}")
        return nodes, counts.ranks // nodes
    return nodes, len(gpus) if gpus else 1

_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62})(?:\.[A-Za-z0-9_][A-Za-z0-9_-]{0,62})*\.?$")


def hosts(raw: str | None, launcher: str) -> tuple[str, ...]:
    """``--hosts``: the machines of ``--launcher ssh``, node 0 first (required there, refused elsewhere)."""
    if raw in (None, ""):
        if launcher == "ssh":
            raise ConfigError(
                f"--launcher ssh needs --hosts: the machines to start the ranks on, node 0 first "
                f"(e.g. --hosts node1,node2). {FIX_HINT}")
        return ()
    text = str(raw).strip()
    if launcher != "ssh":
        slurm_note = "; Slurm picks the nodes: choose them with --slurm-args '--nodelist ...'" if launcher == "slurm" else ""
        raise ConfigError(
            f"--hosts {text} is for --launcher ssh (this kernel's launcher is {launcher}{slurm_note}); "
            f"add --launcher ssh or drop --hosts. {FIX_HINT}")
    hosts = [h.strip() for h in text.split(",")]
    if any(not h for h in hosts):
        raise ConfigError(f"--hosts {text!r} has an empty host name; write host names separated by commas. {FIX_HINT}")
    bad = [h for h in hosts if h.startswith("-") or any(c.isspace() for c in h)]
    if bad:
        raise ConfigError(f"--hosts: {bad[0]!r} is not a host name (ssh would read it as an option). {FIX_HINT}")
    twice = sorted({h for h in hosts if hosts.count(h) > 1})
    if twice:
        raise ConfigError(
            f"--hosts names {', '.join(twice)} twice; each host is one node, so list it once and use "
            f"--ranks-per-node for more ranks on it. {FIX_HINT}")
    return tuple(hosts)


#: Slurm job-step options the kernel sets itself (long names; a prefix match catches --ntasks-per-gpu etc.)
_SLURM_OWN_LONG = ("--nodes", "--ntasks", "--input", "--output", "--error", "--jobid")
_SLURM_OWN_SHORT = ("-N", "-n", "-i", "-o", "-e")


def slurm_args(raw: str | None, launcher: str) -> tuple[str, ...]:
    """``--slurm-args``: the job step's own arguments (``--launcher slurm``), less those the kernel sets."""
    if raw in (None, ""):
        return ()
    text = str(raw)
    if launcher != "slurm":
        raise ConfigError(
            f"--slurm-args is for --launcher slurm (this kernel's launcher is {launcher}); "
            f"add --launcher slurm or drop --slurm-args. {FIX_HINT}")
    try:
        args = tuple(shlex.split(text))
    except ValueError as e:
        raise ConfigError(f"--slurm-args {text!r} cannot be parsed ({e}); check its quotes. {FIX_HINT}") from None
    for arg in args:
        name = arg.split("=", 1)[0]
        if arg.startswith("--"):
            own = next((o for o in _SLURM_OWN_LONG if name == o or (o == "--ntasks" and name.startswith(o))), None)
        elif arg.startswith("-") and len(arg) >= 2:
            own = next((o for o in _SLURM_OWN_SHORT if arg[:2] == o), None)
        else:
            own = None
        if own is None:
            continue
        if own in ("--nodes", "-N", "--ntasks", "-n"):
            fix = "use the kernel's --nodes and --ranks-per-node instead"
        else:
            fix = "remove it (the kernel reads and writes the node agents' streams and job itself)"
        raise ConfigError(
            f"--slurm-args contains {arg!r}, which the kernel sets itself; {fix}. {FIX_HINT}")
    return args


_LOOPBACK_NAMES = ("localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback")


def listen(raw: str | None, remote: bool) -> str | None:
    """``--listen``: the parent's address as the nodes reach it (an IP address or host name, never loopback)."""
    if raw in (None, ""):
        return None
    text = str(raw).strip()
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address | None
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        ip = None
    if ip is None:
        if text.startswith("[") or re.fullmatch(r"[^:]+:\d+", text) or "/" in text:
            raise ConfigError(
                f"--listen {text!r} must be an IP address or host name without port, brackets or "
                f"scheme (e.g. --listen 10.0.0.5); choose the ports with --port-range. {FIX_HINT}")
        if not _HOSTNAME.match(text):
            raise ConfigError(
                f"--listen {text!r} is neither an IP address nor a host name (e.g. --listen 10.0.0.5). {FIX_HINT}")
    if not remote:
        return text  # allowed, unused: the local ranks talk over IPC
    name = text.lower().rstrip(".")
    if (ip is not None and ip.is_loopback) or name in _LOOPBACK_NAMES or name.endswith(".localhost"):
        raise ConfigError(
            f"--listen {text} is a loopback address: the nodes cannot reach this machine's loopback "
            f"(the classic listener bound to localhost). Give this machine's address on the cluster "
            f"network (e.g. from `ip -brief addr`), or leave --listen out to use the address of the "
            f"route to the nodes. {FIX_HINT}")
    if ip is not None and ip.is_unspecified:
        raise ConfigError(
            f"--listen {text} is not an address the nodes can connect to; give this machine's address "
            f"on the cluster network, or leave --listen out. {FIX_HINT}")
    return text


def port_range(raw: str | None, remote: bool) -> tuple[int, int] | None:
    """``--port-range A-B``: the ports the parent and rank 0 listen on (at least 3 for ranks elsewhere)."""
    if raw in (None, ""):
        return None
    text = str(raw).strip()
    m = re.fullmatch(r"(\d+)\s*-\s*(\d+)", text)
    if not m:
        raise ConfigError(f"--port-range {text!r} must be two port numbers A-B, e.g. 29500-29509. {FIX_HINT}")
    lo, hi = int(m.group(1)), int(m.group(2))
    if not 1024 <= lo <= hi <= 65535:
        raise ConfigError(
            f"--port-range {text}: the ports must satisfy 1024 <= A <= B <= 65535 "
            f"(e.g. 29500-29509). {FIX_HINT}")
    if remote and hi - lo + 1 < 3:
        raise ConfigError(
            f"--port-range {text} has {hi - lo + 1} port{'s' if hi > lo else ''}; slurm/ssh need at least 3 (the "
            f"parent's listener, rank 0's rendezvous, and MASTER_PORT for a group initialised by hand), "
            f"e.g. --port-range {min(lo, 65526)}-{min(lo, 65526) + 9}. {FIX_HINT}")
    return (lo, hi)
