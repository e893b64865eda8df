"""Issue 30, section 7: more ranks than GPUs with the backend left to its default."""

from __future__ import annotations

import pytest
from option_args import ns

from dist_kernel import options as config
from dist_kernel.exceptions import ConfigError


def test_two_ranks_on_one_gpu_by_default_share_it_over_gloo_and_say_so_once():
    c = config.resolve(ns(ranks=2), environ={}, available_gpus=[0])
    assert (c.world_size, c.backend, c.gpus) == (2, "gloo", (0,))
    assert [c.device_for(r) for r in range(2)] == ["cuda:0", "cuda:0"]
    said = [w for w in c.warnings if "backend gloo, not nccl" in w]
    assert len(said) == 1 and "2 ranks on 1 GPU(s)" in said[0] and "--ranks 1" in said[0]


def test_the_shared_gpu_warning_says_what_accelerate_and_trainer_users_do():
    c = config.resolve(ns(ranks=2), environ={}, available_gpus=[0])
    (shared,) = [w for w in c.warnings if "share 1 GPU(s) over gloo" in w]
    assert "accelerate and Transformers' Trainer" in shared
    assert "--ranks 1" in shared and "Accelerator(cpu=True)" in shared and "TrainingArguments(use_cpu=True)" in shared


def test_an_explicit_nccl_keeps_the_error():
    with pytest.raises(ConfigError, match="--ranks 2 with nccl needs 2 GPUs but only 1 are selected"):
        config.resolve(ns(ranks=2, backend="nccl"), environ={}, available_gpus=[0])


def test_an_explicit_gloo_is_not_announced_as_a_choice():
    c = config.resolve(ns(ranks=2, backend="gloo"), environ={}, available_gpus=[0])
    assert c.backend == "gloo" and not any("not nccl" in w for w in c.warnings)


def test_one_rank_per_gpu_keeps_nccl_without_a_word():
    c = config.resolve(ns(ranks=2), environ={}, available_gpus=[0, 1])
    assert c.backend == "nccl" and not c.warnings


def test_the_environment_counts_as_a_choice():
    with pytest.raises(ConfigError, match="with nccl needs 2 GPUs"):
        config.resolve(ns(ranks=2), environ={"DIST_KERNEL_BACKEND": "nccl"}, available_gpus=[0])


def test_several_nodes_with_more_ranks_per_node_than_gpus_pick_gloo_too():
    c = config.resolve(ns(launcher="slurm", nodes=2, ranks_per_node=4, gpus="0,1"), environ={}, available_gpus=[])
    assert c.backend == "gloo" and any("--ranks-per-node 2" in w for w in c.warnings)
