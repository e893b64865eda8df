"""The public kernel conformance suite (``jupyter_kernel_test``) against Distributed Python at 2 ranks.

The kernelspec is installed with the real CLI (``python -m dist_kernel install``) into a
temporary prefix, and ``JUPYTER_PATH`` points jupyter_client at it while the classes run,
so the suite starts the kernel exactly as a frontend would: by kernelspec name.

The attributes follow the Python (ipykernel) configuration of the suite, with one
difference that is the point of the kernel: output that every rank produces identically is
shown once, so ``print('hello, world')`` on 2 ranks is one stream message.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
from pathlib import Path
from typing import Any, ClassVar

import jupyter_kernel_test as jkt
import psutil
import pytest
from harness import is_rank_process

pytestmark = pytest.mark.slow

KERNEL_NAME = "distributed-python-test"
RANKS = 2
READY_TIMEOUT = 120  # the ranks import torch and form the group after the parent is up


class _InstalledSpec:
    """Install the kernelspec into a temporary prefix and expose it through JUPYTER_PATH, for
    the life of a suite class; at its end every rank process must be gone."""

    _prefix: ClassVar[str]
    _saved_jupyter_path: ClassVar[str | None]

    @classmethod
    def install_spec(cls) -> None:
        cls._prefix = tempfile.mkdtemp(prefix="dist_kernel-spec-")
        data_dir = Path(cls._prefix) / "share" / "jupyter"
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "dist_kernel", "install", "--prefix", cls._prefix,
                 "--name", KERNEL_NAME, "--ranks", str(RANKS)],
                capture_output=True, text=True, timeout=60)
            assert proc.returncode == 0, proc.stderr
            assert (data_dir / "kernels" / KERNEL_NAME / "kernel.json").is_file(), proc.stdout
        except BaseException:
            shutil.rmtree(cls._prefix, ignore_errors=True)
            raise
        cls._saved_jupyter_path = os.environ.get("JUPYTER_PATH")
        os.environ["JUPYTER_PATH"] = os.pathsep.join(
            [str(data_dir)] + ([cls._saved_jupyter_path] if cls._saved_jupyter_path else []))

    @classmethod
    def remove_spec(cls) -> None:
        if cls._saved_jupyter_path is None:
            os.environ.pop("JUPYTER_PATH", None)
        else:
            os.environ["JUPYTER_PATH"] = cls._saved_jupyter_path
        shutil.rmtree(cls._prefix, ignore_errors=True)

    @classmethod
    def setUpClass(cls) -> None:
        """Install the spec, start the suite's kernel, then ``after_start``; undo all on failure."""
        cls.install_spec()
        try:
            super().setUpClass()
            try:
                cls.after_start()
            except BaseException:
                # unittest skips tearDownClass when setUpClass fails: end the kernel here
                cls.kc.stop_channels()
                cls.km.shutdown_kernel(now=True)
                raise
        except BaseException:
            cls.remove_spec()
            raise

    @classmethod
    def tearDownClass(cls) -> None:
        """``before_stop``, then the suite's shutdown: every rank process must be gone."""
        try:
            cls.before_stop()
            ranks = _rank_processes(cls.km.provisioner.process.pid)
            assert len(ranks) == RANKS, f"expected {RANKS} rank processes, found {len(ranks)}"
            super().tearDownClass()
            _assert_gone(ranks)
        finally:
            cls.remove_spec()

    @classmethod
    def after_start(cls) -> None:
        pass

    @classmethod
    def before_stop(cls) -> None:
        pass


