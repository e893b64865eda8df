"""Starting the node agents of a multi-node kernel through Slurm's ``srun`` or ``ssh`` (issue 13).

The parent starts one node agent per machine (``python -m dist_kernel.node ...``):

- **Slurm**: one ``srun --nodes N --ntasks N --ntasks-per-node 1 ...`` for all nodes. Inside the
  user's allocation (``SLURM_JOB_ID`` set) it is a job step of that allocation; outside one,
  ``srun`` asks for a job itself (with ``--slurm-args``), says on stderr when the job waits in
  the queue, and the kernel cancels that job at the end. The node rank is ``SLURM_NODEID``.
- **SSH**: one ``ssh -T HOST <agent argv>`` per host; the node rank is passed in the argv.

The agents' keys (the *bootstrap*, one JSON line) go to each agent on its stdin, never in argv
or the environment; srun's ``--input=all`` gives every task the line. Stdin then stays open:
its EOF (the launcher stopped, or the parent died and the kernel closed the pipe) tells each
agent to end everything. Each launcher process's stderr (srun's messages, ssh's errors, the
agents' own stderr) is read continuously into a bounded tail that :meth:`NodeLauncher.failure`
quotes when a launcher process exits.

A SIGKILLed parent cannot stop its launchers: they are recorded in ``RUNTIME_DIR/launch.json``
and the reaper (or the next sweep) ends them and cancels the job (cleanup.end_launch).

Extra ssh options come from the environment variable :data:`SSH_OPTS_ENV`
(``DIST_KERNEL_SSH_OPTS``, shell-split, put before the kernel's own defaults, so it overrides
them: ssh takes the first value it sees for each option).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import re
import shlex
import signal
import socket
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence

from dist_kernel.exceptions import ConfigError
from dist_kernel.parent.cleanup import LAUNCH_FILE, RUNTIME_PREFIX, cancel_slurm, user_name
from dist_kernel.parent.reaper import write_launch

#: extra ssh options for the SSH launcher (shell syntax), e.g. "-i ~/.ssh/cluster -l me -p 2222"
SSH_OPTS_ENV = "DIST_KERNEL_SSH_OPTS"
#: the kernel's own ssh options; the user's (:data:`SSH_OPTS_ENV`) come first and win
SSH_DEFAULT_OPTS = ("-o", "BatchMode=yes", "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=2",
                    "-o", "ConnectTimeout=10")
#: stderr lines kept per launcher process
TAIL_LINES = 40
#: stderr lines quoted by failure()
QUOTED_LINES = 8
#: seconds stop() waits after closing stdin (the agents end themselves), after SIGTERM, after SIGKILL
STOP_GRACE, STOP_TERM_WAIT, STOP_KILL_WAIT = 1.0, 2.0, 0.5

_QUEUED = re.compile(r"\bjob (\d+) queued and waiting for resources")
_ALLOCATED = re.compile(r"\bjob (\d+) has been allocated resources")
_GRANTED = re.compile(r"\b(?:Granted job allocation|jobid) (\d+)\b")
_STEP_BUSY = re.compile(r"\bJob (\d+) step creation temporarily disabled")


# =============================================================================== pure parts
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


def parse_srun_line(line: str) -> tuple[str, str] | None:
    """What a line of srun's stderr says about the job: ("queued", id), ("allocated", id),
    ("granted", id), ("step_busy", id), or None."""
    for kind, pattern in (("queued", _QUEUED), ("allocated", _ALLOCATED), ("granted", _GRANTED),
                          ("step_busy", _STEP_BUSY)):
        m = pattern.search(line)
        if m:
            return kind, m.group(1)
    return None


def exit_words(label: str, returncode: int, tail: Sequence[str]) -> str:
    """``"srun exited with code 1: srun: error: ..."``: how a launcher process ended, with the
    last lines it printed."""
    if returncode < 0:
        try:
            how = f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"was killed by signal {-returncode}"
    else:
        how = f"exited with code {returncode}"
    lines = [ln for ln in tail if ln.strip()][-QUOTED_LINES:]
    if not lines:
        return f"{label} {how} (it printed nothing)"
    return f"{label} {how}: " + "\n".join(lines)


def check_allocation(config, environ: Mapping[str, str] | None = None) -> None:
    """Inside a Slurm allocation, ``--nodes`` must be its node count (a step of N nodes in an
    allocation of M either fails or waits forever; each node is one agent)."""
    env = os.environ if environ is None else environ
    if getattr(config, "launcher", "local") != "slurm" or not env.get("SLURM_JOB_ID"):
        return
    raw = env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")
    if not raw or not raw.strip().isdigit():
        return
    have, want = int(raw), int(getattr(config, "nodes", 1))
    if have != want:
        job = env["SLURM_JOB_ID"]
        raise ConfigError(
            f"--nodes {want} does not match the Slurm allocation this kernel runs in: job {job} has "
            f"{have} node{'s' if have != 1 else ''} (SLURM_JOB_NUM_NODES={have}). Fix: set --nodes {have} "
            f"(one node agent per allocated node), or start JupyterLab in an allocation of {want} "
            f"nodes (salloc --nodes {want} ...), then restart the kernel.")


# =============================================================================== listen address
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


def _run(argv: list[str], environ: Mapping[str, str] | None, timeout: float = 10.0) -> str | None:
    try:
        p = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout,
                           env=dict(os.environ if environ is None else environ))
    except (OSError, subprocess.SubprocessError):
        return None
    return p.stdout if p.returncode == 0 else None


def ssh_hostname(host: str, environ: Mapping[str, str] | None = None) -> str:
    """The host name ssh would connect to for ``host`` (``ssh -G``: aliases in ~/.ssh/config
    and the options in :data:`SSH_OPTS_ENV` applied; makes no connection)."""
    out = _run(["ssh", "-G", *ssh_options(environ), "--", host], environ)
    for line in (out or "").splitlines():
        key, _, value = line.partition(" ")
        if key.lower() == "hostname" and value.strip():
            return value.strip()
    return host.rsplit("@", 1)[-1]


def expand_hostlist(nodelist: str, environ: Mapping[str, str] | None = None) -> list[str]:
    """``n[1-2],gpu07`` -> ``['n1', 'n2', 'gpu07']`` (``scontrol show hostnames``, else parsed here)."""
    out = _run(["scontrol", "show", "hostnames", nodelist], environ)
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
    out = _run(["scontrol", "-o", "show", "node", node], environ)
    m = re.search(r"\bNodeAddr=(\S+)", out or "")
    return m.group(1) if m and m.group(1) not in ("(null)", "") else node


def slurmctld_host(environ: Mapping[str, str] | None = None) -> str | None:
    """The Slurm controller's address (``SlurmctldHost = ctl(10.77.0.1)``: the part in
    parentheses, else the name; older Slurm: ``ControlAddr``/``ControlMachine``)."""
    return parse_slurmctld_host(_run(["scontrol", "show", "config"], environ) or "")


def munge_socket(environ: Mapping[str, str] | None = None) -> str | None:
    """The MUNGE socket Slurm uses (``AuthInfo = socket=PATH``), or None for munged's default."""
    m = re.search(r"^\s*AuthInfo\s*=.*\bsocket=([^,\s]+)", _run(["scontrol", "show", "config"], environ) or "", re.M)
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


