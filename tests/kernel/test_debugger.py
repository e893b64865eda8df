"""JupyterLab's debugger on one rank (issue 28, section 1), through a real kernel at 2 ranks:
the Debug Adapter Protocol as JupyterLab drives it (and as ipykernel's own debugger tests do),
on rank 0 and on rank 1 (``%dist_debug 1``); the stop button on a rank stopped at a breakpoint.

The cell computes with its rank and then meets the other rank in an ``all_reduce``: while the
debugged rank is stopped, the other waits for it there, with a short ``--hang-grace`` that the
kernel must not enforce on a rank at a breakpoint.
"""

from __future__ import annotations

import itertools
import os
import queue
import signal
import time

import psutil
import pytest
from harness import GROUP_SETUP, DistKernel, assert_group_works_and_variables_survived, group_kernel_for_module

TIMEOUT = 60
CELL = ("def f(x):\n"
        "    y = x + rank\n"
        "    return y\n"
        "\n"
        "z = f(10)\n"
        "t = torch.tensor([z])\n"
        "dist.all_reduce(t)\n"
        "print('z', z, 'sum', int(t.item()))\n")
BREAK_LINE = 2  # y = x + rank

_seq = itertools.count(1)


class Frontend:
    """What JupyterLab's debugger does, on a kernel's channels: requests on control, events
    read from IOPub (other IOPub messages are kept for the cell that caused them)."""

    def __init__(self, k: DistKernel) -> None:
        self.k = k
        self.kept: list[dict] = []  # IOPub messages read while looking for an event

    def request(self, command: str, arguments: dict | None = None) -> dict:
        kc = self.k.kc
        msg = kc.session.msg("debug_request", {"type": "request", "seq": next(_seq), "command": command,
                                               "arguments": arguments or {}})
        kc.control_channel.send(msg)
        while True:
            reply = kc.control_channel.get_msg(timeout=TIMEOUT)
            if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                assert reply["msg_type"] == "debug_reply"
                return reply["content"]

    def event(self, name: str) -> dict:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            try:
                msg = self.k.kc.get_iopub_msg(timeout=1)
            except queue.Empty:
                continue
            if msg["msg_type"] == "debug_event" and msg["content"].get("event") == name:
                return msg["content"]
            self.kept.append(msg)
        raise AssertionError(f"no {name!r} debug_event in {TIMEOUT} s; IOPub: {[m['msg_type'] for m in self.kept]}")

    def cell_end(self, msg_id: str) -> tuple[dict, str, str]:
        """The cell's reply content, stdout and stderr (its IOPub read to its idle)."""
        out = {"stdout": "", "stderr": ""}
        msgs = iter(self.kept)
        while True:
            msg = next(msgs, None) or self.k.kc.get_iopub_msg(timeout=TIMEOUT)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            if msg["msg_type"] == "stream":
                out[msg["content"]["name"]] += msg["content"]["text"]
            if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                break
        self.kept = []
        while True:
            reply = self.k.kc.get_shell_msg(timeout=TIMEOUT)
            if reply["parent_header"].get("msg_id") == msg_id:
                return reply["content"], out["stdout"], out["stderr"]

    def start(self) -> None:
        """The debugger icon: initialize, attach."""
        reply = self.request("initialize", {"clientID": "test", "clientName": "test", "adapterID": "",
                                            "pathFormat": "path", "linesStartAt1": True, "columnsStartAt1": True,
                                            "supportsVariableType": True, "supportsVariablePaging": True,
                                            "supportsRunInTerminalRequest": True, "locale": "en"})
        assert reply["success"], reply
        assert self.request("attach")["success"]

    def break_in(self, code: str, line: int) -> str:
        """A gutter breakpoint at ``line`` of the cell ``code``; the cell's file."""
        source = self.request("dumpCell", {"code": code})["body"]["sourcePath"]
        info = self.request("debugInfo")["body"]
        assert source.startswith(info["tmpFilePrefix"]), (source, info)
        reply = self.request("setBreakpoints", {"breakpoints": [{"line": line}], "source": {"path": source},
                                                "sourceModified": False})
        assert reply["success"] and reply["body"]["breakpoints"][0]["verified"], reply
        assert self.request("configurationDone")["success"]
        return source


@pytest.fixture(scope="module")
def module_kernel():
    yield from group_kernel_for_module("--ranks", "2", "--hang-grace", "1")


@pytest.fixture
def kernel(module_kernel):
    """The module's kernel, left with no debug session after the test: one that fails halfway
    leaves its session attached, and the next test's ``attach`` would fail on it too."""
    yield module_kernel
    module_kernel.km.interrupt_kernel()  # a cell left stopped at a breakpoint ends (the stop button)
    module_kernel.execute("%dist_debug off", timeout=60)
    module_kernel.execute("%dist_debug 0", timeout=60)


