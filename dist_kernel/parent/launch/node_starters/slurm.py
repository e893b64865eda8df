"""Slurm: one ``srun`` starts a node agent on every node (see :func:`srun_argv`).

Inside the user's allocation (``SLURM_JOB_ID`` set) it is a job step of that allocation;
outside one, ``srun`` asks for a job itself (with ``--slurm-args``), says on stderr when the
job waits in the queue, and the kernel cancels that job at the end. The node rank is
``SLURM_NODEID``. What srun says of the job is read as typed events (:class:`SrunEvent`,
:class:`SlurmCancel`), never as sentences searched for words downstream; the rest of the launch
package hears only their :data:`~.base.Phase` (pending, started, ended).

Everything of Slurm lives here: the commands (``srun``, ``scancel``, ``squeue``, ``scontrol``),
the job ids, srun's messages, and the MUNGE credentials the keys travel in (srun's stdin crosses
the cluster network in clear). The launch record keeps the job (:meth:`SlurmNodeStarter.started`);
:meth:`SlurmNodeStarter.end_recorded` cancels it for a kernel that is gone.
"""

from __future__ import annotations

import os
import pwd
import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from dist_kernel import tunnel
from dist_kernel.cleanup import RUNTIME_PREFIX, LaunchRecord, Proc
from dist_kernel.exceptions import ConfigError, RankStartError
from dist_kernel.options import KernelConfig
from dist_kernel.parent.launch.node_starters.base import STOP_TERM_WAIT, NodeStarter, Phase, StarterProcess, run_quiet
from dist_kernel.parent.launch.node_starters.routes import checked_source, this_host_names
from dist_kernel.tunnel.keys import munge_wrap

_QUEUED = re.compile(r"\bjob (\d+) queued and waiting for resources")
_ALLOCATED = re.compile(r"\bjob (\d+) has been allocated resources")
_GRANTED = re.compile(r"\b(?:Granted job allocation|jobid) (\d+)\b")
_STEP_BUSY = re.compile(r"\bJob (\d+) step creation temporarily disabled")
#: slurmstepd's "*** STEP 12.0 ON n1 CANCELLED AT 2026-01-01T10:00:00 DUE TO TIME LIMIT ***"
_CANCELLED = re.compile(r"\*\*\* (?:STEP|JOB) (\d+)(?:\.\S+)? ON (\S+) CANCELLED AT \S+(?: DUE TO ([A-Z ]+?))?(?: \*\*\*|$)")

#: srun ending the step itself (a task failed and --kill-on-bad-exit): its CANCELLED line that
#: follows is srun's doing, not Slurm's (scancel, a time limit)
_SRUN_ENDS_STEP = re.compile(r"^srun: (?:error: \S+: tasks? [0-9,-]+: (?!Terminated)|.*Terminating StepId=)")

SrunKind = Literal["queued", "allocated", "granted", "step_busy"]
#: what each of srun's words means to the rest of the launch package (a step waiting for busy
#: CPUs is a note, not a queue: the connect timeout runs, and the note says how to fix it)
PHASES: dict[SrunKind, Phase] = {"queued": "pending", "allocated": "started", "granted": "started"}


class SrunEvent(NamedTuple):
    """What a line of srun's stderr says about the job: its state, and the job id."""

    kind: SrunKind
    job: str


@dataclass(frozen=True)
class SlurmCancel:
    """Slurm ended the job (or step): scancel, the time limit, preemption, a node failure."""

    job: str
    node: str
    reason: str = ""  # Slurm's "DUE TO ..." words, lower case; "" for scancel
    line: str = ""  # the line that said so

    def words(self) -> str:
        why = {"": "was cancelled (scancel)", "time limit": "reached its time limit (--time)",
               "preemption": "was preempted", "node failure": f"ended: node {self.node} failed"}
        return f"Slurm job {self.job} {why.get(self.reason, f'was cancelled due to {self.reason}')}"


def job_name(runtime_dir: str) -> str:
    """The Slurm job (or step) name of a kernel: its runtime dir's name
    (``dist_kernel-<parent pid>-<random>``), unique, so the job can be cancelled by name."""
    base = os.path.basename(os.path.normpath(runtime_dir))
    return base if base.startswith(RUNTIME_PREFIX) else f"{RUNTIME_PREFIX}{os.getpid()}"


def effective_job_name(slurm_args: Sequence[str], default: str) -> str:
    """The job name srun will use: the last ``-J``/``--job-name`` in ``--slurm-args``, else ours."""
    name, args = default, list(slurm_args)
    for i, arg in enumerate(args):
        if arg in ("-J", "--job-name") and i + 1 < len(args):
            name = args[i + 1]
        elif arg.startswith("--job-name="):
            name = arg.split("=", 1)[1]
        elif arg.startswith("-J") and len(arg) > 2:
            name = arg[2:]
    return name


