"""Starting node agents through Slurm's srun or ssh (dist_kernel/parent/launch/node_starters/; issue 13).

The pure parts (command lines, srun's messages, the words of a failure, the allocation check)
are checked without a cluster; the launchers themselves against the two-node lab of
``tests/cluster/lab.sh`` (a real Slurm and one sshd per node in network namespaces), with a
stand-in agent that reports the line it read on stdin. Only lab addresses (10.77.0.0/24).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from dist_kernel import cleanup
from dist_kernel.cleanup import LaunchRecord
from dist_kernel.exceptions import ConfigError
from dist_kernel.options import KernelConfig
from dist_kernel.parent.launch.node_starters import base as starter_base
from dist_kernel.parent.launch.node_starters import (
    default_listen,
    end_launch,
    make_node_starter,
    node_starter_class,
    slurm,
    ssh,
)
from dist_kernel.parent.launch.node_starters.base import NodeStarter, exit_words
from dist_kernel.parent.launch.node_starters.slurm import SlurmNodeStarter, check_allocation, parse_srun_line, srun_argv
from dist_kernel.parent.launch.node_starters.ssh import SshNodeStarter, ssh_argv
from dist_kernel.parent.reaper import reap

ROOT = Path(__file__).resolve().parents[2]
LOG = logging.getLogger("test_cluster_launch")
BOOTSTRAP = b'{"key": "s3cret-bootstrap"}\n'

# a stand-in node agent: reads the bootstrap line, reports it, waits for EOF on stdin
AGENT = ("import sys, os, socket\n"
         "line = sys.stdin.readline()\n"
         "print('got', socket.gethostname(), os.environ.get('SLURM_NODEID'), os.environ.get('SLURM_JOB_ID'),"
         " len(line), repr(sys.argv[1:]), flush=True, file=sys.stderr)\n"
         "sys.stdin.read()\n"
         "print('eof', socket.gethostname(), flush=True, file=sys.stderr)\n")
# a stuck one: reads the bootstrap, then never looks at stdin again (ignores EOF)
STUCK_AGENT = ("import sys, os, socket, time\n"
               "line = sys.stdin.readline()\n"
               "print('got', socket.gethostname(), os.environ.get('SLURM_NODEID'), os.environ.get('SLURM_JOB_ID'),"
               " len(line), flush=True, file=sys.stderr)\n"
               "time.sleep(600)\n")


def config(**kw) -> KernelConfig:
    """A kernel's configuration as options.py makes it (1 rank per node unless told)."""
    base = {"launcher": "slurm", "nodes": 2, "ranks_per_node": 1, "hosts": (), "slurm_args": (),
            "listen": None, "port_range": None, "startup_timeout": 30.0}
    cfg = {**base, **kw}
    return KernelConfig(world_size=cfg["nodes"] * cfg["ranks_per_node"], backend="gloo", **cfg)


# =============================================================================== pure parts
def test_srun_runs_one_agent_per_node_with_the_users_args_before_the_agent():
    argv = srun_argv(2, ("--partition", "gpu", "--time=1:00:00"), ["py", "-m", "dist_kernel.node", "--parent", "tcp://a:1"],
                     "dist_kernel-12-abc")
    assert argv[:argv.index("--partition")] == [
        "srun", "--nodes", "2", "--ntasks", "2", "--ntasks-per-node", "1", "--kill-on-bad-exit=1",
        "--input=all", "--export=ALL", "--job-name", "dist_kernel-12-abc"]
    assert argv[argv.index("--partition"):] == ["--partition", "gpu", "--time=1:00:00", "py", "-m",
                                                "dist_kernel.node", "--parent", "tcp://a:1"]


def test_the_job_name_is_the_runtime_dirs_unless_the_user_names_the_job():
    assert slurm.job_name("/tmp/dist_kernel-42-x1y2z3") == "dist_kernel-42-x1y2z3"
    assert slurm.job_name("/elsewhere/run") == f"dist_kernel-{os.getpid()}"
    assert slurm.effective_job_name(("-p", "a"), "ours") == "ours"
    assert slurm.effective_job_name(("-J", "mine", "-p", "a"), "ours") == "mine"
    assert slurm.effective_job_name(("--job-name=mine",), "ours") == "mine"
    assert slurm.effective_job_name(("-Jmine", "--job-name", "last"), "ours") == "last"


