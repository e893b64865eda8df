"""fastai notebooks, unchanged, on 2 real ranks (real kernel, real fastai, gloo on CPU).

The example notebooks run through nbclient as they are; the test only adds cells before and
after them that report evidence from every rank as ``DKTEST {json}`` lines.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import nbformat
import pytest
from harness import DistKernel, error_of
from nbclient import NotebookClient

from dist_kernel.runner import kernel_manager

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).parents[2] / "examples"
_LINE = re.compile(r"^(?:\[rank (?P<ranks>[\d,\-]+)\] )?DKTEST (?P<json>\{.*\})$", re.M)

# before the notebook: log who downloads and who extracts (instrumentation, nothing replaced)
BEFORE = """\
import os, shutil, sys, json, torch.distributed as _dist
DKTEST_FASTAI_LOADED = 'fastai' in sys.modules
def _dk_logged(fn, what):
    def inner(*a, **k):
        with open(os.environ['DKTEST_LOG'], 'a') as f: f.write(f'{what} {_dist.get_rank()}\\n')
        return fn(*a, **k)
    return inner
shutil.unpack_archive = _dk_logged(shutil.unpack_archive, 'extract')
import fastdownload
fastdownload.FastDownload.get = _dk_logged(fastdownload.FastDownload.get, 'get')
"""

# after the notebook: a probe fit, replica checksums, get_preds against a plain forward pass
PROBE = """\
import hashlib, torch
from torch.nn.parallel import DistributedDataParallel as _DDP
class _Probe(Callback):
    def before_fit(self): self.ddp, self.batches, self.items = True, 0, 0
    def after_batch(self):  # every training step ran on a DDP-wrapped model
        if self.training: self.ddp &= isinstance(self.learn.model, _DDP); self.batches += 1; self.items += find_bs(self.yb)
_probe, _logger = _Probe(), learn.logger
learn.fit(1, 1e-4, cbs=_probe)
print('DKTEST', json.dumps(dict(rank=rank, ddp=_probe.ddp, batches=_probe.batches, items=_probe.items,
      total_batches=len(learn.dls.train), total_items=len(learn.dls.train_ds), bs=learn.dls.train.bs,
      unwrapped=not isinstance(learn.model, _DDP), loaders_restored=type(learn.dls.train).__name__,
      logger_restored=learn.logger is _logger, fastai_loaded_before=DKTEST_FASTAI_LOADED)))
"""
CHECKSUM = """\
_h = hashlib.sha256()
for _k, _v in learn.model.state_dict().items(): _h.update(_k.encode()); _h.update(_v.detach().cpu().numpy().tobytes())
print('DKTEST', json.dumps(dict(rank=rank, state=_h.hexdigest())))
"""
PREDS = """\
preds, targs = learn.get_preds()
_dl = learn.dls.valid.new(shuffle=False, drop_last=False)
learn.model.eval()
with torch.no_grad():
    _ref = torch.cat([learn.model(*b[:_dl.n_inp]) for b in _dl]).softmax(-1)
    _ys = torch.cat([b[-1].view(-1) for b in _dl])
print('DKTEST', json.dumps(dict(rank=rank, rows=len(preds), n_valid=len(learn.dls.valid_ds),
      targs_in_order=bool((targs.view(-1) == _ys).all()), preds_match=bool(torch.allclose(preds, _ref, atol=1e-5)))))
