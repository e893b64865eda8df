"""Kernel configuration: one source of truth.

Options come from the kernel's argv (written into kernel.json by ``python -m dist_kernel
install``). Each option may be overridden by one environment variable, ``DIST_KERNEL_`` + its
name in capitals. :data:`OPTIONS` is the only place options are defined; the README's
Configuration table documents it.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field

from dist_kernel.exceptions import ConfigError

BACKENDS = ("gloo", "nccl")
#: where the ranks run: this machine, nodes started by Slurm's srun, or hosts reached by ssh
LAUNCHERS = ("local", "slurm", "ssh")

#: each option's default, written once: the help text, :class:`KernelConfig` and
#: :func:`resolve` read it from here (None: decided from the machine, see the help text)
DEFAULTS: dict[str, object] = {
    "ranks": None, "gpus": None, "backend": None, "timeout": 1800.0, "startup_timeout": 120.0,
    "merge_window_ms": 100.0, "fastai": True, "seed": None, "hang_grace": 10.0, "empty_cache": True,
    "rich_output": "all", "launcher": "local", "nodes": 1, "ranks_per_node": None, "hosts": None,
    "slurm_args": None, "listen": None, "port_range": None, "hf": True,
}


def _default(name: str) -> str:
    value = DEFAULTS[name]
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


#: option name (``--name-with-dashes``) -> help text
OPTIONS: dict[str, str] = {
    "ranks": "number of ranks (default: one per GPU, else 2; with slurm/ssh: nodes x ranks per node)",
    "gpus": "comma list of physical GPU ids, rank i on the i-th (slurm/ssh: ids on each node, local rank i on the i-th)",
    "backend": "gloo or nccl (default: nccl when GPUs are used)",
    "timeout": f"collective timeout in seconds (default {_default('timeout')})",
    "startup_timeout": f"seconds for ranks to start and form the group (default {_default('startup_timeout')})",
    "merge_window_ms": f"ms to wait for identical output from other ranks (default {_default('merge_window_ms')})",
    "fastai": f"on|off: fastai integration inside the ranks (default {_default('fastai')})",
    "seed": "random seed shared by every rank (default: random)",
    "hang_grace": f"seconds a rank may wait in a collective the others never entered (default {_default('hang_grace')})",
    "empty_cache": f"on|off: gc + torch.cuda.empty_cache() after each cell (default {_default('empty_cache')})",
    "rich_output": f"all|rank0: rich output from every rank (merged) or from rank 0 only (default {_default('rich_output')})",
    "launcher": f"local|slurm|ssh: where the ranks run: this machine, nodes started by srun, "
                f"or hosts reached by ssh (default {_default('launcher')})",
    "nodes": "number of machines (slurm/ssh; default: 1 for slurm, the number of --hosts for ssh)",
    "ranks_per_node": "ranks on each node (slurm/ssh; default: the number of --gpus, else 1)",
    "hosts": "comma list of hosts to start the ranks on, node 0 first (ssh only)",
    "slurm_args": "extra srun/salloc arguments, e.g. \"--partition gpu --time 2:00:00\" (slurm only)",
    "listen": "the parent's address as the nodes see it, no port (slurm/ssh; default: this "
              "machine's address on its route to the nodes)",
    "port_range": "A-B: ports to listen on and for rank 0's rendezvous (slurm/ssh; default: random free ports)",
    "hf": f"on|off: Hugging Face integration inside the ranks: accelerate's notebook_launcher and print, "
          f"Transformers' Trainer output (default {_default('hf')})",
}

#: option name -> environment variable that overrides it
ENV_OVERRIDES: dict[str, str] = {name: "DIST_KERNEL_" + name.upper() for name in OPTIONS}

OUTPUT_POLICIES = ("all", "rank0")

FIX_HINT = (
    "Fix the option in the kernelspec (reinstall with `python -m dist_kernel install ...`) "
    "or unset the environment override, then restart the kernel."
)


@dataclass(frozen=True)
class KernelConfig:
    """Validated settings for one distributed kernel."""

    world_size: int
    backend: str
    gpus: tuple[int, ...] = ()  # physical GPU ids; empty on CPU
    timeout: float = DEFAULTS["timeout"]  # type: ignore[assignment]
    startup_timeout: float = DEFAULTS["startup_timeout"]  # type: ignore[assignment]
    merge_window: float = DEFAULTS["merge_window_ms"] / 1000  # type: ignore[operator]
    fastai: bool = DEFAULTS["fastai"]  # type: ignore[assignment]
    seed: int | None = None  # None: the parent draws one per start, shared by every rank
    hang_grace: float = DEFAULTS["hang_grace"]  # type: ignore[assignment]
    empty_cache: bool = DEFAULTS["empty_cache"]  # type: ignore[assignment]
    rich_output: str = DEFAULTS["rich_output"]  # type: ignore[assignment]
    launcher: str = DEFAULTS["launcher"]  # type: ignore[assignment]
    nodes: int = DEFAULTS["nodes"]  # type: ignore[assignment]
    #: ranks on each node; 0 when constructed means "all of them" (world_size, local)
    ranks_per_node: int = 0
    hosts: tuple[str, ...] = ()  # ssh: node i is hosts[i]
    slurm_args: tuple[str, ...] = ()  # extra srun/salloc arguments, already split
    listen: str | None = None  # the parent's address as the nodes see it; None: decided at start
    port_range: tuple[int, int] | None = None  # inclusive; None: random free ports
    hf: bool = DEFAULTS["hf"]  # type: ignore[assignment]
    warnings: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not self.ranks_per_node:
            object.__setattr__(self, "ranks_per_node", self.world_size // max(self.nodes, 1))

    @property
    def uses_cuda(self) -> bool:
        return bool(self.gpus)

    @property
    def remote(self) -> bool:
        """The ranks run on other machines (``--launcher slurm`` or ``ssh``)."""
        return self.launcher != "local"

    def node_of(self, rank: int) -> int:
        """The node a rank runs on (ranks are numbered node-major)."""
        return rank // self.ranks_per_node

    def local_rank_of(self, rank: int) -> int:
        """A rank's index among the ranks of its node (``LOCAL_RANK``)."""
        return rank % self.ranks_per_node

    def device_for(self, rank: int) -> str:
        """Device string a rank will use, as seen inside the rank (CUDA ids are remapped)."""
        if not self.gpus:
            return "cpu"
        return f"cuda:{self.local_rank_of(rank) % len(self.gpus)}"

    def describe(self) -> str:
        if not self.remote:
            devices = ", ".join(f"physical GPU {g}" for g in self.gpus) if self.gpus else "CPU"
            return f"{self.world_size} ranks, backend {self.backend}, devices: {devices}"
        devices = f"GPU {','.join(map(str, self.gpus))} on each node" if self.gpus else "CPU"
        where = f" ({', '.join(self.hosts)})" if self.hosts else ""
        return (f"{self.world_size} ranks on {self.nodes} node{'s' if self.nodes != 1 else ''}{where} "
                f"({self.launcher}, {self.ranks_per_node} per node), backend {self.backend}, devices: {devices}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the kernel options to a parser (shared by `kernel`, `install` and `run`)."""
    for name, text in OPTIONS.items():
        parser.add_argument("--" + name.replace("_", "-"), dest=name, default=None, help=text)


def option_argv(ns: argparse.Namespace) -> list[str]:
    """The flags of `ns` that were given, as argv (to write them into kernel.json)."""
    argv: list[str] = []
    for name in OPTIONS:
        value = getattr(ns, name, None)
        if value is None:
            continue
        flag, text = "--" + name.replace("_", "-"), str(value)
        # a value that starts with "-" (--slurm-args "--exclusive") would be read as a flag
        argv += [f"{flag}={text}"] if text.startswith("-") else [flag, text]
    return argv


def visible_gpus(environ: dict[str, str] | None = None) -> list[int]:
    """GPU ids this process may use, found without importing torch (the parent stays light).

    Honours CUDA_VISIBLE_DEVICES; otherwise asks ``nvidia-smi -L``.
    """
    env = os.environ if environ is None else environ
    mask = env.get("CUDA_VISIBLE_DEVICES")
    if mask is not None:
        ids = [p.strip() for p in mask.split(",") if p.strip()]
        if not ids or ids[0].startswith("-"):
            return []
        return list(range(len(ids)))
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [i for i, line in enumerate(x for x in out.splitlines() if x.startswith("GPU "))]


def _int(name: str, raw: str, minimum: int) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"--{name.replace('_', '-')} {raw!r} is not a whole number. {FIX_HINT}") from None
    if value < minimum:
        raise ConfigError(f"--{name.replace('_', '-')} {value} must be at least {minimum}. {FIX_HINT}")
    return value