def test_ssh_takes_the_users_options_first_and_quotes_the_remote_command(monkeypatch):
    agent = ["/opt/my env/bin/python", "-m", "dist_kernel.node", "--parent", "tcp://10.0.0.1:5000",
             "--node-rank", "1", "it's $HOME; `x`"]
    env = {ssh.SSH_OPTS_ENV: "-p 2222 -o 'ProxyJump=jump host' -l me"}
    argv = ssh_argv("node7", agent, env)
    assert argv[:3] == ["ssh", "-T", "-x"]
    user = ["-p", "2222", "-o", "ProxyJump=jump host", "-l", "me"]
    i = argv.index("-p")
    assert argv[i:i + len(user)] == user
    # ssh takes the first value of an option: the user's come before the kernel's defaults
    assert argv.index("ConnectTimeout=10") > i + len(user) and argv.index("BatchMode=yes") > i
    assert argv[-3:-1] == ["--", "node7"]
    assert shlex.split(argv[-1]) == agent  # what the remote shell runs
    assert ssh_argv("n", ["a"], {})[:-3] == ["ssh", "-T", "-x", "-a", *ssh.SSH_DEFAULT_OPTS]
    with pytest.raises(ConfigError, match=ssh.SSH_OPTS_ENV):
        ssh_argv("n", ["a"], {ssh.SSH_OPTS_ENV: "-o 'unclosed"})


@pytest.mark.parametrize("line, parsed", [
    ("srun: job 123 queued and waiting for resources", ("queued", "123")),
    ("srun: job 123 has been allocated resources", ("allocated", "123")),
    ("srun: Granted job allocation 77", ("granted", "77")),
    ("srun: jobid 5: nodes(2):`n[1-2]', cpu counts: 1(x2)", ("granted", "5")),
    ("srun: Job 9 step creation temporarily disabled, retrying (Requested nodes are busy)", ("step_busy", "9")),
    ("srun: error: Unable to allocate resources: Invalid partition name specified", None),
    ("srun: Requested partition configuration not available now", None),
    ("dist_kernel node agent on n1: cannot reach the parent", None),
])
def test_srun_messages_about_the_job_are_recognised(line, parsed):
    assert parse_srun_line(line) == parsed


@pytest.mark.parametrize("line, said", [
    ("slurmstepd-n1: error: *** STEP 21.0 ON n1 CANCELLED AT 2026-11-25T16:39:24 ***",
     ("21", "n1", "", "Slurm job 21 was cancelled (scancel)")),
    ("srun: error: *** JOB 7 ON n2 CANCELLED AT 2026-01-01T10:00:00 DUE TO TIME LIMIT ***",
     ("7", "n2", "time limit", "Slurm job 7 reached its time limit (--time)")),
    ("slurmstepd: error: *** STEP 6.0 ON n1 CANCELLED AT 2026-01-01T10:00:00 DUE TO NODE FAILURE ***",
     ("6", "n1", "node failure", "Slurm job 6 ended: node n1 failed")),
])
def test_slurms_word_that_it_cancelled_the_job_is_read_as_a_typed_event(line, said):
    cancel = slurm.parse_cancel_line(line)
    assert (cancel.job, cancel.node, cancel.reason, cancel.words()) == said and cancel.line == line
    assert slurm.parse_cancel_line("srun: Job step aborted: Waiting up to 5 seconds for job step to finish.") is None


def test_a_cancelled_job_is_the_failure_said_first_even_before_srun_exits_with_code_0(tmp_path):
    line = "slurmstepd-n1: error: *** STEP 5.0 ON n1 CANCELLED AT 2026-11-25T16:39:24 ***"

    class FakeSrun(SlurmNodeStarter):
        def commands(self):
            return [("srun", None, [sys.executable, "-c", f"import sys, time; print({line!r}, flush=True); "
                                                          "sys.stdin.readline(); time.sleep(1); sys.exit(0)"])]

    async def go():
        fake = FakeSrun(config(), lambda i: [], runtime(tmp_path), LOG, print, environ={})
        await fake.start(BOOTSTRAP)
        await until(lambda: fake.failure() is not None, 10, allow_failure=True)
        early = fake.failure()
        await until(lambda: fake._children[0].popen.poll() is not None, 10, allow_failure=True)
        await asyncio.sleep(0.2)
        late = fake.failure()
        fake.expect_exit()
        await fake.stop()
        return early, late

    early, late = asyncio.run(go())
    assert early == f"Slurm job 5 was cancelled (scancel).\n{line}"
    assert late.startswith("Slurm job 5 was cancelled (scancel).\nsrun exited with code 0: ") and line in late


def test_a_step_that_srun_ends_itself_after_a_task_failed_is_no_cancellation(tmp_path):
    # --kill-on-bad-exit: srun says which task failed, ends the step, then slurmstepd says CANCELLED
    lines = ["srun: error: n2: task 1: Killed", "srun: launch/slurm: _step_signal: Terminating StepId=76.0",
             "slurmstepd-n1: error: *** STEP 76.0 ON n1 CANCELLED AT 2026-11-25T17:18:40 ***",
             "srun: error: n1: task 0: Terminated"]

    class FakeSrun(SlurmNodeStarter):
        def commands(self):
            return [("srun", None, [sys.executable, "-c", f"import sys; sys.stdin.readline(); print({chr(10).join(lines)!r});"
                                                          "sys.exit(137)"])]

    async def go():
        fake = FakeSrun(config(), lambda i: [], runtime(tmp_path), LOG, print, environ={})
        await fake.start(BOOTSTRAP)
        await until(lambda: fake.failure() is not None, 10, allow_failure=True)
        words = fake.failure()
        fake.expect_exit()
        await fake.stop()
        return words

    assert asyncio.run(go()) == "srun exited with code 137: " + "\n".join(lines)


