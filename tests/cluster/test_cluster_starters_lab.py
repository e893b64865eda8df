"""Node starters against the two-node lab of ``tests/cluster/lab.sh`` (issues 13 and 37): a real
Slurm and one sshd per node in network namespaces, with a stand-in agent that reports the line it
read on stdin. What srun and ssh give the agents, what stop leaves (nothing), the Slurm queue and
the user's allocation, and what the reaper and the sweep end for a kernel that is gone, its job
included. Only lab addresses (10.77.0.0/24). Without the lab: test_cluster_starters.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from cluster_lab import AGENT, BOOTSTRAP, ROOT, STUCK_AGENT, config, dead_pid, until

from dist_kernel import cleanup
from dist_kernel.cleanup import LaunchRecord
from dist_kernel.parent.launch.node_starters import (
    default_listen,
    end_launch,
    make_node_starter,
    node_starter_class,
    slurm,
    ssh,
)
from dist_kernel.parent.launch.node_starters.base import NodeStarter
from dist_kernel.parent.launch.node_starters.slurm import SlurmNodeStarter
from dist_kernel.parent.launch.node_starters.ssh import SshNodeStarter

LOG = logging.getLogger("test_cluster_starters_lab")


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


def stop_once(launcher: NodeStarter, ready, timeout: float) -> float:
    """Start ``launcher``, wait until ``ready()``, stop it; the seconds ``stop()`` took."""
    async def go() -> float:
        await launcher.start(BOOTSTRAP)
        await until(ready, timeout, launcher)
        t0 = time.monotonic()
        await launcher.stop()
        return time.monotonic() - t0

    return asyncio.run(go())


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
    took = stop_once(launcher, lambda: len(got_lines(launcher)) == 2, 20)
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
        took = stop_once(launcher, lambda: launcher.job_id is not None, 15)
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
    from dist_kernel.tunnel import keys

    sock = slurm.munge_socket(lab)
    assert sock == "/run/dk-cluster-lab/munge/munge.socket"  # the lab's own munged (AuthInfo)
    secret = b'{"client_secret": "' + uuid.uuid4().hex.encode() + b'"}\n'
    line = keys.munge_wrap(secret, sock)
    assert line.startswith(keys.MUNGE_PREFIX) and line.count(b"\n") == 1
    assert secret.strip() not in line and b"client_secret" not in line  # the payload is encrypted
    # decoded on a node (inside n1's namespace), as the agent does
    decode = [sys.executable, "-c", "import sys; from dist_kernel.tunnel import keys; "
              f"sys.stdout.buffer.write(keys.munge_unwrap(sys.stdin.buffer.read(), {sock!r}))"]
    first = subprocess.run(["ip", "netns", "exec", "n1", *decode], input=line, capture_output=True, timeout=30)
    assert first.returncode == 0, first.stderr
    assert first.stdout == secret
    # the same credential again (a second node on the same munged, or a replay) is refused
    again = subprocess.run(["ip", "netns", "exec", "n2", *decode], input=line, capture_output=True, timeout=30)
    assert again.returncode != 0 and b"eplayed" in again.stderr
