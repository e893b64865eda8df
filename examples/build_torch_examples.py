"""Write the PyTorch-ecosystem example notebooks (outputs empty): ``python examples/build_torch_examples.py``.

- ``lightning_ddp.ipynb``: ``Trainer(accelerator="cpu", devices=world_size, strategy="ddp")``,
  then ``validate`` and ``predict``;
- ``fsdp_dcp.ipynb``: FSDP2 ``fully_shard`` on gloo, the full state dict gathered, a sharded
  ``torch.distributed.checkpoint`` save and load;
- ``compile_sampler.ipynb``: ``torch.compile`` of a DDP model, a ``DistributedSampler`` loop
  with ``set_epoch`` and ``tqdm``;
- ``deepspeed_zero.ipynb``: DeepSpeed ZeRO stage 2 on CPU (gloo).

Each is the code a script run by ``torchrun --nproc-per-node N`` would hold (``rank`` and
``world_size``, which the kernel defines, are the only names it does not define itself; the
tests run the same cells as a script under torchrun and compare the results). Small models,
generated data, nothing downloaded: ``python -m dist_kernel run examples/lightning_ddp.ipynb --ranks 2``.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).parent

LIGHTNING = [
    new_markdown_cell(
        "# Lightning DDP in a notebook\n\n"
        "`Trainer(strategy=\"ddp\")` as in a script under `torchrun`: on Distributed Python every rank runs "
        "this cell, Lightning finds the process group the kernel formed, and nothing forks. "
        "`world_size` is defined by the kernel."),
    new_code_cell("import torch, lightning as L\nimport torch.distributed as dist\nfrom torch import nn\n"
                  "from torch.utils.data import DataLoader, TensorDataset"),
    new_code_cell(
        "L.seed_everything(0, verbose=False)\n"
        "X = torch.randn(512, 16)\n"
        "Y = X @ torch.linspace(-1, 1, 16).unsqueeze(1) + 0.1 * torch.randn(512, 1)\n"
        "train_dl = DataLoader(TensorDataset(X[:384], Y[:384]), batch_size=32, shuffle=True)\n"
        "val_dl = DataLoader(TensorDataset(X[384:], Y[384:]), batch_size=32)"),
    new_code_cell(
        "class Regressor(L.LightningModule):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))\n"
        "        self.train_rows = 0\n\n"
        "    def training_step(self, batch, i):\n"
        "        x, y = batch\n"
        "        self.train_rows += len(x)\n"
        "        loss = nn.functional.mse_loss(self.net(x), y)\n"
        "        self.log('train_loss', loss, prog_bar=True)\n"
        "        return loss\n\n"
        "    def validation_step(self, batch, i):\n"
        "        x, y = batch\n"
        "        self.log('val_loss', nn.functional.mse_loss(self.net(x), y), sync_dist=True)\n\n"
        "    def predict_step(self, batch, i):\n"
        "        return self.net(batch[0])\n\n"
        "    def configure_optimizers(self):\n"
        "        return torch.optim.SGD(self.parameters(), lr=0.05)\n\n"
        "model = Regressor()"),
    new_code_cell(
        "trainer = L.Trainer(accelerator='cpu', devices=world_size, strategy='ddp', max_epochs=3,\n"
        "                    logger=False, enable_checkpointing=False, enable_model_summary=False)\n"
        "trainer.fit(model, train_dl, val_dl)"),
    new_markdown_cell("Each rank trained on its share of the rows, and the replicas ended equal:"),
    new_code_cell(
        "flat = torch.cat([p.detach().flatten() for p in model.parameters()])\n"
        "replicas = [torch.empty_like(flat) for _ in range(world_size)]\n"
        "dist.all_gather(replicas, flat)\n"
        "print(f'rows this rank trained on: {model.train_rows} of {3 * 384} (3 epochs, {world_size} ranks)')\n"
        "print('replicas equal:', all(torch.equal(replicas[0], r) for r in replicas))"),
    new_code_cell("metrics = trainer.validate(model, val_dl, verbose=False)"),
    new_code_cell("print('validation loss:', round(metrics[0]['val_loss'], 3))"),
    new_markdown_cell("`predict` gives each rank its share; gathered, the rows are complete and in order "
                      "(the `DistributedSampler` deals rows out round-robin):"),
    new_code_cell(
        "preds = torch.cat(trainer.predict(model, val_dl))"),
    new_code_cell(
        "shares = [torch.empty_like(preds) for _ in range(world_size)]\n"
        "dist.all_gather(shares, preds)\n"
        "ordered = torch.stack(shares, 1).reshape(-1, 1)\n"
        "with torch.no_grad():\n"
        "    expected = model.net(X[384:])\n"
        "print('predictions complete and in order:', ordered.shape == expected.shape and torch.allclose(ordered, expected, atol=1e-6))"),
]

FSDP = [
    new_markdown_cell(
        "# FSDP2 and a sharded checkpoint\n\n"
        "`fully_shard` splits every parameter across the ranks (gloo on CPU, NCCL on GPUs); "
        "`torch.distributed.checkpoint` saves and loads the shards without gathering them. "
        "`rank` and `world_size` are defined by the kernel."),
    new_code_cell(
        "import tempfile, torch\nimport torch.distributed as dist\nimport torch.distributed.checkpoint as dcp\n"
        "from torch import nn\nfrom torch.distributed.fsdp import fully_shard\n"
        "from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict"),
    new_code_cell(
        "def make_model():\n"
        "    torch.manual_seed(0)\n"
        "    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))\n"
        "    for layer in model:\n"
        "        if isinstance(layer, nn.Linear):\n"
        "            fully_shard(layer)\n"
        "    return fully_shard(model)\n\n"
        "model = make_model()\n"
        "opt = torch.optim.Adam(model.parameters(), lr=1e-2)\n"
        "local, whole = model[0].weight.to_local(), model[0].weight.full_tensor()  # full_tensor() gathers the shards\n"
        "print(f'each rank holds {local.shape[0]} of the first layer\\'s {whole.shape[0]} rows')"),
    new_code_cell(
        "g = torch.Generator().manual_seed(100 + rank)  # each rank its own batches\n"
        "w_true = torch.linspace(-1, 1, 16).unsqueeze(1)\n"
        "for _ in range(20):\n"
        "    x = torch.randn(32, 16, generator=g)\n"
        "    loss = nn.functional.mse_loss(model(x), x @ w_true)\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        "    opt.zero_grad()\n"
        "losses = [torch.zeros(()) for _ in range(world_size)]\n"
        "dist.all_gather(losses, loss.detach())\n"
        "print('mean loss after 20 steps:', round(float(sum(losses)) / world_size, 3))"),
    new_markdown_cell("The full state dict, gathered from the shards, is the same model on every rank:"),
    new_code_cell(
        "full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))\n"
        "flat = torch.cat([v.flatten() for v in full.values()])\n"
        "copies = [torch.empty_like(flat) for _ in range(world_size)]\n"
        "dist.all_gather(copies, flat)\n"
        "print(f'full state dict: {len(full)} tensors, {flat.numel()} values; equal on every rank:',\n"
        "      all(torch.equal(copies[0], c) for c in copies))"),
    new_markdown_cell("Save the sharded model and optimizer, load them into a fresh sharded model:"),
    new_code_cell(
        "where = [tempfile.mkdtemp(prefix='fsdp_dcp_') if rank == 0 else None]\n"
        "dist.broadcast_object_list(where)  # one directory for all ranks (a shared disk across machines)\n"
        "model_sd, optim_sd = get_state_dict(model, opt)\n"
        "dcp.save({'model': model_sd, 'optim': optim_sd}, checkpoint_id=where[0])\n\n"
        "fresh = make_model()\n"
        "fresh_opt = torch.optim.Adam(fresh.parameters(), lr=1e-2)\n"
        "fresh_model_sd, fresh_optim_sd = get_state_dict(fresh, fresh_opt)\n"
        "state = {'model': fresh_model_sd, 'optim': fresh_optim_sd}\n"
        "dcp.load(state, checkpoint_id=where[0])\n"
        "set_state_dict(fresh, fresh_opt, model_state_dict=state['model'], optim_state_dict=state['optim'])\n"
        "x = torch.randn(8, 16, generator=torch.Generator().manual_seed(7))\n"
        "with torch.no_grad():\n"
        "    same = torch.equal(model(x), fresh(x))\n"
        "print('loaded model gives the same outputs:', same)"),
]

COMPILE = [
    new_markdown_cell(
        "# torch.compile and a DistributedSampler loop\n\n"
        "The loop a training script holds: a `DistributedSampler` with `set_epoch`, a `tqdm` bar, a "
        "DDP model compiled with `torch.compile`. `rank` and `world_size` are defined by the kernel."),
    new_code_cell(
        "import torch\nimport torch.distributed as dist\nfrom torch import nn\n"
        "from torch.nn.parallel import DistributedDataParallel as DDP\n"
        "from torch.utils.data import DataLoader, DistributedSampler, TensorDataset\nfrom tqdm.auto import tqdm"),
    new_code_cell(
        "torch.manual_seed(0)\n"
        "X = torch.randn(1024, 32)\n"
        "Y = (X[:, :8].sum(1) > 0).long()\n"
        "dataset = TensorDataset(X, Y)\n"
        "sampler = DistributedSampler(dataset, shuffle=True, seed=0)\n"
        "loader = DataLoader(dataset, batch_size=64, sampler=sampler)\n"
        "model = DDP(nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 2)))\n"
        "compiled = torch.compile(model)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.2)"),
    new_code_cell(
        "seen = []\n"
        "for epoch in range(3):\n"
        "    sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank\n"
        "    for x, y in tqdm(loader, desc=f'epoch {epoch}', disable=rank != 0):\n"
        "        loss = nn.functional.cross_entropy(compiled(x), y)\n"
        "        opt.zero_grad()\n"
        "        loss.backward()\n"
        "        opt.step()\n"
        "    seen.append(list(sampler))\n"
        "losses = [torch.zeros(()) for _ in range(world_size)]\n"
        "dist.all_gather(losses, loss.detach())\n"
        "print('mean loss after 3 epochs:', round(float(sum(losses)) / world_size, 3))"),
    new_markdown_cell("Every epoch the ranks took disjoint shares that cover the data, and the replicas ended equal:"),
    new_code_cell(
        "shares = [None] * world_size\n"
        "dist.all_gather_object(shares, seen)\n"
        "print('each epoch covered once:', all(sorted(i for s in shares for i in s[e]) == list(range(len(dataset))) for e in range(3)))\n"
        "print('epochs shuffled differently:', seen[0] != seen[1])\n"
        "flat = torch.cat([p.detach().flatten() for p in model.parameters()])\n"
        "replicas = [torch.empty_like(flat) for _ in range(world_size)]\n"
        "dist.all_gather(replicas, flat)\n"
        "print('replicas equal:', all(torch.equal(replicas[0], r) for r in replicas))"),
]

DEEPSPEED = [
    new_markdown_cell(
        "# DeepSpeed ZeRO stage 2 on CPU\n\n"
        "`deepspeed.initialize` in a cell, as in a script under `torchrun` or the `deepspeed` launcher: DeepSpeed "
        "finds the process group the kernel formed (gloo on CPU). The first run on a machine JIT-compiles "
        "DeepSpeed's small shared-memory op (a minute or more; cached in `~/.cache/torch_extensions`). "
        "`rank` and `world_size` are defined by the kernel."),
    new_code_cell("import deepspeed, torch\nimport torch.distributed as dist\nfrom torch import nn"),
    new_code_cell(
        "torch.manual_seed(0)\n"
        "model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))\n"
        "config = {'train_micro_batch_size_per_gpu': 16, 'zero_optimization': {'stage': 2},\n"
        "          'optimizer': {'type': 'AdamW', 'params': {'lr': 1e-2, 'torch_adam': True}}}\n"
        "engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)"),
    new_code_cell(
        "g = torch.Generator().manual_seed(100 + rank)  # each rank its own batches\n"
        "w_true = torch.linspace(-1, 1, 16).unsqueeze(1)\n"
        "for _ in range(20):\n"
        "    x = torch.randn(16, 16, generator=g)\n"
        "    loss = nn.functional.mse_loss(engine(x), x @ w_true)\n"
        "    engine.backward(loss)\n"
        "    engine.step()\n"
        "losses = [torch.zeros(()) for _ in range(world_size)]\n"
        "dist.all_gather(losses, loss.detach())\n"
        "print('mean loss after 20 steps:', round(float(sum(losses)) / world_size, 3))"),
    new_markdown_cell("ZeRO-2 keeps 1/N of the optimizer state on each rank; the replicas stay equal:"),
    new_code_cell(
        "share = sum(p.numel() for p in optimizer.single_partition_of_fp32_groups)\n"
        "total = sum(p.numel() for p in engine.module.parameters())\n"
        "shares = [None] * world_size\n"
        "dist.all_gather_object(shares, share)\n"
        "print(f'optimizer state: {total} values split {shares} across the ranks')\n"
        "flat = torch.cat([p.detach().flatten() for p in engine.module.parameters()])\n"
        "replicas = [torch.empty_like(flat) for _ in range(world_size)]\n"
        "dist.all_gather(replicas, flat)\n"
        "print('replicas equal:', all(torch.equal(replicas[0], r) for r in replicas))"),
]


def write(name: str, cells: list) -> Path:
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "distributed-python", "display_name": "Distributed Python",
                                 "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    path = HERE / name
    nbformat.write(nb, path)
    return path


if __name__ == "__main__":
    for name, cells in (("lightning_ddp.ipynb", LIGHTNING), ("fsdp_dcp.ipynb", FSDP),
                        ("compile_sampler.ipynb", COMPILE), ("deepspeed_zero.ipynb", DEEPSPEED)):
        print(write(name, cells))