def test_failure_words_quote_the_last_lines():
    tail = ["srun: error: invalid partition specified: nope",
            "srun: error: Unable to allocate resources: Invalid partition name specified"]
    assert exit_words("srun", 1, tail) == (
        "srun exited with code 1: srun: error: invalid partition specified: nope\n"
        "srun: error: Unable to allocate resources: Invalid partition name specified")
    assert exit_words("ssh to n2", 255, ["", "ssh: connect to host n2 port 22: Connection refused"]) == \
        "ssh to n2 exited with code 255: ssh: connect to host n2 port 22: Connection refused"
    assert exit_words("srun", -9, []) == "srun was killed by SIGKILL (it printed nothing)"
    many = [f"line {i}" for i in range(30)]
    assert exit_words("srun", 2, many).endswith("line 22\nline 23\nline 24\nline 25\nline 26\nline 27\nline 28\nline 29")
    assert "line 21" not in exit_words("srun", 2, many)


def test_inside_an_allocation_nodes_must_match_it():
    check_allocation(config(nodes=2), {})  # outside an allocation: srun asks for one
    check_allocation(config(nodes=2), {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "2"})
    check_allocation(config(nodes=2), {"SLURM_JOB_ID": "7", "SLURM_NNODES": "2"})
    SshNodeStarter.check(config(launcher="ssh", nodes=2), {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "4"})  # no Slurm
    with pytest.raises(ConfigError) as e:
        check_allocation(config(nodes=2), {"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "4"})
    assert "--nodes 2" in str(e.value) and "job 7 has 4 nodes" in str(e.value) and "--nodes 4" in str(e.value)
    with pytest.raises(ConfigError, match="--nodes 3 does not match"):
        make_node_starter(config(nodes=3), lambda i: ["a"], "/tmp/x", LOG, print,
                          environ={"SLURM_JOB_ID": "7", "SLURM_NNODES": "1"})


def test_slurm_hostlists_and_controller_lines_are_read():
    assert slurm._expand_hostlist("n[1-2],gpu[07-09,12],login") == [
        "n1", "n2", "gpu07", "gpu08", "gpu09", "gpu12", "login"]
    assert slurm._expand_hostlist("r[1-2]-n[1-2]") == ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]
    assert slurm.parse_slurmctld_host("SlurmctldHost[0]        = ctl(10.77.0.1)\n") == "10.77.0.1"
    assert slurm.parse_slurmctld_host("x = 1\nSlurmctldHost[0] = head01\nSlurmctldHost[1] = head02\n") == "head01"
    assert slurm.parse_slurmctld_host("ControlMachine = old\nControlAddr = 10.1.1.1\n") == "10.1.1.1"
    assert slurm.parse_slurmctld_host("nothing here") is None


def test_a_listen_address_on_the_loopback_route_or_no_route_is_an_error_naming_the_host():
    with pytest.raises(ConfigError) as e:
        default_listen(config(launcher="ssh", hosts=("127.0.0.1",)), {})
    assert "127.0.0.1" in str(e.value) and "--listen" in str(e.value) and "loopback" in str(e.value)
    with pytest.raises(ConfigError) as e:
        default_listen(config(launcher="ssh", hosts=("no-such-host.invalid",)), {})
    assert "no-such-host.invalid" in str(e.value) and "--listen" in str(e.value)
    assert default_listen(config(launcher="ssh", hosts=("x",), listen="10.9.9.9"), {}) == "10.9.9.9"


# =============================================================================== without a cluster
class FakeStarter(NodeStarter):
    """Local processes standing in for srun/ssh."""

    kind = "fake"

    def __init__(self, argvs, runtime_dir, **kw):
        super().__init__(config(launcher="fake"), lambda i: [], runtime_dir, LOG, kw.pop("on_note", print), **kw)
        self.argvs = argvs

    def commands(self):
        return [(f"fake{i}", None, argv) for i, argv in enumerate(self.argvs)]


def runtime(tmp_path: Path) -> str:
    d = tmp_path / f"dist_kernel-{os.getpid()}-launch"
    d.mkdir()
    return str(d)


def test_each_launcher_process_reads_the_bootstrap_and_eof_when_stopped_and_is_recorded(tmp_path):
    out = tmp_path / "out"
    echo = [sys.executable, "-c", f"import sys; l = sys.stdin.readline(); rest = sys.stdin.read();"
                                  f"open({str(out)!r} + sys.argv[1], 'w').write(repr((l, rest)))"]
    rd = runtime(tmp_path)

    async def go():
        fake = FakeStarter([echo + ["0"], echo + ["1"]], rd)
        await fake.start(BOOTSTRAP)
        record = cleanup.read_launch(rd)
        assert [p for p, _ in record.pids] == fake.local_pids() and (record.kind, record.started) == ("fake", {})
        await asyncio.sleep(0.3)
        assert fake.failure() is None  # both wait on stdin
        t0 = time.monotonic()
        await fake.stop()
        assert time.monotonic() - t0 < 1.0  # they ended on EOF, no signal needed
        await fake.stop()  # idempotent
        assert cleanup.read_launch(rd) is None
        assert fake.failure() is None  # stopped on purpose

    asyncio.run(go())
    for i in "01":
        assert (tmp_path / f"out{i}").read_text() == repr((BOOTSTRAP.decode(), ""))


def test_a_launcher_process_that_exits_is_a_failure_with_its_last_lines(tmp_path):
    failures = []

    async def go():
        fake = FakeStarter([[sys.executable, "-c", "import sys, time; sys.stdin.readline(); time.sleep(30)"],
                             [sys.executable, "-c", "import sys; print('srun: error: Unable to allocate resources: "
                                                    "nope', file=sys.stderr); sys.exit(1)"]],
                            runtime(tmp_path), on_failure=failures.append)
        await fake.start(BOOTSTRAP)
        await until(lambda: fake.failure() is not None, 10)
        words = fake.failure()
        await asyncio.sleep(0.1)  # on_failure runs in the loop
        await fake.stop()
        return words

    words = asyncio.run(go())
    assert words == "fake1 exited with code 1: srun: error: Unable to allocate resources: nope"
    assert failures == [words]


def test_stop_is_bounded_even_when_a_process_ignores_eof_and_sigterm(tmp_path):
    stubborn = [sys.executable, "-c", "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
                                      "sys.stdin.readline(); print('ready', flush=True); time.sleep(60)"]

    async def go():
        fake = FakeStarter([stubborn], runtime(tmp_path))
        await fake.start(BOOTSTRAP)
        await until(fake.tail, 10)
        (pid,) = fake.local_pids()
        t0 = time.monotonic()
        await fake.stop()
        return pid, time.monotonic() - t0, fake._children[0].popen.returncode

    pid, took, rc = asyncio.run(go())
    assert rc == -signal.SIGKILL and not cleanup.pid_alive(pid)
    assert starter_base.STOP_GRACE + starter_base.STOP_TERM_WAIT - 0.1 < took < 5.0


def test_a_missing_srun_is_an_error_that_says_so(tmp_path):
    launcher = SlurmNodeStarter(config(), lambda i: ["agent"], runtime(tmp_path), LOG, print,
                             environ={"PATH": str(tmp_path)})
    with pytest.raises(ConfigError, match="cannot run srun"):
        asyncio.run(launcher.start(BOOTSTRAP))
    assert cleanup.read_launch(launcher.runtime_dir) is None


def test_an_expected_exit_is_no_failure(tmp_path):
    failures = []

    async def go():
        fake = FakeStarter([[sys.executable, "-c", "import sys; sys.stdin.readline(); sys.exit(0)"]],
                            runtime(tmp_path), on_failure=failures.append)
        fake.expect_exit()
        await fake.start(BOOTSTRAP)
        await until(lambda: fake._children[0].popen.poll() is not None, 10)
        await asyncio.sleep(0.2)
        assert fake.failure() is None
        await fake.stop()

    asyncio.run(go())
    assert failures == []


def test_a_dead_kernels_launchers_are_ended_by_the_sweep_and_a_reused_pid_is_spared(tmp_path):
    stale = tmp_path / f"dist_kernel-{dead_pid()}-abc"
    stale.mkdir()
    launcher = subprocess.Popen(["sleep", "60"], start_new_session=True)
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        LaunchRecord.of("ssh", [launcher.pid, stranger.pid]).write(str(stale))
        record = json.loads((stale / cleanup.LAUNCH_FILE).read_text())
        record["pids"][1][1] += 1  # as if the pid now named another process
        (stale / cleanup.LAUNCH_FILE).write_text(json.dumps(record))
        report = cleanup.sweep([str(tmp_path)], end_launch=end_launch)
        assert launcher.wait(timeout=5) == -signal.SIGTERM  # SIGTERM first: srun cancels its step
        assert launcher.pid in {p.pid for p in report.killed} and stranger.poll() is None
        assert report.removed == [str(stale)] and report.released == []
    finally:
        for p in (launcher, stranger):
            p.kill()
            p.wait()


def test_the_reaper_ends_launchers_with_sigterm_then_sigkill(tmp_path):
    rd = runtime(tmp_path)
    polite = subprocess.Popen(["sleep", "60"], start_new_session=True)
    deaf = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
                                                   "print('x', flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, start_new_session=True)
    deaf.stdout.readline()
    try:
        LaunchRecord.of("ssh", [polite.pid, deaf.pid]).write(rd)
        reap(rd)
        assert polite.wait(timeout=1) == -signal.SIGTERM and deaf.wait(timeout=1) == -signal.SIGKILL
        assert not os.path.exists(rd)
    finally:
        for p in (polite, deaf):
            p.kill()
            p.wait()


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


# =============================================================================== the lab
@pytest.fixture(scope="module")
def lab(lab):
    """The lab (tests/cluster/conftest.py) as this module's commands need it: over this process's
    environment, with the lab's ssh options where the launcher reads them."""
    return {**os.environ, **lab, ssh.SSH_OPTS_ENV: lab["LAB_SSH_OPTS"]}


def lab_run(lab, *argv: str, check: bool = False) -> str:
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=30, env=lab)
    if check:
        assert p.returncode == 0, p.stderr
    return p.stdout + p.stderr


