"""The slow lanes' order, so that their workers (the README's ``-n 3 --dist loadfile``) end together.

The kernel lane keeps two cores busy (1.94 on average over its 15 minutes); the cluster lane
alone used one (its tests wait on nodes, links and rank faults, in turn). So the two run in one
session: the cluster lane is one unit of work that one worker runs from start to end, while the
other workers run the kernel lane's files; that worker then takes kernel files too.

With ``--dist loadfile`` a worker runs one file at a time and takes the next file from a queue
when it is nearly done. pytest-xdist orders that queue by each file's number of tests, which puts
the long files of few tests (the benchmark smoke test, the GPU-proof rehearsal) at the end: one
worker ran them while the others had nothing left to do. Here the queue is ordered by how long each
file takes instead, longest first, so the short files fill the gaps at the end.

The cluster lane is one unit, not a file each, because its tests share the lab (``tests/cluster/
cluster_lab.py``: a worker holds it from its first lab test to its last): a second worker starting a
cluster file would wait for it, idle, inside its tests' time limits.

The times are rough (seconds per file on the shared 2-core dev machine, from ``--durations``,
measured at ``-n 3``, each file beside two others, as a worker runs); only their order matters.
A file not listed counts as short. Refresh them when a file's time changes much.
"""

from __future__ import annotations

from pathlib import Path

import pytest

HERE = Path(__file__).parent.resolve()

SECONDS = {
    "test_ecosystem_torch.py": 300, "test_faults.py": 320, "test_wedges.py": 270, "test_lab_closed_page.py": 120,
    "test_output_fidelity.py": 185, "test_benchmarks_smoke.py": 175, "test_gpu_proof.py": 160,
    "test_notebooks.py": 145, "test_ecosystem_hf.py": 130, "test_respawn.py": 120, "test_cleanup.py": 85,
    "test_kernel.py": 80, "test_debugger.py": 80, "test_fastai.py": 76, "test_hangs.py": 75, "test_widgets.py": 60,
    "test_progress_bars.py": 50, "test_jupyterlab.py": 50, "test_channel.py": 45, "test_top.py": 40,
    "test_notices_and_small.py": 33, "test_options_at_work.py": 32, "test_frontend.py": 31, "test_late_errors.py": 27,
    "test_conformance.py": 26, "test_sync_copies.py": 26, "test_shared_display_ids.py": 26,
    "test_group_destroyed.py": 26, "test_history.py": 24,
}
SHORT = 20  # any other file
CLUSTER = HERE.parent / "cluster"
#: the cluster lane, run as one unit beside the kernel lane (about 8 minutes under that load)
CLUSTER_SECONDS = 480


def seconds(item: pytest.Item) -> float:
    return SECONDS.get(Path(str(item.path)).name, SHORT)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The kernel lane's files and the cluster lane (one unit), longest first, each unit's tests
    together and in their own order; the tests of other lanes (the unit lane) after them."""
    def key(item: pytest.Item) -> tuple:
        where = Path(str(item.path)).resolve().parent
        if where == CLUSTER:
            return (0, -CLUSTER_SECONDS, str(CLUSTER))
        if where != HERE:
            return (1, 0.0, "")
        return (0, -seconds(item), str(item.path))
    items.sort(key=key)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    """``--dist loadfile`` in the collection's order (above), not xdist's by number of tests, with
    the cluster lane as one unit."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    cluster = CLUSTER.relative_to(Path(config.rootpath).resolve()).as_posix()  # node ids start from the rootdir

    class SlowLanes(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            if nodeid.startswith(cluster + "/"):
                return cluster
            return super()._split_scope(nodeid)

    config.option.loadscopereorder = False
    return SlowLanes(config, log)
