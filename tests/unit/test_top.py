"""``%dist_top`` (issue 28, section 2): the table's text and HTML forms, the n/a cases, the state
names, the GPU each rank is sampled on, NVML's failures, and the live display in the parent
kernel (one display id, updated in place while a cell runs, nothing while none runs), driven
in-process against fake ranks."""

from __future__ import annotations

import asyncio
import os
import sys
import types

import pytest
from fake_ranks import Act
from inprocess import on_fake_ranks

from dist_kernel.load import KEYS, LoadSampler, Nvml, clean, gpu_target
from dist_kernel.parent import magics
from dist_kernel.parent.top import NOT_SHOWN, watched
from dist_kernel.parent.top_table import (
    NA,
    TopRow,
    bundle,
    render_html,
    render_text,
    state_of,
    status_columns,
)
from dist_kernel.protocol import Place
from dist_kernel.tunnel.keys import Bootstrap

pytestmark = pytest.mark.timeout(30)
GIB = 1024 ** 3
FULL = {"cpu": 97.4, "rss": 3 * GIB // 2, "gpu_util": 88.0, "gpu_used": 20 * GIB, "gpu_total": 80 * GIB,
        "gpu_temp": 66.0}


def place(collective: str | None = None, native: str = "", line: str = "x = f(x)") -> Place:
    return Place(collective=collective, group_ranks=[0, 1], peer=None, seq=1, stack=[], line=line, busy=True,
                 native=native)


# ------------------------------------------------------------------ state names
@pytest.mark.parametrize(("kw", "state"), [
    ({"alive": False, "busy": True}, "dead"),
    ({"alive": True, "at_breakpoint": True, "busy": True, "place": place()}, "stopped at a breakpoint"),
    ({"alive": True, "stopped": "stopped (SIGSTOP)", "busy": True}, "stopped"),
    ({"alive": True, "busy": False}, "idle"),
    ({"alive": True, "busy": True, "place": None}, "not answering"),
    ({"alive": True, "busy": True, "place": place("all_reduce")}, "in all_reduce"),
    ({"alive": True, "busy": True, "place": place(native="DistributedDataParallel(...) / _verify")},
     "in DistributedDataParallel(...)"),
    ({"alive": True, "busy": True, "place": place()}, "running"),
])
def test_each_state_has_its_name(kw, state):
    assert state_of(**kw) == state


# ------------------------------------------------------------------ text and HTML
def test_the_text_table_has_a_header_and_one_aligned_row_per_rank_in_rank_order():
    rows = [TopRow(1, "n2", "idle", {}), TopRow(0, "n1", "in all_reduce", FULL, "dist.all_reduce(t)")]
    lines = render_text(rows).splitlines()
    assert lines[0].split() == ["rank", "host", "state", "CPU", "%", "RSS", "GPU", "%", "GPU", "mem", "temp", "line"]
    assert lines[1].startswith("0 ") and lines[2].startswith("1 ")
    assert "in all_reduce" in lines[1] and "97" in lines[1] and "1.5 GiB" in lines[1] and "88" in lines[1]
    assert "20.0/80.0 GiB" in lines[1] and "66 C" in lines[1] and "dist.all_reduce(t)" in lines[1]
    # columns line up: each header starts where its cells start
    at = lines[0].index("state")
    assert lines[1][at:].startswith("in all_reduce") and lines[2][at:].startswith("idle")


def test_unknown_numbers_are_n_a_never_an_error():
    text = render_text([TopRow(0, "", "idle", {}), TopRow(1, "n1", "dead", clean({"cpu": "x", "rss": True}))])
    row0, row1 = text.splitlines()[1:]
    assert row0.split()[1:] == [NA, "idle", NA, NA, NA, NA, NA]  # host unknown, every number n/a
    assert row1.split()[2:] == ["dead", NA, NA, NA, NA, NA]
    assert status_columns({}) == {"cpu": NA, "gpu_util": NA, "gpu_mem": NA, "gpu_temp": NA}
    # a GPU whose total is unknown has no memory figure (and no bar)
    assert status_columns({"gpu_used": GIB})["gpu_mem"] == NA
    assert "width:" not in render_html([TopRow(0, "h", "idle", {"gpu_used": GIB})])


