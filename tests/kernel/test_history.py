"""Cells stored in history, as JupyterLab sends them, make no rank wait for another (issue 26).

Every rank writing the user's one ``history.sqlite`` made N ranks take turns on its lock. Rank 0
keeps the file; the other ranks keep their history in memory, where ``_``, ``_i`` and
``%history`` still work. matplotlib's per-user font cache is written once and then only read.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import psutil
import pytest
from harness import DistKernel

RANKS = 8


def _files_under(pid: int, root: Path) -> list[str]:
    try:
        return [f.path for f in psutil.Process(pid).open_files() if Path(f.path).is_relative_to(root)]
    except psutil.NoSuchProcess:
        return []


@pytest.mark.timeout(300)
def test_at_8_ranks_only_rank_0_writes_the_users_history_and_every_rank_keeps_its_own(tmp_path: Path) -> None:
    ipython_dir, mpl_dir = tmp_path / "ipython", tmp_path / "matplotlib"
    k = DistKernel("--ranks", str(RANKS), "--oversubscribe", "on",
                   env={"IPYTHONDIR": str(ipython_dir), "MPLCONFIGDIR": str(mpl_dir)}, ready_timeout=120)
    try:
        assert k.execute("hist_probe = 41", timeout=240).status == "ok"
        assert k.execute("hist_probe + 1").status == "ok"
        res = k.execute(
            "_h = get_ipython().history_manager\n"
            "print(rank, _h.hist_file if _h.hist_file == ':memory:' else 'file', _ == 42, _i.strip(),\n"
            "      any(src == 'hist_probe = 41' for _s, _n, src in _h.get_range(output=False)), sep='|')"
        )
        assert res.status == "ok", res.stream("stderr")
        # labelled lines read "[rank 3] 3|...": the fields after the label
        rows = [line.split("] ")[-1].split("|") for line in res.stream().splitlines()]
        assert len(rows) == RANKS, res.stream()
        for rank, row in enumerate(sorted(rows, key=lambda r: int(r[0]))):
            where = "file" if rank == 0 else ":memory:"
            assert row == [str(rank), where, "True", "hist_probe + 1", "True"], res.stream()
        # %history reads the rank's own history, from memory on rank 1
        hist = k.execute("%%rank 1\n%history -l 3")
        assert "hist_probe = 41" in hist.stream(), hist.stream()

        # no rank but rank 0 holds a file of the user's IPython directory open
        pids = k.rank_pids()
        assert len(pids) == RANKS
        holders = {pid: _files_under(pid, ipython_dir) for pid in pids}
        assert sum(1 for files in holders.values() if files) == 1, holders

        # matplotlib's per-user font cache is made once (the first import), then only read: cells
        # that plot write nothing of the user's that the ranks would take turns on
        plot = "import matplotlib\nmatplotlib.use('agg')\nimport matplotlib.pyplot as plt\nplt.plot([rank]); plt.close('all')"
        assert k.execute(plot, timeout=240).status == "ok"
        written = {p: p.stat().st_mtime_ns for p in mpl_dir.rglob("*") if p.is_file()}
        assert written, "matplotlib made no font cache under MPLCONFIGDIR"
        for _ in range(3):
            assert k.execute(plot).status == "ok"
        assert {p: p.stat().st_mtime_ns for p in mpl_dir.rglob("*") if p.is_file()} == written
    finally:
        k.shutdown()

    # the user's file received each cell once, as from one kernel
    db = next(ipython_dir.glob("profile_default/history.sqlite"))
    with sqlite3.connect(db) as con:
        sources = [row[0] for row in con.execute("SELECT source FROM history")]
        sessions = con.execute("SELECT COUNT(*) FROM sessions").fetchone()[0]
    assert sources.count("hist_probe = 41") == 1, sources
    assert sources.count("hist_probe + 1") == 1, sources
    assert sessions == 1
