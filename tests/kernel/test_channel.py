"""The typed channel between the parent and its ranks (issue 12), on real kernels at 2 ranks.

Some tests talk to a rank directly, as the parent does: a jupyter_client on the rank's own
connection file (mode 0600, in the kernel's private runtime directory), sending
``dist_request`` messages on the control channel.
"""

from __future__ import annotations

import glob
import re
import time

import pytest
from harness import DistKernel
from jupyter_client import BlockingKernelClient

from dist_kernel import protocol

pytestmark = pytest.mark.slow
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def rank_client(kernel: DistKernel, rank: int) -> BlockingKernelClient:
    """A client on one rank's own channels, found through the kernel's runtime directory."""
    (path,) = glob.glob(f"/tmp/dist_kernel-{kernel.pid}-*/rank{rank}.json")
    kc = BlockingKernelClient(connection_file=path)
    kc.load_connection_file()
    kc.start_channels(shell=False, iopub=False, stdin=False, hb=False, control=True)
    return kc


def ask(kc: BlockingKernelClient, content: object, timeout: float = 5) -> dict:
    """Send one dist_request (any content, valid or not); the reply content."""
    msg = kc.session.msg(protocol.REQUEST, content)
    kc.control_channel.send(msg)
    deadline = time.monotonic() + timeout
    while True:
        reply = kc.get_control_msg(timeout=max(0.1, deadline - time.monotonic()))
        if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
            assert reply["msg_type"] == protocol.REPLY
            return reply["content"]


def error_text(res) -> str:
    return ANSI.sub("", res.reply.get("evalue", "") + "\n" + "\n".join(res.reply.get("traceback", [])))


@pytest.fixture(scope="module")
def kernel():
    k = DistKernel("--ranks", "2", "--hang-grace", "60")
    yield k
    k.shutdown()


def test_where_answers_while_the_ranks_main_thread_is_blocked_in_a_gloo_collective(kernel):
    kernel.execute("import torch, torch.distributed as dist")
    kc = rank_client(kernel, 0)
    try:
        msg_id = kernel.kc.execute("%%rank 0\nx = torch.ones(1)\ndist.all_reduce(x)")
        time.sleep(2)
        reply = ask(kc, protocol.request_content(protocol.Where()))
        assert reply["status"] == "ok"
        place = protocol.parse_reply(reply, "where")
        assert place.busy and place.collective == "all_reduce" and place.group_ranks == [0, 1]
        assert "dist.all_reduce(x)" in place.line
    finally:
        kc.stop_channels()
    # the rank left waiting is freed within the fast grace of the stop button
    kernel.km.interrupt_kernel()
    while True:
        msg = kernel.kc.get_iopub_msg(timeout=30)
        if msg["parent_header"].get("msg_id") == msg_id and msg["content"].get("execution_state") == "idle":
            break
    assert kernel.execute("x = torch.ones(1)\ndist.all_reduce(x)\nprint(x.item())").stream() == "2.0\n"


def test_a_malformed_request_gets_an_error_reply_and_the_rank_keeps_working(kernel):
    kc = rank_client(kernel, 1)
    try:
        v = protocol.VERSION
        bad = [{"version": v, "op": "format_disk", "args": {}},
               {"version": v, "op": "set_option", "args": {"name": "empty_cache", "on": "yes"}},
               {"version": 99, "op": "where", "args": {}},
               {"version": v, "op": "where", "args": {}, "code": "import os"},
               {"version": v, "op": "teardown", "args": {"peer_pids": "all"}}]
        for content in bad:
            reply = ask(kc, content)
            assert reply["status"] == "error" and reply["ename"] == "ProtocolError", reply
        assert ask(kc, protocol.request_content(protocol.Where()))["status"] == "ok"
        reply = ask(kc, protocol.request_content(protocol.SetOption(name="fastai", on=True)))
        assert protocol.parse_reply(reply, "set_option").outcome == "fastai on"
    finally:
        kc.stop_channels()
    assert kernel.execute("print(rank)").stream() == "[rank 0] 0\n[rank 1] 1\n"


def test_status_answers_for_a_rank_whose_cell_the_stop_button_did_not_end(kernel):
    # the cell swallows KeyboardInterrupt: after the interrupt the kernel gives up waiting for it
    msg_id = kernel.kc.execute("%%rank 1\nimport time\nwhile True:\n    try:\n        time.sleep(0.2)\n"
                               "    except KeyboardInterrupt:\n        pass")
    time.sleep(1.5)
    kernel.km.interrupt_kernel()
    ended = None
    while ended is None:
        msg = kernel.kc.get_iopub_msg(timeout=30)
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "error":
            ended = msg["content"]
    assert "did not stop after the interrupt" in ended["evalue"]
    status = kernel.execute("%dist_status")
    table = status.of_type("display_data")[0].content["data"]["text/plain"]
    row1 = next(line for line in table.splitlines() if line.startswith("1 "))
    assert "busy: line 5:" in row1 and "time.sleep(0.2)" in row1, table  # the cell's own line numbers


def test_the_kernel_survives_a_wiped_namespace_on_every_rank():
    k = DistKernel("--ranks", "2", "--hang-grace", "60")
    try:
        k.execute("%reset -f")
        k.execute("for _n in [n for n in list(globals()) if n.startswith('_') and n != '__builtins__']:\n"
                  "    del globals()[_n]")
        k.execute("globals().clear()")
        t0 = time.monotonic()
        res = k.execute("import os, torch, torch.distributed as dist\n"
                        "if os.environ['RANK'] == '1':\n    raise ValueError('rank 1 fails')\n"
                        "dist.all_reduce(torch.ones(1))", timeout=60)
        assert time.monotonic() - t0 < 15
        text = error_text(res)
        assert "rank 1 fails" in text and "CollectiveHangError" in text and "re-formed" in text
        assert k.execute("x = torch.ones(1)\ndist.all_reduce(x)\nprint(x.item())").stream() == "2.0\n"
        status = k.execute("%dist_status").of_type("display_data")[0].content["data"]["text/plain"]
        assert len([line for line in status.splitlines() if re.match(r"^[01] ", line)]) == 2
        assert all(" idle" in line for line in status.splitlines() if re.match(r"^[01] ", line))
        assert k.execute("%dist_empty_cache off").stream() == "empty_cache: off on every rank\n"
    finally:
        k.shutdown()


def test_no_rank_thread_polls_the_runtime_directory():
    """The old probe thread woke ten times a second; a rank now runs ipykernel's threads only."""
    k = DistKernel("--ranks", "2")
    try:
        k.execute("import threading")
        names = k.execute("print(sorted(t.name for t in threading.enumerate()))").stream()
        assert "dist_kernel" not in names
        assert not glob.glob(f"/tmp/dist_kernel-{k.pid}-*/*.probe")
    finally:
        k.shutdown()