def srun_argv(nodes: int, slurm_args: Sequence[str], agent_argv: Sequence[str], name: str) -> list[str]:
    """``srun`` for one agent on each of ``nodes`` nodes.

    ``--ntasks`` too, not only ``--ntasks-per-node``: inside an ``salloc -n 8`` allocation srun
    reads ``SLURM_NTASKS=8`` from the environment and would start 8 agents. ``--input=all``
    (every task reads srun's stdin), ``--kill-on-bad-exit`` (one agent failing ends the step),
    ``--export=ALL`` (even if ``SLURM_EXPORT_ENV`` says otherwise: the agents need PATH). The
    user's ``--slurm-args`` come after the kernel's options (options.py rejects those that
    would change what the kernel sets), the agent's argv last.
    """
    return ["srun", "--nodes", str(nodes), "--ntasks", str(nodes), "--ntasks-per-node", "1",
            "--kill-on-bad-exit=1", "--input=all", "--export=ALL", "--job-name", name,
            *slurm_args, *agent_argv]


def parse_srun_line(line: str) -> SrunEvent | None:
    """What a line of srun's stderr says about the job, or None."""
    for kind, pattern in (("queued", _QUEUED), ("allocated", _ALLOCATED), ("granted", _GRANTED),
                          ("step_busy", _STEP_BUSY)):
        m = pattern.search(line)
        if m:
            return SrunEvent(kind, m.group(1))  # type: ignore[arg-type]
    return None


def parse_cancel_line(line: str) -> SlurmCancel | None:
    """slurmstepd's line that the job or step was cancelled, as srun relays it; or None."""
    m = _CANCELLED.search(line)
    return SlurmCancel(m.group(1), m.group(2), (m.group(3) or "").strip().lower(), line.strip()) if m else None


def check_allocation(config: KernelConfig, environ: Mapping[str, str] | None = None) -> None:
    """Inside a Slurm allocation, ``--nodes`` must be its node count (a step of N nodes in an
    allocation of M either fails or waits forever; each node is one agent)."""
    env = os.environ if environ is None else environ
    if not env.get("SLURM_JOB_ID"):
        return
    raw = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    if not raw or not raw.strip().isdigit():
        return
    have, want = int(raw), config.nodes
    if have != want:
        job = env["SLURM_JOB_ID"]
        raise ConfigError(
            f"--nodes {want} does not match the Slurm allocation this kernel runs in: job {job} has "
            f"{have} node{'s' if have != 1 else ''} (SLURM_JOB_NUM_NODES={have}). Fix: set --nodes {have} "
            f"(one node agent per allocated node), or start JupyterLab in an allocation of {want} "
            f"nodes (salloc --nodes {want} ...), then restart the kernel.")


