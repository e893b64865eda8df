"""Write the Hugging Face example notebooks (outputs empty): ``python examples/build_hf_examples.py``.

- ``accelerate_regression.ipynb``: ``Accelerator()`` in a cell, ``prepare``, ``backward``,
  ``gather_for_metrics``, ``accelerator.print``, ``save_state``/``load_state``, then
  ``notebook_launcher`` on the kernel's ranks.
- ``transformers_trainer.ipynb``: a two-layer BERT built from a ``BertConfig`` trained with
  ``Trainer``/``TrainingArguments`` on generated token sequences; ``evaluate``, ``predict``,
  ``save_model``.

Nothing is downloaded: the models are built from configs, the data is generated. Each notebook's
code, cells tagged ``kernel-only`` left out, is also a script that runs as it is under
``torchrun --nproc-per-node N`` (``tests/kernel/test_ecosystem_hf.py`` compares the two); its last cell
prints one ``RESULT {json}`` line with the numbers compared.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).parent
#: cells with this tag run in the kernel only (``notebook_launcher``): a torchrun script has no use for them
KERNEL_ONLY = "kernel-only"


def kernel_only(source: str) -> nbformat.NotebookNode:
    cell = new_code_cell(source)
    cell.metadata["tags"] = [KERNEL_ONLY]
    return cell


ACCELERATE = [
    new_markdown_cell(
        "# accelerate, unchanged\n\n"
        "The code of an `accelerate` training script, cell by cell. On the **Distributed Python** kernel every "
        "cell runs on every rank, and the ranks are already one process group: `Accelerator()` joins it, "
        "`prepare` shards the data, `backward` averages the gradients. The same cells (all but the "
        "`notebook_launcher` ones at the end) run as a script under `torchrun --nproc-per-node 2`."),
    new_code_cell(
        "import json, os, tempfile\n"
        "import torch\n"
        "from torch import nn\n"
        "from torch.utils.data import DataLoader, TensorDataset\n"
        "from accelerate import Accelerator, notebook_launcher\n"
        "from accelerate.utils import broadcast_object_list, set_seed\n\n"
        "accelerator = Accelerator()\n"
        "accelerator.print(f'{accelerator.num_processes} processes, {accelerator.distributed_type}, device {accelerator.device}')"),
    new_markdown_cell(
        "A synthetic regression problem: 512 training samples, 100 validation samples (not a multiple of "
        "the batch size times the number of processes, so `gather_for_metrics` has padding to drop). Each "
        "sample carries its index, so we can check which process saw which sample."),
    new_code_cell(
        "set_seed(0)  # the same data and initial weights on every process\n"
        "X, w_true = torch.randn(612, 8), torch.randn(8, 1)\n"
        "Y = X @ w_true + 0.05 * torch.randn(612, 1)\n"
        "ids = torch.arange(612)\n"
        "train_dl = DataLoader(TensorDataset(ids[:512], X[:512], Y[:512]), batch_size=16, shuffle=True)\n"
        "valid_dl = DataLoader(TensorDataset(ids[512:], X[512:], Y[512:]), batch_size=16)\n\n"
        "model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))\n"
        "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)\n"
        "model, optimizer, train_dl, valid_dl = accelerator.prepare(model, optimizer, train_dl, valid_dl)"),
    new_code_cell(
        "seen = []  # the sample ids this process trained on\n"
        "for epoch in range(4):\n"
        "    model.train()\n"
        "    for i, x, y in train_dl:\n"
        "        loss = nn.functional.mse_loss(model(x), y)\n"
        "        accelerator.backward(loss)\n"
        "        optimizer.step()\n"
        "        optimizer.zero_grad()\n"
        "        seen.append(i)\n"
        "    mean_loss = accelerator.reduce(loss.detach(), 'mean').item()\n"
        "    accelerator.print(f'epoch {epoch}: loss {mean_loss:.4f}')"),
    new_markdown_cell("Each process trained on its own share of the batches; together they saw every sample once per epoch."),
    new_code_cell(
        "seen = torch.cat(seen)\n"
        "per_process = accelerator.gather(torch.tensor([len(seen)], device=accelerator.device)).tolist()\n"
        "all_seen = accelerator.gather(seen)\n"
        "accelerator.print('samples per process over 4 epochs:', per_process)\n"
        "accelerator.print('every sample seen once per epoch:', bool((torch.bincount(all_seen, minlength=512) == 4).all()))"),
    new_markdown_cell("Validation: `gather_for_metrics` returns exactly the 100 validation rows, in order, on every process."),
    new_code_cell(
        "model.eval()\n"
        "preds, targets, order = [], [], []\n"
        "for i, x, y in valid_dl:\n"
        "    with torch.no_grad():\n"
        "        p = model(x)\n"
        "    p, y, i = accelerator.gather_for_metrics((p, y, i))\n"
        "    preds.append(p); targets.append(y); order.append(i)\n"
        "preds, targets, order = torch.cat(preds), torch.cat(targets), torch.cat(order)\n"
        "valid_mse = nn.functional.mse_loss(preds, targets).item()\n"
        "accelerator.print(f'{len(preds)} validation rows, in order: {order.tolist() == list(range(512, 612))}, mse {valid_mse:.4f}')"),
    new_markdown_cell("The replicas stayed identical: one checksum per process, gathered."),
    new_code_cell(
        "def checksum(m):\n"
        "    return torch.cat([p.detach().flatten() for p in accelerator.unwrap_model(m).parameters()]).double().sum()\n\n"
        "sums = accelerator.gather(checksum(model).reshape(1))\n"
        "accelerator.print('replicas equal:', bool((sums == sums[0]).all()))"),
    new_markdown_cell(
        "`save_state` writes model, optimizer and RNG states once (the main process writes the model); "
        "`load_state` brings them back on every process. The directory is made on the main process and its "
        "name shared with the others."),
    new_code_cell(
        "ckpt = broadcast_object_list([tempfile.mkdtemp(prefix='accelerate_ckpt_') if accelerator.is_main_process else None])[0]\n"
        "accelerator.save_state(ckpt)\n"
        "accelerator.wait_for_everyone()  # the main process wrote the model: wait for it before reading\n"
        "before = checksum(model).item()\n"
        "with torch.no_grad():\n"
        "    for p in model.parameters():\n"
        "        p.add_(1.0)\n"
        "accelerator.load_state(ckpt)\n"
        "accelerator.print('restored from the checkpoint:', checksum(model).item() == before)\n"
        "accelerator.print('files:', sorted(os.listdir(ckpt)))"),
    new_markdown_cell("The numbers the tests compare with the same script under `torchrun`:"),
    new_code_cell(
        "print('RESULT ' + json.dumps({'loss': mean_loss, 'valid_mse': valid_mse, 'checksum': before,\n"
        "                              'samples_per_process': per_process}))"),
    new_markdown_cell(
        "## `notebook_launcher`, without forking\n\n"
        "Notebooks written for one machine wrap their training in a function and hand it to "
        "`notebook_launcher`, which forks worker processes. Here the ranks already are those processes: "
        "the call runs the function once on every rank, in the existing group, and returns when all are "
        "done. (`%dist_hf off` gives accelerate's own launcher back.)"),
    kernel_only(
        "def training_function(epochs):\n"
        "    accelerator = Accelerator()\n"
        "    set_seed(1)\n"
        "    model = nn.Linear(8, 1)\n"
        "    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)\n"
        "    dl = DataLoader(TensorDataset(X[:512], Y[:512]), batch_size=32, shuffle=True)\n"
        "    model, optimizer, dl = accelerator.prepare(model, optimizer, dl)\n"
        "    for _ in range(epochs):\n"
        "        for x, y in dl:\n"
        "            loss = nn.functional.mse_loss(model(x), y)\n"
        "            accelerator.backward(loss)\n"
        "            optimizer.step()\n"
        "            optimizer.zero_grad()\n"
        "    accelerator.print(f'process {accelerator.process_index}: {len(dl)} batches per epoch, '\n"
        "                      f'loss {accelerator.reduce(loss.detach(), \"mean\").item():.4f}')\n\n"
        "notebook_launcher(training_function, args=(3,), num_processes=accelerator.num_processes)"),
]


TRANSFORMERS = [
    new_markdown_cell(
        "# Transformers `Trainer`, unchanged\n\n"
        "A two-layer BERT built from a `BertConfig` (nothing downloaded) learns a toy task on generated token "
        "sequences: are most of its tokens small? `Trainer` and `TrainingArguments` are used as in a script: "
        "on the **Distributed Python** kernel they find the ranks' process group and train data-parallel, "
        "one progress bar and one log table show, `evaluate()` and `predict()` cover the whole evaluation "
        "set in order, `save_model` writes once. The same cells run as a script under "
        "`torchrun --nproc-per-node 2`."),
    new_code_cell(
        "import json, os, tempfile\n"
        "import torch\n"
        "from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments, set_seed"),
    new_code_cell(
        "class Sequences(torch.utils.data.Dataset):\n"
        "    \"Random token sequences, labelled 1 when most of their tokens are small (below 18).\"\n"
        "    def __init__(self, n, seed, length=16, vocab=32):\n"
        "        g = torch.Generator().manual_seed(seed)\n"
        "        self.x = torch.randint(4, vocab, (n, length), generator=g)\n"
        "        self.y = ((self.x < 18).sum(1) * 2 > length).long()\n"
        "    def __len__(self): return len(self.y)\n"
        "    def __getitem__(self, i): return {'input_ids': self.x[i], 'labels': self.y[i]}\n\n"
        "train_ds, eval_ds = Sequences(512, seed=0), Sequences(101, seed=1)"),
    new_code_cell(
        "set_seed(0)\n"
        "config = BertConfig(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,\n"
        "                    intermediate_size=64, max_position_embeddings=16, num_labels=2)\n"
        "model = BertForSequenceClassification(config)\n"
        "print(f'{model.num_parameters():,} parameters')"),
    new_code_cell(
        "def accuracy(pred):\n"
        "    return {'accuracy': float((pred.predictions.argmax(-1) == pred.label_ids).mean())}\n\n"
        "out_dir = os.path.join(tempfile.gettempdir(), 'tiny_bert_trainer')  # the same path on every process\n"
        "args = TrainingArguments(out_dir, per_device_train_batch_size=16, per_device_eval_batch_size=16,\n"
        "                         num_train_epochs=3, learning_rate=1e-3, logging_steps=8, eval_strategy='epoch',\n"
        "                         save_strategy='no', seed=0,\n"
        "                         ddp_find_unused_parameters=False)  # BERT uses every parameter: no DDP warning\n"
        "trainer = Trainer(model=model, args=args, train_dataset=train_ds, eval_dataset=eval_ds, compute_metrics=accuracy)\n"
        "train_result = trainer.train()"),
    new_code_cell("metrics = trainer.evaluate()\nmetrics"),
    new_code_cell(
        "out = trainer.predict(eval_ds)\n"
        "print(out.predictions.shape, 'predictions; labels in order:', bool((out.label_ids == eval_ds.y.numpy()).all()))\n"
        "print(f\"test accuracy {out.metrics['test_accuracy']:.3f}\")"),
    new_code_cell(
        "trainer.save_model(out_dir + '/model')  # written by the main process only\n"
        "trainer.accelerator.wait_for_everyone()\n"
        "print('saved:', sorted(os.listdir(out_dir + '/model')))"),
    new_markdown_cell("The replicas stayed identical, and the numbers the tests compare with `torchrun`:"),
    new_code_cell(
        "checksum = sum(p.detach().double().sum() for p in trainer.model.parameters())\n"
        "if torch.distributed.is_initialized():\n"
        "    sums = [torch.zeros(1, dtype=torch.float64) for _ in range(torch.distributed.get_world_size())]\n"
        "    torch.distributed.all_gather(sums, checksum.reshape(1))\n"
        "    print('replicas equal:', all(bool(s == sums[0]) for s in sums))\n"
        "print('RESULT ' + json.dumps({'train_loss': train_result.training_loss, 'eval_loss': metrics['eval_loss'],\n"
        "                              'eval_accuracy': metrics['eval_accuracy'], 'checksum': checksum.item(),\n"
        "                              'steps': trainer.state.global_step}))"),
]


def write(name: str, cells: list) -> None:
    nb = new_notebook(cells=cells)
    nb.metadata = {"kernelspec": {"display_name": "Distributed Python", "language": "python",
                                  "name": "distributed-python"}, "language_info": {"name": "python"}}
    nbformat.write(nb, HERE / name)


if __name__ == "__main__":
    write("accelerate_regression.ipynb", ACCELERATE)
    write("transformers_trainer.ipynb", TRANSFORMERS)
