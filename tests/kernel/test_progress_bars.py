"""Issue 30, progress bars, on a real kernel (real ipykernel ranks, real gloo), run through
nbclient, whose saved notebook is what a reader sees: a ``\\r`` bar on every rank ends as one
line, as under python3; a line that differs per rank for a while leaves no frame behind; an
ipywidgets ``Output`` that rank 0 alone redraws with ``clear_output(wait=True)`` (Lightning's rich
progress bar) holds its last frame only, and what the ranks print after it merges."""

from __future__ import annotations

import re

import nbformat
import pytest
from harness import DistKernel
from jupyter_client.manager import KernelManager
from nbclient import NotebookClient

from dist_kernel.parent.merge import render_cr
from dist_kernel.parent.merge.units import progress_key

pytestmark = pytest.mark.slow

VIEW = "application/vnd.jupyter.widget-view+json"

#: plain tqdm in a DDP-ish loop: every rank draws its bar at its own pace
TQDM = ("import time\nfrom tqdm import tqdm\n"
        "for i in tqdm(range(12), desc='train', mininterval=0):\n    time.sleep(0.02 + 0.01 * rank)")


@pytest.fixture(scope="module")
def k2():
    k = DistKernel("--ranks", "2")
    yield k
    k.shutdown()


@pytest.fixture(scope="module")
def k4():
    k = DistKernel("--ranks", "4")
    yield k
    k.shutdown()


def run_notebook(km: KernelManager, *cells: str) -> nbformat.NotebookNode:
    """Run ``cells`` through nbclient on the running kernel of ``km`` (left running)."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(c) for c in cells]
    NotebookClient(nb, km=km, timeout=180).execute()
    return nb


def shown(outputs: list) -> str:
    """What a frontend shows of saved outputs: consecutive stream text of one name as one output,
    ``\\r`` rewriting its line; a display's text."""
    texts: list[list[str]] = []  # [stream name or "", text]
    for out in outputs:
        if out["output_type"] == "stream" and texts and texts[-1][0] == out["name"]:
            texts[-1][1] += out["text"]
        elif out["output_type"] == "stream":
            texts.append([out["name"], out["text"]])
        else:
            texts.append(["", out.get("data", {}).get("text/plain", "") + "\n"])
    return "".join(render_cr(text) if name else text for name, text in texts)


def widgets(nb: nbformat.NotebookNode) -> dict[str, list]:
    """The outputs each ipywidgets ``Output`` holds in the saved widget state, by model id."""
    state = nb.metadata.get("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    return {k: v["state"].get("outputs", []) for k, v in state.items() if v["model_name"] == "OutputModel"}


# ------------------------------------------------------------------ 2.1: \r bars
@pytest.mark.parametrize("fixture", ["k2", "k4"])
def test_plain_tqdm_on_every_rank_leaves_one_final_line_as_under_python3(request, fixture):
    k = request.getfixturevalue(fixture)
    plain_km = KernelManager(kernel_name="python3")
    plain_km.start_kernel()
    try:
        plain = shown(run_notebook(plain_km, "rank = 0", TQDM).cells[1].outputs)
    finally:
        plain_km.shutdown_kernel(now=True)
    ours = shown(run_notebook(k.km, TQDM).cells[0].outputs)
    assert re.fullmatch(r"train: 100%\|█+\| 12/12 \[.*it/s\]\n", ours), ours
    assert progress_key(ours) == progress_key(plain)  # the same bar, its rate and times aside


@pytest.mark.parametrize("fixture", ["k2", "k4"])
def test_a_line_that_differs_per_rank_for_two_steps_is_redrawn_in_place_and_leaves_no_frame(request, fixture):
    k = request.getfixturevalue(fixture)
    n = 2 if fixture == "k2" else 4
    code = ("import time\nfor i in range(5):\n    tag = f' (rank {rank})' if i in (1, 2) else ''\n"
            "    print(f'\\rstep {i}{tag}', end='', flush=True)\n    time.sleep(0.3)\nprint()\nprint('done')")
    res = k.execute(code)
    states = [o.text for o in res.outputs if o.msg_type in ("display_data", "update_display_data")]
    # while the ranks differ, each rank's line is one line of the one display
    assert "\n".join(f"[rank {r}] step 2 (rank {r})" for r in range(n)) in states, states
    assert len({o.content["transient"]["display_id"] for o in res.outputs if "transient" in o.content}) == 1
    assert shown(run_notebook(k.km, code).cells[0].outputs) == "step 4\ndone\n"


# ------------------------------------------------------------------ 2.2: Output widgets
REDRAW = ("import ipywidgets as w, time\nfrom IPython.display import clear_output, display, HTML\n"
          "out = w.Output()\ndisplay(out)\nfor i in range(5):\n    if rank == 0:\n        with out:\n"
          "            clear_output(wait=True)\n            {show}\n    else:\n"
          "        print('meanwhile', i)\n    time.sleep(0.1)\nprint('after', world_size)")


def test_a_widget_rank_0_alone_redraws_holds_its_last_frame_and_nothing_else(k2):
    nb = run_notebook(k2.km, REDRAW.format(show="print('frame', i)"))
    (held,) = widgets(nb).values()
    assert [(o["output_type"], o.get("text")) for o in held] == [("stream", "[rank 0] frame 4\n")], nb.cells[0].outputs
    # the other rank's lines, printed while rank 0 captured, went to the cell
    cell = nb.cells[0].outputs
    assert VIEW in cell[0]["data"]
    assert shown(cell[1:]) == "".join(f"[rank 1] meanwhile {i}\n" for i in range(5)) + "after 2\n"


def test_a_display_rank_0_redraws_in_a_widget_stays_in_the_widget(k2):
    nb = run_notebook(k2.km, REDRAW.format(show="display(HTML(f'<b>frame {i}</b>'))"))
    (held,) = widgets(nb).values()
    assert len(held) == 1 and "<b>frame 4</b>" in held[0]["data"]["text/html"]
    assert "frame" not in str(nb.cells[0].outputs)  # nothing escaped into the cell


# ------------------------------------------------------------------ 2.2, 2.3: Lightning
LIGHTNING_SETUP = """\
import torch, lightning as L
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
X = torch.randn(64, 4)
dl = DataLoader(TensorDataset(X, X.sum(1, keepdim=True)), batch_size=8)
class M(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(4, 1)
    def training_step(self, b, i):
        loss = nn.functional.mse_loss(self.net(b[0]), b[1])
        self.log('loss', loss, prog_bar=True)
        return loss
    def validation_step(self, b, i):
        self.log('val_loss', nn.functional.mse_loss(self.net(b[0]), b[1]), sync_dist=True)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
trainer = L.Trainer(accelerator='cpu', devices=world_size, strategy='ddp', max_epochs=2, logger=False,
                    enable_checkpointing=False, enable_model_summary=False)"""


def test_lightnings_rich_bar_holds_one_frame_and_what_follows_fit_and_validate_merges(k2):
    nb = run_notebook(k2.km, LIGHTNING_SETUP, "trainer.fit(M(), dl, dl)\nprint('after fit', world_size)\n"
                                              "trainer.validate(trainer.model, dl, verbose=False)\n"
                                              "print('after validate', world_size)")
    bars = widgets(nb)
    assert len(bars) == 2 and all(len(held) == 1 for held in bars.values()), bars  # the bars of fit and validate
    after = [line for line in shown(nb.cells[1].outputs).splitlines() if "after" in line]
    assert after == ["after fit 2", "after validate 2"]  # merged: shown once each, unlabelled, in place
