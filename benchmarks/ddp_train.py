"""A small DDP training loop, the same code in the kernel and under torchrun.

In the kernel: ``from benchmarks.ddp_train import train; train(...)`` on every rank (the group
is already formed). As a script: ``python -m torch.distributed.run --standalone
--nproc-per-node N benchmarks/ddp_train.py --steps S ...`` (the group is formed here). Rank 0
prints one line ``@@{json}`` with the per-step timings.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def train(steps: int = 40, warmup: int = 5, batch: int = 64, width: int = 256, depth: int = 3,
          seed: int = 0) -> dict:
    """Run ``warmup + steps`` DDP steps of an MLP on fixed random data; timings of rank 0.

    On the current CUDA device when the rank has one (kernel: ``--gpus``; torchrun: a GPU
    per LOCAL_RANK), each step then ends with a synchronise so it is timed whole.
    """
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = DDP(nn.Sequential(*layers, nn.Linear(width, 1)).to(device),
                device_ids=[device.index] if cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed + dist.get_rank())
    x = torch.randn(batch, width, generator=gen).to(device)
    y = torch.randn(batch, 1, generator=gen).to(device)
    times: list[float] = []
    dist.barrier()
    t_all = time.perf_counter()
    for i in range(warmup + steps):
        if i == warmup:
            t_all = time.perf_counter()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    wall = time.perf_counter() - t_all
    return {"median_step_s": statistics.median(times), "mean_step_s": wall / steps, "steps": steps,
            "world_size": dist.get_world_size(), "threads": torch.get_num_threads(), "loss": float(loss),
            "device": str(device), "backend": dist.get_backend()}


def kernel_cell(**kw: int) -> str:
    """The cell the benchmark runs in the distributed kernel."""
    return ("import json as _json\nfrom benchmarks.ddp_train import train as _train\n"
            f"_res = _train(**{kw!r})\n"
            "if rank == 0:\n    print('@@' + _json.dumps(_res))\n")


def parse(text: str) -> dict:
    """The result line rank 0 printed (labelled or not)."""
    for line in text.splitlines():
        if "@@" in line:
            return json.loads(line.split("@@", 1)[1])
    raise ValueError(f"no result line in output: {text[-500:]!r}")


def main() -> None:
    import os

    import torch
    import torch.distributed as dist

    p = argparse.ArgumentParser()
    for name, default in (("steps", 40), ("warmup", 5), ("batch", 64), ("width", 256), ("depth", 3)):
        p.add_argument(f"--{name}", type=int, default=default)
    a = p.parse_args()
    if torch.cuda.is_available():  # as the kernel does with --gpus: a GPU per local rank, nccl
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo")
    report_and_leave(train(steps=a.steps, warmup=a.warmup, batch=a.batch, width=a.width, depth=a.depth))


def report_and_leave(res: dict) -> None:
    """The end of a benchmark script under torchrun: rank 0 prints its ``@@`` line, then every
    rank leaves the group together."""
    import torch.distributed as dist

    if dist.get_rank() == 0:
        print("@@" + json.dumps(res), flush=True)
    dist.barrier()  # nobody leaves while a peer still talks to it (gloo aborts on that)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
