"""A kernel on the lab's nodes, for the cluster lane's tests: :class:`ClusterKernel` (a
:class:`~harness.DistKernel` started with a remote launcher), :class:`Owned` (what on the nodes
and in Slurm is one kernel's) and the readers of a cell's output the tests share.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from pathlib import Path

import psutil
from cluster_lab import HEAD, NODES, QUEUED, Capture, NsProc, environ_of, job_table, kernel_env, ns_procs, wait_until
from harness import DistKernel

FIRST_CELL = "import json, os, socket, time, torch, torch.distributed as dist"
ALL_REDUCE = "t = torch.ones(1)\ndist.all_reduce(t)\nprint(int(t.item()))"
_LABEL = re.compile(r"^\[rank (\d+)\] ?(.*)$")


class Owned:
    """What on the nodes and in Slurm belongs to one kernel, found from its parent process(es)
    while they live, and remembered afterwards, so other kernels on the same lab (another test
    run, a person trying the lab) are never counted:

    * the parent's listening ports on 10.77.0.1 -> agents whose command line connects there;
    * those agents' pids -> ranks (``JPY_PARENT_PID``) -> their runtime dirs
      (``DIST_KERNEL_RUNTIME_DIR``, inherited by whatever a rank starts);
    * the parent's ``srun`` children (own sessions) and the agents' ``SLURM_JOB_ID`` -> jobs.
    """

    def __init__(self, parents) -> None:
        self.parents = parents  # () -> pids of the processes that may be parent kernels
        self.ports: set[int] = set()
        self.agent_pids: set[int] = set()
        self.rank_dirs: set[str] = set()
        self.srun_sids: set[int] = set()
        self.job_ids: set[int] = set()
        self._poller: threading.Thread | None = None
        self._stop = threading.Event()

    def track(self) -> None:
        for pid in self.parents():
            try:
                proc = psutil.Process(pid)
                family = [proc, *proc.children(recursive=True)]
            except psutil.Error:
                continue
            for p in family:
                with contextlib.suppress(psutil.Error):
                    self.ports |= {c.laddr.port for c in p.net_connections("tcp")
                                   if c.status == psutil.CONN_LISTEN and c.laddr.ip == HEAD}
                    if p.name() == "srun":
                        self.srun_sids.add(os.getsid(p.pid))
        for ns in NODES:
            for p in ns_procs(ns):
                if any(f"tcp://{HEAD}:{port}" in p.cmdline for port in self.ports) and p.runs_module("dist_kernel.node"):
                    self.agent_pids.add(p.pid)
                    job = environ_of(p.pid).get("SLURM_JOB_ID")
                    if job:
                        self.job_ids.add(int(job))
                elif p.runs_module("dist_kernel.rank"):
                    env = environ_of(p.pid)
                    if env.get("JPY_PARENT_PID", "").isdigit() and int(env["JPY_PARENT_PID"]) in self.agent_pids:
                        self.rank_dirs.add(env.get("DIST_KERNEL_RUNTIME_DIR", ""))

    def procs(self) -> list[NsProc]:
        """Every process of this kernel still in a node namespace (agents, ranks, what ranks started,
        and any wrapper whose command line names the parent's port)."""
        self.track()
        out = []
        for ns in NODES:
            for p in ns_procs(ns):
                if p.pid in self.agent_pids or any(f"tcp://{HEAD}:{port}" in p.cmdline for port in self.ports):
                    out.append(p)
                elif environ_of(p.pid).get("DIST_KERNEL_RUNTIME_DIR") in self.rank_dirs:
                    out.append(p)
        return out

    def jobs(self) -> dict[int, str]:
        """This kernel's Slurm jobs that squeue still lists: {id: state}."""
        self.track()
        return {j: state for j, (state, sid) in job_table().items()
                if (j in self.job_ids or sid in self.srun_sids) and state in QUEUED}

    def poll(self, every: float = 0.5) -> Owned:
        """Track in a thread until :meth:`stop_polling` (for kernels that a library starts and ends)."""
        def run() -> None:
            while not self._stop.wait(every):
                with contextlib.suppress(Exception):
                    self.track()
        self._poller = threading.Thread(target=run, daemon=True)
        self._poller.start()
        return self

    def stop_polling(self) -> None:
        self._stop.set()
        if self._poller:
            self._poller.join(10)
        self.track()


def assert_nothing_left(owned: Owned, timeout: float, what: str) -> float:
    """Within ``timeout`` s no process of ``owned`` is left in n1 or n2; returns how long it took."""
    t0 = time.monotonic()
    if not wait_until(lambda: not owned.procs(), timeout):
        rest = owned.procs()
        raise AssertionError(f"{what}: still in the node namespaces after {timeout:.0f} s:\n"
                             + "\n".join(f"  {p.ns} pid {p.pid}: {p.cmdline}" for p in rest))
    return time.monotonic() - t0


def per_rank(text: str) -> dict[int, str]:
    """{rank: its line} from output in which every rank printed one differing line."""
    out = {}
    for line in text.splitlines():
        m = _LABEL.match(line)
        assert m, f"unlabelled line {line!r} in {text!r}"
        out[int(m.group(1))] = m.group(2)
    return out


def error_text(res) -> str:
    errs = res.of_type("error")
    assert errs, f"no error output; status {res.status}, stdout {res.stream()!r}"
    return "\n".join(f"{e.content['ename']}: {e.content['evalue']}\n" + "\n".join(e.content["traceback"])
                     for e in errs)


def names_ranks(text: str, ranks: list[int]) -> bool:
    """``text`` names every rank in ``ranks`` ("rank 2 ... rank 3", "ranks 2, 3", "ranks 2-3")."""
    if all(re.search(rf"\brank {r}\b", text) for r in ranks):
        return True
    for m in re.finditer(r"\branks ([0-9][0-9 ,\-and]*)", text):
        listed: set[int] = set()
        for part in re.split(r",|\band\b", m.group(1)):
            a, _, b = part.strip().partition("-")
            if a.strip().isdigit():
                listed |= set(range(int(a), int(b) + 1)) if b.strip().isdigit() else {int(a)}
        if set(ranks) <= listed:
            return True
    return False


class ClusterKernel(DistKernel):
    """A kernel on the lab's nodes, with what the tests need to find its parts."""

    def __init__(self, lab: dict[str, str], options: tuple[str, ...], ranks_per_node: int, capture: bool = False):
        self.ranks_per_node = ranks_per_node
        self.world = ranks_per_node * len(NODES)
        self.owned = Owned(self._parent_pids)
        self.startup_capture = Capture() if capture else None
        if self.startup_capture:
            self.startup_capture.__enter__()
        try:
            super().__init__(*options, env=kernel_env(lab))
            self.first_cell()
        except BaseException:
            if self.startup_capture:
                self.startup_capture.__exit__(None, None, None)
            with contextlib.suppress(Exception):
                self.shutdown()
            raise
        if self.startup_capture:
            self.startup_capture.__exit__(None, None, None)

    def _parent_pids(self) -> list[int]:
        proc = getattr(getattr(self, "km", None) and self.km.provisioner, "process", None)
        return [proc.pid] if proc is not None and proc.poll() is None else []

    def first_cell(self) -> None:
        """The first cell after a start: every rank up on its node, the group formed."""
        t0 = time.monotonic()
        res = self.execute(FIRST_CELL, timeout=240)
        self.first_cell_s = time.monotonic() - t0
        assert res.status == "ok", error_text(res)
        self.owned.track()

    def restart(self) -> None:
        self.km.restart_kernel(now=False)
        self.kc.wait_for_ready(timeout=60)
        self.first_cell()

    def listen_port(self) -> int:
        """The port the parent listens on for its node agents (on --listen)."""
        ports = {c.laddr.port for c in psutil.Process(self.pid).net_connections("tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.ip == HEAD}
        assert len(ports) == 1, f"the parent listens on {sorted(ports)} on {HEAD}"
        return ports.pop()

    def mine(self) -> list[NsProc]:
        """This kernel's processes on the nodes."""
        return self.owned.procs()

    def ranks_on(self, ns: str) -> list[NsProc]:
        return [p for p in self.mine() if p.ns == ns and p.runs_module("dist_kernel.rank")]

    def agent_on(self, ns: str) -> NsProc:
        (agent,) = [p for p in self.mine() if p.ns == ns and p.runs_module("dist_kernel.node")]
        return agent

    def my_jobs(self) -> dict[int, str]:
        return self.owned.jobs()

    def check_works(self, timeout: float = 240) -> None:
        res = self.execute(ALL_REDUCE, timeout=timeout)
        assert res.status == "ok", error_text(res)
        assert res.stream() == f"{self.world}\n", res.stream()


def connection_file_of(p: NsProc) -> dict:
    return json.loads(Path(p.argv[p.argv.index("-f") + 1]).read_text())