def test_a_long_line_is_cut_and_the_html_escapes_it():
    rows = [TopRow(0, "h<1>", "running", FULL, "print('<b>' + " + "x" * 200 + ")")]
    text = render_text(rows)
    assert "..." in text and max(len(line) for line in text.splitlines()) < 160
    page = render_html(rows)
    assert "<b>" not in page and "&lt;b&gt;" in page and "h&lt;1&gt;" in page


def test_the_html_table_has_bars_for_cpu_gpu_and_gpu_memory():
    page = render_html([TopRow(0, "n1", "in all_reduce", FULL, "dist.all_reduce(t)"),
                        TopRow(1, "n1", "idle", {"cpu": 250.0})])
    assert page.count("<tr>") == 3 and "<th" in page
    assert "width:97%" in page and "width:88%" in page and "width:25%" in page  # 20 of 80 GiB
    assert "width:100%" in page  # 250% of a core: a full bar, the number says the rest
    assert "in all_reduce" in page and "<code>dist.all_reduce(t)</code>" in page
    data = bundle([TopRow(0, "n1", "idle", {})], title="ranks")
    assert set(data) == {"text/plain", "text/html"} and data["text/plain"].startswith("ranks\n")


# ------------------------------------------------------------------ sampling
@pytest.mark.parametrize(("gpus", "local", "mask", "target"), [
    ((), 0, None, None),  # CPU ranks
    ((0, 1), 1, None, 1),
    ((0, 1), 3, None, 1),  # more ranks than GPUs: wrapped round, as the rank pins it
    ((0, 1), 1, "4,5", 5),  # NVML ignores CUDA_VISIBLE_DEVICES: the mask maps the id
    ((0,), 0, "GPU-abc", "GPU-abc"),
    ((0,), 0, "MIG-xyz", None),  # NVML cannot name it: n/a
    ((2,), 0, "0,1", None),  # hidden
    ((0,), 0, "", None),
])
def test_each_rank_is_sampled_on_the_gpu_it_pins(gpus, local, mask, target):
    assert gpu_target(gpus, local, mask) == target


def _fake_nvml(monkeypatch, fail_init: bool = False) -> None:
    mod = types.ModuleType("pynvml")
    mod.NVML_TEMPERATURE_GPU = 0

    def init():
        if fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    mod.nvmlInit = init
    mod.nvmlDeviceGetHandleByIndex = lambda i: ("h", i) if i < 2 else (_ for _ in ()).throw(RuntimeError("no"))
    mod.nvmlDeviceGetUtilizationRates = lambda h: types.SimpleNamespace(gpu=70)
    mod.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(used=GIB, total=8 * GIB)

    def temp(h, kind):
        raise RuntimeError("not supported")

    mod.nvmlDeviceGetTemperature = temp
    monkeypatch.setitem(sys.modules, "pynvml", mod)


def test_nvml_gives_what_it_can_and_n_a_for_the_rest(monkeypatch):
    _fake_nvml(monkeypatch)
    nv = Nvml()
    assert nv.sample(1) == {"gpu_util": 70.0, "gpu_used": GIB, "gpu_total": 8 * GIB, "gpu_temp": None}
    assert nv.sample(7) == {"gpu_util": None, "gpu_used": None, "gpu_total": None, "gpu_temp": None}
    assert nv.sample(None)["gpu_util"] is None


@pytest.mark.parametrize("how", ["missing", "no driver"])
def test_without_nvml_the_gpu_is_n_a(monkeypatch, how):
    if how == "missing":
        monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    else:
        _fake_nvml(monkeypatch, fail_init=True)
    assert LoadSampler(Nvml()).sample(os.getpid(), 0)["gpu_util"] is None


def test_a_process_is_sampled_from_outside_and_a_gone_one_is_n_a():
    sampler = LoadSampler()
    first = sampler.sample(os.getpid(), None)
    assert set(first) == set(KEYS) and first["cpu"] is None and first["rss"] > 0  # CPU needs two samples
    assert isinstance(sampler.sample(os.getpid(), None)["cpu"], float)
    assert sampler.sample(2 ** 22 + 12345, None)["rss"] is None


# ------------------------------------------------------------------ in the kernel
def test_dist_top_is_a_parent_magic():
    calls, rest = magics.split("%dist_top off\n")
    assert calls == [("dist_top", "off")] and not rest.strip()