def node_procs(token: str, job: str | None = None) -> list[str]:
    """Processes in the lab's node namespaces that belong to a test: its token in their command
    line, or a slurmstepd of its job."""
    from cluster_lab import cmdline, netns_pids
    found = []
    for ns in ("n1", "n2"):
        for pid in netns_pids(ns):
            cmd = cmdline(pid)
            if (token in cmd or (job and f"[{job}." in cmd)) and cleanup.pid_alive(pid):
                found.append(f"{ns} pid {pid}: {cmd}")
    return found


def nothing_left(lab, token: str, name: str | None, job: str | None, timeout: float = 5.0) -> float:
    """Wait until nothing of the test is on the nodes or in the queue; the seconds it took."""
    t0 = time.monotonic()
    while True:
        procs = node_procs(token, job)
        queue = lab_run(lab, "squeue", "-h", "-o", "%i %j") if name else ""
        jobs = [ln for ln in queue.splitlines() if name in ln.split()[1:]] if name else []
        if not procs and not jobs:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            pytest.fail(f"left behind after {timeout}s: {procs} {jobs}")
        time.sleep(0.1)


def launched(lab, kind: str, tmp_path: Path, agent: str = AGENT, notes: list | None = None, **cfg):
    token = f"dktest-{uuid.uuid4().hex[:10]}"
    rd = tmp_path / f"dist_kernel-{os.getpid()}-{token[-6:]}"
    rd.mkdir()
    cls = node_starter_class(kind)
    cfg.setdefault("hosts", ("10.77.0.11", "10.77.0.12") if kind == "ssh" else ())
    cfg.setdefault("nodes", len(cfg["hosts"]) if kind == "ssh" else 2)
    launcher = cls(config(launcher=kind, **cfg),
                   lambda node: [sys.executable, "-c", agent, token, *([] if node is None else [str(node)])],
                   str(rd), LOG, (notes if notes is not None else []).append, environ=lab)
    return launcher, token