"""


def _run(name: str, before: list[str], after: list[str], tmp_path: Path, monkeypatch) -> tuple[list, list[dict]]:
    monkeypatch.setenv("FASTAI_HOME", str(tmp_path / "fastai_home"))
    monkeypatch.setenv("DKTEST_LOG", str(tmp_path / "log.txt"))
    nb = nbformat.read(EXAMPLES / name, as_version=4)
    n_before = len(before)
    nb.cells = ([nbformat.v4.new_code_cell(c) for c in before] + nb.cells
                + [nbformat.v4.new_code_cell(c) for c in after])
    client = NotebookClient(nb, km=kernel_manager(["--ranks", "2"]), timeout=240,
                            resources={"metadata": {"path": str(EXAMPLES)}})
    client.execute()
    evidence = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.output_type == "stream":
                for m in _LINE.finditer(out.text):
                    evidence.append(json.loads(m["json"]))
    return nb.cells[n_before:len(nb.cells) - len(after)], evidence


def _progress_outputs(cell) -> list:
    return [o for o in cell.get("outputs", []) if "fastprogress" in json.dumps(o.get("data", {}))
            or "<progress" in json.dumps(o.get("data", {}))]


def _check_training_evidence(ev: list[dict]) -> None:
    probes = {e["rank"]: e for e in ev if "ddp" in e}
    assert set(probes) == {0, 1}
    for p in probes.values():
        assert p["ddp"] and p["unwrapped"] and p["logger_restored"]
        assert p["loaders_restored"] != "DistributedDL"
        assert not p["fastai_loaded_before"]  # installing the integration imported no fastai
        # each rank trains on about half of the batches and of the items
        assert abs(p["batches"] - p["total_batches"] / 2) <= 1, p
        assert abs(p["items"] - p["total_items"] / 2) <= p["bs"], p
    states = {e["rank"]: e["state"] for e in ev if "state" in e}
    assert set(states) == {0, 1} and states[0] == states[1]  # replicas bit-identical
    preds = [e for e in ev if "rows" in e]
    assert len(preds) in (1, 2)  # the same line from both ranks is merged into one
    for p in preds:
        assert p["rows"] == p["n_valid"] and p["targs_in_order"] and p["preds_match"], p


def _check_shown_once(cell, what: str, n: int = 1) -> None:
    """``cell`` shows ``n`` figures or tables (progress bars aside), none labelled with ranks."""
    shown = [o for o in cell.get("outputs", []) if o.output_type in ("display_data", "execute_result")
             and {"image/png", "text/html"} & set(o.get("data", {}))
             and (o.data.get("image/png") or o.data.get("text/html", "").lstrip().startswith("<table"))
             and not _progress_outputs({"outputs": [o]})]
    assert len(shown) == n, (what, [(o.get("metadata"), o.data.get("text/html", "")[:60]) for o in shown])
    for o in shown:
        assert "dist_kernel" not in o.get("metadata", {}), (what, o.metadata)


def test_vision_notebook_trains_data_parallel(tmp_path, monkeypatch):
    cells, ev = _run("fastai_pets_tiny.ipynb", [BEFORE], [PROBE, CHECKSUM, PREDS], tmp_path, monkeypatch)
    _check_training_evidence(ev)
    # untar_data ran once, on rank 0; the archive was extracted once
    assert (tmp_path / "log.txt").read_text().split("\n")[:-1] == ["get 0", "extract 0"]

    src = {i: "".join(c.source) for i, c in enumerate(cells) if c.cell_type == "code"}
    fine_tune = next(i for i, s in src.items() if "fine_tune" in s)
    lr_find = next(i for i, s in src.items() if "lr_find" in s)
    # one progress bar per fit, as on one process (fine_tune = 2 fits), and all from rank 0
    assert len(_progress_outputs(cells[fine_tune])) == 2
    for cell in cells:
        for out in _progress_outputs(cell):
            assert out.metadata.get("dist_kernel", {}).get("ranks", [0]) == [0]
    # lr_find finished with the same suggestion on both ranks: one unlabelled result
    results = [o for o in cells[lr_find].outputs if o.output_type == "execute_result"]
    assert len(results) == 1 and results[0].data["text/plain"].startswith("SuggestedLRs(valley=")
    # figures drawn after training (random batches, per-rank state) appear once, unlabelled
    for needle in ("show_batch", "show_results", "plot_confusion_matrix", "plot_top_losses", "lr_find"):
        i = next(i for i, s in src.items() if needle in s)
        _check_shown_once(cells[i], needle)
    # the trained model is good, and predict/export/load_learner worked on every rank
    assert re.search(r"is this a cat\? (True|False)\.", "".join(
        o.get("text", "") for c in cells for o in c.get("outputs", []) if o.output_type == "stream"))


MAGIC = """\
%dist_fastai off
_probe = _Probe()
learn.fit(1, 1e-4, cbs=_probe)
print('DKTEST', json.dumps(dict(rank=rank, off_ddp=_probe.ddp, off_batches=_probe.batches,
      total_batches=len(learn.dls.train))))
