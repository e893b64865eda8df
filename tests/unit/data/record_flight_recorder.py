"""Record the flight-recorder dumps that tests/unit/test_nccl_stall.py reads (real ones, not made up).

torch's flight recorder (``TORCH_FR_BUFFER_SIZE``) records every collective of a process group
in a ring buffer; NCCL's and gloo's dumps share one JSON format. NCCL needs GPUs, gloo does not,
so these are gloo's dumps of the two cases the NCCL stall rule tells apart, on 2 CPU ranks:

- ``fr_stall_rank0.json`` / ``fr_stall_rank1.json``: both ranks all_reduce once; then rank 0
  starts ``all_reduce(async_op=True)`` (as NCCL starts every collective: the Python thread goes
  on) on a 4x3 float tensor, which rank 1 never enters (a ``%%rank 0`` cell). Each rank dumps
  while rank 0's collective is pending.
- ``fr_healthy_rank0.json``: both ranks all_reduce and broadcast, and wait for them; rank 0 dumps.

Regenerate (from the repository root; takes a few seconds, needs no GPU)::

    .venv/bin/python tests/unit/data/record_flight_recorder.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
WORLD = 2


def dump() -> dict:
    """This process's flight-recorder dump, as the rank reads it (JSON, never a pickle)."""
    from torch._C._distributed_c10d import _dump_fr_trace_json

    raw = _dump_fr_trace_json(includeCollectives=True, onlyActive=False)
    return json.loads(raw)


def rank_main(case: str, rank: int, store: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    dist.all_reduce(torch.ones(2))
    if case == "stall":
        if rank == 0:
            work = dist.all_reduce(torch.ones(4, 3), async_op=True)
            time.sleep(0.5)
            assert not work.is_completed()
        dist.barrier(group=dist.new_group(backend="gloo"))  # both dump after rank 0 started it
        payload = dump()
    else:
        dist.broadcast(torch.zeros(3, dtype=torch.int64), src=0)
        dist.barrier()
        payload = dump()
    Path(out).write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    os._exit(0)  # rank 0's pending collective would keep a clean exit waiting


def main() -> None:
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "64", "CUDA_VISIBLE_DEVICES": ""}
    for case, keep in (("stall", (0, 1)), ("healthy", (0,))):
        with tempfile.TemporaryDirectory() as tmp:
            store = os.path.join(tmp, "store")
            outs = [os.path.join(tmp, f"{r}.json") for r in range(WORLD)]
            procs = [subprocess.Popen([sys.executable, __file__, case, str(r), store, outs[r]], env=env)
                     for r in range(WORLD)]
            for p in procs:
                if p.wait(timeout=120) != 0:
                    raise SystemExit(f"a rank of {case!r} failed")
            for r in keep:
                target = HERE / f"fr_{case}_rank{r}.json"
                target.write_text(Path(outs[r]).read_text())
                print("wrote", target.relative_to(Path.cwd()) if target.is_relative_to(Path.cwd()) else target)


if __name__ == "__main__":
    if len(sys.argv) == 5:
        rank_main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
    else:
        main()