def _variables(fe: Frontend, scopes: list[dict], name: str) -> dict[str, str]:
    ref = next(s["variablesReference"] for s in scopes if s["name"] == name)
    return {v["name"]: v["value"] for v in fe.request("variables", {"variablesReference": ref})["body"]["variables"]}


@pytest.mark.parametrize("rank", [0, 1])
def test_the_debug_adapter_protocol_on_one_rank(kernel, rank):
    info = kernel.kc.kernel_info(reply=True, timeout=10)["content"]
    assert "debugger" in info["supported_features"]
    switched = kernel.execute(f"%dist_debug {rank}")
    assert switched.status == "ok" and switched.stream() == f"debugger: rank {rank}\n", switched.explain()
    fe = Frontend(kernel)
    fe.start()
    source = fe.break_in(CELL, BREAK_LINE)
    msg_id = kernel.kc.execute(CELL)

    stopped = fe.event("stopped")
    assert stopped["body"]["reason"] == "breakpoint"
    thread = stopped["body"]["threadId"]
    time.sleep(2)  # past --hang-grace: the other rank waits in all_reduce, and nobody is torn down
    frames = fe.request("stackTrace", {"threadId": thread})["body"]["stackFrames"]
    assert frames[0]["line"] == BREAK_LINE and frames[0]["source"]["path"] == source, frames[0]
    assert fe.request("source", {"source": {"path": source}})["body"]["content"] == CELL
    scopes = fe.request("scopes", {"frameId": frames[0]["id"]})["body"]["scopes"]
    assert _variables(fe, scopes, "Globals")["rank"] == str(rank)  # this rank's own variables
    assert _variables(fe, scopes, "Locals")["x"] == "10"
    rich = fe.request("richInspectVariables", {"variableName": "x", "frameId": frames[0]["id"]})
    assert rich["body"]["data"] == {"text/plain": "10"}, rich

    assert fe.request("next", {"threadId": thread})["success"]
    assert fe.event("stopped")["body"]["reason"] == "step"
    frames = fe.request("stackTrace", {"threadId": thread})["body"]["stackFrames"]
    assert frames[0]["line"] == BREAK_LINE + 1
    scopes = fe.request("scopes", {"frameId": frames[0]["id"]})["body"]["scopes"]
    assert _variables(fe, scopes, "Locals")["y"] == str(10 + rank)

    assert fe.request("continue", {"threadId": thread})["success"]
    reply, stdout, stderr = fe.cell_end(msg_id)
    assert reply["status"] == "ok", (reply, stderr)
    assert stdout == "[rank 0] z 10 sum 21\n[rank 1] z 11 sum 21\n", stdout
    assert stderr.count(f"rank {rank} is stopped at a breakpoint") == 1, stderr

    names = {v["name"] for v in fe.request("inspectVariables")["body"]["variables"]}
    assert {"z", "t"} <= names
    assert fe.request("disconnect", {"restart": False, "terminateDebuggee": True})["success"]
    assert kernel.execute("print(z)").stream() == "[rank 0] 10\n[rank 1] 11\n"  # every rank lives on
    shown = kernel.execute("%dist_debug")
    assert shown.stream() == f"debugger: rank {rank}\n"


def test_a_breakpoint_in_a_rank_selected_cell_stops_that_rank_and_keeps_the_indentation(kernel):
    # the frontend dumps the cell as written, %%rank line included; the rank runs it with that line
    # a comment, under the name of the source as written, and with the debugger on (which keeps a
    # blank first line) its indented lines stay as they are
    assert kernel.execute("%dist_debug 1").status == "ok"
    fe = Frontend(kernel)
    fe.start()
    code = "%%rank 1\nfor i in range(2):\n    if i:\n        w = i + 40\nprint('w', w)\n"
    source = fe.break_in(code, 4)
    msg_id = kernel.kc.execute(code)
    stopped = fe.event("stopped")
    assert stopped["body"]["reason"] == "breakpoint"
    frames = fe.request("stackTrace", {"threadId": stopped["body"]["threadId"]})["body"]["stackFrames"]
    assert frames[0]["line"] == 4 and frames[0]["source"]["path"] == source, frames[0]
    assert fe.request("continue", {"threadId": stopped["body"]["threadId"]})["success"]
    reply, stdout, stderr = fe.cell_end(msg_id)
    assert reply["status"] == "ok" and stdout == "w 41\n", (reply, stdout, stderr)
    assert fe.request("disconnect", {"restart": False, "terminateDebuggee": False})["success"]


def test_stop_ends_a_cell_whose_rank_is_stopped_at_a_breakpoint(kernel):
    assert kernel.execute("%dist_debug 0").status == "ok"
    fe = Frontend(kernel)
    fe.start()
    code = "for i in range(3):\n    j = i * 2\nt = torch.ones(1)\ndist.all_reduce(t)\nprint('done')\n"
    fe.break_in(code, 2)
    msg_id = kernel.kc.execute(code)
    fe.event("stopped")
    kernel.km.interrupt_kernel()  # the stop button
    reply, stdout, _ = fe.cell_end(msg_id)
    assert reply["status"] == "error" and reply["ename"] == "KeyboardInterrupt", reply
    assert not any("pydevd" in line for line in reply["traceback"])  # it ends in the cell, not in debugpy
    assert "done" not in stdout
    assert fe.request("disconnect", {"restart": False, "terminateDebuggee": False})["success"]
    assert_group_works_and_variables_survived(kernel)


