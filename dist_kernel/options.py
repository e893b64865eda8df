"""Kernel configuration: one source of truth.

Every option is declared once, in :data:`OPTIONS`: its name (the flag ``--name-with-dashes``
and the environment variable ``DIST_KERNEL_NAME``), its parser, its default, its help text and
the module that consumes it. The command line's flags, their help, the defaults of
:class:`KernelConfig`, the environment variables and the README's Configuration table (checked
by a test) all come from there.

Where a value comes from, as in Jupyter's traitlets: the command line (the kernelspec's argv,
written by ``python -m dist_kernel install``) beats the environment; a ``DIST_KERNEL_*``
variable fills only an option the command line leaves out; the declared default fills the rest.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from dist_kernel import capacity
from dist_kernel.capacity import Machine
from dist_kernel.exceptions import ConfigError

BACKENDS = ("gloo", "nccl")
#: where the ranks run: this machine, nodes started by Slurm's srun, or hosts reached by ssh
LAUNCHERS = ("local", "slurm", "ssh")
OUTPUT_POLICIES = ("all", "rank0")
ENV_PREFIX = "DIST_KERNEL_"

FIX_HINT = (
    "Fix the option in the kernelspec (reinstall with `python -m dist_kernel install ...`) "
    "or the DIST_KERNEL_* environment variable, then restart the kernel."
)

#: ``parse(flag, text)``: the value of an option given as ``text``, or a :class:`ConfigError`
#: naming ``flag``. Checks against other options (the launcher, this machine's GPUs) are in
#: :func:`resolve`.
Parser = Callable[[str, str], object]


def whole(minimum: int) -> Parser:
    """A whole number, at least ``minimum``."""
    def parse(flag: str, text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise ConfigError(f"{flag} {text!r} is not a whole number. {FIX_HINT}") from None
        if value < minimum:
            raise ConfigError(f"{flag} {value} must be at least {minimum}. {FIX_HINT}")
        return value
    return parse


def positive(flag: str, text: str) -> float:
    """A number above zero."""
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(f"{flag} {text!r} is not a number. {FIX_HINT}") from None
    if value <= 0:
        raise ConfigError(f"{flag} {value} must be positive. {FIX_HINT}")
    return value


def milliseconds(flag: str, text: str) -> float:
    """A positive number of milliseconds, as seconds."""
    return positive(flag, text) / 1000


def switch(flag: str, text: str) -> bool:
    """on|off (true/false, 1/0 also read)."""
    value = text.strip().lower()
    if value not in ("on", "off", "true", "false", "1", "0"):
        raise ConfigError(f"{flag} {text!r} must be on or off. {FIX_HINT}")
    return value in ("on", "true", "1")


def choice(*values: str) -> Parser:
    """One of ``values``, in any case."""
    def parse(flag: str, text: str) -> str:
        value = text.strip().lower()
        if value not in values:
            raise ConfigError(f"{flag} {text!r} is unknown; use one of {', '.join(values)}. {FIX_HINT}")
        return value
    return parse


def verbatim(flag: str, text: str) -> str:  # flag unused: the Parser signature
    """The text as given: checked in :func:`resolve`, where the other options are known."""
    return text


@dataclass(frozen=True)
class Option:
    """One kernel option, declared once."""

    name: str
    parse: Parser
    #: the value's text when neither the command line nor the environment gives one, parsed like
    #: a given one; None: decided by :func:`resolve` from the machine or the other options
    default: str | None
    help: str  # "{default}" in it is replaced by the default
    #: the module that reads ``KernelConfig.<field>`` and acts on it
    consumer: str
    #: the :class:`KernelConfig` attribute holding the value (default: the option's name)
    field: str = ""
    metavar: str = ""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        """The environment variable that sets the option when the command line does not."""
        return ENV_PREFIX + self.name.upper()

    @property
    def attribute(self) -> str:
        return self.field or self.name

    @property
    def help_text(self) -> str:
        return self.help.replace("{default}", self.default or "")

    def default_value(self) -> object:
        """The default, parsed (None when it is decided by :func:`resolve`)."""
        return None if self.default is None else self.parse(self.flag, self.default)


_SUPERVISOR = "dist_kernel.parent.supervisor"
_KERNEL = "dist_kernel.parent.kernel"
_REMOTE = "dist_kernel.parent.launch.remote"

#: every kernel option, in the order of the help and of a kernelspec's argv
OPTIONS: tuple[Option, ...] = (
    Option("ranks", whole(1), None, "number of ranks (default: one per GPU, else 2; with slurm/ssh: "
           "nodes x ranks per node)", _SUPERVISOR, field="world_size", metavar="N"),
    Option("gpus", verbatim, None, "comma list of physical GPU ids, rank i on the i-th (slurm/ssh: ids on "
           "each node, local rank i on the i-th)", "dist_kernel.parent.launch.local", metavar="LIST"),
    Option("backend", choice(*BACKENDS), None, "torch.distributed backend (default: nccl when GPUs are "
           "used, else gloo)", _SUPERVISOR, metavar="gloo|nccl"),
    Option("timeout", positive, "1800", "collective timeout in seconds (default {default})", _SUPERVISOR,
           metavar="S"),
    Option("startup_timeout", positive, "120", "seconds for ranks to start and form the group "
           "(default {default})", _SUPERVISOR, metavar="S"),
    Option("merge_window_ms", milliseconds, "100", "ms to wait for identical output from other ranks "
           "(default {default})", _KERNEL, field="merge_window", metavar="MS"),
    Option("fastai", switch, "on", "fastai integration inside the ranks (default {default})", _SUPERVISOR,
           metavar="on|off"),
    Option("lightning", switch, "on", "Lightning integration inside the ranks (default {default})", _SUPERVISOR,
           metavar="on|off"),
    Option("hf", switch, "on", "Hugging Face integration inside the ranks: accelerate's notebook_launcher and "
           "print, Transformers' Trainer output (default {default})", _SUPERVISOR, metavar="on|off"),
    Option("seed", whole(0), None, "random seed shared by every rank (default: random)", _SUPERVISOR,
           metavar="N"),
    Option("hang_grace", positive, "10", "seconds a rank may wait in a collective the others never "
           "entered (default {default})", _KERNEL, metavar="S"),
    Option("empty_cache", switch, "on", "gc + torch.cuda.empty_cache() after each cell (default {default})",
           _SUPERVISOR, metavar="on|off"),
    Option("rich_output", choice(*OUTPUT_POLICIES), "all", "rich output from every rank (merged) or "
           "from rank 0 only (default {default})", _KERNEL, metavar="all|rank0"),
    Option("launcher", choice(*LAUNCHERS), "local", "where the ranks run: this machine, nodes started by "
           "srun, or hosts reached by ssh (default {default})", "dist_kernel.parent.launch", metavar="local|slurm|ssh"),
    Option("nodes", whole(1), "1", "number of machines (slurm/ssh; default: 1 for slurm, the number of "
           "--hosts for ssh)", _REMOTE, metavar="N"),
    Option("ranks_per_node", whole(1), None, "ranks on each node (slurm/ssh; default: the number of "
           "--gpus, else 1)", _REMOTE, metavar="G"),
    Option("hosts", verbatim, None, "comma list of hosts to start the ranks on, node 0 first (ssh only)",
           "dist_kernel.parent.launch.node_starters.ssh", metavar="H1,H2"),
    Option("slurm_args", verbatim, None, "extra srun/salloc arguments, e.g. \"--partition gpu --time "
           "2:00:00\" (slurm only)", "dist_kernel.parent.launch.node_starters.slurm", metavar="ARGS"),
    Option("listen", verbatim, None, "the parent's address as the nodes see it, no port (slurm/ssh; "
           "default: this machine's address on its route to the nodes)", "dist_kernel.parent.launch.node_starters", metavar="ADDR"),
    Option("port_range", verbatim, None, "ports to listen on, for rank 0's rendezvous and for MASTER_PORT "
           "(slurm/ssh; at least 3; default: random free ports)", _REMOTE, metavar="A-B"),
    Option("oversubscribe", switch, "off", "start more ranks than this machine's memory or CPU cores "
           "can hold (local launcher; default {default})", "dist_kernel.capacity", metavar="on|off"),
)

OPTION: dict[str, Option] = {o.name: o for o in OPTIONS}


def _default(name: str):  # no return type: each KernelConfig field has its own
    return OPTION[name].default_value()


@dataclass(frozen=True)
class KernelConfig:
    """Validated settings for one distributed kernel (defaults from :data:`OPTIONS`)."""

    world_size: int
    backend: str
    gpus: tuple[int, ...] = ()  # physical GPU ids; empty on CPU
    timeout: float = _default("timeout")
    startup_timeout: float = _default("startup_timeout")
    merge_window: float = _default("merge_window_ms")  # seconds
    fastai: bool = _default("fastai")
    lightning: bool = _default("lightning")
    hf: bool = _default("hf")
    seed: int | None = None  # None: the parent draws one per start, shared by every rank
    hang_grace: float = _default("hang_grace")
    empty_cache: bool = _default("empty_cache")
    rich_output: str = _default("rich_output")
    launcher: str = _default("launcher")
    nodes: int = _default("nodes")
    #: ranks on each node; 0 when constructed means "all of them" (world_size, local)
    ranks_per_node: int = 0
    hosts: tuple[str, ...] = ()  # ssh: node i is hosts[i]
    slurm_args: tuple[str, ...] = ()  # extra srun/salloc arguments, already split
    listen: str | None = None  # the parent's address as the nodes see it; None: decided at start
    port_range: tuple[int, int] | None = None  # inclusive; None: random free ports
    oversubscribe: bool = _default("oversubscribe")
    #: shown once, in the first cell (ranks sharing GPUs over gloo, an option with no effect)
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
    for o in OPTIONS:
        parser.add_argument(o.flag, dest=o.name, default=None, metavar=o.metavar or None,
                            help=f"{o.help_text} [{o.env}]")


def option_argv(ns: argparse.Namespace) -> list[str]:
    """The flags of `ns` that were given, as argv (to write them into kernel.json)."""
    argv: list[str] = []
    for o in OPTIONS:
        value = getattr(ns, o.name, None)
        if value is None:
            continue
        text = str(value)
        # a value that starts with "-" (--slurm-args "--exclusive") would be read as a flag
        argv += [f"{o.flag}={text}"] if text.startswith("-") else [o.flag, text]
    return argv


def given(ns: argparse.Namespace, environ: Mapping[str, str]) -> dict[str, str | None]:
    """Each option's text as given: the command line's, else its environment variable's
    (traitlets' order: the command line beats the environment); None when neither gives it."""
    out: dict[str, str | None] = {}
    for o in OPTIONS:
        flag = getattr(ns, o.name, None)
        text = str(flag) if flag not in (None, "") else environ.get(o.env, "")
        out[o.name] = text if text != "" else None
    return out


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


def resolve(ns: argparse.Namespace, environ: Mapping[str, str] | None = None,
            available_gpus: list[int] | None = None, machine: Machine | None = None) -> KernelConfig:
    """Turn flags (and the environment, where a flag is not given) into a validated :class:`KernelConfig`.

    ``available_gpus`` and ``machine`` default to this machine's. Raises :class:`ConfigError`
    with a message naming the option and the fix.
    """
    env = os.environ if environ is None else environ
    raw = given(ns, env)
    value: dict[str, object] = {}
    for o in OPTIONS:
        text = raw[o.name]
        value[o.name] = None if text is None else _parse(o, text, ns)

    def get(name: str):  # no return type: the option's own
        return OPTION[name].default_value() if value[name] is None else value[name]

    def given_int(name: str) -> int | None:
        """A whole-number option's parsed value; None when it was not given."""
        v = value[name]
        assert v is None or isinstance(v, int), (name, v)
        return v

    warnings: list[str] = []

    launcher = get("launcher")
    remote = launcher != "local"
    hosts = _hosts(raw["hosts"], launcher)
    slurm_args = _slurm_args(raw["slurm_args"], launcher)
    listen = _listen(raw["listen"], remote)
    port_range = _port_range(raw["port_range"], remote)
    if not remote:
        warnings += [f"{OPTION[name].flag} is for --launcher slurm or ssh; the local ranks talk over IPC "
                     f"on this machine, so it has no effect." for name in ("listen", "port_range") if raw[name]]

    if remote:
        gpus = _remote_gpus(raw["gpus"])
    else:
        gpus = _local_gpus(raw["gpus"], visible_gpus(dict(env)) if available_gpus is None else available_gpus)

    chosen = value["backend"]  # None: the kernel picks, once the ranks per GPU are known
    assert chosen is None or isinstance(chosen, str)
    backend = chosen or ("nccl" if gpus else "gloo")
    if backend == "nccl" and not gpus:
        if remote:
            raise ConfigError(
                f"--backend nccl needs GPUs: with --launcher {launcher}, name the GPU ids on each node "
                f"with --gpus (e.g. --gpus 0,1,2,3), or use --backend gloo. {FIX_HINT}")
        raise ConfigError(f"--backend nccl needs GPUs, and none is visible; use --backend gloo. {FIX_HINT}")

    given_ranks, given_per_node, given_nodes = given_int("ranks"), given_int("ranks_per_node"), given_int("nodes")
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
        backend = _default_backend(chosen, backend, per_node, gpus, warnings)
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
            nodes = get("nodes")
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
        backend = _default_backend(chosen, backend, per_node, gpus, warnings)
        if backend == "nccl" and per_node > len(gpus):
            raise ConfigError(
                f"--ranks-per-node {per_node} with nccl needs {per_node} GPUs on each node but only "
                f"{len(gpus)} are selected with --gpus (NCCL cannot put two ranks on one GPU); use fewer "
                f"ranks per node, more --gpus or --backend gloo. {FIX_HINT}")

    if gpus and per_node < len(gpus):
        gpus = gpus[:per_node]
    if gpus and per_node > len(gpus):
        where = " on each node" if remote else ""
        warnings.append(shared_gpu_warning(per_node, len(gpus), where))

    config = KernelConfig(world_size=world, backend=backend, gpus=tuple(gpus), timeout=get("timeout"),
                          startup_timeout=get("startup_timeout"), merge_window=get("merge_window_ms"),
                          fastai=get("fastai"), lightning=get("lightning"), hf=get("hf"), seed=given_int("seed"),
                          hang_grace=get("hang_grace"),
                          empty_cache=get("empty_cache"), rich_output=get("rich_output"), launcher=launcher,
                          nodes=nodes, ranks_per_node=per_node, hosts=hosts, slurm_args=slurm_args,
                          listen=listen, port_range=port_range, oversubscribe=get("oversubscribe"))
    if not remote:  # the nodes' memory and cores cannot be seen from here
        warnings += capacity.check(config, capacity.this_machine() if machine is None else machine)
    return dataclasses.replace(config, warnings=tuple(warnings))


def _default_backend(chosen: str | None, backend: str, per_node: int, gpus: list[int],
                     warnings: list[str]) -> str:
    """The backend where the user chose none: gloo when ranks must share GPUs, since NCCL cannot
    put two ranks on one GPU (one GPU and ``--ranks 2`` is the common workstation). Said once, in
    the first cell. A backend the user chose is kept, and checked by the caller."""
    if chosen is None and backend == "nccl" and per_node > len(gpus):
        warnings.append(f"backend gloo, not nccl: {per_node} ranks on {len(gpus)} GPU(s) must share them, and "
                        "NCCL cannot put two ranks on one GPU. For nccl, use one rank per GPU "
                        f"(--ranks {len(gpus)}); pass --backend gloo to choose gloo yourself and drop this line.")
        return "gloo"
    return backend


def shared_gpu_warning(per_node: int, gpus: int, where: str = "") -> str:
    """What ranks that share GPUs over gloo mean for the user's code, with what to do."""
    # seen on an H100 at 2 ranks: accelerate's DistributedDataParallel gets device_ids=[LOCAL_RANK],
    # and rank 1 fails in the first forward pass with IndexError, as it does under torchrun
    return (f"{per_node} ranks share {gpus} GPU(s){where} over gloo. Code that puts rank LOCAL_RANK on GPU "
            "LOCAL_RANK fails on the ranks past the last GPU: accelerate and Transformers' Trainer do "
            "(IndexError in the first forward pass). With them, use one rank per GPU "
            f"({'--ranks-per-node' if where else '--ranks'} {gpus}), or train on CPU: Accelerator(cpu=True), "
            "TrainingArguments(use_cpu=True). Plain DDP on `device` works as it is.")


def _parse(option: Option, text: str, ns: argparse.Namespace) -> object:
    """An option's value; an error names the environment variable when the text came from there."""
    try:
        return option.parse(option.flag, text)
    except ConfigError as e:
        if getattr(ns, option.name, None) in (None, ""):
            raise ConfigError(f"{option.env}={text!r} in the kernel's environment: {e}") from None
        raise


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
    if remote and hi - lo + 1 < 3:
        raise ConfigError(
            f"--port-range {text} has {hi - lo + 1} port{'s' if hi > lo else ''}; slurm/ssh need at least 3 (the "
            f"parent's listener, rank 0's rendezvous, and MASTER_PORT for a group initialised by hand), "
            f"e.g. --port-range {min(lo, 65526)}-{min(lo, 65526) + 9}. {FIX_HINT}")
    return (lo, hi)