async def until(predicate, timeout: float, launcher: NodeStarter | None = None, allow_failure: bool = False):
    deadline = time.monotonic() + timeout
    while not predicate():
        if launcher is not None and not allow_failure:
            assert launcher.failure() is None, launcher.failure()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out; output: {launcher.tail() if launcher else ''}")
        await asyncio.sleep(0.05)


def got_lines(launcher: NodeStarter) -> list[list[str]]:
    return [ln.split(": ", 1)[1].split(" ", 5) for ln in launcher.tail() if ln.split(": ", 1)[1].startswith("got ")]


def test_srun_gives_the_bootstrap_to_an_agent_on_each_node_and_stop_leaves_nothing(lab, tmp_path):
    launcher, token = launched(lab, "slurm", tmp_path)

    async def go():
        await launcher.start(BOOTSTRAP)
        await until(lambda: len(got_lines(launcher)) == 2, 20, launcher)
        got = sorted(got_lines(launcher))
        assert [(g[1], g[2], g[4]) for g in got] == [("n1", "0", str(len(BOOTSTRAP))), ("n2", "1", str(len(BOOTSTRAP)))]
        assert got[0][3] == got[1][3] != "None"
        launcher.hello({0: {"job": got[0][3]}})  # as the remote launcher hands it the agents' hellos (SLURM_JOB_ID)
        assert launcher.job_id == got[0][3]
        record = cleanup.read_launch(launcher.runtime_dir)
        assert (record.kind, record.started["job"]) == ("slurm", launcher.job_id)
        assert node_procs(token)
        t0 = time.monotonic()
        await launcher.stop()
        return time.monotonic() - t0

    took = asyncio.run(go())
    print(f"srun stop() took {took:.2f}s")
    assert took < 2.0  # the agents end on EOF
    assert sum(ln.endswith(("eof n1", "eof n2")) for ln in launcher.tail()) == 2
    nothing_left(lab, token, launcher.name, launcher.job_id)


