"""Drive a real Distributed Python kernel through jupyter_client, as a frontend would."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psutil
from jupyter_client import KernelManager

from dist_kernel.runner import spec_manager


@dataclass
class Output:
    msg_type: str
    content: dict
    t: float  # seconds since the request was sent
    wall: float = 0.0  # time.time() when it arrived

    @property
    def text(self) -> str:
        if self.msg_type == "stream":
            return self.content["text"]
        return self.content.get("data", {}).get("text/plain", "")


@dataclass
class Result:
    reply: dict
    outputs: list[Output] = field(default_factory=list)
    busy_idle: list[str] = field(default_factory=list)

    @property
    def status(self) -> str:
        return self.reply["status"]

    def stream(self, name: str = "stdout") -> str:
        return "".join(o.content["text"] for o in self.outputs if o.msg_type == "stream" and o.content["name"] == name)

    def of_type(self, msg_type: str) -> list[Output]:
        return [o for o in self.outputs if o.msg_type == msg_type]

    def explain(self) -> str:
        """The cell's reply, errors and streams in full, for an assertion message (a repr of the
        outputs is cut short before the traceback that says why a cell failed)."""
        errors = ["".join(f"{e.content['ename']}: {e.content['evalue']}\n" + "\n".join(e.content["traceback"]))
                  for e in self.of_type("error")]
        return (f"status {self.status}; reply {self.reply.get('ename', '')} {self.reply.get('evalue', '')}\n"
                f"--- errors\n{chr(10).join(errors)}\n--- stdout\n{self.stream()[-4000:]}\n"
                f"--- stderr\n{self.stream('stderr')[-4000:]}")


def visible(outputs: list[tuple[str, dict]]) -> str:
    """What a frontend shows at the end, replaying outputs as JupyterLab does: clear_output
    (wait=True clears at the next output), display updates by display_id, stream appends."""
    shown: list[list] = []  # [msg_type, display_id, text]
    clear_pending = False
    for msg_type, content in outputs:
        if msg_type == "clear_output":
            if content.get("wait"):
                clear_pending = True
            else:
                shown = []
            continue
        if msg_type == "update_display_data":
            for out in shown:
                if out[1] == content["transient"]["display_id"]:
                    out[2] = content["data"].get("text/plain", "")
            continue
        if clear_pending:
            shown, clear_pending = [], False
        if msg_type == "stream":
            shown.append(["stream", None, content["text"]])
        elif msg_type in ("display_data", "execute_result"):
            shown.append([msg_type, (content.get("transient") or {}).get("display_id"),
                          content["data"].get("text/plain", "")])
    return "".join(o[2] if o[0] == "stream" else o[2] + "\n" for o in shown)


def is_rank_process(proc: psutil.Process) -> bool:
    """Is this process one of a kernel's ranks (``python -m dist_kernel.rank``)?"""
    try:
        return "dist_kernel.rank" in proc.cmdline()
    except psutil.Error:
        return False


def own_session(kc: Any) -> Any:
    """A client whose messages cannot share ids with its manager's (the stop button's
    interrupt_request). ``km.client()`` clones the manager's session id, each counts from 0,
    so an execute and an earlier interrupt could both be ``<id>_<pid>_8``: a reader matching
    by parent id would take the interrupt's ``idle`` for the cell's, and end it early."""
    kc.session.session = str(uuid.uuid4())
    return kc


