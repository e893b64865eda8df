"""The Lightning integration's parts, in this process: the import hook, the notebook flag, the
devices check (the real-kernel runs are in test_ecosystem_torch.py)."""

from __future__ import annotations

import importlib
import sys
import types
from datetime import timedelta

import pytest

from dist_kernel.rank import import_hook
from dist_kernel.rank import lightning as integration


def test_a_module_is_patched_when_imported_and_once_per_integration(tmp_path, monkeypatch):
    (tmp_path / "dk_fake_lib.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[types.ModuleType] = []
    finders = list(sys.meta_path)
    try:
        import_hook.patch_on_import("dk-test", {"dk_fake_lib": seen.append})
        import_hook.patch_on_import("dk-test", {"dk_fake_lib": seen.append})  # a re-formed group: no second finder
        assert import_hook.installed("dk-test") and not import_hook.installed("other")
        mod = importlib.import_module("dk_fake_lib")
        assert seen == [mod] and mod.VALUE == 1
    finally:
        sys.meta_path[:] = finders
        sys.modules.pop("dk_fake_lib", None)


def test_devices_must_match_the_kernels_ranks():
    assert integration.world_mismatch(2, 1, 2, 2) is None
    assert integration.world_mismatch(4, 2, 8, 4) is None
    why = integration.world_mismatch(4, 1, 2, 2)
    assert "Trainer(devices=4, num_nodes=1) asks for 4 processes" in why and "Use Trainer(devices=2)" in why
    assert "num_nodes=2" in integration.world_mismatch(4, 1, 8, 4)


@pytest.fixture
def group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1,
                            timeout=timedelta(seconds=60))
    yield
    dist.destroy_process_group()


def test_lightning_in_an_ipython_process_accepts_ddp_while_on_and_refuses_it_while_off(group, monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "0")
    finders = list(sys.meta_path)
    try:
        integration.install()
        import lightning as L
        from lightning.fabric.utilities.exceptions import MisconfigurationException
        from lightning.pytorch.trainer.connectors import accelerator_connector

        assert isinstance(accelerator_connector._IS_INTERACTIVE, integration._Interactive)
        # what Lightning finds in an IPython kernel (sys.ps1 exists there; not in pytest)
        monkeypatch.setattr(accelerator_connector._IS_INTERACTIVE, "found", True)
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy="ddp", logger=False)
        assert type(trainer.strategy).__name__ == "DDPStrategy"
        integration.switch.set(False)
        with pytest.raises(MisconfigurationException, match="not compatible with an interactive environment"):
            L.Trainer(accelerator="cpu", devices=1, strategy="ddp", logger=False)
    finally:
        integration.switch.set(True)
        sys.meta_path[:] = finders
