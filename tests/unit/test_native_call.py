"""How a rank names the torch call it is blocked in when that call started its collective in C++
(``DDP(...)``'s constructor): from frames that stand in for torch's, no torch imported."""

from __future__ import annotations

import linecache
import sys
from types import FrameType

from dist_kernel.rank import stack

TORCH = "/venv/lib/python3.11/site-packages/torch"
UTILS = f"{TORCH}/distributed/utils.py"
DDP = f"{TORCH}/nn/parallel/distributed.py"


def load(path: str, source: str, namespace: dict) -> None:
    linecache.cache[path] = (len(source), None, source.splitlines(True), path)  # its lines, for the callee
    exec(compile(source, path, "exec"), namespace)


def frames_inside_ddp() -> FrameType:
    """The innermost frame of ``DistributedDataParallel(model)`` as it calls into C++."""
    ns: dict = {}
    load(UTILS, "def _verify_param_shape_across_processes(process_group, tensors):\n"
                "    return dist._verify_params_across_processes(process_group, tensors)\n", ns)
    ns["dist"] = type("dist", (), {"_verify_params_across_processes": staticmethod(lambda *a: sys._getframe(1))})
    load(DDP, "class DistributedDataParallel:\n"
              "    def __init__(self, module):\n"
              "        self.frame = _verify_param_shape_across_processes(None, [module])\n", ns)
    return ns["DistributedDataParallel"](object()).frame


def test_a_call_into_cpp_from_torchs_distributed_code_is_named_from_the_outside_in():
    frame = frames_inside_ddp()
    name, group = stack.native_call(frame)
    assert name == "DistributedDataParallel(...) / _verify_param_shape_across_processes / " \
                   "_verify_params_across_processes"
    assert group is None  # no process group object on the way: the default one


def test_code_outside_torchs_distributed_code_is_no_such_call():
    assert stack.native_call(sys._getframe()) == ("", None)


class Between:
    """A frame as CPython shows one while it runs an instruction that has no line: ``f_lineno``
    is None (seen once in a look, which then failed with a TypeError, issue 36)."""

    f_lineno = None
    f_lasti = -1

    def __init__(self, frame: FrameType) -> None:
        self._frame = frame

    def __getattr__(self, name: str) -> object:
        return getattr(self._frame, name)


def test_a_frame_without_a_line_number_is_named_without_its_callee_and_the_look_goes_on():
    name, group = stack.native_call(Between(frames_inside_ddp()))  # type: ignore[arg-type]
    assert name == "DistributedDataParallel(...) / _verify_param_shape_across_processes"
    assert group is None


def test_the_callee_is_the_call_the_frame_is_at_not_the_first_on_its_line():
    ns: dict = {}
    load(DDP, "class DistributedDataParallel:\n"
              "    def forward(self):\n"
              "        if torch.is_grad_enabled() and self.reducer._rebuild_buckets():\n"
              "            pass\n", ns)
    ns["torch"] = type("torch", (), {"is_grad_enabled": staticmethod(lambda: True)})
    ddp = ns["DistributedDataParallel"]()
    seen: list = []  # what a look from another thread reads while forward() waits in the call
    ddp.reducer = type("reducer", (), {"_rebuild_buckets": staticmethod(
        lambda: seen.append(stack.native_call(sys._getframe(1))))})
    ddp.forward()
    assert seen[0] == ("forward(...) / _rebuild_buckets", None)
