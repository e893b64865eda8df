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
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dist_kernel import capacity, cluster_options, devices, placement
from dist_kernel.capacity import Machine
from dist_kernel.exceptions import FIX_HINT, ConfigError
from dist_kernel.launchers import KINDS, is_remote

BACKENDS = ("gloo", "nccl")
#: where the ranks run: the ``--launcher`` values, from the table of kinds (dist_kernel/launchers.py)
LAUNCHERS = tuple(k.name for k in KINDS)
OUTPUT_POLICIES = ("all", "rank0")
ENV_PREFIX = "DIST_KERNEL_"

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


_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([kmg]?)i?b?", re.IGNORECASE)
#: the smallest output log: a few cells' worth
MIN_LOG_BYTES = 4096


def size_or_off(flag: str, text: str) -> int:
    """A size in bytes (``10MB``, ``512KB``, ``1GB``, ``65536``), or ``off`` (0)."""
    value = text.strip()
    if value.lower() in ("off", "0", "false"):
        return 0
    m = _SIZE.fullmatch(value)
    if not m:
        raise ConfigError(f"{flag} {text!r} is neither a size (10MB, 512KB, 1GB) nor off. {FIX_HINT}")
    size = int(float(m.group(1)) * {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2).lower()])
    if size < MIN_LOG_BYTES:
        raise ConfigError(f"{flag} {text!r} is below {MIN_LOG_BYTES // 1024}KB; give a larger size, or off. {FIX_HINT}")
    return size


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
    #: an on/off behaviour inside each rank: sent at the first formation (``Join.switches``),
    #: switchable at run time (``set_option``, ``%dist_<name>``, on every rank at once); what it
    #: does there is in dist_kernel.rank.switches
    rank_switch: bool = False
    #: a rank switch that installs an integration at the first formation, only when on: it can be
    #: switched off and on again, but not on in a kernel started with it off (a library the ranks
    #: imported meanwhile would be left unpatched)
    installed_at_start: bool = False

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
           metavar="on|off", rank_switch=True, installed_at_start=True),
    Option("lightning", switch, "on", "Lightning integration inside the ranks (default {default})", _SUPERVISOR,
           metavar="on|off", rank_switch=True, installed_at_start=True),
    Option("hf", switch, "on", "Hugging Face integration inside the ranks: accelerate's notebook_launcher and "
           "print, Transformers' Trainer output (default {default})", _SUPERVISOR, metavar="on|off",
           rank_switch=True, installed_at_start=True),
    Option("seed", whole(0), None, "random seed shared by every rank (default: random)", _SUPERVISOR,
           metavar="N"),
    Option("hang_grace", positive, "10", "seconds a rank may wait in a collective the others never "
           "entered (default {default})", "dist_kernel.parent.execution", metavar="S"),
    Option("respawn", switch, "off", "start a rank that died anew at once, in its place; the other ranks keep "
           "their variables (default {default})", "dist_kernel.parent.execution", metavar="on|off"),
    Option("empty_cache", switch, "on", "gc + torch.cuda.empty_cache() after each cell (default {default})",
           _SUPERVISOR, metavar="on|off", rank_switch=True),
    Option("rich_output", choice(*OUTPUT_POLICIES), "all", "rich output from every rank (merged) or "
           "from rank 0 only (default {default})", _KERNEL, metavar="all|rank0"),
    Option("launcher", choice(*LAUNCHERS), KINDS[0].name, "where the ranks run: "
           + "; ".join(f"{k.name}: {k.where}" for k in KINDS) + " (default {default})", "dist_kernel.parent.launch",
           metavar="|".join(k.name for k in KINDS if not k.for_tests)),
    Option("nodes", whole(1), "1", "number of machines (slurm/ssh; default: 1 for slurm, the number of "
           "--hosts for ssh)", _REMOTE, metavar="N"),
    Option("ranks_per_node", whole(1), None, "ranks on each node (slurm/ssh; default: the number of "
           "--gpus, else 1)", _REMOTE, metavar="G"),
    Option("hosts", verbatim, None, "comma list of hosts to start the ranks on, node 0 first (ssh only)",
           "dist_kernel.parent.launch.node_starters.ssh", metavar="H1,H2"),
    Option("slurm_args", verbatim, None, "extra arguments for the Slurm job step, e.g. \"--partition gpu --time "
           "2:00:00\" (slurm only)", "dist_kernel.parent.launch.node_starters.slurm", metavar="ARGS"),
    Option("listen", verbatim, None, "the parent's address as the nodes see it, no port (slurm/ssh; "
           "default: this machine's address on its route to the nodes)", "dist_kernel.parent.launch.node_starters", metavar="ADDR"),
    Option("port_range", verbatim, None, "ports to listen on, for rank 0's rendezvous and for MASTER_PORT "
           "(slurm/ssh; at least 3; default: random free ports)", _REMOTE, metavar="A-B"),
    Option("oversubscribe", switch, "off", "start more ranks than this machine's memory or CPU cores "
           "can hold (local launcher; default {default})", "dist_kernel.capacity", metavar="on|off"),
    Option("output_log", size_or_off, "10MB", "every cell's merged output, appended to a log beside the "
           "kernel's connection file, rotated at SIZE (one earlier file kept); off: no log (default {default})",
           "dist_kernel.parent.output_log", metavar="SIZE|off"),
)

