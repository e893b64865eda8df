"""The unit lane starts no process: a test that tries fails, naming the lane it belongs in."""

from __future__ import annotations

import os
import subprocess

import pytest

_MOVE = "a test in tests/unit started a process ({}): it belongs in tests/kernel (marked slow by its directory)"


@pytest.fixture(autouse=True)
def no_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(what: str):
        def start(*args, **kwargs):
            raise AssertionError(_MOVE.format(what))
        return start

    monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse("subprocess"))
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp", "execv", "execve", "system"):
        if hasattr(os, name):
            monkeypatch.setattr(os, name, refuse(f"os.{name}"))
