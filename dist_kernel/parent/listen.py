"""The parent's address as the nodes see it (``--listen``, or found on the route to them)."""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping

from dist_kernel.exceptions import ConfigError
from dist_kernel.options import KernelConfig
from dist_kernel.parent.slurm import expand_hostlist, slurm_node_address, slurmctld_host
from dist_kernel.parent.ssh import ssh_hostname


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


def _this_host_names() -> set[str]:
    names = {socket.gethostname(), socket.getfqdn()}
    return {n.split(".", 1)[0].lower() for n in names if n}


def _listen_error(what: str, host: str, problem: str) -> ConfigError:
    return ConfigError(
        f"Cannot tell this machine's address on the cluster network: the route to {what} {host} "
        f"{problem}. Fix: pass --listen ADDR, an address of this machine that the nodes can reach "
        f"(see `ip -brief addr`), then restart the kernel.")


def _checked_source(what: str, host: str) -> str:
    try:
        source = route_source(host)
    except OSError as e:
        raise _listen_error(what, host, f"could not be found ({e.strerror or e})") from None
    if ipaddress.ip_address(source).is_loopback:
        raise _listen_error(what, host, f"is the loopback interface ({source}), which the nodes cannot reach")
    return source


def default_listen(config: KernelConfig, environ: Mapping[str, str] | None = None) -> str:
    """The parent's address as the nodes should see it: ``--listen`` if given, else this
    machine's address on its route to the nodes.

    ssh: the route to the first host (as ``ssh -G`` resolves it). Slurm inside an allocation:
    the route to the first allocated node that is not this machine (its ``NodeAddr``); outside
    one (or when every node is this machine): the route to the Slurm controller. Raises
    ConfigError naming the host when the route is unknown or is loopback.
    """
    if config.listen:
        return config.listen
    env = os.environ if environ is None else environ
    if config.launcher == "ssh":  # options.py made sure that --hosts names the hosts
        return _checked_source("the first host", ssh_hostname(config.hosts[0], env))
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if env.get("SLURM_JOB_ID") and nodelist:
        here = _this_host_names() | {env.get("SLURMD_NODENAME", "").split(".", 1)[0].lower()} - {""}
        nodes = expand_hostlist(nodelist, env)
        others = [n for n in nodes if n.split(".", 1)[0].lower() not in here]
        if others:
            return _checked_source("the allocated node", slurm_node_address(others[0], env))
        if nodes:  # the whole allocation is this machine: the controller's route, else loopback works
            ctl = slurmctld_host(env)
            try:
                return _checked_source("the Slurm controller", ctl) if ctl else "127.0.0.1"
            except ConfigError:
                return "127.0.0.1"
    ctl = slurmctld_host(env)
    if not ctl:
        raise ConfigError(
            "Cannot tell this machine's address on the cluster network: `scontrol show config` did not "
            "name the Slurm controller (is Slurm installed here and SLURM_CONF right?). Fix: pass "
            "--listen ADDR, an address of this machine that the nodes can reach, then restart the kernel.")
    return _checked_source("the Slurm controller", ctl)


