"""Widgets as one (issue 19): a widget every rank creates the same way is one widget in the
frontend, and what the frontend does to it reaches every rank; widgets that differ stay one per
rank, labelled; ipywidgets' ``Output`` captures once, as in the plain Python kernel."""

from __future__ import annotations

import time

import nbformat
import pytest
from harness import kernel_for_module
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from dist_kernel.runner import kernel_manager

VIEW = "application/vnd.jupyter.widget-view+json"

#: nbclient's own test notebook for ipywidgets' Output (nbclient tests/files/Output.ipynb,
#: BSD-3-Clause), cell by cell: captures, a swallowed error, clear_output inside and outside a
#: capture, a display inside one, and nested captures
OUTPUT_NOTEBOOK = [
    "import ipywidgets as widgets\nfrom IPython.display import clear_output\n\noutput1 = widgets.Output()\noutput1",
    'print("hi")\nwith output1:\n    print("in output")',
    'with output1:\n    raise ValueError("trigger msg_type=error")',
    "import ipywidgets as widgets\n\noutput2 = widgets.Output()\noutput2",
    'print("hi2")\nwith output2:\n    print("in output2")\n    clear_output(wait=True)',
    "import ipywidgets as widgets\n\noutput3 = widgets.Output()\noutput3",
    'print("hi3")\nwith output3:\n    print("hello")\n    clear_output(wait=True)\n    print("world")',
    "import ipywidgets as widgets\n\noutput4 = widgets.Output()\noutput4",
    'print("hi4")\nwith output4:\n    print("hello world")\n    clear_output()',
    "import ipywidgets as widgets\n\noutput5 = widgets.Output()\noutput5",
    'print("hi5")\nwith output5:\n    display("hello world")  # this is not a stream but plain text\nclear_output()',
    "import ipywidgets as widgets\n\noutput_outer = widgets.Output()\noutput_inner = widgets.Output()\noutput_inner",
    "output_outer",
    'with output_inner:\n    print("in inner")\n    with output_outer:\n        print("in outer")\n    print("also in inner")',
]


@pytest.fixture(scope="module")
def kernel4():
    yield from kernel_for_module("--ranks", "4")


def _saved(nb: nbformat.NotebookNode) -> tuple[list, dict]:
    """A run notebook as a reader sees it: each cell's outputs and each Output widget's captured
    outputs (the widget state nbclient saves), widgets named by the order they appear in."""
    names: dict[str, str] = {}

    def name(model_id: str) -> str:
        return names.setdefault(model_id, f"widget {len(names)}")

    def shown(out: dict) -> tuple:
        if out["output_type"] == "stream":
            return ("stream", out["name"], out["text"])
        if out["output_type"] == "error":
            return ("error", out["ename"], out["evalue"])
        data = out.get("data", {})
        if VIEW in data:
            return (out["output_type"], name(data[VIEW]["model_id"]))
        return (out["output_type"], data.get("text/plain"))

    def joined(outputs: list) -> list[tuple]:
        # consecutive stream outputs read as one text: how a kernel's prints are cut into
        # messages depends on timing (under load python3 itself sent 'hi4' and '\n' apart)
        out: list[tuple] = []
        for o in map(shown, outputs):
            if out and o[0] == "stream" and out[-1][:2] == o[:2]:
                out[-1] = (*o[:2], out[-1][2] + o[2])
            else:
                out.append(o)
        return out

    cells = [joined(c.outputs) for c in nb.cells]
    state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    captured = {name(k): joined(v["state"].get("outputs", []))
                for k, v in state.items() if v["model_name"] == "OutputModel"}
    return cells, captured


def _run(km: KernelManager) -> tuple[list, dict]:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in OUTPUT_NOTEBOOK]
    try:
        NotebookClient(nb, km=km, timeout=120, allow_errors=True).execute()
    finally:
        km.shutdown_kernel()
    return _saved(nb)


def test_nbclients_output_widget_notebook_at_2_ranks_reads_as_under_python3():
    plain = _run(KernelManager(kernel_name="python3"))
    distributed = _run(kernel_manager(["--ranks", "2"]))
    assert plain[1]["widget 0"][0] == ("stream", "stdout", "in output\n")  # the reference captured
    assert distributed == plain