def expand_hostlist(nodelist: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """``n[1-2],gpu07`` -> ``['n1', 'n2', 'gpu07']`` (``scontrol show hostnames``, else parsed here)."""
    out = run_quiet(["scontrol", "show", "hostnames", nodelist], environ)
    if out and out.split():
        return out.split()
    return _expand_hostlist(nodelist)


def _expand_hostlist(text: str) -> list[str]:
    """Slurm's hostlist syntax without scontrol: ``a[1-3,07],b`` and ``r[1-2]-n[1-2]``."""
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
            continue
        depth += (ch == "[") - (ch == "]")
        cur += ch
    parts.append(cur)
    hosts: list[str] = []
    for part in filter(None, (p.strip() for p in parts)):
        m = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", part)
        if not m:
            hosts.append(part)
            continue
        prefix, ranges, rest = m.groups()
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            values = [lo] if not hi else [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
            for v in values:
                hosts.extend(prefix + v + tail for tail in (_expand_hostlist(rest) if rest else [""]))
    return hosts


def slurm_node_address(node: str, environ: Mapping[str, str] | None = None) -> str:
    """The address Slurm reaches ``node`` at (its ``NodeAddr``), else the name itself."""
    out = run_quiet(["scontrol", "-o", "show", "node", node], environ)
    m = re.search(r"\bNodeAddr=(\S+)", out or "")
    return m.group(1) if m and m.group(1) not in ("(null)", "") else node


def slurmctld_host(environ: Mapping[str, str] | None = None) -> str | None:
    """The Slurm controller's address (``SlurmctldHost = ctl(10.77.0.1)``: the part in
    parentheses, else the name; older Slurm: ``ControlAddr``/``ControlMachine``)."""
    return parse_slurmctld_host(run_quiet(["scontrol", "show", "config"], environ) or "")


def user_name() -> str:
    """This user's name: ``scancel --user`` takes it."""
    try:
        return pwd.getpwuid(os.getuid()).pw_name
    except KeyError:
        return str(os.getuid())


def _slurm_run(argv: list[str], slurm_conf: str | None, timeout: float = 5.0) -> subprocess.CompletedProcess | None:
    env = dict(os.environ)
    if slurm_conf:
        env["SLURM_CONF"] = slurm_conf
    try:
        return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                              timeout=timeout, env=env)
    except (OSError, subprocess.SubprocessError):
        return None


def cancel_job(job: Mapping[str, Any]) -> list[str]:
    """Cancel what a Slurm starter's record names (:meth:`SlurmNodeStarter.started`); returns
    the ``scancel`` calls made (their arguments).

    The kernel's own job (``own_job``): ``scancel --user U --name NAME [JOB]``, filters that
    Slurm ANDs, so only a job of this user with the kernel's unique name is ever cancelled
    (also one whose id was never learnt). Inside the user's allocation only the steps of that
    job with the kernel's name are cancelled, never the allocation.
    """
    name, job_id = job.get("name"), job.get("job")
    user = job.get("user") or user_name()
    conf = job.get("slurm_conf")
    if not name:
        return []
    calls: list[list[str]] = []
    if job.get("own_job"):
        calls.append(["scancel", f"--user={user}", f"--name={name}", *([str(job_id)] if job_id else [])])
    elif job_id:
        listed = _slurm_run(["squeue", "-h", "-s", "-j", str(job_id), "-o", "%i %j"], conf)
        for line in (listed.stdout.splitlines() if listed and listed.returncode == 0 else []):
            parts = line.split(None, 1)
            if len(parts) == 2 and parts[1].strip() == name and parts[0].startswith(f"{job_id}."):
                calls.append(["scancel", parts[0]])
    for argv in calls:
        _slurm_run(argv, conf)
    return [" ".join(argv[1:]) for argv in calls]


def munge_socket(environ: Mapping[str, str] | None = None) -> str | None:
    """The MUNGE socket Slurm uses (``AuthInfo = socket=PATH``), or None for munged's default."""
    m = re.search(r"^\s*AuthInfo\s*=.*\bsocket=([^,\s]+)", run_quiet(["scontrol", "show", "config"], environ) or "", re.M)
    return m.group(1) if m else None


def parse_slurmctld_host(config_text: str) -> str | None:
    m = re.search(r"^\s*SlurmctldHost(?:\[0\])?\s*=\s*([^\s(]+)(?:\(([^)\s]+)\))?", config_text, re.M)
    if m:
        return m.group(2) or m.group(1)
    for key in ("ControlAddr", "ControlMachine"):
        m = re.search(rf"^\s*{key}\s*=\s*(\S+)", config_text, re.M)
        if m and m.group(1) != "(null)":
            return m.group(1)
    return None


class SlurmNodeStarter(NodeStarter):
    """One ``srun`` starts the agents on every node; see :func:`srun_argv`."""

    kind = "slurm"

    @classmethod
    def check(cls, config: KernelConfig, environ: Mapping[str, str] | None = None) -> None:
        check_allocation(config, environ)

    @classmethod
    def listen_address(cls, config: KernelConfig, environ: Mapping[str, str]) -> str:
        """Inside an allocation: the route to the first allocated node that is not this machine
        (its ``NodeAddr``); outside one (or when every node is this machine): the route to the
        Slurm controller. Raises ConfigError naming the host when the route is unknown or loopback."""
        nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
        if environ.get("SLURM_JOB_ID") and nodelist:
            here = this_host_names() | {environ.get("SLURMD_NODENAME", "").split(".", 1)[0].lower()} - {""}
            nodes = expand_hostlist(nodelist, environ)
            others = [n for n in nodes if n.split(".", 1)[0].lower() not in here]
            if others:
                return checked_source("the allocated node", slurm_node_address(others[0], environ))
            if nodes:  # the whole allocation is this machine: the controller's route, else loopback works
                ctl = slurmctld_host(environ)
                try:
                    return checked_source("the Slurm controller", ctl) if ctl else "127.0.0.1"
                except ConfigError:
                    return "127.0.0.1"
        ctl = slurmctld_host(environ)
        if not ctl:
            raise ConfigError(
                "Cannot tell this machine's address on the cluster network: `scontrol show config` did not "
                "name the Slurm controller (is Slurm installed here and SLURM_CONF right?). Fix: pass "
                "--listen ADDR, an address of this machine that the nodes can reach, then restart the kernel.")
        return checked_source("the Slurm controller", ctl)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        inside = self.environ.get("SLURM_JOB_ID")
        #: True when srun asks for the job itself (and the kernel cancels it); False inside the
        #: user's allocation, which the kernel never cancels
        self.own_job = not inside
        self.job_id = inside or None
        self.name = effective_job_name(self.config.slurm_args, job_name(self.runtime_dir))
        self._allocated_noted = False
        self.cancelled: SlurmCancel | None = None  # Slurm's word that it ended the job or step
        self._srun_ended_step = False  # srun ended the step itself first (a task failed)
        self._munge_socket: list[str | None] = []  # munged's socket, once asked (scontrol, once)

    def commands(self) -> list[tuple[str, str | None, list[str]]]:
        argv = srun_argv(self.config.nodes, self.config.slurm_args,
                         self.agent_argv(None), job_name(self.runtime_dir))
        return [("srun", None, argv)]

    def started(self) -> dict[str, Any]:
        """The job: its id (None until srun or an agent says it), the kernel's unique job name,
        the user, whether the kernel asked for it (else it is the user's allocation, of which
        only the kernel's step is ever cancelled), and the ``SLURM_CONF`` to reach Slurm with."""
        return {"job": self.job_id, "name": self.name, "user": user_name(), "own_job": self.own_job,
                "slurm_conf": self.environ.get("SLURM_CONF")}

    @classmethod
    def end_recorded(cls, record: LaunchRecord, term_wait: float = STOP_TERM_WAIT) -> tuple[list[Proc], list[str]]:
        """srun first (SIGTERM: it cancels its step itself), then ``scancel`` the job (or the
        kernel's leftover step in the user's allocation)."""
        ended, words = super().end_recorded(record, term_wait)
        return ended, words + [f"cancelled Slurm job: scancel {call}" for call in cancel_job(record.started)]

    # ------------------------------------------------------------- the keys: MUNGE credentials
    def _munge_path(self) -> str | None:
        if not self._munge_socket:
            self._munge_socket.append(munge_socket(self.environ))
        return self._munge_socket[0]

    def agent_flags(self) -> list[str]:
        path = self._munge_path()
        return ["--munge", *(["--munge-socket", path] if path else [])]

    def seal(self, bootstrap: bytes) -> bytes:
        """srun's stdin crosses the network in clear: the keys go wrapped in MUNGE credentials,
        one per node (nodes may share one munged, which decodes each credential once)."""
        path = self._munge_path()
        try:
            return b"".join(munge_wrap(bootstrap, path) for _ in range(self.config.nodes))
        except (OSError, tunnel.TunnelError) as e:
            raise RankStartError(f"cannot protect the keys for the nodes with MUNGE: {e}. Fix: run the kernel "
                                 "on a machine of the Slurm cluster (munge installed, munged running).") from None

    # ------------------------------------------------------------- the job
    def hello(self, hellos: Mapping[int, dict]) -> None:
        """The job id the agents read from ``SLURM_JOB_ID`` (srun says nothing when the job starts at once)."""
        job = next((h.get("job") for h in hellos.values() if h.get("job")), None)
        if job:
            self.note_job(str(job))

    def note_job(self, job_id: str) -> None:
        job_id = str(job_id).strip()
        if not job_id or job_id == self.job_id:
            return
        if self.job_id is None:
            self.job_id = job_id
            self._record()

    def failure(self) -> str | None:
        """How srun ended. Once Slurm said that it cancelled the job (scancel, the time limit),
        that is the failure, said first, at once: srun may wait seconds for the step to end,
        and then often exits with code 0."""
        words = super().failure()
        if self.cancelled is None or self._stopping:
            return words
        return f"{self.cancelled.words()}.\n{words or self.cancelled.line}"

    def _on_line(self, child: StarterProcess, line: str) -> None:
        if _SRUN_ENDS_STEP.search(line):
            self._srun_ended_step = True
        cancel = parse_cancel_line(line)
        if cancel is not None and self.cancelled is None and not self._srun_ended_step:
            self.cancelled = cancel
            self._phase("ended")
        parsed = parse_srun_line(line)
        if parsed is None:
            return
        kind, job = parsed
        if kind in PHASES:
            self._phase(PHASES[kind])
        if kind in ("queued", "allocated", "granted"):
            self.note_job(job)
        if kind == "queued":
            self._note(f"Waiting in the Slurm queue: job {job} (`squeue -j {job}` says why). The ranks "
                       f"start when Slurm gives it {self.config.nodes} node(s); restarting or shutting "
                       f"down the kernel cancels the job.")
        elif kind == "allocated" and not self._allocated_noted:
            self._allocated_noted = True
            self._note(f"Slurm job {job} has its nodes; starting the node agents.")
        elif kind == "step_busy":
            self._note(f"srun is waiting: Slurm will not start a step in job {job} while other steps hold "
                       f"its CPUs (JupyterLab itself started with srun?). Add --overlap to --slurm-args, "
                       f"or start JupyterLab without srun in the allocation.")

    def _end_started(self, killed: bool) -> None:
        """The kernel's own job always; a step in the user's allocation only when srun was
        killed (srun ending by itself ended its step)."""
        if self.own_job or killed:
            made = cancel_job(self.started())
            if made:
                self.log.info("scancel %s", "; scancel ".join(made))