"""


def test_tabular_notebook_trains_data_parallel_and_the_magic_switches_off(tmp_path, monkeypatch):
    cells, ev = _run("fastai_tabular.ipynb", [BEFORE], [PROBE, CHECKSUM, PREDS, MAGIC, "%dist_fastai on"], tmp_path, monkeypatch)
    _check_training_evidence(ev)
    src = {i: "".join(c.source) for i, c in enumerate(cells) if c.cell_type == "code"}
    lr_find = next(i for i, s in src.items() if "lr_find" in s)
    results = [o for o in cells[lr_find].outputs if o.output_type == "execute_result"]
    assert len(results) == 1 and results[0].data["text/plain"].startswith("SuggestedLRs(valley=")
    fit = next(i for i, s in src.items() if "fit_one_cycle" in s)
    assert len(_progress_outputs(cells[fit])) == 1
    for needle in ("show_batch", "show_results", "plot_loss", "lr_find"):  # shown once, unlabelled
        _check_shown_once(cells[next(i for i, s in src.items() if needle in s)], needle)
    # %dist_fastai off: plain fastai again, each rank on every batch, no DDP
    off = [e for e in ev if "off_ddp" in e]
    assert off and all(not e["off_ddp"] and e["off_batches"] == e["total_batches"] for e in off)


def test_fastai_off_in_the_kernelspec_leaves_fastai_untouched():
    k = DistKernel("--ranks", "2", "--fastai", "off")
    try:
        res = k.execute("import sys, fastai.learner, fastai.data.external\n"
                        "from dist_kernel.rank.import_hook import installed; print(installed('fastai'),"
                        " hasattr(fastai.learner.Learner.fit, '__dist_kernel__'),"
                        " hasattr(fastai.data.external.untar_data, '__dist_kernel__'))", timeout=120)
        # the same on every rank (whether shown once, or labelled because the ranks drifted apart)
        lines = {re.sub(r"^\[rank [\d,-]+\] ", "", line) for line in res.stream().splitlines()}
        assert res.status == "ok" and lines == {"False False False"}
        assert "started with --fastai off" in error_of(k.execute("%dist_fastai on"))["evalue"]  # never installed
    finally:
        k.shutdown()


OWN_CTX = """\
from fastai.tabular.all import *
from fastai.distributed import *
from accelerate import Accelerator
import hashlib, json
from torch.nn.parallel import DistributedDataParallel as _DDP
rng = np.random.default_rng(0); n = 800
df = pd.DataFrame({'a': rng.normal(size=n), 'b': rng.normal(size=n), 'k': rng.choice(list('xyz'), n)})
df['y'] = np.where(df.a + df.b > 0, 'hi', 'lo')
dls = TabularDataLoaders.from_df(df, y_names='y', cat_names=['k'], cont_names=['a', 'b'],
                                 procs=[Categorify, Normalize], bs=64, num_workers=0)
learn = tabular_learner(dls, layers=[32], metrics=accuracy)
class _Probe(Callback):
    order = 100
    def before_fit(self): self.ddp, self.batches = True, 0
    def after_batch(self):  # wrapped once, by fastai's own DistributedTrainer
        if self.training:
            self.ddp &= isinstance(self.learn.model, _DDP) and not isinstance(self.learn.model.module, _DDP)
            self.batches += 1
_p = _Probe()
with learn.distrib_ctx(in_notebook=True):
    learn.fit(1, 1e-3, cbs=_p)