OPTION: dict[str, Option] = {o.name: o for o in OPTIONS}
#: the options that switch a behaviour inside each rank (``set_option``'s names)
RANK_SWITCHES: tuple[str, ...] = tuple(o.name for o in OPTIONS if o.rank_switch)


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
    respawn: bool = _default("respawn")
    empty_cache: bool = _default("empty_cache")
    rich_output: str = _default("rich_output")
    launcher: str = _default("launcher")
    nodes: int = _default("nodes")
    #: ranks on each node; 0 when constructed means "all of them" (world_size, local)
    ranks_per_node: int = 0
    hosts: tuple[str, ...] = ()  # ssh: node i is hosts[i]
    slurm_args: tuple[str, ...] = ()  # extra arguments for the Slurm job step, already split
    listen: str | None = None  # the parent's address as the nodes see it; None: decided at start
    port_range: tuple[int, int] | None = None  # inclusive; None: random free ports
    oversubscribe: bool = _default("oversubscribe")
    output_log: int = _default("output_log")  # bytes a log file grows to before it is rotated; 0: no log
    #: shown once, in the first cell (ranks sharing GPUs over gloo, an option with no effect)
    warnings: tuple[str, ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if not self.ranks_per_node:
            object.__setattr__(self, "ranks_per_node", self.world_size // max(self.nodes, 1))

    def rank_switches(self) -> dict[str, bool]:
        """Each rank switch (:data:`RANK_SWITCHES`) and whether it is on, for ``Join.switches``."""
        return {name: bool(getattr(self, OPTION[name].attribute)) for name in RANK_SWITCHES}

    def with_switch(self, name: str, on: bool) -> KernelConfig:
        """This configuration with the rank switch ``name`` on or off (its magic, at run time)."""
        changed: dict[str, Any] = {OPTION[name].attribute: on}  # one of the bool fields
        return dataclasses.replace(self, **changed)

    @property
    def uses_cuda(self) -> bool:
        return bool(self.gpus)

    @property
    def remote(self) -> bool:
        """The ranks run on other machines (a ``--launcher`` kind with a node starter)."""
        return is_remote(self.launcher)

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
        return f"cuda:{placement.cuda_index(self.local_rank_of(rank), len(self.gpus))}"

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


def resolve(ns: argparse.Namespace, environ: Mapping[str, str] | None = None,
            available_gpus: list[int] | None = None, machine: Machine | None = None) -> KernelConfig:
    """Turn flags (and the environment, where a flag is not given) into a validated :class:`KernelConfig`.

    ``available_gpus`` and ``machine`` default to this machine's. Raises :class:`ConfigError`
    with a message naming the option and the fix.
    """
    env = os.environ if environ is None else environ
    raw = given(ns, env)
    value = {o.name: None if raw[o.name] is None else _parse(o, str(raw[o.name]), ns) for o in OPTIONS}

    def get(name: str):  # no return type: the option's own
        return OPTION[name].default_value() if value[name] is None else value[name]

    warnings: list[str] = []
    launcher = get("launcher")
    remote = is_remote(launcher)
    hosts = cluster_options.hosts(raw["hosts"], launcher)
    slurm_args = cluster_options.slurm_args(raw["slurm_args"], launcher)
    listen = cluster_options.listen(raw["listen"], remote)
    port_range = cluster_options.port_range(raw["port_range"], remote)
    if not remote:
        warnings += [f"{OPTION[name].flag} is for --launcher slurm or ssh; the local ranks talk over IPC "
                     f"on this machine, so it has no effect." for name in ("listen", "port_range") if raw[name]]

    available = devices.visible_gpus(env) if available_gpus is None else available_gpus
    gpus = devices.selected_gpus(raw["gpus"], remote, [] if remote else available)
    chosen = value["backend"]  # None: the kernel picks, once the ranks per GPU are known
    assert chosen is None or isinstance(chosen, str)
    devices.check_nccl_has_gpus(chosen, gpus, launcher)
    counts = cluster_options.RankCounts(_given_int(value, "ranks"), _given_int(value, "ranks_per_node"),
                         _given_int(value, "nodes"), get("nodes"))
    nodes, per_node = cluster_options.remote_layout(counts, launcher, hosts, gpus) if remote else cluster_options.local_layout(counts, gpus)
    backend = devices.pick_backend(chosen, gpus, per_node, remote, warnings)
    gpus = devices.fit_gpus(gpus, per_node, remote, warnings)

    config = KernelConfig(world_size=nodes * per_node, backend=backend, gpus=tuple(gpus), timeout=get("timeout"),
                          startup_timeout=get("startup_timeout"), merge_window=get("merge_window_ms"),
                          fastai=get("fastai"), lightning=get("lightning"), hf=get("hf"),
                          seed=_given_int(value, "seed"), hang_grace=get("hang_grace"), respawn=get("respawn"),
                          empty_cache=get("empty_cache"), rich_output=get("rich_output"), launcher=launcher,
                          nodes=nodes, ranks_per_node=per_node, hosts=hosts, slurm_args=slurm_args,
                          listen=listen, port_range=port_range, oversubscribe=get("oversubscribe"),
                          output_log=get("output_log"))
    if not remote:  # the nodes' memory and cores cannot be seen from here
        warnings += capacity.check(config, capacity.this_machine() if machine is None else machine)
    return dataclasses.replace(config, warnings=tuple(warnings))


def _given_int(value: Mapping[str, object], name: str) -> int | None:
    """A whole-number option's parsed value; None when it was not given."""
    v = value[name]
    assert v is None or isinstance(v, int), (name, v)
    return v


def _parse(option: Option, text: str, ns: argparse.Namespace) -> object:
    """An option's value; an error names the environment variable when the text came from there."""
    try:
        return option.parse(option.flag, text)
    except ConfigError as e:
        if getattr(ns, option.name, None) in (None, ""):
            raise ConfigError(f"{option.env}={text!r} in the kernel's environment: {e}") from None
        raise