def _float(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise ConfigError(f"--{name.replace('_', '-')} {raw!r} is not a number. {FIX_HINT}") from None
    if value <= 0:
        raise ConfigError(f"--{name.replace('_', '-')} {value} must be positive. {FIX_HINT}")
    return value


def resolve(ns: argparse.Namespace, environ: dict[str, str] | None = None,
            available_gpus: list[int] | None = None) -> KernelConfig:
    """Turn flags (+ environment overrides) into a validated :class:`KernelConfig`.

    Raises :class:`ConfigError` with a message naming the option and the fix.
    """
    env = os.environ if environ is None else environ
    raw: dict[str, str | None] = {}
    for name, var in ENV_OVERRIDES.items():
        raw[name] = env.get(var) or getattr(ns, name, None)

    warnings: list[str] = []

    launcher = str(raw["launcher"] or KernelConfig.launcher).strip().lower()
    if launcher not in LAUNCHERS:
        raise ConfigError(f"--launcher {raw['launcher']!r} is unknown; use one of {', '.join(LAUNCHERS)}. {FIX_HINT}")
    remote = launcher != "local"
    hosts = _hosts(raw["hosts"], launcher)
    slurm_args = _slurm_args(raw["slurm_args"], launcher)
    listen = _listen(raw["listen"], remote)
    port_range = _port_range(raw["port_range"], remote)

    if remote:
        gpus = _remote_gpus(raw["gpus"])
    else:
        gpus = _local_gpus(raw["gpus"], visible_gpus(env) if available_gpus is None else available_gpus)

    backend = (raw["backend"] or ("nccl" if gpus else "gloo")).lower()
    if backend not in BACKENDS:
        raise ConfigError(f"--backend {raw['backend']!r} is unknown; use one of {', '.join(BACKENDS)}. {FIX_HINT}")
    if backend == "nccl" and not gpus:
        if remote:
            raise ConfigError(
                f"--backend nccl needs GPUs: with --launcher {launcher}, name the GPU ids on each node "
                f"with --gpus (e.g. --gpus 0,1,2,3), or use --backend gloo. {FIX_HINT}")
        raise ConfigError(f"--backend nccl needs GPUs, and none is visible; use --backend gloo. {FIX_HINT}")

    given_ranks = _int("ranks", str(raw["ranks"]), 1) if raw["ranks"] is not None else None
    given_per_node = (_int("ranks_per_node", str(raw["ranks_per_node"]), 1)
                      if raw["ranks_per_node"] not in (None, "") else None)
    given_nodes = _int("nodes", str(raw["nodes"]), 1) if raw["nodes"] not in (None, "") else None

    if not remote:
        if given_nodes is not None and given_nodes != 1:
            raise ConfigError(
                f"--nodes {given_nodes} needs ranks on other machines; use --launcher slurm or ssh "
                f"(the local launcher runs every rank on this machine). {FIX_HINT}")
        if given_per_node is not None and given_ranks is not None and given_per_node != given_ranks:
            raise ConfigError(
                f"--ranks-per-node {given_per_node} differs from --ranks {given_ranks}; with the local "
                f"launcher there is one node, so give only --ranks. {FIX_HINT}")
        nodes = 1
        world = given_ranks or given_per_node or (len(gpus) if gpus else 2)
        per_node = world
        if backend == "nccl" and world > len(gpus):
            raise ConfigError(
                f"--ranks {world} with nccl needs {world} GPUs but only {len(gpus)} are selected "
                f"(NCCL cannot put two ranks on one GPU); use fewer ranks or --backend gloo. {FIX_HINT}")
    else:
        if launcher == "ssh":
            if given_nodes is not None and given_nodes != len(hosts):
                raise ConfigError(
                    f"--nodes {given_nodes} does not match the {len(hosts)} host(s) in --hosts "
                    f"({','.join(hosts)}); with --launcher ssh each host is one node, so drop --nodes "
                    f"or list {given_nodes} hosts. {FIX_HINT}")
            nodes = len(hosts)
        else:
            nodes = given_nodes if given_nodes is not None else KernelConfig.nodes
        if given_per_node is not None:
            per_node = given_per_node
            if given_ranks is not None and given_ranks != nodes * per_node:
                raise ConfigError(
                    f"--ranks {given_ranks} is not --nodes {nodes} x --ranks-per-node {per_node} "
                    f"= {nodes * per_node}; give only --nodes and --ranks-per-node. {FIX_HINT}")
        elif given_ranks is not None:
            if given_ranks % nodes:
                raise ConfigError(
                    f"--ranks {given_ranks} cannot be split evenly over {nodes} nodes; give "
                    f"--ranks-per-node instead (ranks = nodes x ranks per node). {FIX_HINT}")
            per_node = given_ranks // nodes
        else:
            per_node = len(gpus) if gpus else 1
        world = nodes * per_node
        if backend == "nccl" and per_node > len(gpus):
            raise ConfigError(
                f"--ranks-per-node {per_node} with nccl needs {per_node} GPUs on each node but only "
                f"{len(gpus)} are selected with --gpus (NCCL cannot put two ranks on one GPU); use fewer "
                f"ranks per node, more --gpus or --backend gloo. {FIX_HINT}")

    if gpus and per_node < len(gpus):
        gpus = gpus[:per_node]
    if gpus and per_node > len(gpus):
        where = " on each node" if remote else ""
        warnings.append(f"{per_node} ranks share {len(gpus)} GPU(s){where} over gloo.")

    timeout = _float("timeout", raw["timeout"]) if raw["timeout"] else KernelConfig.timeout
    startup = _float("startup_timeout", raw["startup_timeout"]) if raw["startup_timeout"] else KernelConfig.startup_timeout
    window = _float("merge_window_ms", raw["merge_window_ms"]) / 1000 if raw["merge_window_ms"] else KernelConfig.merge_window
    seed = _int("seed", str(raw["seed"]), 0) if raw["seed"] not in (None, "") else None
    grace = _float("hang_grace", raw["hang_grace"]) if raw["hang_grace"] else KernelConfig.hang_grace
    output = str(raw["rich_output"] or KernelConfig.rich_output).lower()
    if output not in OUTPUT_POLICIES:
        raise ConfigError(f"--rich-output {raw['rich_output']!r} must be one of {', '.join(OUTPUT_POLICIES)}. {FIX_HINT}")
    return KernelConfig(world_size=world, backend=backend, gpus=tuple(gpus), timeout=timeout,
                        startup_timeout=startup, merge_window=window,
                        fastai=_switch("fastai", raw["fastai"], KernelConfig.fastai), seed=seed, hang_grace=grace,
                        empty_cache=_switch("empty_cache", raw["empty_cache"], KernelConfig.empty_cache),
                        rich_output=output, launcher=launcher, nodes=nodes, ranks_per_node=per_node,
                        hosts=hosts, slurm_args=slurm_args, listen=listen, port_range=port_range,
                        hf=_switch("hf", raw["hf"], KernelConfig.hf), warnings=tuple(warnings))


def _switch(name: str, raw: str | None, default: bool) -> bool:
    if raw in (None, ""):
        return default
    value = str(raw).lower()
    if value not in ("on", "off", "true", "false", "1", "0"):
        raise ConfigError(f"--{name.replace('_', '-')} {raw!r} must be on or off. {FIX_HINT}")
    return value in ("on", "true", "1")


def _gpu_list(raw: str | None, where: str) -> list[int] | None:
    """--gpus as ids; None when not given, [] for ``none``/``cpu``; an error names ``where``."""
    if raw in (None, ""):
        return None
    text = str(raw).strip()
    if text.lower() in ("none", "cpu"):
        return []
    try:
        gpus = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        gpus = [-1]
    if not gpus or any(g < 0 for g in gpus):
        raise ConfigError(f"--gpus {text!r} must be a comma list of GPU ids{where} like 0,1. {FIX_HINT}")
    if len(set(gpus)) != len(gpus):
        raise ConfigError(f"--gpus {text} lists a GPU twice. {FIX_HINT}")
    return gpus


def _local_gpus(raw: str | None, gpus_avail: list[int]) -> list[int]:
    """--gpus for ranks on this machine: checked against the GPUs this machine shows."""
    gpus = _gpu_list(raw, "")
    if gpus is None:
        return list(gpus_avail)
    missing = [g for g in gpus if g not in gpus_avail]
    if missing:
        have = ", ".join(map(str, gpus_avail)) or "none"
        raise ConfigError(
            f"--gpus {str(raw).strip()}: GPU {', '.join(map(str, missing))} does not exist on this machine "
            f"(visible GPUs: {have}). {FIX_HINT}")
    return gpus


def _remote_gpus(raw: str | None) -> list[int]:
    """--gpus for ranks on other machines: ids on each node, which this machine cannot check.

    Without --gpus the ranks use the CPU: the parent cannot see the nodes' GPUs.
    """
    return _gpu_list(raw, " on each node") or []


_HOSTNAME = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,62})(?:\.[A-Za-z0-9_][A-Za-z0-9_-]{0,62})*\.?$")


def _hosts(raw: str | None, launcher: str) -> tuple[str, ...]:
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


#: srun options the kernel sets itself (long names; a prefix match catches --ntasks-per-gpu etc.)
_SLURM_OWN_LONG = ("--nodes", "--ntasks", "--input", "--output", "--error", "--jobid")
_SLURM_OWN_SHORT = ("-N", "-n", "-i", "-o", "-e")


def _slurm_args(raw: str | None, launcher: str) -> tuple[str, ...]:
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


def _listen(raw: str | None, remote: bool) -> str | None:
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


def _port_range(raw: str | None, remote: bool) -> tuple[int, int] | None:
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
    if remote and hi - lo + 1 < 2:
        raise ConfigError(
            f"--port-range {text} has one port; slurm/ssh need at least 2 (one for the parent's "
            f"listener, one for rank 0's rendezvous), e.g. --port-range {min(lo, 65526)}-{min(lo, 65526) + 9}. {FIX_HINT}")
    return (lo, hi)