def test_dist_debug_off_and_bad_arguments(kernel):
    off = kernel.execute("%dist_debug off")
    assert off.stream() == "debugger: off (`%dist_debug N` debugs rank N)\n"
    reply = Frontend(kernel).request("initialize", {"clientID": "test", "adapterID": ""})
    assert not reply["success"] and "off" in reply["message"]
    bad = kernel.execute("%dist_debug 2")
    assert bad.status == "error" and "rank 2 does not exist" in bad.reply["evalue"]
    assert kernel.execute("%dist_debug 0").stream() == "debugger: rank 0\n"


def test_shutdown_while_a_rank_is_stopped_at_a_breakpoint_ends_every_rank():
    k = DistKernel("--ranks", "2")
    try:
        assert k.execute(GROUP_SETUP).status == "ok"
        ranks = [psutil.Process(pid) for pid in k.rank_pids()]
        fe = Frontend(k)
        fe.start()
        fe.break_in(CELL, BREAK_LINE)
        k.kc.execute(CELL)
        fe.event("stopped")
        k.kc.stop_channels()
        k.km.shutdown_kernel(now=False)  # a shutdown_request, as Kernel > Shut Down sends
        assert not k.km.is_alive()
        _, alive = psutil.wait_procs(ranks, timeout=30)
        assert alive == []
    finally:
        k.shutdown()


# ------------------------------------------------------------------ the debugged rank replaced (issue 36)
@pytest.fixture(scope="module")
def replaced():
    yield from group_kernel_for_module("--ranks", "2", "--hang-grace", "1")


def _breaks_and_runs_on_rank_1(k: DistKernel, fe: Frontend) -> None:
    """A breakpoint set now hits on rank 1's (new) process, and the cell ends once continued."""
    assert k.execute("%%rank 1\nimport torch, torch.distributed as dist").status == "ok"
    fe.break_in(CELL, BREAK_LINE)  # dumpCell answered by the new process (it got {} before)
    msg_id = k.kc.execute(CELL)
    stopped = fe.event("stopped")
    assert stopped["body"]["reason"] == "breakpoint"
    assert fe.request("continue", {"threadId": stopped["body"]["threadId"]})["success"]
    reply, stdout, stderr = fe.cell_end(msg_id)
    assert reply["status"] == "ok" and stdout == "[rank 0] z 10 sum 21\n[rank 1] z 11 sum 21\n", (reply, stderr)


def test_a_rank_killed_at_a_breakpoint_and_started_anew_gets_the_session_back(replaced, busy_machine):
    k = replaced
    assert k.execute("%dist_debug 1").status == "ok"
    fe = Frontend(k)
    fe.start()
    fe.break_in(CELL, BREAK_LINE)
    pid = int(k.execute("%%rank 1\nprint(os.getpid())").stream())
    msg_id = k.kc.execute(CELL)
    fe.event("stopped")
    os.kill(pid, signal.SIGKILL)
    reply, _, _ = fe.cell_end(msg_id)
    assert reply["status"] == "error" and "killed by SIGKILL" in reply["evalue"], reply
    assert k.execute("%dist_debug").stream() == "debugger: rank 1\n"  # stopped no longer: its process is gone
    assert k.execute("%dist_respawn", timeout=180).status == "ok"
    assert k.execute("%dist_debug").stream() == "debugger: rank 1\n"
    # a stale "stopped" turned the hang checks off: this waited for good instead of being named
    hang = k.execute("%%rank 0\nt = torch.ones(1)\ndist.all_reduce(t)", timeout=90)
    assert hang.status == "error" and hang.reply["ename"] == "CollectiveHangError", hang.explain()
    _breaks_and_runs_on_rank_1(k, fe)
    assert k.execute("%dist_debug off").stream() == "debugger: off (`%dist_debug N` debugs rank N)\n"


def test_after_the_rank_count_changes_the_debugged_ranks_new_process_gets_the_session(replaced):
    k = replaced
    assert k.execute("%dist_debug 1").status == "ok"
    fe = Frontend(k)
    fe.start()
    assert k.execute("%dist_ranks 1", timeout=120).status == "ok"
    assert k.execute("%dist_ranks 2", timeout=180).status == "ok"
    assert k.execute("%dist_debug 1").stream() == "debugger: rank 1\n"
    _breaks_and_runs_on_rank_1(k, fe)
    assert k.execute("%dist_debug 0").stream() == "debugger: rank 0\n"  # switching: the old session ends at once
    assert fe.request("disconnect", {"restart": False, "terminateDebuggee": False})["success"]
