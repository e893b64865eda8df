"""Lightning integration: ``Trainer(strategy="ddp")`` in a cell trains on the kernel's group.

Runs inside each rank. :func:`install` is called once, after the process group has formed,
when the kernel's ``--lightning`` option is on; it imports nothing from Lightning (an import
hook, :mod:`dist_kernel.rank.import_hook`, patches its modules when a cell imports them).

What Lightning already gets right: the kernel sets ``LOCAL_RANK`` (and RANK, WORLD_SIZE,
MASTER_ADDR) as torchrun does, so Lightning's ``LightningEnvironment`` says the processes were
created externally, its launcher starts none, and it reuses the process group that is already
up. What it gets wrong is the notebook check: ``sys.ps1`` exists in an IPython kernel, so
Lightning believes one interactive process must fork the others. It then refuses
``strategy="ddp"``, picks ``ddp_fork`` for ``strategy="auto"`` and uses one GPU for
``devices="auto"``. Here each rank is a long-lived process of its own, as under torchrun, so:

- ``_IS_INTERACTIVE`` of the accelerator connector is false while the integration is on;
- ``Trainer(devices=D, num_nodes=M)`` must ask for as many processes as the kernel has ranks
  (Lightning would otherwise split the data for D x M replicas among the kernel's N: silently
  wrong), checked when a fit or evaluation starts, as torchrun's environment checks it;
- the progress bar and tables rank 0 shows during ``fit``/``validate``/``test``/``predict``
  are shown unlabelled, as one process would show them (rank 0 is Lightning's only bar).

``%dist_lightning on|off`` (the parent's magic, sent to every rank) and ``--lightning off`` switch it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from functools import wraps
from types import ModuleType
from typing import Any

from dist_kernel.rank import import_hook
from dist_kernel.rank.integration import in_group, is_marked, mark
from dist_kernel.rank.integration import lightning as switch

#: Lightning ships as ``lightning`` (lightning.pytorch) and as the older ``pytorch_lightning``
_PACKAGES = (("lightning.pytorch", "lightning.fabric"), ("pytorch_lightning", "lightning_fabric"))
#: the Trainer methods that run a loop (and show its progress bar)
_LOOPS = ("fit", "validate", "test", "predict")


def active() -> bool:
    """True when the patches should act: switched on (``%dist_lightning``, ``--lightning``),
    inside a process group of any size (a 1-rank kernel is a torchrun of one, not a notebook)."""
    return switch.enabled and in_group()


class _Interactive:
    """Stands in for Lightning's ``_IS_INTERACTIVE`` flag, read at each use: what Lightning
    found (``sys.ps1`` exists), unless the integration is active."""

    def __init__(self, found: bool) -> None:
        self.found = bool(found)

    def __bool__(self) -> bool:
        return self.found and not active()

    def __repr__(self) -> str:
        return repr(bool(self))


def _patch_connector(mod: Any) -> None:  # lightning's accelerator connector module
    if not isinstance(mod._IS_INTERACTIVE, _Interactive):
        mod._IS_INTERACTIVE = _Interactive(mod._IS_INTERACTIVE)


def world_mismatch(devices: int, num_nodes: int, world_size: int, local_world_size: int) -> str | None:
    """Why ``Trainer(devices, num_nodes)`` cannot run on the kernel's ranks, or None."""
    if devices * num_nodes == world_size:
        return None
    nodes = max(1, world_size // max(1, local_world_size))
    return (f"Trainer(devices={devices}, num_nodes={num_nodes}) asks for {devices * num_nodes} processes, but "
            f"this kernel has {world_size} ranks ({local_world_size} per node): Lightning would split the data "
            f"for {devices * num_nodes} replicas among {world_size}. Use Trainer(devices={local_world_size}"
            f"{f', num_nodes={nodes}' if nodes > 1 else ''}), or start the kernel with --ranks "
            f"{devices * num_nodes}.")


def _patch_environment(mod: ModuleType) -> None:
    env_cls = mod.LightningEnvironment
    original = env_cls.validate_settings
    if is_marked(original):
        return

    @wraps(original)
    def validate_settings(self: Any, num_devices: int, num_nodes: int) -> None:
        original(self, num_devices, num_nodes)
        if not active():
            return
        import torch.distributed as dist

        why = world_mismatch(num_devices, num_nodes, dist.get_world_size(),
                             int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size())))
        if why:
            raise ValueError(f"rank {dist.get_rank()}: {why}")

    mark(validate_settings)
    env_cls.validate_settings = validate_settings


@contextmanager
def _shown_as_one_process(trainer: Any) -> Iterator[None]:
    """Rank 0's rich output during a loop (its progress bar, the only one) shown unlabelled."""
    import torch.distributed as dist

    from dist_kernel.rank.agent import cell_ranks, solo_output

    shows = active() and dist.get_world_size() > 1 and dist.get_rank() == 0 == min(cell_ranks())
    with solo_output() if shows else nullcontext():
        yield


def _loop(original: Callable) -> Callable:
    @wraps(original)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _shown_as_one_process(self):
            return original(self, *args, **kwargs)

    mark(run)
    return run


def _patch_trainer(mod: ModuleType) -> None:
    for name in _LOOPS:
        method = getattr(mod.Trainer, name)
        if not is_marked(method):
            setattr(mod.Trainer, name, _loop(method))


def _patches() -> dict[str, Callable[[ModuleType], None]]:
    patches: dict[str, Callable[[ModuleType], None]] = {}
    for trainer_pkg, fabric_pkg in _PACKAGES:
        patches[f"{trainer_pkg}.trainer.connectors.accelerator_connector"] = _patch_connector
        patches[f"{trainer_pkg}.trainer.trainer"] = _patch_trainer
        patches[f"{fabric_pkg}.plugins.environments.lightning"] = _patch_environment
    return patches


def install() -> None:
    """Arrange for Lightning to use the kernel's ranks when (and only when) it is imported."""
    import_hook.patch_on_import("lightning", _patches())