def test_a_stuck_agent_under_srun_is_ended_and_its_job_cancelled_within_seconds(lab, tmp_path):
    launcher, token = launched(lab, "slurm", tmp_path, agent=STUCK_AGENT)

    async def go():
        await launcher.start(BOOTSTRAP)
        await until(lambda: len(got_lines(launcher)) == 2, 20, launcher)
        t0 = time.monotonic()
        await launcher.stop()
        return time.monotonic() - t0

    took = asyncio.run(go())
    print(f"srun stop() with stuck agents took {took:.2f}s")
    assert took < 5.0
    nothing_left(lab, token, launcher.name, None)


def test_waiting_in_the_slurm_queue_is_said_with_the_job_id_and_stop_cancels_the_job(lab, tmp_path):
    blocker_name = f"dktest-blocker-{uuid.uuid4().hex[:6]}"
    blocker = lab_run(lab, "sbatch", "--parsable", "--exclusive", "-N2", "--job-name", blocker_name,
                      "--output=/dev/null", "--wrap", "sleep 120", check=True).strip().split(";")[0]
    notes: list[str] = []
    launcher, token = launched(lab, "slurm", tmp_path, notes=notes)
    try:
        async def go():
            await launcher.start(BOOTSTRAP)
            await until(lambda: launcher.job_id is not None, 15, launcher)
            await until(lambda: notes, 2, launcher)
            assert notes[0].startswith(f"Waiting in the Slurm queue: job {launcher.job_id} ")
            assert lab_run(lab, "squeue", "-h", "-j", launcher.job_id, "-o", "%T").strip() == "PENDING"
            assert launcher.failure() is None
            # the nodes free up: srun says so and the agents get the bootstrap
            lab_run(lab, "scancel", blocker, check=True)
            await until(lambda: len(got_lines(launcher)) == 2, 30, launcher)
            assert any(n.startswith(f"Slurm job {launcher.job_id} has its nodes") for n in notes), notes
            assert {g[3] for g in got_lines(launcher)} == {launcher.job_id}
            await launcher.stop()

        asyncio.run(go())
        nothing_left(lab, token, launcher.name, launcher.job_id)
    finally:
        lab_run(lab, "scancel", blocker)
        launcher.stop_sync()


def test_stop_while_queued_cancels_the_pending_job(lab, tmp_path):
    blocker = lab_run(lab, "sbatch", "--parsable", "--exclusive", "-N2", "--job-name",
                      f"dktest-blocker-{uuid.uuid4().hex[:6]}", "--output=/dev/null", "--wrap", "sleep 120",
                      check=True).strip()
    launcher, token = launched(lab, "slurm", tmp_path)
    try:
        async def go():
            await launcher.start(BOOTSTRAP)
            await until(lambda: launcher.job_id is not None, 15, launcher)
            t0 = time.monotonic()
            await launcher.stop()
            return time.monotonic() - t0

        took = asyncio.run(go())
        print(f"stop() while queued took {took:.2f}s")
        assert took < 5.0
        nothing_left(lab, token, launcher.name, launcher.job_id)
        assert lab_run(lab, "squeue", "-h", "-j", launcher.job_id, "-o", "%T").strip() in ("", "CANCELLED")
    finally:
        lab_run(lab, "scancel", blocker)
        launcher.stop_sync()


def test_a_bad_slurm_arg_is_a_failure_in_sruns_words(lab, tmp_path):
    launcher, _ = launched(lab, "slurm", tmp_path, slurm_args=("--partition", "nope"))

    async def go():
        await launcher.start(BOOTSTRAP)
        await until(lambda: launcher.failure() is not None, 15, launcher, allow_failure=True)
        words = launcher.failure()
        await launcher.stop()
        return words

    words = asyncio.run(go())
    print(words)
    assert words.startswith("srun exited with code 1: ")
    assert "invalid partition specified: nope" in words and "Unable to allocate resources" in words


