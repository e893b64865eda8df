"""Kernel options and %%rank selections: parsing, validation, and the messages users see."""

from __future__ import annotations

import argparse

import pytest

from dist_kernel import options as config
from dist_kernel.exceptions import ConfigError, RankSpecError
from dist_kernel.parent.magics import format_ranks, parse_rank_spec, plan_cell


def ns(**kw):
    p = argparse.ArgumentParser()
    config.add_arguments(p)
    args = []
    for k, v in kw.items():
        args += ["--" + k.replace("_", "-"), str(v)]
    return p.parse_args(args)


class TestRankSpec:
    @pytest.mark.parametrize("spec,expected", [
        ("all", (0, 1, 2, 3)), ("0", (0,)), ("0,2", (0, 2)), ("1-3", (1, 2, 3)),
        ("[0,1]", (0, 1)), ("0, 2-3", (0, 2, 3)), (" ALL ", (0, 1, 2, 3)),
    ])
    def test_valid_specs(self, spec, expected):
        assert parse_rank_spec(spec, 4) == expected

    @pytest.mark.parametrize("spec", ["", "x", "1-", "3-1", "0;1", "-1"])
    def test_unparseable_specs_say_how_to_write_one(self, spec):
        with pytest.raises(RankSpecError, match="This kernel has ranks 0-3"):
            parse_rank_spec(spec, 4)

    def test_a_rank_that_does_not_exist_is_named(self):
        with pytest.raises(RankSpecError, match="rank 5 does not exist"):
            parse_rank_spec("0,5", 2)

    def test_plan_strips_the_magic_but_keeps_line_numbers(self):
        plan = plan_cell("%%rank 1\nx = 1\ny = 2", 2)
        assert plan.ranks == (1,) and plan.selected
        assert plan.code.split("\n")[1:] == ["x = 1", "y = 2"]

    def test_a_cell_without_magic_runs_everywhere(self):
        plan = plan_cell("x = 1", 3)
        assert plan.ranks == (0, 1, 2) and not plan.selected and plan.code == "x = 1"

    def test_format_ranks_is_compact(self):
        assert format_ranks([0, 1, 2, 5]) == "0-2,5"
        assert format_ranks([0, 1]) == "0,1"


class TestConfig:
    def test_cpu_default_is_two_gloo_ranks(self):
        c = config.resolve(ns(), environ={}, available_gpus=[])
        assert (c.world_size, c.backend, c.gpus) == (2, "gloo", ())

    def test_gpu_default_is_one_nccl_rank_per_visible_gpu(self):
        c = config.resolve(ns(), environ={}, available_gpus=[0, 1, 2])
        assert (c.world_size, c.backend, c.gpus) == (3, "nccl", (0, 1, 2))
        assert [c.device_for(r) for r in range(3)] == ["cuda:0", "cuda:1", "cuda:2"]

    def test_gpus_picks_physical_gpus(self):
        c = config.resolve(ns(gpus="2,3"), environ={}, available_gpus=[0, 1, 2, 3])
        assert c.gpus == (2, 3) and c.world_size == 2

    def test_more_nccl_ranks_than_gpus_is_a_clear_error(self):
        with pytest.raises(ConfigError, match="needs 4 GPUs but only 2"):
            config.resolve(ns(ranks=4), environ={}, available_gpus=[0, 1])

    def test_gloo_ranks_may_share_gpus(self):
        c = config.resolve(ns(ranks=4, backend="gloo"), environ={}, available_gpus=[0])
        assert c.world_size == 4 and c.warnings

    @pytest.mark.parametrize("kw,message", [
        ({"ranks": 0}, "--ranks 0 must be at least 1"),
        ({"ranks": "two"}, "not a whole number"),
        ({"gpus": 9}, "GPU 9 does not exist"),
        ({"backend": "mpi"}, "unknown; use one of gloo, nccl"),
        ({"backend": "nccl"}, "nccl needs GPUs"),
        ({"timeout": -1}, "must be positive"),
    ])
    def test_bad_options_name_the_option_and_the_fix(self, kw, message):
        with pytest.raises(ConfigError, match=message) as e:
            config.resolve(ns(**kw), environ={}, available_gpus=[])
        assert "restart the kernel" in str(e.value)

    def test_environment_overrides_flags(self):
        c = config.resolve(ns(ranks=2), environ={"DIST_KERNEL_RANKS": "3"}, available_gpus=[])
        assert c.world_size == 3

    def test_cuda_visible_devices_limits_gpus_without_torch(self):
        assert config.visible_gpus({"CUDA_VISIBLE_DEVICES": "4,5"}) == [0, 1]
        assert config.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []

    def test_option_argv_round_trips(self):
        assert config.option_argv(ns(ranks=3, backend="gloo")) == ["--ranks", "3", "--backend", "gloo"]


def test_a_huge_rank_range_is_refused_without_building_it():
    # building the range first would need terabytes: this would never return
    with pytest.raises(RankSpecError, match="rank 2-100000000000 does not exist"):
        parse_rank_spec("0-100000000000", 2)