def _kernel_test(test, script):
    async def fast(fe, ranks):
        fe.kernel.top.interval = 0.05
        return await test(fe, ranks)
    return on_fake_ranks(fast, script, hang_grace=60)


def _tables(messages: list[dict]) -> list[tuple[str, str, str]]:
    """(msg_type, display_id, text) of each %dist_top display message."""
    return [(m["msg_type"], m["content"]["transient"]["display_id"], m["content"]["data"].get("text/plain", ""))
            for m in messages if m["msg_type"] in ("display_data", "update_display_data")
            and m["content"].get("metadata", {}).get("dist_kernel", {}).get("top")]


def _row(text: str, rank: int) -> str:
    return next(line for line in text.splitlines() if line.split()[0] == str(rank))


def test_dist_top_updates_one_display_in_place_while_a_cell_runs_and_shows_who_waits_in_a_collective():
    async def test(fe, ranks):
        # as JupyterLab sends cells: someone is there to answer input(), and to watch the table
        assert (await fe.execute("%dist_top", allow_stdin=True)).stream().startswith("dist_top: on (a table")
        msg = fe.execute_request("%%rank 0\ndist.all_reduce(t)", allow_stdin=True)
        task = asyncio.ensure_future(fe.send_shell(msg))
        await ranks.running(1)
        for _ in range(200):  # three updates (every 0.05 s), however loaded the machine
            await asyncio.sleep(0.05)
            live = _tables(fe.published(msg))
            if len(live) >= 3:
                break
        assert len(live) >= 3, live
        assert live[0][0] == "display_data" and {t for t, _, _ in live[1:]} == {"update_display_data"}
        assert len({d for _, d, _ in live}) == 1  # one display
        assert "in all_reduce" in _row(live[-1][2], 0) and "idle" in _row(live[-1][2], 1)
        assert ranks.sampling == [True]
        await fe.send_control(fe.request("interrupt_request", {}))  # blocked: torn down after the stop
        await task
        cell = fe.collect(msg)
        assert cell.status == "error"
        final = _tables(cell.messages)
        # the cell is over: the display is emptied, so a notebook saved now keeps no table
        assert final[-1][0] == "update_display_data" and final[-1][2] == "" and final[-2][2]
        assert [m["content"]["data"] for m in cell.messages if m["msg_type"] == "update_display_data"][-1] == {}
        assert ranks.sampling == [True, False]
        # nothing while no cell runs; a short cell shows no table
        await asyncio.sleep(0.2)
        assert not _tables(fe.published(msg)[len(cell.messages):])
        assert (await fe.execute("%dist_top off")).stream() == "dist_top: off\n"
        msg = fe.execute_request("x = 1", allow_stdin=True)
        task = asyncio.ensure_future(fe.send_shell(msg))
        await ranks.running(2)
        await asyncio.sleep(0.3)
        await fe.send_control(fe.request("interrupt_request", {}))
        await task
        assert not _tables(fe.collect(msg).messages)
        bad = await fe.execute("%dist_top sideways")
        assert bad.status == "error" and "%dist_top off" in bad.errors[0]["evalue"]

    def script(rank, code):
        if "all_reduce" in code:
            return Act(blocked_in="all_reduce")
        return Act(runs=True) if code.startswith("x = 1") else Act()

    _kernel_test(test, script)


def test_the_table_is_only_for_a_frontend_a_person_watches():
    assert watched({"content": {"allow_stdin": True}})  # JupyterLab, Notebook, VS Code
    assert not watched({"content": {"allow_stdin": False}, "metadata": {}})  # nbclient, papermill
    assert watched({"content": {"allow_stdin": False}, "metadata": {"dist_kernel": {"live": True}}})  # run, a tty
    assert not watched({"content": {}, "metadata": {"dist_kernel": {"live": "yes"}}})


