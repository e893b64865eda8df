"""Whole notebooks: nbclient, ``python -m dist_kernel run``, and installing the kernelspec."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import nbformat
import psutil
import pytest
from harness import end_process_tree
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

from dist_kernel.runner import kernel_manager

pytestmark = pytest.mark.slow
ROOT = Path(__file__).parents[2]
EXAMPLE = ROOT / "examples" / "ddp_synthetic.ipynb"


def notebook(*sources: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    return nb


def run_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dist_kernel", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def test_nbclient_runs_a_notebook_and_the_saved_outputs_read_like_one_process():
    nb = notebook("import torch.distributed as dist\nprint('group of', dist.get_world_size())",
                  "print('rank', rank)", "world_size")
    km = kernel_manager(["--ranks", "3"])
    try:
        NotebookClient(nb, km=km, timeout=120).execute()
    finally:
        km.shutdown_kernel()
    first, second, third = (c.outputs for c in nb.cells)
    assert first == [nbformat.v4.new_output("stream", name="stdout", text="group of 3\n")]
    assert "".join(o.text for o in second) == "[rank 0] rank 0\n[rank 1] rank 1\n[rank 2] rank 2\n"
    assert [o.output_type for o in third] == ["execute_result"] and third[0].data["text/plain"] == "3"


def test_nbclient_stops_at_the_failing_cell_naming_the_rank():
    nb = notebook("x = 1", "if rank == 1:\n    raise ValueError('bad shard')", "print('not reached')")
    km = kernel_manager(["--ranks", "2"])
    try:
        with pytest.raises(CellExecutionError) as e:
            NotebookClient(nb, km=km, timeout=120).execute()
    finally:
        km.shutdown_kernel()
    assert e.value.ename == "ValueError" and "rank 1" in str(e.value)
    assert nb.cells[2].outputs == []


def test_the_ddp_example_trains_with_replicas_equal(tmp_path):
    out = tmp_path / "out.ipynb"
    proc = run_cli("run", str(EXAMPLE), "--ranks", "2", "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "replicas equal: True" in proc.stdout
    nb = nbformat.read(out, as_version=4)
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "epoch 7: loss" in text and "[rank" not in text.split("samples on this rank")[1]


def test_run_exits_nonzero_naming_the_cell_and_rank(tmp_path):
    path = tmp_path / "bad.ipynb"
    nbformat.write(notebook("print('fine')", "%%rank 1\nraise RuntimeError('only on one rank')"), path)
    proc = run_cli("run", str(path), "--ranks", "2")
    assert proc.returncode == 1
    assert "cell 2 of 2 failed" in proc.stderr and "RuntimeError" in proc.stderr
    assert "fine" in proc.stdout


def test_run_shows_a_cells_output_as_it_arrives_between_the_cells_place_and_time(tmp_path):
    path = tmp_path / "live.ipynb"
    nbformat.write(notebook("x = 1", "import time\nprint('first line', flush=True)\ntime.sleep(6)\n"
                            "print('second line')\nrank"), path)
    lines: dict[str, list[tuple[float, str]]] = {"stdout": [], "stderr": []}

    def read(name: str, pipe) -> None:
        for line in pipe:
            lines[name].append((time.monotonic(), line))

    proc = subprocess.Popen([sys.executable, "-m", "dist_kernel", "run", str(path), "--ranks", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        readers = [threading.Thread(target=read, args=(n, getattr(proc, n))) for n in lines]
        for t in readers:
            t.start()
        assert proc.wait(timeout=120) == 0
        for t in readers:
            t.join(timeout=10)
    finally:
        end_process_tree(proc)  # failed: end the runner and the kernel it started
    out = {text: t for t, text in lines["stdout"]}
    rules = [text for _, text in lines["stderr"] if text.startswith("──")]
    # stdout holds the notebook's output only, merged across ranks as in the notebook
    assert list(out) == ["first line\n", "second line\n", "[rank 0] 0\n", "[rank 1] 1\n"]
    assert out["second line\n"] - out["first line\n"] > 4  # shown while the cell still ran
    assert [re.sub(r"\d+\.\d", "T", r) for r in rules] == [
        "── cell 1/2 ──\n", "── cell 1/2 done in Ts ──\n", "── cell 2/2 ──\n", "── cell 2/2 done in Ts ──\n"]
    assert float(rules[3].split()[5][:-1]) >= 6
    # the rules go to stderr: each before and after its cell's output
    times = {r: t for t, r in lines["stderr"]}
    assert times[rules[2]] <= out["first line\n"] and times[rules[3]] >= out["second line\n"]


def start_a_run_of_a_long_cell(tmp_path: Path) -> tuple[subprocess.Popen, list[str], list[psutil.Process]]:
    """``dist_kernel run`` on a notebook whose second cell runs for ten minutes, once that cell
    runs; its stderr lines (read on), and the kernel and its ranks."""
    path = tmp_path / "long.ipynb"
    nbformat.write(notebook("print(rank)", "import time\ntime.sleep(600)"), path)
    proc = subprocess.Popen([sys.executable, "-m", "dist_kernel", "run", str(path), "--ranks", "2"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    err: list[str] = []
    threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True).start()
    deadline = time.monotonic() + 180
    while not any(line.startswith("── cell 2/2 ──") for line in err):
        assert proc.poll() is None and time.monotonic() < deadline, err
        time.sleep(0.2)
    time.sleep(1)  # the cell is sent and running on the ranks
    started = psutil.Process(proc.pid).children(recursive=True)
    assert len([p for p in started if "dist_kernel.rank" in " ".join(p.cmdline())]) == 2
    return proc, err, started


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_run_stopped_by_sigterm_or_ctrl_c_shuts_its_kernel_down_and_exits_at_once(tmp_path, sig):
    # nbclient's own handler only scheduled the shutdown: the run waited out its cell (10 min)
    proc, err, started = start_a_run_of_a_long_cell(tmp_path)
    try:
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 128 + sig
        _, alive = psutil.wait_procs(started, timeout=30)
        assert alive == []  # the kernel and its ranks went with it
        assert any(f"stopped by {sig.name} during cell 2 of 2" in line for line in err), err
    finally:
        end_process_tree(proc)


def test_run_whose_kernel_is_killed_ends_naming_the_cell_instead_of_waiting_forever(tmp_path):
    # a blocking kernel client waited in zmq for a reply from a kernel that was gone
    proc, err, started = start_a_run_of_a_long_cell(tmp_path)
    try:
        (kernel,) = psutil.Process(proc.pid).children()
        kernel.kill()
        assert proc.wait(timeout=60) == 1
        _, alive = psutil.wait_procs(started, timeout=30)
        assert alive == []  # its ranks followed the kernel
        assert any("cell 2 of 2 failed: the kernel died" in line for line in err), err
    finally:
        end_process_tree(proc)


def test_a_run_killed_after_cell_2_of_4_left_a_notebook_with_cells_1_and_2(tmp_path):
    # as papermill does (issue 35): the notebook is written after every cell, not only at the end
    mark, out = tmp_path / "cell-3-runs", tmp_path / "out.ipynb"
    path = tmp_path / "four.ipynb"
    nbformat.write(notebook("print('one')", "print('two', rank)",
                            f"import time\nif rank == 0:\n    open({str(mark)!r}, 'w').close()\ntime.sleep(600)",
                            "print('four')"), path)
    proc = subprocess.Popen([sys.executable, "-m", "dist_kernel", "run", str(path), "--ranks", "2",
                             "--output", str(out)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    started: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 180
        while not mark.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "cell 3 never ran"
            time.sleep(0.2)
        started = psutil.Process(proc.pid).children(recursive=True)
        proc.kill()  # no handler, no finally: what is on disk is what the run wrote before
        proc.wait(timeout=30)
        saved = nbformat.read(out, as_version=4)
        assert [c.execution_count for c in saved.cells] == [1, 2, None, None]
        assert saved.cells[0].outputs[0].text == "one\n"
        assert saved.cells[1].outputs[0].text == "[rank 0] two 0\n[rank 1] two 1\n"
        assert saved.cells[2].outputs == [] and saved.cells[3].outputs == []
        assert sorted(p.name for p in tmp_path.iterdir()) == ["cell-3-runs", "four.ipynb", "out.ipynb"]
        _, alive = psutil.wait_procs(started, timeout=60)
        assert alive == []  # the kernel and its ranks noticed the runner was gone
    finally:
        end_process_tree(proc)
        for p in started:  # failed: what the killed runner left
            with contextlib.suppress(psutil.Error):
                p.kill()


def test_run_of_cells_whose_output_widgets_capture_prints_ends(tmp_path):
    # nbclient answers each capture with a comm message on the shell socket; sent through
    # Session's blocking shadow of the asyncio socket it ate the wakeup for the execute_reply,
    # and the run waited forever inside one of these cells (Lightning's progress bar does this)
    capture = ("out = widgets.Output()\ndisplay(out)\nfor i in range(10):\n    with out:\n        print(i)\n"
               "    print('outside', i)")
    path = tmp_path / "capture.ipynb"
    nbformat.write(notebook("import ipywidgets as widgets", *[capture] * 20, "print('the end')"), path)
    proc = subprocess.Popen([sys.executable, "-m", "dist_kernel", "run", str(path), "--ranks", "2"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        end_process_tree(proc)
    assert proc.returncode == 0, err[-3000:]
    assert out.count("Output()\n") == 20 and out.count("outside 9\n") == 20 and out.endswith("the end\n")


def test_run_rejects_a_bad_option_before_starting():
    proc = run_cli("run", str(EXAMPLE), "--backend", "mpi")
    assert proc.returncode == 2 and "--backend 'mpi' is unknown" in proc.stderr


def test_install_writes_a_spec_bound_to_this_interpreter(tmp_path):
    proc = run_cli("install", "--prefix", str(tmp_path), "--ranks", "3", "--name", "dk-test",
                   "--display-name", "DK test")
    assert proc.returncode == 0, proc.stderr
    spec = json.loads((tmp_path / "share/jupyter/kernels/dk-test/kernel.json").read_text())
    assert spec["argv"][:4] == [sys.executable, "-m", "dist_kernel", "kernel"]
    assert spec["argv"][-2:] == ["--ranks", "3"] and spec["display_name"] == "DK test"
    assert spec["interrupt_mode"] == "message"


def test_install_refuses_a_bad_option(tmp_path):
    proc = run_cli("install", "--prefix", str(tmp_path), "--ranks", "0")
    assert proc.returncode == 2 and "--ranks 0 must be at least 1" in proc.stderr


def test_the_shipped_kernelspec_installs_with_jupyter_kernelspec(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "jupyter_client.kernelspecapp", "install",
                           str(ROOT / "kernelspec" / "distributed-python"), "--prefix", str(tmp_path)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    spec = json.loads((tmp_path / "share/jupyter/kernels/distributed-python/kernel.json").read_text())
    assert spec["display_name"] == "Distributed Python" and spec["argv"][1:4] == ["-m", "dist_kernel", "kernel"]
