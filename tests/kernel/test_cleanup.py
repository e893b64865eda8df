"""Nothing a kernel started outlives it (issue 11, items 18 and 19).

Whatever kills the kernel (shutdown, SIGKILL of the parent, SIGKILL of the reaper and then of
the parent), every process it started ends: the ranks, what they started in their sessions
(DataLoader workers), and what left those sessions (``os.setsid``). A clean-up never touches a
live kernel or anyone else's process. Real kernels, real processes; every test kills what it
started, even when it fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import psutil
import pytest
from harness import DistKernel, end_process_tree

from dist_kernel import cleanup
from dist_kernel.parent.launch.node_starters import end_launch
from dist_kernel.parent.reaper import reap, write_pids

ROOT = Path(__file__).parents[2]

# run in every rank: three processes that outlive a rank killed by SIGKILL; prints their pids
START_LEFTOVERS = """\
import os, subprocess
_kept = [
    subprocess.Popen(['sleep', '1000']),                          # in the rank's session
    subprocess.Popen(['sleep', '1001'], start_new_session=True),  # os.setsid(): a session of its own
    subprocess.Popen(['sleep', '1002'], env={'PATH': os.environ['PATH']}),  # environment scrubbed
]
print(*[p.pid for p in _kept])
"""


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def kill_all(pids) -> None:
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def gone(pids, timeout: float = 5.0) -> list[int]:
    """The pids still alive (zombies count as gone) after waiting up to ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [pid for pid in pids if cleanup.pid_alive(pid)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def sleeper(env: dict | None = None, **kw) -> subprocess.Popen:
    return subprocess.Popen(["sleep", "120"], env=env, start_new_session=True, **kw)


def clean(env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dist_kernel", "clean"], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env={**os.environ, **(env or {})})


# ------------------------------------------------------------------ the reaper (no kernel)
def test_the_reaper_kills_its_ranks_groups_but_never_a_process_that_reused_a_rank_pid(tmp_path):
    # a "rank" (its command line names its connection file in the runtime dir) with a child in
    # its process group, as a DataLoader worker is; and a stranger holding a pid in the list
    rank = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                             "print(subprocess.Popen(['sleep', '60']).pid, flush=True); time.sleep(60)",
                             str(tmp_path / "rank0.json")], stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = psutil.Process(int(rank.stdout.readline()))
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        write_pids(str(tmp_path), [rank.pid, stranger.pid])
        reap(str(tmp_path))
        assert rank.wait(timeout=5) == -signal.SIGKILL
        _, alive = psutil.wait_procs([child], timeout=5)
        assert alive == [] and stranger.poll() is None and not tmp_path.exists()
    finally:
        for p in (rank, stranger):
            p.kill()
            p.wait()
        kill_all([child.pid])


def test_the_reaper_also_ends_what_a_rank_started_in_a_session_of_its_own(tmp_path):
    runtime = tmp_path / f"dist_kernel-{os.getpid()}-reaped"
    runtime.mkdir()
    env = {**os.environ, cleanup.ENV_VAR: str(runtime)}
    rank = subprocess.Popen([sys.executable, "-c", "import subprocess, time\n"
                             "print(subprocess.Popen(['sleep', '60'], start_new_session=True).pid, flush=True)\n"
                             "time.sleep(60)", str(runtime / "rank0.json")],
                            stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)
    escaped = int(rank.stdout.readline())
    try:
        write_pids(str(runtime), [rank.pid])
        reap(str(runtime))
        assert rank.wait(timeout=5) == -signal.SIGKILL
        assert gone([escaped]) == [] and not runtime.exists()
    finally:
        rank.kill()
        rank.wait()
        kill_all([escaped])


# ------------------------------------------------------------------ the sweep (no kernel)
def test_a_runtime_dir_whose_kernel_is_gone_is_swept_at_the_next_start(tmp_path):
    gone_pid = dead_pid()
    stale = tmp_path / f"dist_kernel-{gone_pid}-abc"
    live = tmp_path / f"dist_kernel-{os.getpid()}-def"
    other = tmp_path / f"dist_kernel-notapid-{gone_pid}"
    for d in (stale, live, other):
        d.mkdir()
        (d / "rank0.json").write_text("{}")
    assert cleanup.sweep([str(tmp_path)], end_launch=end_launch).removed == [str(stale)]
    assert not stale.exists() and live.exists() and other.exists()


def test_a_sweep_ends_a_dead_kernels_processes_and_spares_a_live_kernels_and_strangers(tmp_path):
    stale = tmp_path / f"dist_kernel-{dead_pid()}-abc"
    live = tmp_path / f"dist_kernel-{os.getpid()}-def"  # this test is the "live kernel"
    removed_earlier = tmp_path / f"dist_kernel-{dead_pid()}-ghi"  # its dir is gone already
    for d in (stale, live):
        d.mkdir()
    procs = {
        "stale": sleeper({**os.environ, cleanup.ENV_VAR: str(stale)}),
        "removed": sleeper({**os.environ, cleanup.ENV_VAR: str(removed_earlier)}),
        "live": sleeper({**os.environ, cleanup.ENV_VAR: str(live)}),
        "stranger": sleeper(),
        "not ours": sleeper({**os.environ, cleanup.ENV_VAR: str(tmp_path / "elsewhere")}),
    }
    try:
        report = cleanup.sweep([str(tmp_path)], end_launch=end_launch)
        killed = {p.pid for p in report.killed}
        assert killed >= {procs["stale"].pid, procs["removed"].pid}
        assert killed.isdisjoint({procs[k].pid for k in ("live", "stranger", "not ours")})
        assert gone([procs["stale"].pid, procs["removed"].pid]) == []
        assert all(procs[k].poll() is None for k in ("live", "stranger", "not ours"))
        assert report.removed == [str(stale)] and live.exists()
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def test_another_kernels_sweep_ends_a_dead_ranks_leftovers_named_or_not(tmp_path):
    # a dead kernel's rank (a session leader, as ranks are) left two children in its session,
    # one with the kernel's variable, one with a scrubbed environment; the sweep of another
    # kernel (which does not know this kernel's runtime dir, nor its rank pids) runs first
    runtime = tmp_path / f"dist_kernel-{dead_pid()}-abcdefgh"
    runtime.mkdir()
    rank = subprocess.Popen([sys.executable, "-c", "import os, subprocess, time\n"
                             "named = subprocess.Popen(['sleep', '60'])\n"
                             "scrubbed = subprocess.Popen(['sleep', '60'], env={'PATH': os.environ['PATH']})\n"
                             "print(named.pid, scrubbed.pid, flush=True); time.sleep(60)"],
                            stdout=subprocess.PIPE, text=True, start_new_session=True,
                            env={**os.environ, cleanup.ENV_VAR: str(runtime)})
    named, unnamed = map(int, rank.stdout.readline().split())
    try:
        write_pids(str(runtime), [rank.pid])
        rank.kill()
        rank.wait()
        other = cleanup.sweep([str(tmp_path / "elsewhere")], end_launch=end_launch)
        # both, or the unnamed one would be found by nothing once the named one is gone
        assert {named, unnamed} <= {p.pid for p in other.killed}
        assert gone([named, unnamed]) == []
        assert cleanup.sweep([str(tmp_path)], end_launch=end_launch).removed == [str(runtime)]  # this kernel's own clean, later
    finally:
        kill_all([named, unnamed])


# ------------------------------------------------------------------ real kernels
def family(k: DistKernel) -> tuple[int, list[int]]:
    """The kernel's reaper pid and rank pids."""
    kids = psutil.Process(k.pid).children()
    (reaper,) = [p.pid for p in kids if "dist_kernel.parent.reaper" in " ".join(p.cmdline())]
    return reaper, k.rank_pids()


def started_leftovers(k: DistKernel) -> list[int]:
    res = k.execute(START_LEFTOVERS)
    leftovers = [int(w) for w in res.stream().replace("[rank 0]", "").replace("[rank 1]", "").split()]
    assert len(leftovers) == 6, res.stream()
    return leftovers


def kill_reaper_then_parent(k: DistKernel) -> tuple[str, list[int]]:
    """Start the leftovers in every rank, SIGKILL the reaper and then the parent, wait for the
    ranks to die (PR_SET_PDEATHSIG); return the runtime dir and the leftovers.

    The leftovers outlive the kernel: nothing of it is left to end them. Any kernel of this user
    that starts meanwhile (another test, a second copy of the suite) ends them, though: its
    start-up sweep ends the leftovers of every kernel that is gone, ours included (see
    test_another_kernels_sweep_ends_a_dead_ranks_leftovers_named_or_not), which is the promise
    the callers check, kept by another. So they are not required alive here, and the callers
    require only that none survives, whoever ended it."""
    leftovers: list[int] = []
    try:
        runtime = k.execute("import os\nprint(os.environ['DIST_KERNEL_RUNTIME_DIR'])").stream().strip()
        leftovers = started_leftovers(k)
        reaper, ranks = family(k)
        os.kill(reaper, signal.SIGKILL)
        assert gone([reaper]) == []
        os.kill(k.pid, signal.SIGKILL)
        k.km.provisioner.process.wait(timeout=10)  # a frontend collects its dead kernel
        assert gone(ranks) == []
        time.sleep(0.5)
    except BaseException:
        kill_all([k.pid, *leftovers])
        raise
    finally:
        k.kc.stop_channels()
        k.km.cleanup_resources()
    return runtime, leftovers


@pytest.mark.slow
@pytest.mark.parametrize("how", ["python -m dist_kernel clean", "the next kernel start"])
def test_after_the_reaper_and_the_parent_are_killed_nothing_the_ranks_started_survives(how):
    # a TMPDIR of its own: a kernel of an older version starting meanwhile would remove the
    # stale runtime dir (and with it the rank pids) without ending the processes
    env = {"TMPDIR": tempfile.mkdtemp(prefix="dk-")}
    nxt = None
    leftovers: list[int] = []
    try:
        runtime, leftovers = kill_reaper_then_parent(DistKernel("--ranks", "2", env=env))
        assert os.path.dirname(runtime) == env["TMPDIR"]
        if how == "the next kernel start":
            nxt = DistKernel("--ranks", "1", env=env)
        else:
            out = clean(env)
            assert out.returncode == 0, out.stderr
            # which leftovers clean itself ended depends on whether another kernel's sweep came
            # first (see kill_reaper_then_parent); the runtime dir is in this test's own TMPDIR,
            # which only this test's clean sweeps
            assert f"removed {runtime}" in out.stdout, out.stdout
        assert gone(leftovers) == [], "leftovers of the killed kernel survived"
        assert not os.path.exists(runtime)
        if nxt is not None:
            assert nxt.execute("print(rank)").stream() == "0\n"
    finally:
        kill_all(leftovers)
        if nxt is not None:
            nxt.shutdown()
        subprocess.run(["rm", "-rf", env["TMPDIR"]], check=False)


@pytest.mark.slow
def test_killing_the_parent_ends_what_the_ranks_started_even_in_sessions_of_their_own():
    k = DistKernel("--ranks", "2")
    leftovers: list[int] = []
    try:
        leftovers = started_leftovers(k)
        os.kill(k.pid, signal.SIGKILL)  # the reaper is alive: it does the work
        assert gone(leftovers) == []
    finally:
        kill_all([*leftovers, k.pid])
        k.km.provisioner.process.wait(timeout=10)
        k.kc.stop_channels()
        k.km.cleanup_resources()


@pytest.mark.slow
def test_a_shutdown_ends_what_the_ranks_started_even_in_sessions_of_their_own():
    k = DistKernel("--ranks", "2")
    leftovers: list[int] = []
    try:
        leftovers = started_leftovers(k)
    finally:
        k.shutdown()
        alive = gone(leftovers)
        kill_all(leftovers)
    assert alive == []


@pytest.mark.slow
def test_clean_never_touches_a_live_kernel_or_another_process():
    k = DistKernel("--ranks", "2")
    stranger = sleeper()
    leftovers: list[int] = []
    try:
        leftovers = started_leftovers(k)
        reaper, ranks = family(k)
        out = clean()
        assert out.returncode == 0, out.stderr
        mine = [k.pid, reaper, *ranks, *leftovers, stranger.pid]
        assert not any(f"ended pid {pid}:" in out.stdout for pid in mine), out.stdout
        assert gone(mine, timeout=0) == mine
        # and from inside a rank (a shell in the notebook) as well
        res = k.execute("import subprocess, sys\n"
                        "print(subprocess.run([sys.executable, '-m', 'dist_kernel', 'clean'], "
                        "capture_output=True, text=True).returncode)")
        assert res.stream() == "0\n"
        assert gone(mine, timeout=0) == mine
        res = k.execute("import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\n"
                        "print(int(t.item()))")
        assert res.stream() == "2\n"
    finally:
        k.shutdown()
        stranger.kill()
        stranger.wait()
        kill_all(leftovers)


# ------------------------------------------------------------------ 19: a long TMPDIR
def long_dir(base: Path, length: int = 150) -> Path:
    path = base
    while len(str(path)) < length:
        path = path / ("d" * min(50, length - len(str(path)) - 1))
    path.mkdir(parents=True)
    assert len(str(path)) == length
    return path


def test_a_runtime_dir_under_a_long_tmpdir_is_short_private_and_found_by_the_sweep(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(long_dir(tmp_path)))
    d = cleanup.make_runtime_dir()
    try:
        assert len(d) + cleanup.SOCKET_SUFFIX_MAX <= cleanup.SOCKET_PATH_MAX
        assert stat.S_IMODE(os.stat(d).st_mode) == 0o700
        assert cleanup.owner_pid(d) == os.getpid() and os.path.dirname(d) in cleanup.runtime_bases()
    finally:
        os.rmdir(d)


def test_no_short_directory_at_all_is_an_error_naming_tmpdir(tmp_path, monkeypatch):
    monkeypatch.setattr(cleanup, "runtime_bases", lambda: [str(long_dir(tmp_path))])
    monkeypatch.setenv("TMPDIR", "/somewhere/long")
    with pytest.raises(OSError, match="TMPDIR"):
        cleanup.make_runtime_dir()


@pytest.mark.slow
def test_a_kernel_started_with_a_150_character_tmpdir_runs_an_all_reduce(tmp_path):
    tmpdir = long_dir(Path(tempfile.gettempdir()) / f"dk-long-{os.getpid()}")
    try:
        k = DistKernel("--ranks", "2", env={"TMPDIR": str(tmpdir)})
        try:
            res = k.execute("import torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\n"
                            "print(int(t.item()))")
            assert res.stream() == "2\n", res.outputs
        finally:
            k.shutdown()
    finally:
        subprocess.run(["rm", "-rf", str(Path(tempfile.gettempdir()) / f"dk-long-{os.getpid()}")], check=False)


@pytest.mark.slow
def test_run_works_with_a_long_tmpdir_and_a_long_jupyter_runtime_dir_and_leaves_no_dir(tmp_path):
    base = Path(tempfile.gettempdir()) / f"dk-long-{os.getpid()}"
    long = long_dir(base)
    path = tmp_path / "reduce.ipynb"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import torch, torch.distributed as dist\nt = torch.ones(1)\n"
                                          "dist.all_reduce(t)\nprint(int(t.item()))")]
    nbformat.write(nb, path)
    env = {**os.environ, "TMPDIR": str(long), "JUPYTER_RUNTIME_DIR": str(long)}
    proc = subprocess.Popen([sys.executable, "-m", "dist_kernel", "run", str(path), "--ranks", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        end_process_tree(proc)  # failed: end the runner and the kernel it started
        subprocess.run(["rm", "-rf", str(base)], check=False)
    assert proc.returncode == 0, err
    assert out == "2\n"
    # the runner's own short socket dir is gone with it
    assert not [d for b in cleanup.runtime_bases() for d in Path(b).glob(f"{cleanup.RUNTIME_PREFIX}{proc.pid}-*")]