def test_no_table_is_sent_to_a_frontend_that_runs_cells_unwatched_but_one_to_the_runner_on_a_terminal():
    async def test(fe, ranks):
        on = await fe.execute("%dist_top")  # nbclient's way: allow_stdin off
        assert on.stream() == NOT_SHOWN
        cells = {}
        for name, extra in (("nbclient", {}), ("run", {"metadata": {"dist_kernel": {"live": True}}})):
            msg = fe.execute_request("x = 1")
            msg.update(extra)
            task = asyncio.ensure_future(fe.send_shell(msg))
            await ranks.running(2)
            for _ in range(100):  # a few intervals (0.05 s) for a table to come, if one will
                await asyncio.sleep(0.05)
                if len(_tables(fe.published(msg))) >= 2 or (name == "nbclient" and _ > 10):
                    break
            await fe.send_control(fe.request("interrupt_request", {}))
            await task
            cells[name] = fe.collect(msg)
        assert not _tables(cells["nbclient"].messages)
        assert ranks.sampling == [True, False]  # sampled for the runner's cell only
        shown = _tables(cells["run"].messages)
        assert shown[0][0] == "display_data" and "running" in _row(shown[0][2], 0) and shown[-1][2] == ""

    _kernel_test(test, lambda rank, code: Act(runs=True) if code.startswith("x = 1") else Act())


def test_dist_status_has_the_load_columns():
    async def test(fe, ranks):
        cell = await fe.execute("%dist_status")
        text = next(c["data"]["text/plain"] for t, c in cell.outputs if t == "display_data")
        header = text.splitlines()[1]
        for col in ("CPU %", "GPU %", "GPU mem", "temp"):
            assert col in header
        assert NA in text.splitlines()[2]  # fake ranks have no GPU

    _kernel_test(test, lambda rank, code: Act())


# ------------------------------------------------------------------ the node agent
def test_a_node_agent_adds_its_ranks_load_to_its_beats_only_while_the_parent_asks(tmp_path):
    import shutil

    from dist_kernel import tunnel
    from dist_kernel.node.agent import NodeAgent, RankChild

    boot = Bootstrap(server_key="", client_public="", client_secret="", hmac_key="k" * 32, rank_keys={},
                            nodes=2, ranks_per_node=1)
    agent = NodeAgent("tcp://127.0.0.1:1", 1, boot)
    sent: list[dict] = []
    agent.sock = types.SimpleNamespace(send_multipart=lambda frames: sent.append(
        tunnel.unpack_ctl(boot.hmac_key, frames[1:], tunnel.FROM_NODE)))
    proc = types.SimpleNamespace(pid=os.getpid(), poll=lambda: None)  # the unit lane starts no process
    try:
        agent.ranks = {1: RankChild(1, proc, str(tmp_path / "log"), {})}

        def beat(sample: bool | None) -> dict:
            if sample is not None:
                agent.from_parent(tunnel.pack_ctl(boot.hmac_key, {"type": "beat", "sample": sample}))
            agent.beat()
            return sent[-1]["ranks"]["1"]

        assert "load" not in beat(None)  # nothing sampled until asked
        beat(True)
        load = beat(True)["load"]
        assert set(load) == set(KEYS) and load["rss"] > 0 and load["cpu"] is not None
        assert load["gpu_util"] is None  # a node without GPUs: n/a
        assert "load" not in beat(False)
    finally:
        shutil.rmtree(agent.runtime_dir, ignore_errors=True)


# ------------------------------------------------------------------ python -m dist_kernel run
def test_the_terminal_status_is_drawn_under_complete_lines_erased_before_output_and_gone_at_the_end():
    import io

    from dist_kernel.statusline import ERASE, StatusLine
    from dist_kernel.text_output import is_top

    top = {"msg_type": "update_display_data", "content": {"data": {"text/plain": "t"}, "metadata": {
        "dist_kernel": {"top": True}}}}
    assert is_top(top) and not is_top({"msg_type": "display_data", "content": {"data": {}, "metadata": {}}})
    out = io.StringIO()
    line = StatusLine(out)
    line.update("rank  state\n0     idle", at_line_start=False)  # under a \r progress bar: waits
    assert out.getvalue() == ""
    line.draw()
    assert out.getvalue() == "rank  state\n0     idle\n" and line.shown == 2
    line.update("rank  state\n0     in all_reduce", at_line_start=True)
    assert out.getvalue().endswith("\x1b[2F" + ERASE + "rank  state\n0     in all_reduce\n")
    line.reset()
    assert out.getvalue().endswith("\x1b[2F" + ERASE) and line.shown == 0
    line.draw()  # forgotten: nothing to draw
    assert out.getvalue().endswith(ERASE)
