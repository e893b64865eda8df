"""Many ranks on one machine start in bounded waves, and the kernel answers the frontend meanwhile
(issue 20, item 1): a rank is *starting* from its process's start until it has bound its Jupyter
sockets, and never more than ``launch.local.START_WAVE`` ranks are starting at once."""

from __future__ import annotations

import os
import threading
import time

import psutil
import pytest
from harness import DistKernel, is_rank_process
from jupyter_client import KernelManager

from dist_kernel.parent.launch.local import START_WAVE
from dist_kernel.runner import spec_manager


def starting_ranks(parent_pid: int) -> tuple[int, int]:
    """(rank processes of this kernel, those whose shell socket is not bound yet)."""
    try:
        children = psutil.Process(parent_pid).children()
    except psutil.Error:
        return 0, 0
    total = starting = 0
    for p in children:
        if not is_rank_process(p):
            continue
        try:
            argv = p.cmdline()
        except psutil.Error:
            continue
        total += 1
        connection_file = argv[argv.index("-f") + 1]
        if not os.path.exists(connection_file.removesuffix(".json") + "-1"):  # the IPC shell socket
            starting += 1
    return total, starting


@pytest.mark.slow
def test_many_ranks_start_in_waves_while_the_kernel_answers_the_frontend():
    ranks = START_WAVE + 4
    seen: list[tuple[int, int]] = []
    k = DistKernel.__new__(DistKernel)  # started by hand: the watching starts before the kernel answers
    k.km = KernelManager(kernel_name="distributed-python", kernel_spec_manager=spec_manager(["--ranks", str(ranks)]))
    k.km.start_kernel()
    stop = threading.Event()

    def sample() -> None:  # what the kernel's ranks are doing, every 20 ms, until the group is formed
        while not stop.is_set():
            seen.append(starting_ranks(k.pid))
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        k.kc = k.km.client()
        k.kc.start_channels()
        k.kc.wait_for_ready(timeout=120)  # kernel_info, answered by the parent
        total, starting = starting_ranks(k.pid)
        assert total - starting < ranks, "kernel_info was answered only once every rank was up"
        res = k.execute("print(world_size, flush=True)", timeout=600)
        stop.set()
        sampler.join()
        assert res.status == "ok", res.outputs
        assert res.stream() == f"{ranks}\n"
        assert max(s for _, s in seen) <= START_WAVE, f"ranks starting at once (total, starting): {seen}"
        assert max(t for t, _ in seen) == ranks
    finally:
        stop.set()
        k.shutdown()