def default_listen(config, environ: Mapping[str, str] | None = None) -> str:
    """The parent's address as the nodes should see it: ``--listen`` if given, else this
    machine's address on its route to the nodes.

    ssh: the route to the first host (as ``ssh -G`` resolves it). Slurm inside an allocation:
    the route to the first allocated node that is not this machine (its ``NodeAddr``); outside
    one (or when every node is this machine): the route to the Slurm controller. Raises
    ConfigError naming the host when the route is unknown or is loopback.
    """
    if getattr(config, "listen", None):
        return config.listen
    env = os.environ if environ is None else environ
    if getattr(config, "launcher", "local") == "ssh":
        hosts = list(getattr(config, "hosts", ()) or ())
        if not hosts:
            raise ConfigError("--launcher ssh needs --hosts to find the route to the nodes.")
        return _checked_source("the first host", ssh_hostname(hosts[0], env))
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


# =============================================================================== launchers
class _Child:
    """One launcher process (srun, or ssh to one host) and what it printed."""

    def __init__(self, label: str, popen: subprocess.Popen, host: str | None) -> None:
        self.label = label
        self.popen = popen
        self.host = host
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.reader: threading.Thread | None = None
        self.exited_at: float | None = None  # monotonic time its exit was seen
        self.read_all = False  # its last lines were waited for once (see failure())

    def exited(self) -> bool:
        if self.popen.poll() is None:
            return False
        if self.exited_at is None:
            self.exited_at = time.monotonic()
        return True


