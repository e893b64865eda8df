"""The real parent at 256 ranks (issue 26): stub ranks behind stub node agents (``--launcher
stub``, :mod:`dist_kernel.testing`), which speak the rank protocol over real ZMQ with HMAC
and answer in random order. Output comes back complete, ordered and labelled; a fault names
the rank it happened on."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from harness import DistKernel, error_of

from dist_kernel.testing.stub_node import JITTER_ENV

NODES, PER_NODE = 4, 64
RANKS = NODES * PER_NODE
#: each rank answers up to this late, at random: the parent gets their outputs out of order
JITTER_MS = "30"


def stub_kernel() -> DistKernel:
    return DistKernel("--launcher", "stub", "--nodes", str(NODES), "--ranks-per-node", str(PER_NODE),
                      env={JITTER_ENV: JITTER_MS})


@pytest.fixture(scope="module")
def k() -> Iterator[DistKernel]:
    kernel = stub_kernel()
    try:
        yield kernel
    finally:
        kernel.shutdown()


def test_every_rank_prints_and_the_lines_come_back_complete_in_rank_order_and_labelled(k: DistKernel) -> None:
    res = k.execute("print(rank)", timeout=60)
    assert res.status == "ok", res.explain()
    assert res.stream() == "".join(f"[rank {r}] {r}\n" for r in range(RANKS))


def test_the_same_line_from_every_rank_is_shown_once(k: DistKernel) -> None:
    res = k.execute("print(1)", timeout=60)
    assert res.status == "ok", res.explain()
    assert res.stream() == "1\n"


def test_an_error_on_one_rank_names_that_rank_alone(k: DistKernel) -> None:
    res = k.execute("fail_on(201)", timeout=60)
    assert res.status == "error"
    err = error_of(res)
    assert (err["ename"], err["evalue"]) == ("StubError", "failed on rank 201")
    text = "\n".join(err["traceback"])
    assert "rank 201" in text and "rank 200" not in text and "rank 202" not in text, text
    assert k.execute("x = 1", timeout=60).status == "ok"  # the others go on


def test_a_rank_that_dies_is_named_with_its_node() -> None:
    kernel = stub_kernel()
    try:
        res = kernel.execute("die_on(137)", timeout=60)
    finally:
        kernel.shutdown()
    assert res.status == "error"
    err = error_of(res)
    # one rank's death, as on one machine: the rank, its node and how it ended
    assert "rank 137 (pid" in err["evalue"] and "on stub-node2" in err["evalue"], err["evalue"]
    assert "exited with code 1" in err["evalue"], err["evalue"]


def test_a_rank_selection_runs_on_those_ranks_alone(k: DistKernel) -> None:
    # the cell goes once to each node that holds a selected rank, and its agent hands it to those only
    res = k.execute("%%rank 62-65,200\nprint(rank)", timeout=60)
    assert res.status == "ok", res.explain()
    assert res.stream() == "".join(f"[rank {r}] {r}\n" for r in (62, 63, 64, 65, 200))


def test_the_stop_button_ends_the_cell_on_every_rank(k: DistKernel) -> None:
    stopped: list[bool] = []

    def stop(_output: object) -> None:
        if not stopped:  # every rank is in its sleep once the line is out
            stopped.append(True)
            k.km.interrupt_kernel()

    res = k.execute("print(1)\nsleep(30)", timeout=60, on_output=stop)
    assert stopped and res.status == "error", res.explain()
    assert error_of(res)["ename"] == "KeyboardInterrupt", res.explain()
    assert k.execute("x = 1", timeout=60).status == "ok"


def test_512_ranks_on_this_machine_start_and_answer_through_one_agent() -> None:
    # one node agent holds the 512 ranks' channels: the parent opens one connection, not 2,048
    # sockets, and never meets ZMQ's socket limit or the open-file limit
    kernel = DistKernel("--launcher", "stub", "--nodes", "1", "--ranks-per-node", "512")
    try:
        res = kernel.execute("print(rank)", timeout=120)
        assert res.status == "ok", res.explain()
        assert res.stream() == "".join(f"[rank {r}] {r}\n" for r in range(512))
        assert kernel.execute("fail_on(511)", timeout=60).status == "error"
        assert kernel.execute("x = 1", timeout=60).status == "ok"
    finally:
        kernel.shutdown()
