"""Across machines, the notebook works as on one (issue 13): the stop button, ``input()``,
widgets, ``%%rank`` and fastai, with ranks on the lab's two nodes (real ssh, real namespaces)."""

from __future__ import annotations

import queue
import threading
import time

import pytest
from cluster_lab import SSH_OPTS, kernel_env
from harness import DistKernel, shell_reply

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def remote2(lab):
    k = DistKernel(*SSH_OPTS, env=kernel_env(lab))
    try:
        res = k.execute("import socket\nprint(socket.gethostname())", timeout=240)
        assert res.stream() == "[rank 0] n1\n[rank 1] n2\n", res.outputs
        yield k
    finally:
        k.shutdown()


def test_the_stop_button_interrupts_ranks_on_other_machines_once(remote2):
    threading.Timer(1.5, remote2.km.interrupt_kernel).start()
    t0 = time.monotonic()
    res = remote2.execute("import time\ntime.sleep(60)", timeout=30)
    (err,) = res.of_type("error")
    assert err.content["ename"] == "KeyboardInterrupt"
    assert time.monotonic() - t0 < 15
    assert remote2.execute("print('alive', socket.gethostname())").stream() == "[rank 0] alive n1\n[rank 1] alive n2\n"


def test_input_prompts_once_and_the_answer_reaches_every_node(remote2):
    msg_id = remote2.kc.execute("name = input('your name? ')", allow_stdin=True)
    request = remote2.kc.get_stdin_msg(timeout=30)
    assert request["content"]["prompt"] == "your name? "
    remote2.kc.input("ada")
    with pytest.raises(queue.Empty):
        remote2.kc.get_stdin_msg(timeout=2)  # one prompt, not one per node
    assert shell_reply(remote2, msg_id)["status"] == "ok"
    assert remote2.execute("print(name, socket.gethostname())").stream() == "[rank 0] ada n1\n[rank 1] ada n2\n"


def test_a_widget_on_another_machine_gets_the_frontends_messages(remote2):
    res = remote2.execute("import ipywidgets as w\ns = w.IntSlider(value=10 + rank)\ns")
    sliders = {o.content["data"]["state"]["value"]: o.content["comm_id"] for o in res.of_type("comm_open")
               if o.content["data"]["state"].get("_model_name") == "IntSliderModel"}
    assert set(sliders) == {10, 11}
    msg = remote2.kc.session.msg("comm_msg", {"comm_id": sliders[11], "data": {
        "method": "update", "state": {"value": 42}, "buffer_paths": []}})
    remote2.kc.shell_channel.send(msg)
    time.sleep(1)
    assert remote2.execute("print(s.value)").stream() == "[rank 0] 10\n[rank 1] 42\n"


def test_rank_selection_runs_a_cell_only_on_the_named_ranks_node(remote2):
    # a cell of one rank is not labelled, as on one machine
    assert remote2.execute("%%rank 1\nprint(socket.gethostname())").stream() == "n2\n"


FASTAI = """\
import json, hashlib, numpy as np, pandas as pd
from fastai.tabular.all import *
from torch.nn.parallel import DistributedDataParallel as DDP
rng = np.random.default_rng(0)
df = pd.DataFrame({'a': rng.normal(size=512), 'b': rng.normal(size=512)})
df['y'] = (df.a + df.b > 0).map({True: 'yes', False: 'no'})
dls = TabularDataLoaders.from_df(df, y_names='y', cont_names=['a', 'b'], bs=32)
learn = tabular_learner(dls, layers=[8])
class Probe(Callback):
    def before_fit(self): self.ddp, self.batches = True, 0
    def after_batch(self):
        if self.training: self.ddp &= isinstance(self.learn.model, DDP); self.batches += 1
probe = Probe()
learn.fit(1, 1e-2, cbs=probe)
h = hashlib.sha256(b''.join(v.detach().cpu().numpy().tobytes() for v in learn.model.state_dict().values()))
print(json.dumps(dict(ddp=probe.ddp, batches=probe.batches, total=len(learn.dls.train), state=h.hexdigest()[:16])))
"""


def test_fastai_trains_data_parallel_across_the_nodes(remote2):
    import json

    res = remote2.execute(FASTAI, timeout=300)
    assert res.status == "ok", res.explain()
    lines = [ln.split("] ", 1)[-1] for ln in res.stream().splitlines() if ln.strip().endswith("}")]
    rows = [json.loads(ln) for ln in lines] or [json.loads(res.stream())]
    # one merged line: every rank trained under DDP on half the batches, and ends with the same weights
    assert len(rows) == 1, res.stream()
    row = rows[0]
    assert row["ddp"] and 0 < row["batches"] < row["total"], row
