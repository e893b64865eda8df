"""Each documented option changes what a real kernel does (the parsing is specified in
tests/unit/test_config_and_magics.py)."""

from __future__ import annotations

import pytest

from dist_kernel import capacity


def status_rows(res) -> list[str]:
    (table,) = res.of_type("display_data")
    return [line for line in table.text.splitlines()[2:] if line[:1].isdigit()]  # the output log's line aside


def error_of(res) -> dict:
    (err,) = res.of_type("error")
    return err.content


@pytest.fixture(scope="module")
def configured():
    """A kernel whose command line and environment disagree; and what its first cell showed."""
    from harness import DistKernel

    k = DistKernel("--ranks", "2", "--empty-cache", "off", "--timeout", "3", "--hang-grace", "60",
                   "--merge-window-ms", "5000", "--port-range", "29500-29509",
                   env={"DIST_KERNEL_RANKS": "3", "DIST_KERNEL_EMPTY_CACHE": "on", "DIST_KERNEL_SEED": "1234"})
    try:
        first = k.execute("x = 1")
        yield k, first
    finally:
        k.shutdown()


@pytest.mark.slow
def test_a_configuration_warning_is_shown_once_in_the_first_cell(configured):
    k, first = configured
    assert first.status == "ok"
    assert first.stream("stderr") == ("[dist_kernel] warning: --port-range is for --launcher slurm or ssh; the local "
                                      "ranks talk over IPC on this machine, so it has no effect.\n")
    assert k.execute("y = 2").stream("stderr") == ""


@pytest.mark.slow
def test_empty_cache_off_reaches_the_ranks_and_the_command_line_beats_the_environment(configured):
    k, _ = configured
    rows = status_rows(k.execute("%dist_status"))
    assert len(rows) == 2  # --ranks 2, not DIST_KERNEL_RANKS=3
    assert all(row.rstrip().endswith("False") for row in rows), rows  # --empty-cache off, not the variable's on
    assert k.execute("%dist_empty_cache on").status == "ok"
    assert all(row.rstrip().endswith("True") for row in status_rows(k.execute("%dist_status")))
    assert k.execute("%dist_empty_cache off").status == "ok"


@pytest.mark.slow
def test_the_environment_fills_an_option_the_command_line_leaves_out(configured):
    k, _ = configured
    assert k.execute("import torch\nprint(torch.initial_seed())").stream() == "1234\n"  # DIST_KERNEL_SEED, on every rank


@pytest.mark.slow
def test_merge_window_ms_is_how_long_a_line_waits_for_the_same_line_of_the_other_ranks(configured):
    # rank 1 prints half a second after rank 0: within 5 s the lines merge (since issue 19 they
    # merge with the default 100 ms too: outputs are aligned by sequence, see merge.LAG_BOUND)
    k, _ = configured
    assert k.execute("import time\ntime.sleep(0.5 * rank)\nprint('same line')").stream() == "same line\n"


@pytest.mark.slow
def test_merge_window_ms_is_how_long_an_unfinished_line_waits_for_its_end(configured, kernel2):
    # the start of a line is shown once it waited the window for its end: with the default 100 ms
    # before the end comes 1.5 s later, with 5000 ms only together with its end
    cell = "import sys, time\nsys.stdout.write('abc')\nsys.stdout.flush()\ntime.sleep(1.5)\nprint('def')"
    k, _ = configured
    assert [o.content["text"] for o in k.execute(cell).of_type("stream")] == ["abcdef\n"]
    assert [o.content["text"] for o in kernel2.execute(cell).of_type("stream")] == ["abc", "def\n"]


@pytest.mark.slow
def test_timeout_is_the_collective_timeout(configured):
    # rank 0 alone in a barrier: with --timeout 3 gloo gives up after 3 s (--hang-grace 60 keeps
    # the kernel's own hang report out of the way); with the default it would wait 30 minutes
    k, _ = configured
    res = k.execute("%%rank 0\nimport torch.distributed as dist\ndist.barrier()", timeout=60)
    assert res.status == "error"
    assert "Timed out waiting 3000ms" in error_of(res)["evalue"]


@pytest.mark.slow
def test_startup_timeout_bounds_the_start_of_the_ranks():
    from harness import DistKernel

    k = DistKernel("--ranks", "2", "--startup-timeout", "0.2")
    try:
        err = error_of(k.execute("x = 1", timeout=60))
        assert err["ename"] == "RankStartError"
        assert "did not start and form the process group within 0s" in err["evalue"]
        assert "raise --startup-timeout" in err["evalue"]
        assert k.rank_pids() == []  # the ranks that had started were ended
    finally:
        k.shutdown()


@pytest.mark.slow
def test_more_ranks_than_this_machine_holds_start_nothing_and_the_kernel_answers():
    from harness import DistKernel

    n = max(64, capacity.most_ranks(capacity.this_machine()) + 1)
    k = DistKernel("--ranks", str(n))
    try:
        assert k.rank_pids() == []
        err = error_of(k.execute("x = 1", timeout=30))
        assert err["ename"] == "ConfigError"
        assert f"--ranks {n} is more than this machine can hold" in err["evalue"]
        assert "--oversubscribe on" in err["evalue"] and "No rank was started" in err["evalue"]
        assert k.execute("x = 1", timeout=30).status == "error"  # it keeps answering, and says it again
        k.kc.kernel_info()
        assert k.kc.get_shell_msg(timeout=30)["msg_type"] == "kernel_info_reply"
        assert k.rank_pids() == []
    finally:
        k.shutdown()


