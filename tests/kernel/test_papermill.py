"""papermill runs parameterised notebooks on Distributed Python (2 ranks).

The kernelspec is installed with the real CLI into a temporary prefix; papermill finds it
by name through ``JUPYTER_PATH``, the way a user's ``papermill -k distributed-python ...``
would. Nothing is mocked: real parent kernel, real ipykernel ranks, real gloo group.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import papermill as pm
import pytest
from papermill.exceptions import PapermillExecutionError

pytestmark = pytest.mark.slow

KERNEL_NAME = "distributed-python-papermill-test"


@pytest.fixture(scope="module")
def kernel_name(tmp_path_factory):
    """Install the 2-rank kernelspec into a temporary prefix and put it on JUPYTER_PATH."""
    prefix = tmp_path_factory.mktemp("spec-prefix")
    proc = subprocess.run(
        [sys.executable, "-m", "dist_kernel", "install", "--prefix", str(prefix),
         "--name", KERNEL_NAME, "--ranks", "2"],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    data_dir = prefix / "share" / "jupyter"
    assert (data_dir / "kernels" / KERNEL_NAME / "kernel.json").is_file()
    saved = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join([str(data_dir)] + ([saved] if saved else []))
    try:
        yield KERNEL_NAME
    finally:
        if saved is None:
            os.environ.pop("JUPYTER_PATH", None)
        else:
            os.environ["JUPYTER_PATH"] = saved


def _notebook(path: Path, *cells: tuple[str, list[str]]) -> Path:
    """Write a notebook whose metadata names the plain python3 kernel (papermill's -k overrides it)."""
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["language_info"] = {"name": "python"}
    for source, tags in cells:
        cell = nbformat.v4.new_code_cell(source)
        if tags:
            cell.metadata["tags"] = tags
        nb.cells.append(cell)
    nbformat.write(nb, path)
    return path


def _text(cell: nbformat.NotebookNode) -> str:
    """Everything a reader sees in a cell's outputs, as text."""
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            parts.append(out.data.get("text/plain", "") + "\n")
    return "".join(parts)


def test_parameters_are_injected_and_merged_results_land_in_the_notebook(kernel_name, tmp_path):
    src = _notebook(
        tmp_path / "in.ipynb",
        ("scale = 1\nlabel = 'default'", ["parameters"]),
        ("import torch\nimport torch.distributed as dist\n"
         "t = torch.tensor([float(scale * (rank + 1))])\n"
         "dist.all_reduce(t)\n"
         "total = t.item()\n"
         "print(f'{label}: total={total}')", []),
        ("print('rank', rank, 'of', world_size, 'has', scale * (rank + 1))", []),
        ("total", []),
    )
    out = tmp_path / "out.ipynb"
    pm.execute_notebook(str(src), str(out), parameters={"scale": 10, "label": "injected"},
                        kernel_name=kernel_name, progress_bar=False, start_timeout=120,
                        execution_timeout=120)

    nb = nbformat.read(out, as_version=4)
    assert nb.metadata["papermill"]["parameters"] == {"scale": 10, "label": "injected"}
    params, injected, reduce_cell, per_rank, result = nb.cells
    assert "parameters" in params.metadata["tags"]
    assert "injected-parameters" in injected.metadata["tags"]
    assert "scale = 10" in injected.source and 'label = "injected"' in injected.source

    # all_reduce over ranks: 10*1 + 10*2 on both ranks, identical, so shown once and unlabelled
    assert reduce_cell.outputs == [nbformat.v4.new_output("stream", name="stdout", text="injected: total=30.0\n")]
    # different on each rank: one labelled line per rank
    assert _text(per_rank) == "[rank 0] rank 0 of 2 has 10\n[rank 1] rank 1 of 2 has 20\n"
    # one Out[n] for the cell, from the parent's own execution count
    assert [o.output_type for o in result.outputs] == ["execute_result"]
    assert result.outputs[0].data["text/plain"] == "30.0"
    assert result.outputs[0].execution_count == result.execution_count
    assert all(c.metadata["papermill"]["status"] == "completed" for c in nb.cells)


def test_a_failing_cell_raises_papermill_execution_error_naming_the_rank(kernel_name, tmp_path):
    src = _notebook(
        tmp_path / "in.ipynb",
        ("bad_rank = 0", ["parameters"]),
        ("if rank == bad_rank:\n    raise ValueError(f'bad shard on rank {rank}')", []),
        ("print('not reached')", []),
    )
    out = tmp_path / "out.ipynb"
    with pytest.raises(PapermillExecutionError) as e:
        pm.execute_notebook(str(src), str(out), parameters={"bad_rank": 1},
                            kernel_name=kernel_name, progress_bar=False, start_timeout=120,
                            execution_timeout=120)
    err = e.value
    assert err.ename == "ValueError"
    assert err.evalue == "bad shard on rank 1"
    message = str(err)
    assert "rank 1" in message and "ValueError" in message
    # only rank 1 failed: the merged error must not claim rank 0 or all ranks
    assert "rank 0" not in message and "all 2 ranks" not in message

    # papermill saved the notebook: the error is in the failing cell, later cells did not run
    nb = nbformat.read(out, as_version=4)
    cells = [c for c in nb.cells if c.cell_type == "code"]
    failing = next(c for c in cells if "raise ValueError" in c.source)
    errors = [o for o in failing.outputs if o.output_type == "error"]
    assert len(errors) == 1 and errors[0].ename == "ValueError"
    assert failing.metadata["papermill"]["status"] == "failed"
    last = next(c for c in cells if "not reached" in c.source)
    assert last.outputs == [] and last.metadata["papermill"]["status"] == "pending"
