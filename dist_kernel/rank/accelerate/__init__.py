"""accelerate on the kernel's ranks: the ranks already are the processes ``accelerate launch``
would start, in one group, so ``Accelerator()`` in a cell works as in a script. Two things differ
in a notebook, and are patched here (see :mod:`dist_kernel.rank.hf`):

- ``notebook_launcher(fn, args, num_processes=N)`` forks N new processes and starts a group of
  their own (it refuses when an ``Accelerator`` exists already, and would race for its port on
  every rank). Here it runs ``fn(*args)`` once on every rank, in the existing group, and says
  clearly when ``num_processes`` asks for a different number of processes than there are ranks.
  Each call gives ``fn`` what the launcher's new processes would have: a fresh ``AcceleratorState``
  with the ``mixed_precision`` asked for (an ``Accelerator`` made in an earlier cell would pin it
  otherwise, silently). An ``Accelerator`` made outside ``fn`` keeps its own state, and the cells
  after the call see the state they saw before it.
- ``accelerator.print`` prints on the main process only; merged, that is a line labelled
  ``[rank 0]``. It is shown unlabelled, as one process shows it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

from dist_kernel.rank.integration import hf, in_group, world_size, wrap_once


def check_processes(num_processes: int | None, num_nodes: int, world: int) -> None:
    """A ``notebook_launcher`` call that asks for another number of processes than the kernel
    has ranks cannot run as asked: say so, with the fix."""
    for name, value in (("num_processes", num_processes), ("num_nodes", num_nodes)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise TypeError(f"notebook_launcher({name}={value!r}): {name} must be an int, not "
                            f"{type(value).__name__}. Fix: {name}={_as_int_hint(value)}.")
    if num_processes is None:
        return
    asked = num_processes * num_nodes
    if asked == world:
        return
    nodes = f", num_nodes={num_nodes}" if num_nodes != 1 else ""
    raise ValueError(
        f"notebook_launcher(num_processes={num_processes}{nodes}) asks for {asked} processes, but this "
        f"Distributed Python kernel has {world} ranks, and they are the processes: the function runs once "
        f"on each of them, in their process group. Fix: pass num_processes={max(world // max(num_nodes, 1), 1)} "
        f"(or leave it out), or restart the kernel with --ranks {asked}.")


def _as_int_hint(value: Any) -> str:
    """What to write instead of ``value``: the int it spells, where it spells one."""
    try:
        return str(int(value))
    except (TypeError, ValueError):
        return "an int"


@contextlib.contextmanager
def fresh_states(*classes: type) -> Iterator[None]:
    """Give each of accelerate's shared-state (Borg) ``classes`` an empty state for the block,
    as a new process has, and put the old one back after it. Instances made before keep theirs:
    they hold the old dict itself, which is neither cleared nor changed here."""
    saved: list[tuple[type, Any, dict | None]] = []  # class, its attribute, a descriptor's storage
    for cls in classes:
        raw = cls.__dict__["_shared_state"]
        if isinstance(raw, dict):
            setattr(cls, "_shared_state", type(raw)())  # noqa: B010 - the class attribute, swapped
            saved.append((cls, raw, None))
        else:  # accelerate's thread-local descriptor (torch_xla): swap what it stores
            saved.append((cls, raw, raw._storage))
            raw._storage = {}
    try:
        yield
    finally:
        for cls, raw, storage in reversed(saved):
            if storage is None:
                setattr(cls, "_shared_state", raw)  # noqa: B010
            else:
                raw._storage = storage


def _on_ranks(original: Callable) -> Callable:
    signature = inspect.signature(original)

    def notebook_launcher(*args: Any, **kwargs: Any) -> None:
        if not hf.enabled or not in_group():  # a 1-rank kernel too: its one rank is the process
            return original(*args, **kwargs)
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        given = call.arguments
        check_processes(given["num_processes"], given["num_nodes"], world_size())
        from accelerate.utils import PrecisionType, patch_environment

        precision = str(given["mixed_precision"]).lower()
        if precision not in PrecisionType.list():
            raise ValueError(f"Unknown mixed_precision mode: {precision}. Choose between {PrecisionType.list()}.")
        from dist_kernel.rank.agent import device

        kind = "GPU" if device().startswith("cuda") else "CPU"
        print(f"Launching training on {world_size()} {kind}s: the kernel's ranks, in their process group "
              "(no new processes).")
        from accelerate.state import AcceleratorState, GradientState

        # what the launcher's new processes would start from: no AcceleratorState yet, and the
        # mixed precision asked for ("no" too) where Accelerator() reads it. Without the fresh
        # state, an Accelerator made in an earlier cell (or an earlier launch) would decide it.
        with fresh_states(AcceleratorState, GradientState), \
                patch_environment(ACCELERATE_MIXED_PRECISION=precision):
            given["function"](*given["args"])
        return None

    return notebook_launcher


def _print_once(original: Callable) -> Callable:
    def print(self: Any, *args: Any, **kwargs: Any) -> None:  # PartialState.print
        if not hf.active() or not self.use_distributed:
            return original(self, *args, **kwargs)
        from dist_kernel.rank.agent import flush_streams, solo_output

        if not self.is_main_process:
            flush_streams()  # as the main process does before it prints
            return None  # a node's local main prints under torchrun; here rank 0 shows it once

        with solo_output(streams=True):
            return original(self, *args, **kwargs)

    return print


def _patch_launchers(mod: ModuleType) -> None:
    wrap_once(mod, "notebook_launcher", _on_ranks)


def _patch_package(mod: ModuleType) -> None:
    # ``from .launchers import notebook_launcher`` copied it before the hook could act, when
    # accelerate was imported before the integration was installed
    launchers = getattr(mod, "launchers", None)
    if launchers is not None and hasattr(mod, "notebook_launcher"):
        mod.notebook_launcher = launchers.notebook_launcher  # type: ignore[attr-defined]  # ModuleType declares no attributes; accelerate has it


def _patch_state(mod: ModuleType) -> None:
    wrap_once(mod.PartialState, "print", _print_once)


#: accelerate module -> its patch
PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "accelerate.launchers": _patch_launchers,
    "accelerate.state": _patch_state,
    "accelerate": _patch_package,
}
