"""SSH: ``ssh -T HOST <agent argv>`` starts the node agent on each host; node i is ``hosts[i]``,
its node rank passed in the argv.

Extra ssh options come from the environment variable :data:`SSH_OPTS_ENV`
(``DIST_KERNEL_SSH_OPTS``, shell-split, put before the kernel's own defaults, so it overrides
them: ssh takes the first value it sees for each option).
"""

from __future__ import annotations

import os
import shlex
from collections.abc import Mapping, Sequence

from dist_kernel.exceptions import ConfigError
from dist_kernel.options import KernelConfig
from dist_kernel.parent.launch.node_starters.base import NodeStarter, run_quiet
from dist_kernel.parent.launch.node_starters.routes import checked_source

#: extra ssh options for the SSH node starter (shell syntax), e.g. "-i ~/.ssh/cluster -l me -p 2222"
SSH_OPTS_ENV = "DIST_KERNEL_SSH_OPTS"
#: the kernel's own ssh options; the user's (:data:`SSH_OPTS_ENV`) come first and win
SSH_DEFAULT_OPTS = ("-o", "BatchMode=yes", "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=2",
                    "-o", "ConnectTimeout=10")


def ssh_options(environ: Mapping[str, str] | None = None) -> list[str]:
    """The user's ssh options (:data:`SSH_OPTS_ENV`, shell-split) followed by the kernel's."""
    env = os.environ if environ is None else environ
    raw = env.get(SSH_OPTS_ENV, "")
    try:
        user = shlex.split(raw)
    except ValueError as e:
        raise ConfigError(f"{SSH_OPTS_ENV}={raw!r} cannot be parsed ({e}); check its quotes.") from None
    return [*user, *SSH_DEFAULT_OPTS]


def ssh_argv(host: str, agent_argv: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """``ssh`` running the agent on ``host``: no pty (``-T``: stdin carries the keys, a pty would
    echo them), no X11 or agent forwarding; the remote command quoted for the remote shell (ssh
    joins its argv with spaces)."""
    return ["ssh", "-T", "-x", "-a", *ssh_options(environ), "--", host, shlex.join(list(agent_argv))]


def ssh_hostname(host: str, environ: Mapping[str, str] | None = None) -> str:
    """The host name ssh would connect to for ``host`` (``ssh -G``: aliases in ~/.ssh/config
    and the options in :data:`SSH_OPTS_ENV` applied; makes no connection)."""
    out = run_quiet(["ssh", "-G", *ssh_options(environ), "--", host], environ)
    for line in (out or "").splitlines():
        key, _, value = line.partition(" ")
        if key.lower() == "hostname" and value.strip():
            return value.strip()
    return host.rsplit("@", 1)[-1]


class SshNodeStarter(NodeStarter):
    """``ssh -T HOST <agent argv>`` for each host; node i is ``hosts[i]``."""

    kind = "ssh"

    @classmethod
    def listen_address(cls, config: KernelConfig, environ: Mapping[str, str]) -> str:
        """The route to the first host, as ``ssh -G`` resolves it (options.py made sure that
        --hosts names the hosts)."""
        return checked_source("the first host", ssh_hostname(config.hosts[0], environ))

    def hosts(self) -> list[str] | None:
        return list(self.config.hosts)

    def commands(self) -> list[tuple[str, str | None, list[str]]]:
        return [(f"ssh to {host}", host, ssh_argv(host, self.agent_argv(i), self.environ))
                for i, host in enumerate(self.hosts() or [])]


