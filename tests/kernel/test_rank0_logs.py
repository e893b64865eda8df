"""Issue 30 §3.1: lines a library writes on rank 0 only (stderr, from code the cells' source does
not show, so nothing marks them) do not split the identical prints around them: a real kernel at
2 ranks. A rank's stderr is sent apart from its stdout, and a logging handler flushes each line,
so rank 0's log lines reach the parent before the prints it made first."""

from __future__ import annotations

import re

import pytest
from harness import kernel_for_module

pytestmark = pytest.mark.slow

LIB = '''import logging, os, sys

log = logging.getLogger("fakelib")
log.addHandler(logging.StreamHandler())  # stderr, flushed after each record
log.setLevel(logging.INFO)
log.propagate = False


def setup(n, how):
    """As a library logs at start-up: on rank 0 only, from code the cell does not show."""
    if int(os.environ["RANK"]) == 0:
        for i in range(n):
            if how == "logging":
                log.info(f"lib line {i}")
            else:
                print(f"lib line {i}", file=sys.stderr, flush=True)
'''


@pytest.fixture(scope="module")
def k2(tmp_path_factory):
    lib = tmp_path_factory.mktemp("lib")
    (lib / "fakelib.py").write_text(LIB)
    for k in kernel_for_module("--ranks", "2"):
        assert k.execute(f"import sys\nsys.path.insert(0, {str(lib)!r})\nfrom fakelib import setup").status == "ok"
        yield k


@pytest.mark.parametrize(("how", "n"), [("logging", 3), ("logging", 6), ("print", 6)])
def test_identical_prints_around_a_librarys_rank_0_only_log_lines_show_once(k2, how, n):
    for _ in range(4):  # it split in most tries before
        res = k2.execute(f'print("hello"); setup({n}, {how!r}); print("bye")')
        assert res.status == "ok"
        assert res.stream() == "hello\nbye\n"
        err = [re.sub(r"^\[rank 0\] ", "", line) for line in res.stream("stderr").splitlines()]
        assert err == [f"lib line {i}" for i in range(n)]
