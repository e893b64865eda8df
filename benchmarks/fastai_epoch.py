"""Time one fastai training epoch on Distributed Python at 1 and at 2 ranks.

    python benchmarks/fastai_epoch.py [--ranks 1 2] [--repeats 3] [--rows 20000] [--json out.json]

Each run starts a real kernel, builds a synthetic tabular task in every rank (the notebook
code is the same at any rank count), fits once to warm up, then times ``learn.fit(1)``
inside the ranks (the slowest rank counts). At 2 ranks the fastai integration trains
data-parallel: each rank takes half the batches, so on idle cores the epoch should take
about half as long, minus the cost of all-reducing gradients over gloo.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from jupyter_client import KernelManager

from dist_kernel.runner import spec_manager

SETUP = """\
from fastai.tabular.all import *
import time, torch
torch.set_num_threads(1)
rng = np.random.default_rng(0)
n = {rows}
df = pd.DataFrame({{'a': rng.normal(size=n), 'b': rng.normal(size=n), 'k': rng.choice(list('xyz'), n)}})
df['y'] = np.where(df.a + df.b + (df.k == 'x') > 0.5, 'hi', 'lo')
dls = TabularDataLoaders.from_df(df, y_names='y', cat_names=['k'], cont_names=['a', 'b'],
                                 procs=[Categorify, Normalize], bs=64, num_workers=0)
learn = tabular_learner(dls, layers=[256, 256], metrics=accuracy)
with learn.no_bar(), learn.no_logging(): learn.fit(1, 1e-3)  # warm-up
"""
EPOCH = """\
with learn.no_bar(), learn.no_logging():
    t0 = time.perf_counter(); learn.fit(1, 1e-3); dt = time.perf_counter() - t0
print(f'EPOCH {dt:.4f}')
"""


def run_cell(kc, code: str, timeout: float = 600) -> str:
    msg_id = kc.execute(code)
    text = []
    while True:
        msg = kc.get_iopub_msg(timeout=timeout)
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "stream":
            text.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            raise RuntimeError("\n".join(msg["content"]["traceback"]))
        elif msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return "".join(text)


def time_epochs(ranks: int, repeats: int, rows: int) -> list[float]:
    """Seconds per epoch (slowest rank), ``repeats`` times, on a fresh kernel with ``ranks`` ranks."""
    km = KernelManager(kernel_name="distributed-python", kernel_spec_manager=spec_manager(["--ranks", str(ranks)]))
    km.start_kernel()
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        run_cell(kc, SETUP.format(rows=rows))
        times = []
        for _ in range(repeats):
            out = run_cell(kc, EPOCH)
            times.append(max(float(t) for t in re.findall(r"EPOCH ([\d.]+)", out)))
        return times
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    results = {}
    for n in args.ranks:
        t0 = time.monotonic()
        times = time_epochs(n, args.repeats, args.rows)
        results[n] = {"median_s": statistics.median(times), "times_s": times}
        print(f"{n} rank(s): epoch {statistics.median(times):.3f} s median of {times} "
              f"({time.monotonic() - t0:.0f} s with startup)", flush=True)
    if 1 in results:
        for n, r in results.items():
            if n != 1:
                print(f"speed-up at {n} ranks: {results[1]['median_s'] / r['median_s']:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": args.rows, "results": results}, indent=2))


if __name__ == "__main__":
    main()
