"""Node starters without the lab (dist_kernel/parent/launch/node_starters/; issues 13 and 37).

The pure parts (command lines, srun's messages, the words of a failure, the allocation check),
then the starter's processes on this machine: stand-ins for srun or ssh that read the
bootstrap, a failure in their words, a bounded stop, and what the sweep and the reaper end of a
launch record. The starters against the real Slurm and sshd of the lab: test_cluster_starters_lab.py.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest
from cluster_lab import BOOTSTRAP, config, dead_pid, runtime, until

from dist_kernel import cleanup
from dist_kernel.cleanup import LaunchRecord
from dist_kernel.exceptions import ConfigError
from dist_kernel.parent.launch.node_starters import base as starter_base
from dist_kernel.parent.launch.node_starters import (
    default_listen,
    end_launch,
    make_node_starter,
    slurm,
    ssh,
)
from dist_kernel.parent.launch.node_starters.base import NodeStarter, exit_words
from dist_kernel.parent.launch.node_starters.slurm import SlurmNodeStarter, check_allocation, parse_srun_line, srun_argv
from dist_kernel.parent.launch.node_starters.ssh import SshNodeStarter, ssh_argv
from dist_kernel.parent.reaper import reap

LOG = logging.getLogger("test_cluster_starters")


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