def test_a_slider_every_rank_makes_is_one_slider_and_moving_it_changes_every_rank(kernel4):
    res = kernel4.execute("import ipywidgets as w\ns = w.IntSlider()\ns")
    sliders = [o.content for o in res.of_type("comm_open")
               if o.content["data"]["state"].get("_model_name") == "IntSliderModel"]
    views = [o.content for o in res.outputs if VIEW in o.content.get("data", {})]
    assert len(sliders) == 1 and len(views) == 1, (sliders, views)
    assert views[0]["data"][VIEW]["model_id"] == sliders[0]["comm_id"]
    assert "[rank" not in views[0]["data"]["text/plain"]
    # one comm per model (the slider, its layout, its style), as one process opens: not one per rank
    assert len(res.of_type("comm_open")) == 3
    assert [o.msg_type for o in res.outputs if not o.msg_type.startswith("comm_")] == ["execute_result"]
    # the frontend moves the slider: the one message reaches the slider of every rank
    msg = kernel4.kc.session.msg("comm_msg", {"comm_id": sliders[0]["comm_id"], "data": {
        "method": "update", "state": {"value": 42}, "buffer_paths": []}})
    kernel4.kc.shell_channel.send(msg)
    time.sleep(0.5)
    assert kernel4.execute("print(s.value)").stream() == "42\n"


def test_a_widget_made_on_one_rank_only_shows_once_labelled_and_only_that_rank_hears_it(kernel4):
    res = kernel4.execute("import ipywidgets as w\nmine = w.IntSlider(value=7) if rank == 1 else None\n"
                          "if rank == 1:\n    display(mine)")
    opens = [o.content for o in res.of_type("comm_open")
             if o.content["data"]["state"].get("_model_name") == "IntSliderModel"]
    shown = [o.content["data"] for o in res.of_type("display_data")]
    assert len(opens) == 1 and [VIEW in d for d in shown] == [False, True], shown
    assert shown[0]["text/plain"].startswith("[rank 1]")  # the label, just above the widget
    msg = kernel4.kc.session.msg("comm_msg", {"comm_id": opens[0]["comm_id"], "data": {
        "method": "update", "state": {"value": 9}, "buffer_paths": []}})
    kernel4.kc.shell_channel.send(msg)
    time.sleep(0.5)
    lines = kernel4.execute("print(mine.value if mine else None)").stream().splitlines()
    assert sorted(lines) == ["[rank 0,2,3] None", "[rank 1] 9"]


def test_what_a_shared_buttons_callback_prints_on_every_rank_shows_once(kernel4):
    res = kernel4.execute("import ipywidgets as w\nb = w.Button(description='go')\nclicks = []\n"
                          "b.on_click(lambda _: (clicks.append(rank), print('clicked', world_size)))\nb")
    button = next(o.content["comm_id"] for o in res.of_type("comm_open")
                  if o.content["data"]["state"].get("_model_name") == "ButtonModel")
    msg = kernel4.kc.session.msg("comm_msg", {"comm_id": button, "data": {
        "method": "custom", "content": {"event": "click"}}})
    kernel4.kc.shell_channel.send(msg)
    texts = []
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        out = kernel4.kc.get_iopub_msg(timeout=30)
        if out["parent_header"].get("msg_id") == msg["header"]["msg_id"] and out["msg_type"] == "stream":
            texts.append(out["content"]["text"])
            if "".join(texts).endswith("\n"):
                break
    time.sleep(0.5)
    while kernel4.kc.iopub_channel.msg_ready():
        out = kernel4.kc.get_iopub_msg(timeout=1)
        if out["parent_header"].get("msg_id") == msg["header"]["msg_id"] and out["msg_type"] == "stream":
            texts.append(out["content"]["text"])
    assert "".join(texts) == "clicked 4\n"  # printed by the four ranks, shown once
    assert kernel4.execute("print(len(clicks))").stream() == "1\n"  # the click reached every rank