def test_inside_the_users_allocation_the_step_ends_and_the_allocation_stays(lab, tmp_path):
    out = lab_run(lab, "salloc", "--no-shell", "-N2", "--job-name", f"dktest-alloc-{uuid.uuid4().hex[:6]}")
    alloc = re.search(r"Granted job allocation (\d+)", out)
    assert alloc, out
    job = alloc.group(1)
    env = {**lab, "SLURM_JOB_ID": job, "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "n[1-2]"}
    try:
        launcher, token = launched(env, "slurm", tmp_path, agent=STUCK_AGENT)
        assert launcher.job_id == job and not launcher.own_job

        async def go():
            await launcher.start(BOOTSTRAP)
            await until(lambda: len(got_lines(launcher)) == 2, 20, launcher)
            assert {g[3] for g in got_lines(launcher)} == {job}
            await launcher.stop()

        asyncio.run(go())
        nothing_left(lab, token, None, None)
        assert lab_run(lab, "squeue", "-h", "-j", job, "-o", "%T").strip() == "RUNNING"
        steps = lab_run(lab, "squeue", "-h", "-s", "-j", job, "-o", "%i %j")
        assert launcher.name not in steps, steps
    finally:
        lab_run(lab, "scancel", job)


def test_ssh_gives_each_host_the_bootstrap_and_its_exact_argv_and_stop_leaves_nothing(lab, tmp_path):
    launcher, token = launched(lab, "ssh", tmp_path)
    assert launcher.hosts() == ["10.77.0.11", "10.77.0.12"] and launcher.started() == {}

    async def go():
        await launcher.start(BOOTSTRAP)
        await until(lambda: len(got_lines(launcher)) == 2, 20, launcher)
        assert sorted((g[1], g[4]) for g in got_lines(launcher)) == [("n1", str(len(BOOTSTRAP))), ("n2", str(len(BOOTSTRAP)))]
        assert sorted(g[5] for g in got_lines(launcher)) == [repr([token, "0"]), repr([token, "1"])]
        assert len(node_procs(token)) >= 2
        t0 = time.monotonic()
        await launcher.stop()
        return time.monotonic() - t0

    took = asyncio.run(go())
    print(f"ssh stop() took {took:.2f}s")
    assert took < 2.0
    nothing_left(lab, token, None, None)


def test_ssh_quotes_an_awkward_argument_exactly(lab, tmp_path):
    awkward = "it's a \"$HOME\" `id`; *"
    launcher, token = launched(lab, "ssh", tmp_path, hosts=("10.77.0.11",))
    launcher.agent_argv = lambda node: [sys.executable, "-c", AGENT, token, awkward]

    async def go():
        await launcher.start(BOOTSTRAP)
        await until(lambda: len(got_lines(launcher)) == 1, 20, launcher)
        await launcher.stop()

    asyncio.run(go())
    assert got_lines(launcher)[0][5] == repr([token, awkward])


def test_ssh_to_an_unreachable_host_is_a_quick_failure_in_sshs_words(lab, tmp_path):
    launcher, token = launched(lab, "ssh", tmp_path, hosts=("10.77.0.11", "10.77.0.99"))

    async def go():
        await launcher.start(BOOTSTRAP)
        t0 = time.monotonic()
        await until(lambda: launcher.failure() is not None, 15, launcher, allow_failure=True)
        took = time.monotonic() - t0
        words = launcher.failure()
        await launcher.stop()
        return words, took

    words, took = asyncio.run(go())
    print(f"{words} (after {took:.1f}s)")
    assert words.startswith("ssh to 10.77.0.99 exited with code 255: ssh: connect to host 10.77.0.99 port 22: ")
    assert took < 8
    nothing_left(lab, token, None, None)


def test_the_default_listen_address_is_this_machines_on_the_route_to_the_nodes(lab):
    assert default_listen(config(launcher="ssh", hosts=("10.77.0.11",)), lab) == "10.77.0.1"
    # outside an allocation: the route to the controller (SlurmctldHost = ctl(10.77.0.1))
    assert default_listen(config(launcher="slurm"), lab) == "10.77.0.1"
    # inside one: the route to the first allocated node (n1, NodeAddr 10.77.0.11)
    inside = {**lab, "SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2"}
    assert slurm.expand_hostlist("n[1-2]", inside) == ["n1", "n2"]
    assert slurm.slurm_node_address("n2", inside) == "10.77.0.12"
    assert default_listen(config(launcher="slurm"), inside) == "10.77.0.1"


REAPED_PARENT = """
import asyncio, json, logging, os, subprocess, sys, tempfile, types
from dist_kernel.options import KernelConfig
from dist_kernel.parent.launch.node_starters import node_starter_class
kind, token, agent, python = sys.argv[1:5]
env = json.loads(sys.stdin.readline())
rd = tempfile.mkdtemp(prefix=f"dist_kernel-{os.getpid()}-")
reaper = subprocess.Popen([sys.executable, "-m", "dist_kernel.parent.reaper", str(os.getpid()), rd],
                          stdin=subprocess.DEVNULL, start_new_session=True)
cfg = KernelConfig(world_size=2, backend="gloo", launcher=kind, nodes=2, ranks_per_node=1,
                   hosts=("10.77.0.11", "10.77.0.12") if kind == "ssh" else ())
cls = node_starter_class(kind)
launcher = cls(cfg, lambda node: [python, "-c", agent, token], rd, logging.getLogger(), print, environ=env)
async def main():
    await launcher.start(b"{}\\n")
    while sum(" got " in ln for ln in launcher.tail()) < 2:
        assert launcher.failure() is None, launcher.failure()
        await asyncio.sleep(0.05)
    print(json.dumps({"rd": rd, "reaper": reaper.pid, "pids": launcher.local_pids(), "name": getattr(launcher, "name", None)}), flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
"""


@pytest.mark.parametrize("kind", ["slurm", "ssh"])
def test_a_sigkilled_parent_s_launchers_and_job_are_ended_by_the_reaper(lab, kind):
    token = f"dktest-{uuid.uuid4().hex[:10]}"
    # stuck agents: they ignore the EOF that the parent's death gives them, so only the reaper's
    # SIGTERM to srun (or ssh) and its scancel can end them
    agent = STUCK_AGENT if kind == "slurm" else AGENT
    parent = subprocess.Popen([sys.executable, "-c", REAPED_PARENT, kind, token, agent, sys.executable],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT, env=lab,
                              start_new_session=True)
    info = None
    try:
        parent.stdin.write(json.dumps(lab) + "\n")
        parent.stdin.flush()
        line = parent.stdout.readline()
        assert line, "the stand-in parent did not start its launcher"
        info = json.loads(line)
        assert node_procs(token)
        t0 = time.monotonic()
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while cleanup.pid_alive(info["reaper"]) and time.monotonic() < deadline:
            time.sleep(0.05)
        took = time.monotonic() - t0
        print(f"{kind}: the reaper finished {took:.2f}s after the parent's SIGKILL")
        assert not cleanup.pid_alive(info["reaper"])
        assert not [pid for pid in info["pids"] if cleanup.pid_alive(pid)]
        assert not os.path.exists(info["rd"])
        nothing_left(lab, token, info["name"], None)
    finally:
        with contextlib.suppress(OSError):
            os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
        for pid in (info or {}).get("pids", []):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if info and info["name"]:
            lab_run(lab, "scancel", "--name", info["name"])


@pytest.mark.parametrize("written_by", ["this version", "the version before kinds"])
def test_the_sweep_cancels_a_dead_kernels_slurm_job(lab, tmp_path, written_by):
    stale = tmp_path / f"dist_kernel-{dead_pid()}-{uuid.uuid4().hex[:6]}"
    stale.mkdir()
    name = stale.name
    job = lab_run(lab, "sbatch", "--parsable", "-N1", "--job-name", name, "--output=/dev/null", "--wrap", "sleep 120",
                  check=True).strip()
    started = {"job": None, "name": name, "user": slurm.user_name(), "own_job": True, "slurm_conf": lab["SLURM_CONF"]}
    try:
        if written_by == "this version":
            LaunchRecord("slurm", (), started).write(str(stale))
        else:  # a kernel killed before an upgrade: no kind, the job under "slurm"
            (stale / cleanup.LAUNCH_FILE).write_text(json.dumps({"pids": [], "slurm": started}))
        report = cleanup.sweep([str(tmp_path)], end_launch=end_launch)
        assert report.released == [f"cancelled Slurm job: scancel --user={slurm.user_name()} --name={name}"]
        nothing_left(lab, "never-a-token", name, job)
    finally:
        lab_run(lab, "scancel", job)


def test_make_node_starter_picks_the_node_starter(tmp_path):
    assert isinstance(make_node_starter(config(), lambda i: [], str(tmp_path), LOG, print, environ={}), SlurmNodeStarter)
    ssh = make_node_starter(config(launcher="ssh", hosts=("a", "b")), lambda i: [], str(tmp_path), LOG, print,
                            environ={})
    assert isinstance(ssh, SshNodeStarter) and ssh.hosts() == ["a", "b"]
    with pytest.raises(ValueError):
        make_node_starter(config(launcher="local"), lambda i: [], str(tmp_path), LOG, print)


def test_keys_for_slurm_nodes_travel_munge_wrapped_decodable_once_per_munged_and_never_in_clear(lab):
    from dist_kernel import tunnel

    sock = slurm.munge_socket(lab)
    assert sock == "/run/dk-cluster-lab/munge/munge.socket"  # the lab's own munged (AuthInfo)
    secret = b'{"client_secret": "' + uuid.uuid4().hex.encode() + b'"}\n'
    line = tunnel.munge_wrap(secret, sock)
    assert line.startswith(tunnel.MUNGE_PREFIX) and line.count(b"\n") == 1
    assert secret.strip() not in line and b"client_secret" not in line  # the payload is encrypted
    # decoded on a node (inside n1's namespace), as the agent does
    decode = [sys.executable, "-c", "import sys; from dist_kernel import tunnel; "
              f"sys.stdout.buffer.write(tunnel.munge_unwrap(sys.stdin.buffer.read(), {sock!r}))"]
    first = subprocess.run(["ip", "netns", "exec", "n1", *decode], input=line, capture_output=True, timeout=30)
    assert first.returncode == 0, first.stderr
    assert first.stdout == secret
    # the same credential again (a second node on the same munged, or a replay) is refused
    again = subprocess.run(["ip", "netns", "exec", "n2", *decode], input=line, capture_output=True, timeout=30)
    assert again.returncode != 0 and b"eplayed" in again.stderr