_h = hashlib.sha256()
for _v in learn.model.state_dict().values(): _h.update(_v.detach().cpu().numpy().tobytes())
_acc = Accelerator()
print('DKTEST', json.dumps(dict(rank=rank, ddp=_p.ddp, batches=_p.batches, total=len(learn.dls.train),
      unwrapped=not isinstance(learn.model, _DDP), state=_h.hexdigest(),
      accelerate_wraps=isinstance(_acc.prepare(torch.nn.Linear(2, 2)), _DDP), accelerate_world=_acc.num_processes)))
"""


# The tests below run their cells on one shared kernel (``kernel2``), one after the other as in one
# notebook; the figures test comes last, since it ends with ``%dist_fastai off``.
def test_a_notebook_using_fastais_own_distrib_ctx_trains_data_parallel_on_cpu_ranks(kernel2):
    # written for `accelerate launch`/notebook_launcher: fastai's DistributedTrainer does the
    # wrapping; the kernel's integration steps aside and accelerate uses the kernel's group
    k = kernel2
    res = k.execute(OWN_CTX, timeout=240)
    assert res.status == "ok", res.reply.get("evalue")
    ev = {e["rank"]: e for e in (json.loads(m["json"]) for m in _LINE.finditer(res.stream()))}
    assert set(ev) == {0, 1}
    for e in ev.values():
        assert e["ddp"] and e["unwrapped"] and e["accelerate_wraps"] and e["accelerate_world"] == 2
        assert e["batches"] == e["total"] / 2  # 10 batches of 64, 5 per rank
    assert ev[0]["state"] == ev[1]["state"]
    assert "Training Learner..." in res.stream()  # fastai's own rank-0 message, shown once


# ------------------------------------------------------------------ empty DataLoaders (issue 11, 14)
EMPTY = """\
import json, warnings
warnings.filterwarnings('ignore')
from fastai.tabular.all import *
rng = np.random.default_rng(0); n = 200
df = pd.DataFrame({'a': rng.normal(size=n), 'b': rng.normal(size=n), 'k': rng.choice(list('xyz'), n)})
df['y'] = np.where(df.a + df.b > 0, 'hi', 'lo')
to = TabularPandas(df, procs=[Categorify, Normalize], cat_names=['k'], cont_names=['a', 'b'], y_names='y',
                   splits=(list(range(n)), []))  # no validation set
learn = tabular_learner(to.dataloaders(bs=32, num_workers=0), layers=[8], metrics=accuracy)
learn.fit(1)
ev = dict(rank=rank, log=[v is None for v in learn.recorder.log[1:-1]], validate=list(learn.validate()),
          test_preds=learn.get_preds(dl=learn.dls.test_dl(df.iloc[:0])))

def _ds(n):
    x = torch.randn(n, 2)
    return [(x[i], x[i].sum(0, keepdim=True)) for i in range(n)]
def _dl(n, **kw): return DataLoader(_ds(n), bs=4, num_workers=0, **kw)
for tr, va in [(0, 20), (0, 0)]:  # no training set
    l = Learner(DataLoaders(_dl(tr, shuffle=True, drop_last=True), _dl(va)), nn.Linear(2, 1), loss_func=MSELossFlat())
    l.fit(1)
    ev[f'train{tr}_valid{va}'] = [v is None for v in l.recorder.log[1:-1]]
print('DKTEST', json.dumps(ev))
"""


def test_a_fit_with_an_empty_validation_or_training_set_runs_as_in_plain_fastai(kernel2):
    # plain fastai (one process) trains with valid_loss/metrics None, and returns None for an
    # empty DataLoader's validate/get_preds; DistributedDL used to divide by the empty length
    k = kernel2
    res = k.execute(EMPTY, timeout=240)
    assert res.status == "ok", (res.reply.get("ename"), res.reply.get("evalue"))
    ev = {e["rank"]: e for e in (json.loads(m["json"]) for m in _LINE.finditer(res.stream()))}
    assert set(ev) == {0, 1}
    for e in ev.values():
        assert e["log"] == [False, True, True]  # train_loss, valid_loss None, accuracy None
        assert e["validate"] == [None, None] and e["test_preds"] == [None, None]
        assert e["train0_valid20"] == [False, False] and e["train0_valid0"] == [False, True]


# ------------------------------------------------------------------ figures shown once (issue 11, 15)
FIGURES_SETUP = """\
import json, warnings
warnings.filterwarnings('ignore')
from fastai.vision.all import *
import torch.distributed as dist
rng = np.random.default_rng(0)
imgs = [rng.integers(0, 255, (16, 16, 3), dtype=np.uint8) for _ in range(48)]
labels = ['odd' if i % 2 else 'even' for i in range(48)]
dblock = DataBlock(blocks=(ImageBlock, CategoryBlock), get_items=lambda _: list(range(48)),
                   get_x=lambda i: PILImage.create(imgs[i]), get_y=lambda i: labels[i],
                   splitter=IndexSplitter(range(32, 48)), item_tfms=RandomCrop(12))  # random in training