class DistKernel:
    """A started kernel with a blocking client."""

    def __init__(self, *options: str, env: dict | None = None, ready_timeout: float = 60) -> None:
        self.km = KernelManager(kernel_name="distributed-python", kernel_spec_manager=spec_manager(list(options)))
        kw = {"env": {**os.environ, **env}} if env else {}
        self.km.start_kernel(**kw)
        self.kc = own_session(self.km.client())
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=ready_timeout)

    @property
    def pid(self) -> int:
        return self.km.provisioner.process.pid

    def rank_pids(self) -> list[int]:
        return [p.pid for p in psutil.Process(self.pid).children() if is_rank_process(p)]

    def execute(self, code: str, timeout: float = 120, on_output: Callable[[Output], None] | None = None,
                **kw) -> Result:
        """Run ``code``; ``on_output`` sees each output as it arrives (to act while the cell runs)."""
        kw.setdefault("allow_stdin", False)  # as nbclient; tests that answer input() pass True
        msg_id = self.kc.execute(code, **kw)
        t0 = time.monotonic()
        res = Result(reply={})
        while True:
            msg = self.kc.get_iopub_msg(timeout=timeout)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            mt = msg["msg_type"]
            if mt == "status":
                res.busy_idle.append(msg["content"]["execution_state"])
                if msg["content"]["execution_state"] == "idle":
                    break
                continue
            if mt == "execute_input":
                continue
            res.outputs.append(Output(mt, msg["content"], time.monotonic() - t0, time.time()))
            if on_output is not None:
                on_output(res.outputs[-1])
        while True:
            reply = self.kc.get_shell_msg(timeout=timeout)
            if reply["parent_header"].get("msg_id") == msg_id:
                res.reply = reply["content"]
                return res

    def shutdown(self) -> None:
        self.kc.stop_channels()
        if self.km.has_kernel:
            self.km.shutdown_kernel(now=False)


def shell_reply(k: DistKernel, msg_id: str, timeout: float = 10) -> dict:
    """The content of the shell reply to request ``msg_id`` (other replies are skipped)."""
    while True:
        reply = k.kc.get_shell_msg(timeout=timeout)
        if reply["parent_header"]["msg_id"] == msg_id:
            return reply["content"]


def kernel_for_module(*options: str) -> Iterator[DistKernel]:
    """Body of a module-scoped fixture: one kernel with ``options``, shut down at the end."""
    k = DistKernel(*options)
    try:
        yield k
    finally:
        k.shutdown()


def group_kernel_for_module(*options: str) -> Iterator[DistKernel]:
    """Body of a module-scoped fixture: :func:`kernel_for_module` with torch imported and ``kept``
    defined on every rank (``GROUP_SETUP``), for tests of the process group."""
    for k in kernel_for_module(*options):
        assert k.execute(GROUP_SETUP).status == "ok"
        yield k


#: a busy loop that ends as soon as the process that started it is gone (a killed test run leaves no hog)
_HOG = "import os\np = os.getppid()\nwhile os.getppid() == p:\n    sum(range(10000))\n"


@contextlib.contextmanager
def cpu_hogs(n: int | None = None) -> Iterator[list[subprocess.Popen]]:
    """Keep every core busy (``n`` busy loops, one per core by default) while the body runs: a
    race's test runs beside them, as a user's busy machine would. They end with the block, or with
    the test process if it is killed."""
    hogs = [subprocess.Popen([sys.executable, "-c", _HOG]) for _ in range(n or os.cpu_count() or 2)]
    try:
        yield hogs
    finally:
        for h in hogs:
            h.kill()
        for h in hogs:
            h.wait()


def end_process_tree(proc: subprocess.Popen) -> None:
    """A test's subprocess (a runner, say) that may still run: kill it and everything it started."""
    if proc.poll() is None:
        for p in [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]:
            with contextlib.suppress(psutil.Error):
                p.kill()
    proc.wait()


# ------------------------------------------------------------ faults (test_faults, test_group_*)
GROUP_SETUP = "import torch, torch.distributed as dist, os, time\nkept = 100 + rank"


def error_of(res: Result) -> dict:
    """The one error output of a cell."""
    (err,) = res.of_type("error")
    return err.content


def assert_group_works_and_variables_survived(k: DistKernel) -> None:
    res = k.execute("t = torch.ones(1)\ndist.all_reduce(t)\nprint(int(t.item()), kept)", timeout=30)
    assert res.stream() == "[rank 0] 2 100\n[rank 1] 2 101\n", res.outputs


@contextlib.contextmanager
def memory_guard(pid: int, limit: int = 1 << 30) -> Iterator[list[int]]:
    """Kill the parent if it takes more than ``limit`` bytes (the machine is shared)."""
    peak = [psutil.Process(pid).memory_info().rss]
    stop = threading.Event()

    def watch() -> None:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            while not stop.wait(0.05):
                peak[0] = max(peak[0], p.memory_info().rss)
                if peak[0] > limit:
                    p.kill()
                    return

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        yield peak
    finally:
        stop.set()
        t.join()
