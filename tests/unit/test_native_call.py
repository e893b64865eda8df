"""How a rank names the torch call it is blocked in when that call started its collective in C++
(``DDP(...)``'s constructor): from frames that stand in for torch's, no torch imported."""

from __future__ import annotations

import linecache
import sys
from types import FrameType

from dist_kernel.rank import agent

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
    name, group = agent._native_call(frame)
    assert name == "DistributedDataParallel(...) / _verify_param_shape_across_processes / " \
                   "_verify_params_across_processes"
    assert group is None  # no process group object on the way: the default one


def test_code_outside_torchs_distributed_code_is_no_such_call():
    assert agent._native_call(sys._getframe()) == ("", None)
