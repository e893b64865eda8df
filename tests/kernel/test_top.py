"""``%dist_top`` through a real kernel (issue 28, section 2): 2 ipykernel ranks, a real gloo group.

- While a sleeping cell runs, the table is one display (one display id) updated in place, emptied
  when the cell ends.
- In a hang (``%%rank 0`` around an all_reduce that rank 1 never enters) the table shows rank 0
  "in all_reduce" and rank 1 "idle"; the stop button ends the cell and the kernel goes on.
- A live view is not output (issue 36): a notebook run by nbclient or by ``python -m dist_kernel
  run`` keeps no table, and the runner on a terminal still draws it as its status line.

Nothing here asserts a timing: the bounds only keep a hang from passing.
"""

from __future__ import annotations

import os
import pty
import subprocess
import sys
import threading
from pathlib import Path

import nbformat
import pytest
from harness import DistKernel, Output, assert_group_works_and_variables_survived, end_process_tree
from jupyter_client import AsyncKernelManager
from nbclient import NotebookClient

from dist_kernel.parent.top import NOT_SHOWN
from dist_kernel.runner import kernel_manager

pytestmark = pytest.mark.timeout(300)


def is_top(o: Output) -> bool:
    return o.msg_type in ("display_data", "update_display_data") and \
        bool(o.content.get("metadata", {}).get("dist_kernel", {}).get("top"))


def row(text: str, rank: int) -> str:
    return next((line for line in text.splitlines() if line.split()[:1] == [str(rank)]), "")


ROOT = Path(__file__).parents[2]
#: a cell long enough for a few of the table's updates (one a second)
SLEEPY = ["import time", "time.sleep(4)\nprint('slept')"]


def saved_tables(nb: nbformat.NotebookNode) -> list[dict]:
    """The outputs of a run notebook that are %dist_top's table (or what is left of it)."""
    return [o for c in nb.cells for o in c.get("outputs", [])
            if (o.get("metadata") or {}).get("dist_kernel", {}).get("top")]


def sleepy_notebook(*first: str) -> nbformat.NotebookNode:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in (*first, *SLEEPY)]
    return nb


def test_dist_top_updates_one_display_in_place_and_names_the_rank_waiting_in_a_collective():
    k = DistKernel("--ranks", "2", "--hang-grace", "600")
    try:
        res = k.execute("import time, torch, torch.distributed as dist\nkept = 100 + rank", timeout=120)
        assert res.status == "ok", res.explain()
        # as JupyterLab sends cells (allow_stdin: a person is there, to watch the table too)
        assert "dist_top: on (a table" in k.execute("%dist_top", timeout=30, allow_stdin=True).stream()

        res = k.execute("time.sleep(4)\nprint('slept')", timeout=60, allow_stdin=True)
        assert res.status == "ok", res.explain()
        tables = [o for o in res.outputs if is_top(o)]
        assert len(tables) >= 3, [o.msg_type for o in res.outputs]
        assert tables[0].msg_type == "display_data"
        assert {o.msg_type for o in tables[1:]} == {"update_display_data"}
        assert len({o.content["transient"]["display_id"] for o in tables}) == 1
        assert tables[-1].content["data"] == {}  # the cell is over: emptied, no notebook saved now keeps it
        assert any("running" in row(o.text, 0) and "time.sleep(4)" in row(o.text, 0) for o in tables)
        assert "text/html" in tables[0].content["data"] and "<table" in tables[0].content["data"]["text/html"]

        # a hang: rank 0 waits in all_reduce for rank 1, which is idle; seen, then stopped
        seen: list[str] = []
        fallback = threading.Timer(120, k.km.interrupt_kernel)  # never hang the suite

        def watch(o: Output) -> None:
            if is_top(o) and not seen and "in all_reduce" in row(o.text, 0) and "idle" in row(o.text, 1):
                seen.append(o.text)
                k.km.interrupt_kernel()  # the stop button

        fallback.start()
        try:
            res = k.execute("%%rank 0\ndist.all_reduce(torch.ones(1))", timeout=180, on_output=watch, allow_stdin=True)
        finally:
            fallback.cancel()
        assert seen, "\n".join(o.text for o in res.outputs if is_top(o))[-3000:]
        assert "dist.all_reduce(torch.ones(1))" in row(seen[0], 0)
        assert res.status == "error", res.explain()

        assert_group_works_and_variables_survived(k)
        assert (k.execute("%dist_top off", timeout=30)).stream() == "dist_top: off\n"
        res = k.execute("time.sleep(2)", timeout=60, allow_stdin=True)
        assert res.status == "ok" and not [o for o in res.outputs if is_top(o)], res.outputs
    finally:
        k.shutdown()


def test_a_notebook_nbclient_runs_keeps_no_table_and_says_why():
    nb = sleepy_notebook("%dist_top")
    km = kernel_manager(["--ranks", "2"], cls=AsyncKernelManager)
    NotebookClient(nb, km=km, timeout=120).execute()  # nbclient's cells allow no stdin: nobody watches
    assert not saved_tables(nb), saved_tables(nb)
    assert nb.cells[0].outputs[0]["text"] == NOT_SHOWN
    assert [o["output_type"] for o in nb.cells[2].outputs] == ["stream"]  # 'slept', and nothing else


def test_the_runner_saves_no_table_piped_and_draws_it_as_its_status_on_a_terminal(tmp_path):
    path, piped_out, tty_out = tmp_path / "top.ipynb", tmp_path / "piped.ipynb", tmp_path / "tty.ipynb"
    nbformat.write(sleepy_notebook("%dist_top"), path)
    cmd = [sys.executable, "-m", "dist_kernel", "run", str(path), "--ranks", "2", "--output"]
    piped = subprocess.run([*cmd, str(piped_out)], capture_output=True, text=True, cwd=ROOT, timeout=240)
    assert piped.returncode == 0, piped.stderr[-3000:]
    assert not saved_tables(nbformat.read(piped_out, as_version=4))
    assert "rank" not in piped.stdout and piped.stdout.endswith("slept\n")

    # on a terminal the runner asks for the table itself (the notebook's %dist_top is not needed)
    nbformat.write(sleepy_notebook(), path)
    master, slave = pty.openpty()
    proc = subprocess.Popen([*cmd, str(tty_out)], stdout=slave, stderr=subprocess.PIPE, cwd=ROOT)
    os.close(slave)
    screen = bytearray()
    try:
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the runner closed the terminal
                break
            if not chunk:
                break
            screen += chunk
        assert proc.wait(timeout=240) == 0, proc.stderr.read().decode()[-3000:] if proc.stderr else ""
    finally:
        os.close(master)
        end_process_tree(proc)
    text = screen.decode(errors="replace")
    assert "state" in text and "running" in text and "time.sleep" in text, text[-3000:]  # the live table, drawn
    assert not saved_tables(nbformat.read(tty_out, as_version=4))