dls = dblock.dataloaders(0, bs=8, num_workers=0)
learn = Learner(dls, nn.Sequential(nn.Flatten(), nn.Linear(12 * 12 * 3, 2)), metrics=accuracy)
learn.fit(1)
# the ranks' random states drift apart in real runs (each rank's own items through data-dependent
# augmentation, rank-specific code); here they differ outright, so each rank draws its own figures
set_seed(rank)
"""
SHOWN_ONCE = {
    "dls.show_batch(max_n=4, figsize=(4, 4))": 1,
    "learn.show_results(max_n=4, figsize=(4, 4))": 1,
    "learn.recorder.plot_loss()": 1,
    "interp = ClassificationInterpretation.from_learner(learn)\ninterp.plot_confusion_matrix()": 1,
    "interp.plot_top_losses(4, nrows=1)": 1,
    "learn.lr_find(num_it=5)": 1,
    # drawn into a figure the cell made first
    "fig, axs = plt.subplots(1, 4)\ndls.show_batch(ctxs=axs, max_n=4)": 1,
    # the cell returns the figure: execute_result + the inline backend's display, as in one process
    "dls.show_batch(max_n=4, figsize=(4, 4))\nplt.gcf()": 2,
    "%%rank 1\ndls.show_batch(max_n=4, figsize=(4, 4))": 1,  # the cell's only rank shows it
    # draws into the progress bar, which only one rank shows (the others used to fail its assert)
    "learn.fit(1, cbs=ShowGraphCallback())": 1,
}


def _images(res) -> list:
    return [o for o in res.outputs if o.msg_type in ("display_data", "execute_result")
            and "image/png" in o.content.get("data", {})]


def _ranks(output) -> list[int] | None:
    return ((output.content.get("metadata") or {}).get("dist_kernel") or {}).get("ranks")


def test_figures_drawn_from_random_batches_are_shown_once_and_unlabelled(kernel2):
    k = kernel2
    res = k.execute(FIGURES_SETUP, timeout=240)
    assert res.status == "ok", (res.reply.get("ename"), res.reply.get("evalue"))
    shown = {}  # per cell: the rank labels of its figures (None: unlabelled, as one process shows it)
    for code in SHOWN_ONCE:
        res = k.execute(code, timeout=120)
        assert res.status == "ok", (code, res.reply.get("ename"), res.reply.get("evalue"))
        shown[code] = [_ranks(o) for o in _images(res)]
    assert shown == {code: [None] * n for code, n in SHOWN_ONCE.items()}
    # every rank ran every helper: the group is in step (a skipped or extra collective hangs here)
    res = k.execute("t = torch.ones(1); dist.all_reduce(t); learn.fit(1); print('DKTEST', json.dumps(dict(rank=rank, sum=t.item())))", timeout=120)
    assert res.status == "ok" and {m["json"] for m in _LINE.finditer(res.stream())} == {
        json.dumps(dict(rank=r, sum=2.0)) for r in (0, 1)}
    # %dist_fastai off: fastai untouched, each rank shows its own batch, labelled
    assert k.execute("%dist_fastai off").status == "ok"
    res = k.execute("dls.show_batch(max_n=4, figsize=(4, 4))", timeout=120)
    assert res.status == "ok" and sorted(_ranks(o) for o in _images(res)) == [[0], [1]]