class NodeLauncher:
    """Starts one node agent per node and ends them; see the module docstring.

    ``agent_argv(node_rank)`` is the argv of the agent of one node (``None`` for Slurm, where
    one argv serves every node and the agent reads ``SLURM_NODEID``). ``on_note`` gets progress
    for the first cell (waiting in the Slurm queue, ...) and ``on_failure`` the words of the
    first launcher process that exits unexpectedly; both are called in the event loop that
    ran :meth:`start`. ``environ``: the environment of the launcher processes (default
    ``os.environ``; it also says whether the kernel runs inside a Slurm allocation).
    """

    kind = "base"

    def __init__(self, config, agent_argv: Callable[[int | None], list[str]], runtime_dir: str,
                 log: logging.Logger, on_note: Callable[[str], None],
                 on_failure: Callable[[str], None] | None = None,
                 environ: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.agent_argv = agent_argv
        self.runtime_dir = runtime_dir
        self.log = log
        self.on_note = on_note
        self.on_failure = on_failure
        self.environ = dict(os.environ if environ is None else environ)
        self.job_id: str | None = None
        self._children: list[_Child] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.RLock()
        self._stop_lock = threading.Lock()
        self._stopping = False
        self._stopped = False
        self._failure_reported = False

    # ------------------------------------------------------------- what a launcher provides
    def commands(self) -> list[tuple[str, str | None, list[str]]]:
        """(label, host, argv) of each launcher process."""
        raise NotImplementedError

    def hosts(self) -> list[str] | None:
        return None

    def _slurm_record(self) -> dict | None:
        return None

    def _on_line(self, child: _Child, line: str) -> None:
        pass

    # ------------------------------------------------------------- start
    async def start(self, bootstrap: bytes) -> None:
        """Start the launcher processes and give each the bootstrap line on its stdin, which
        stays open. Returns at once (does not wait for the queue or the agents)."""
        self._loop = asyncio.get_running_loop()
        try:
            self._spawn(bootstrap)  # fork+exec and a pipe write of one line: no waiting
        except ConfigError:
            await self.stop()
            raise

    def _spawn(self, bootstrap: bytes) -> None:
        if not bootstrap.endswith(b"\n"):
            raise ValueError("the bootstrap must be whole lines, ending in a newline")
        for label, host, argv in self.commands():
            self.log.info("starting %s: %s", label, shlex.join(argv))
            try:
                popen = subprocess.Popen(
                    argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    env=self.environ, start_new_session=True)  # a Ctrl-C at the parent is not for srun
            except OSError as e:
                raise ConfigError(f"cannot run {argv[0]} for {label}: {e.strerror or e}. Fix: install it "
                                  f"or put it on the kernel's PATH, then restart the kernel.") from None
            child = _Child(label, popen, host)
            with self._lock:
                self._children.append(child)
            child.reader = threading.Thread(target=self._read, args=(child,), daemon=True,
                                            name=f"dist_kernel {label}")
            child.reader.start()
            self._record()
            try:
                assert popen.stdin is not None
                popen.stdin.write(bootstrap)
                popen.stdin.flush()
            except OSError:  # it died at once: failure() says why
                pass

    def send(self, lines: bytes) -> None:
        """More lines for every agent's stdin (fresh MUNGE-wrapped keys once the job left the queue)."""
        with self._lock:
            children = list(self._children)
        for child in children:
            try:
                assert child.popen.stdin is not None
                child.popen.stdin.write(lines)
                child.popen.stdin.flush()
            except (OSError, ValueError):  # exited or closed: failure() says why
                continue

    def _read(self, child: _Child) -> None:
        """Read a launcher process's output line by line until it closes; note its exit."""
        assert child.popen.stdout is not None
        for raw in iter(child.popen.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\r\n")
            child.tail.append(line)
            self.log.info("%s: %s", child.label, line)
            try:
                self._on_line(child, line)
            except Exception:  # noqa: BLE001 - a parse problem must not stop the reading
                self.log.exception("while reading %s", child.label)
        while True:  # a timeout: poll() in other threads gets no answer while wait() blocks
            try:
                child.popen.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:  # it closed its output but runs on
                if self._stopped:
                    return
        child.exited()
        if not self._stopping and not self._failure_reported and self.on_failure is not None:
            words = self.failure()
            if words:
                self._failure_reported = True
                self._call_in_loop(self.on_failure, words)

    def _call_in_loop(self, fn: Callable[[str], None], text: str) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(fn, text)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def _note(self, text: str) -> None:
        self.log.info("%s", text)
        self._call_in_loop(self.on_note, text)

    def _record(self) -> None:
        """launch.json for the reaper and the sweep (skipped once stopped)."""
        if self._stopped or not os.path.isdir(self.runtime_dir):
            return
        try:
            write_launch(self.runtime_dir, self.local_pids(), self._slurm_record())
        except OSError as e:
            self.log.warning("cannot write %s: %s", LAUNCH_FILE, e)

    # ------------------------------------------------------------- state
    def local_pids(self) -> list[int]:
        """The launcher processes' pids (srun, ssh), for the reaper."""
        with self._lock:
            return [c.popen.pid for c in self._children]

    def tail(self) -> list[str]:
        """The last lines every launcher process printed, each prefixed by its label."""
        with self._lock:
            return [f"{c.label}: {ln}" for c in self._children for ln in list(c.tail)]

    def failure(self) -> str | None:
        """None while every launcher process runs (or once stop() was called); else how the
        first one to exit ended, with its last lines."""
        if self._stopping:
            return None
        with self._lock:
            children = list(self._children)
        gone = [c for c in children if c.exited()]
        if not gone:
            return None
        first = min(gone, key=lambda c: c.exited_at or 0.0)
        if not first.read_all and first.reader is not None and first.reader is not threading.current_thread():
            first.reader.join(timeout=0.5)  # its last lines (once: a grandchild may hold the pipe)
            first.read_all = True
        return exit_words(first.label, first.popen.returncode, list(first.tail))

    def note_job(self, job_id: str) -> None:
        """The Slurm job id, as an agent reported it (srun says nothing when the job starts at once)."""

    def expect_exit(self) -> None:
        """The launcher processes are about to end on purpose (the parent told the agents to
        stop): from now on their exit is no failure. :meth:`stop` still ends what is left."""
        self._stopping = True

    # ------------------------------------------------------------- stop
    async def stop(self) -> None:
        """End every launcher process and the kernel's Slurm job; idempotent, a few seconds at most."""
        await asyncio.get_running_loop().run_in_executor(None, self.stop_sync)

    def stop_sync(self) -> None:
        """:meth:`stop` for code that cannot await (atexit)."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopping = True
            t0 = time.monotonic()
            with self._lock:
                children = list(self._children)
            for c in children:  # EOF: the agents end their ranks and themselves
                try:
                    if c.popen.stdin is not None:
                        c.popen.stdin.close()
                except OSError:
                    pass
            killed = False
            for sig, wait in ((None, STOP_GRACE), (signal.SIGTERM, STOP_TERM_WAIT),
                              (signal.SIGKILL, STOP_KILL_WAIT)):
                running = [c for c in children if c.popen.poll() is None]
                if not running:
                    break
                if sig is not None:
                    killed = killed or sig == signal.SIGKILL
                    for c in running:
                        try:
                            c.popen.send_signal(sig)
                        except OSError:
                            pass
                deadline = time.monotonic() + wait
                while time.monotonic() < deadline and any(c.popen.poll() is None for c in running):
                    time.sleep(0.02)
            self._cancel(killed)
            for c in children:
                if c.reader is not None:
                    c.reader.join(timeout=0.5)
                if c.popen.stdout is not None:
                    try:
                        c.popen.stdout.close()
                    except OSError:
                        pass
            self._stopped = True
            try:
                os.unlink(os.path.join(self.runtime_dir, LAUNCH_FILE))
            except OSError:
                pass
            self.log.info("%s launcher stopped in %.2fs", self.kind, time.monotonic() - t0)

    def _cancel(self, srun_killed: bool) -> None:
        """Slurm: cancel the kernel's job (or its leftover step in the user's allocation)."""


class SlurmLauncher(NodeLauncher):
    """One ``srun`` starts the agents on every node; see :func:`srun_argv`."""

    kind = "slurm"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        inside = self.environ.get("SLURM_JOB_ID")
        #: True when srun asks for the job itself (and the kernel cancels it); False inside the
        #: user's allocation, which the kernel never cancels
        self.own_job = not inside
        self.job_id = inside or None
        self.name = effective_job_name(getattr(self.config, "slurm_args", ()) or (), job_name(self.runtime_dir))
        self._allocated_noted = False

    def commands(self) -> list[tuple[str, str | None, list[str]]]:
        argv = srun_argv(int(self.config.nodes), tuple(getattr(self.config, "slurm_args", ()) or ()),
                         self.agent_argv(None), job_name(self.runtime_dir))
        return [("srun", None, argv)]

    def _slurm_record(self) -> dict | None:
        return {"job": self.job_id, "name": self.name, "user": user_name(), "own_job": self.own_job,
                "slurm_conf": self.environ.get("SLURM_CONF")}

    def note_job(self, job_id: str) -> None:
        job_id = str(job_id).strip()
        if not job_id or job_id == self.job_id:
            return
        if self.job_id is None:
            self.job_id = job_id
            self._record()

    def _on_line(self, child: _Child, line: str) -> None:
        parsed = parse_srun_line(line)
        if parsed is None:
            return
        kind, job = parsed
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

    def _cancel(self, srun_killed: bool) -> None:
        if self.own_job or srun_killed:
            made = cancel_slurm(self._slurm_record() or {})
            if made:
                self.log.info("scancel %s", "; scancel ".join(made))


class SshLauncher(NodeLauncher):
    """``ssh -T HOST <agent argv>`` for each host; node i is ``hosts[i]``."""

    kind = "ssh"

    def hosts(self) -> list[str] | None:
        return list(getattr(self.config, "hosts", ()) or ())

    def commands(self) -> list[tuple[str, str | None, list[str]]]:
        return [(f"ssh to {host}", host, ssh_argv(host, self.agent_argv(i), self.environ))
                for i, host in enumerate(self.hosts() or [])]


def make_launcher(config, agent_argv: Callable[[int | None], list[str]], runtime_dir: str,
                  log: logging.Logger, on_note: Callable[[str], None],
                  on_failure: Callable[[str], None] | None = None,
                  environ: Mapping[str, str] | None = None) -> NodeLauncher:
    """The launcher for ``config.launcher`` (slurm or ssh); checks an allocation's node count."""
    launcher = getattr(config, "launcher", "local")
    if launcher == "slurm":
        check_allocation(config, environ)
        return SlurmLauncher(config, agent_argv, runtime_dir, log, on_note, on_failure, environ)
    if launcher == "ssh":
        if not getattr(config, "hosts", ()):
            raise ConfigError("--launcher ssh needs --hosts: the machines to start the ranks on, node 0 first.")
        return SshLauncher(config, agent_argv, runtime_dir, log, on_note, on_failure, environ)
    raise ValueError(f"no node launcher for --launcher {launcher}")