def _rank_processes(parent_pid: int) -> list[psutil.Process]:
    try:
        children = psutil.Process(parent_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []
    return [p for p in children if is_rank_process(p)]


def _assert_gone(procs: list[psutil.Process], timeout: float = 15) -> None:
    _gone, alive = psutil.wait_procs(procs, timeout=timeout)
    assert not alive, f"rank processes left behind after shutdown: {[p.pid for p in alive]}"


class DistributedPythonKernelTests(_InstalledSpec, jkt.KernelTests):
    kernel_name = KERNEL_NAME

    language_name = "python"
    file_extension = ".py"

    # identical on both ranks: published once, unlabelled, in one stream message
    code_hello_world = "print('hello, world')"
    code_stderr = "import sys; print('test', file=sys.stderr)"

    completion_samples: ClassVar[list[dict[str, Any]]] = [
        {"text": "zi", "matches": {"zip"}},
        # a name that exists only inside the ranks (defined when they joined the group):
        # completion is answered from a live rank, not from the parent
        {"text": "world_si", "matches": {"world_size"}},
    ]

    complete_code_samples: ClassVar[list[str]] = ["1", "print('hello, world')", "def f(x):\n  return x*2\n\n\n"]
    incomplete_code_samples: ClassVar[list[str]] = ["print('''hello", "def f(x):\n  x*2"]
    invalid_code_samples: ClassVar[list[str]] = ["import = 7q"]

    # the pager payload must come from one rank only (test_pager wants exactly one)
    code_page_something = "zip?"

    # raised on both ranks: the suite wants exactly one error output
    code_generate_error = "raise"

    code_execute_result: ClassVar[list[dict[str, str]]] = [
        {"code": "1+2+3", "result": "6"},
        {"code": "[n*n for n in range(1, 4)]", "result": "[1, 4, 9]"},
        # the same on every rank because the ranks really share one process group
        {"code": "import torch.distributed as dist; dist.get_world_size()", "result": str(RANKS)},
    ]

    code_display_data: ClassVar[list[dict[str, str]]] = [
        {"code": "from IPython.display import HTML, display; display(HTML('<b>test</b>'))", "mime": "text/html"},
        {"code": "from IPython.display import Math, display; display(Math('\\frac{1}{2}'))", "mime": "text/latex"},
    ]

    code_history_pattern = "1?2*"
    # "range" too: plain ipykernel 7 fails it (IPython answers with session 0 for the current
    # session); the parent echoes the session asked for (DistributedKernel.do_history)
    supported_history_operations = ("tail", "range", "search")

    code_inspect_sample = "zip"

    code_clear_output = "from IPython.display import clear_output; clear_output()"

    @classmethod
    def after_start(cls) -> None:
        """Run one cell that needs the whole group, with a start-up sized timeout.

        The parent answers kernel_info at once; its first cell waits for the ranks. The
        suite's own timeout (15 s per request) is for a running kernel, not a starting one.
        """
        msg_id = cls.kc.execute(f"import torch.distributed as dist\nassert dist.get_world_size() == {RANKS}")
        deadline = time.monotonic() + READY_TIMEOUT
        while True:
            msg = cls.kc.get_iopub_msg(timeout=max(1, deadline - time.monotonic()))
            if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                    and msg["content"]["execution_state"] == "idle"):
                break
        while True:  # skip wait_for_ready's kernel_info replies
            reply = cls.kc.get_shell_msg(timeout=READY_TIMEOUT)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        assert reply["content"]["status"] == "ok", reply["content"]

    # -------------------------------------------------- beyond the public suite
    def test_output_from_every_rank_is_merged_not_duplicated(self) -> None:
        """The suite's hello-world passes with one message; check that it really is one."""
        self.flush_channels()
        reply, outputs = self.execute_helper("print('hello, world')")
        self.assertEqual(reply["content"]["status"], "ok")
        streams = [m["content"] for m in outputs if m["msg_type"] == "stream"]
        self.assertEqual(streams, [{"name": "stdout", "text": "hello, world\n"}])

        reply, outputs = self.execute_helper("print('I am rank', rank)")
        self.assertEqual(reply["content"]["status"], "ok")
        text = "".join(m["content"]["text"] for m in outputs if m["msg_type"] == "stream")
        self.assertEqual(text, "[rank 0] I am rank 0\n[rank 1] I am rank 1\n")


class DistributedPythonIopubWelcomeTests(_InstalledSpec, jkt.IopubWelcomeTests):
    """ipykernel 7 greets each new IOPub subscriber; the parent kernel is an ipykernel 7 kernel."""

    kernel_name = KERNEL_NAME
    support_iopub_welcome = True

    @classmethod
    def before_stop(cls) -> None:
        # let the ranks come up (one cell), so shutting down also covers running ranks
        if not cls.kc.channels_running:
            cls.kc.start_channels()
        reply = cls.kc.execute_interactive("pass", timeout=READY_TIMEOUT, output_hook=lambda msg: None)
        assert reply["content"]["status"] == "ok", reply["content"]


if __name__ == "__main__":
    unittest.main()
