"""Training and inference patches: fastai's ``Learner`` on N ranks, as if on one.

- ``Learner.fit`` (so ``fine_tune``, ``fit_one_cycle``, ...) runs data-parallel: for the
  length of the fit the model is wrapped in DDP and every DataLoader in fastai's
  ``DistributedDL`` (each rank takes 1/N of the batches, metrics are gathered), then
  everything is put back, even when the fit raises. A learner already inside
  ``distrib_ctx`` is left to fastai's own ``DistributedTrainer``: nothing is wrapped twice.
- Inference (``get_preds``, so ``predict``, ``show_results``, ``Interpretation``; and
  ``validate``) runs whole on every rank with fastai's all_gather switched off: without
  this every prediction tensor is gathered N times over and rows come back duplicated.
- ``lr_find`` runs data-parallel like a fit; its temporary checkpoint is written by every
  rank (fastai writes it on rank 0 only, then only rank 0 reaches the barrier in ``load``:
  a deadlock). Its losses are gathered means, so every rank stops at the same step and
  suggests the same rate.
- Ranks other than 0 (the cell's first rank) show no progress bar and log no metrics table while fastai runs,
  and get their logger back afterwards; ``ShowGraphCallback`` (which draws into the bar)
  sits the fit out on them.
- An empty DataLoader (no validation set, an empty test set) runs no batch on any rank, as
  in plain fastai; fastai's ``DistributedDL`` divides by its length.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import dist_kernel.rank.fastai.state as state
from dist_kernel.rank.fastai.state import wrap_once as _wrap_once

_fit_depth = 0  # > 0 while a (patched) fit runs: nested fits/inference pass straight through
_local_depth = 0  # > 0 while inference runs whole on this rank: no all_gather
_every_rank_saves = False  # True inside lr_find: its temporary checkpoint is per rank


def _uses_fastai_ddp(learn: Any) -> bool:
    """The notebook's own ``distrib_ctx`` (fastai's DistributedTrainer) is in charge."""
    return any(type(cb).__name__ == "DistributedTrainer" for cb in learn.cbs)


@contextlib.contextmanager
def _quiet_other_ranks(learn: Any) -> Iterator[None]:
    """One rank (rank 0; the cell's first rank in a ``%%rank`` cell) shows the progress bar and the
    metrics table; the others hide theirs and get their logger back after."""
    if state.shows_output():
        from dist_kernel.rank.agent import solo_output

        with solo_output():  # the only bar and table: shown unlabelled, as in one process
            yield
        return
    from fastai.callback.progress import ProgressCallback

    bars = [cb for cb in learn.cbs if isinstance(cb, ProgressCallback)]
    logger = learn.logger
    learn.remove_cbs(bars)
    learn.logger = _noop
    try:
        yield
    finally:
        learn.add_cbs(bars)
        learn.logger = logger


def _noop(*args: Any, **kwargs: Any) -> None:
    return None


def _shard(dl: Any) -> Any:
    """fastai's DistributedDL over ``dl``: rank r takes the r-th 1/N of each epoch's indices."""
    from fastai.distributed import DistributedDL

    return dl if dl is None or isinstance(dl, DistributedDL) else DistributedDL(dl)


@contextlib.contextmanager
def _sharded_loaders(learn: Any) -> Iterator[None]:
    loaders = list(learn.dls.loaders)
    learn.dls.loaders = [_shard(dl) for dl in loaders]
    try:
        yield
    finally:
        learn.dls.loaders = loaders


def _ddp_callback() -> Any:
    """A fastai Callback that wraps the model in DDP at ``before_fit`` (after the optimizer and
    the splitter have seen the bare model) and shards whatever DataLoader a phase uses."""
    from fastai.callback.core import Callback
    from torch.nn.parallel import DistributedDataParallel

    class DistributedDataParallelCallback(Callback):
        order = 11  # where fastai's DistributedTrainer sits: after TrainEval, before Recorder

        def before_fit(self) -> None:
            model = self.learn.model
            if isinstance(model, DistributedDataParallel) or not any(p.requires_grad for p in model.parameters()):
                return
            device = next(model.parameters()).device
            ids = [device.index] if device.type == "cuda" else None
            # DDP broadcasts rank 0's parameters and buffers here: replicas start identical
            self.learn.model = DistributedDataParallel(model, device_ids=ids, output_device=device.index if ids else None)

        def before_train(self) -> None:
            self.learn.dl = _shard(self.learn.dl)

        def before_validate(self) -> None:
            self.learn.dl = _shard(self.learn.dl)

    return DistributedDataParallelCallback()


@contextlib.contextmanager
def _data_parallel(learn: Any) -> Iterator[None]:
    """DDP + sharded DataLoaders for one fit; the learner is restored whatever happens."""
    from torch.nn.parallel import DistributedDataParallel

    model = learn.model
    with _sharded_loaders(learn), learn.added_cbs(_ddp_callback()):
        try:
            yield
            if isinstance(learn.model, DistributedDataParallel):
                _sync_buffers(learn.model.module)
        finally:
            if isinstance(learn.model, DistributedDataParallel) and not isinstance(model, DistributedDataParallel):
                learn.model = learn.model.module


def _sync_buffers(model: Any) -> None:
    """DDP gives every rank the same gradients, but BatchNorm's running statistics are updated by
    each rank's own last batch: take rank 0's, so the replicas end bit-identical."""
    import torch.distributed as dist

    for buf in model.buffers():
        dist.broadcast(buf, 0)


# ------------------------------------------------------------------ patches
def _fit(original: Callable) -> Callable:
    def fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _fit_depth
        if not state.active() or _fit_depth:
            return original(self, *args, **kwargs)
        _fit_depth += 1
        try:
            logger = self.logger
            try:
                with _quiet_other_ranks(self):
                    if _uses_fastai_ddp(self):
                        return original(self, *args, **kwargs)
                    with _data_parallel(self):
                        return original(self, *args, **kwargs)
            finally:
                self.logger = logger  # fastai's DistributedTrainer leaves noop on rank > 0
        finally:
            _fit_depth -= 1

    return fit


def _local_inference(original: Callable) -> Callable:
    """``get_preds``/``validate``: the whole dataset on every rank, nothing gathered."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _local_depth
        if not state.active() or _fit_depth or _uses_fastai_ddp(self):
            return original(self, *args, **kwargs)
        _local_depth += 1
        try:
            with _quiet_other_ranks(self):
                return original(self, *args, **kwargs)
        finally:
            _local_depth -= 1

    return method


def _lr_find(original: Callable) -> Callable:
    def lr_find(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _every_rank_saves
        if not state.active() or _fit_depth or _uses_fastai_ddp(self):
            return original(self, *args, **kwargs)
        _every_rank_saves = True
        try:
            # sharded before lr_find counts len(dls.train), so it plans the right number of epochs
            with _sharded_loaders(self):
                return original(self, *args, **kwargs)
        finally:
            _every_rank_saves = False

    return lr_find


def _save_model(original: Callable) -> Callable:
    def save_model(file: Any, model: Any, opt: Any, with_opt: bool = True, pickle_protocol: int = 2,
                   **torch_save_kwargs: Any) -> None:
        if not (_every_rank_saves and state.active() and state.rank() > 0):
            return original(file, model, opt, with_opt, pickle_protocol, **torch_save_kwargs)
        # fastai's own body minus its `if rank_distrib(): return`
        import torch
        from fastai.torch_core import get_model

        sd = get_model(model).state_dict()
        if with_opt and opt is not None:
            sd = {"model": sd, "opt": opt.state_dict()}
        torch.save(sd, file, pickle_protocol=pickle_protocol, **torch_save_kwargs)

    return save_model


def _maybe_gather(original: Callable) -> Callable:
    def maybe_gather(x: Any, axis: int = 0) -> Any:
        return x if _local_depth else original(x, axis)

    return maybe_gather


def _patch_torch_core(mod: ModuleType) -> None:
    # to_detach looks maybe_gather up in this module's globals at call time
    _wrap_once(mod, "maybe_gather", _maybe_gather)


def _patch_learner(mod: ModuleType) -> None:
    _wrap_once(mod.Learner, "fit", _fit)
    _wrap_once(mod.Learner, "get_preds", _local_inference)
    _wrap_once(mod.Learner, "validate", _local_inference)
    _wrap_once(mod, "save_model", _save_model)  # Learner.save looks it up in this module


def _patch_schedule(mod: ModuleType) -> None:
    _wrap_once(mod.Learner, "lr_find", _lr_find)  # fastai patches lr_find onto Learner here


def _patch_distributed(mod: ModuleType) -> None:
    """fastai.distributed assumes CUDA; make it work over gloo on CPU too."""

    def _broadcast(self: Any, t: Any, rank: int) -> list:
        import torch
        import torch.distributed as dist

        t = torch.tensor(t, dtype=torch.long)
        if dist.get_backend() == "nccl":
            t = t.cuda()  # nccl only moves CUDA tensors
        dist.broadcast(t, rank)
        return t.cpu().tolist()

    mod.DistributedDL._broadcast = _broadcast
    _wrap_once(mod.DistributedDL, "get_idxs", _get_idxs)

    def _init(original: Callable) -> Callable:
        def __init__(self: Any, sync_bn: bool = True, **kwargs: Any) -> None:
            import torch

            # SyncBatchNorm has no CPU implementation
            original(self, sync_bn=sync_bn and torch.cuda.is_available(), **kwargs)

        return __init__

    _wrap_once(mod.DistributedTrainer, "__init__", _init)


def _graph_before_fit(original: Callable) -> Callable:
    """``ShowGraphCallback`` draws its loss graph into the progress bar, and asserts there is one:
    on the ranks that hide theirs it would raise mid-fit while the others wait in a collective.
    There it sits the fit out; the graph is drawn once, by the rank that shows the bar."""

    def before_fit(self: Any) -> Any:
        if state.active() and not hasattr(self.learn, "progress") and not state.shows_output():
            self.run = False  # fastai sets it back to True after the fit
            return None
        return original(self)

    return before_fit


def _patch_progress(mod: ModuleType) -> None:
    _wrap_once(mod.ShowGraphCallback, "before_fit", _graph_before_fit)


def _get_idxs(original: Callable) -> Callable:
    """fastai's ``DistributedDL.get_idxs`` that also shards an empty DataLoader (an empty
    validation set, an empty test set): no batches on any rank, as plain fastai runs no batch.
    fastai's own divides by the number of items (ZeroDivisionError)."""

    def get_idxs(self: Any) -> list:
        if not state.active():
            return original(self)
        # fastai's body: every rank computes its indices (same length), rank 0's are used
        idxs = self._broadcast(list(self.dl.get_idxs()), 0)
        self.n = len(idxs)
        self.n_padded = -(-self.n // self.world_size) * self.world_size  # next multiple
        if self.n:  # pad by repeating indices so that every rank gets as many
            idxs += (idxs * (self.n_padded // self.n))[: self.n_padded - self.n]
        share = self.n_padded // self.world_size
        return idxs[self.rank * share:(self.rank + 1) * share]

    return get_idxs


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "fastai.torch_core": _patch_torch_core,
    "fastai.learner": _patch_learner,
    "fastai.callback.schedule": _patch_schedule,
    "fastai.distributed": _patch_distributed,
    "fastai.callback.progress": _patch_progress,
}
