"""Kernel options and %%rank selections: parsing, validation, and the messages users see."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from pathlib import Path

import pytest
from option_args import ns

from dist_kernel import capacity, devices
from dist_kernel import options as config
from dist_kernel.exceptions import ConfigError, RankSpecError
from dist_kernel.parent.selection import format_ranks, parse_rank_spec, plan_cell


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
            config.resolve(ns(ranks=4, backend="nccl"), environ={}, available_gpus=[0, 1])

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

    def test_the_command_line_beats_the_environment(self):
        # traitlets' order (issue 18): the kernelspec's flag wins over DIST_KERNEL_* ...
        c = config.resolve(ns(ranks=2), environ={"DIST_KERNEL_RANKS": "3"}, available_gpus=[])
        assert c.world_size == 2

    def test_the_environment_fills_what_the_command_line_leaves_out(self):
        c = config.resolve(ns(ranks=2), environ={"DIST_KERNEL_RANKS": "3", "DIST_KERNEL_SEED": "7",
                                                 "DIST_KERNEL_EMPTY_CACHE": "off"}, available_gpus=[])
        assert (c.world_size, c.seed, c.empty_cache) == (2, 7, False)
        # ... an empty variable is no value, and a bad one is named like a bad flag
        assert config.resolve(ns(), environ={"DIST_KERNEL_RANKS": ""}, available_gpus=[]).world_size == 2
        with pytest.raises(ConfigError, match="DIST_KERNEL_TIMEOUT='soon' in the kernel's environment: "
                                              "--timeout 'soon' is not a number"):
            config.resolve(ns(), environ={"DIST_KERNEL_TIMEOUT": "soon"}, available_gpus=[])

    def test_cuda_visible_devices_limits_gpus_without_torch(self):
        assert devices.visible_gpus({"CUDA_VISIBLE_DEVICES": "4,5"}) == [0, 1]
        assert devices.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []

    def test_option_argv_round_trips(self):
        assert config.option_argv(ns(ranks=3, backend="gloo")) == ["--ranks", "3", "--backend", "gloo"]


def test_a_huge_rank_range_is_refused_without_building_it():
    # building the range first would need terabytes: this would never return
    with pytest.raises(RankSpecError, match="rank 2-100000000000 does not exist"):
        parse_rank_spec("0-100000000000", 2)


def remote(**kw):
    """Resolve options for ranks on other machines (this machine shows no GPU)."""
    return config.resolve(ns(**kw), environ={}, available_gpus=[])


class TestSeveralMachines:
    def test_local_is_the_default_and_unchanged(self):
        c = config.resolve(ns(), environ={}, available_gpus=[0, 1])
        assert (c.launcher, c.nodes, c.ranks_per_node, c.hosts, c.slurm_args) == ("local", 1, 2, (), ())
        assert (c.listen, c.port_range, c.remote) == (None, None, False)
        assert [c.node_of(r) for r in range(2)] == [0, 0]
        assert [c.local_rank_of(r) for r in range(2)] == [0, 1]
        assert c.describe() == "2 ranks, backend nccl, devices: physical GPU 0, physical GPU 1"

    def test_a_config_built_by_hand_has_one_node_of_all_ranks(self):
        c = config.KernelConfig(world_size=3, backend="gloo")
        assert (c.nodes, c.ranks_per_node, c.local_rank_of(2), c.node_of(2)) == (1, 3, 2, 0)

    def test_local_ranks_per_node_is_the_rank_count(self):
        assert config.resolve(ns(ranks_per_node=3), environ={}, available_gpus=[]).world_size == 3
        with pytest.raises(ConfigError, match="--ranks-per-node 3 differs from --ranks 2"):
            config.resolve(ns(ranks=2, ranks_per_node=3), environ={}, available_gpus=[])

    def test_slurm_nodes_times_ranks_per_node_numbered_node_major(self):
        c = remote(launcher="slurm", nodes=2, ranks_per_node=2)
        assert (c.world_size, c.nodes, c.ranks_per_node, c.remote) == (4, 2, 2, True)
        assert [c.node_of(r) for r in range(4)] == [0, 0, 1, 1]
        assert [c.local_rank_of(r) for r in range(4)] == [0, 1, 0, 1]
        assert c.describe() == "4 ranks on 2 nodes (slurm, 2 per node), backend gloo, devices: CPU"

    def test_remote_default_is_one_cpu_gloo_rank_per_node_whatever_this_machine_has(self):
        c = config.resolve(ns(launcher="slurm", nodes=2), environ={}, available_gpus=[0, 1, 2, 3])
        assert (c.world_size, c.ranks_per_node, c.gpus, c.backend) == (2, 1, (), "gloo")

    def test_remote_gpus_are_ids_on_each_node_not_checked_here(self):
        c = remote(launcher="slurm", nodes=2, gpus="0,1,2,3")
        assert (c.world_size, c.ranks_per_node, c.backend, c.gpus) == (8, 4, "nccl", (0, 1, 2, 3))
        assert [c.device_for(r) for r in (0, 3, 4, 7)] == ["cuda:0", "cuda:3", "cuda:0", "cuda:3"]
        assert "GPU 0,1,2,3 on each node" in c.describe()

    def test_remote_gpus_beyond_the_ranks_per_node_are_dropped(self):
        c = remote(launcher="slurm", nodes=2, ranks_per_node=2, gpus="4,5,6")
        assert c.gpus == (4, 5) and c.world_size == 4

    def test_ranks_are_split_over_the_nodes(self):
        c = remote(launcher="slurm", nodes=2, ranks=6)
        assert (c.world_size, c.ranks_per_node) == (6, 3)

    def test_ssh_nodes_are_the_hosts(self):
        c = remote(launcher="ssh", hosts="node1, node2", ranks_per_node=1)
        assert (c.hosts, c.nodes, c.world_size) == (("node1", "node2"), 2, 2)
        assert c.describe() == "2 ranks on 2 nodes (node1, node2) (ssh, 1 per node), backend gloo, devices: CPU"
        assert remote(launcher="ssh", hosts="a,b", nodes=2).nodes == 2

    def test_slurm_args_are_split_like_a_shell(self):
        c = remote(launcher="slurm", slurm_args="--partition gpu --time 2:00:00 --comment 'two words' -w n[1-2]")
        assert c.slurm_args == ("--partition", "gpu", "--time", "2:00:00", "--comment", "two words", "-w", "n[1-2]")

    def test_listen_and_port_range(self):
        c = remote(launcher="slurm", listen="10.0.0.5", port_range="29500-29509")
        assert (c.listen, c.port_range) == ("10.0.0.5", (29500, 29509))
        assert remote(launcher="ssh", hosts="a", listen="head.cluster.local").listen == "head.cluster.local"
        assert remote(launcher="ssh", hosts="a", listen="fd00::5").listen == "fd00::5"

    def test_loopback_listen_is_allowed_but_unused_with_local(self):
        c = remote(listen="127.0.0.1", port_range="5000-5000")
        assert (c.listen, c.port_range, c.remote) == ("127.0.0.1", (5000, 5000), False)

    def test_environment_overrides_the_new_options(self):
        c = config.resolve(ns(), environ={"DIST_KERNEL_LAUNCHER": "ssh", "DIST_KERNEL_HOSTS": "x,y",
                                          "DIST_KERNEL_RANKS_PER_NODE": "2"}, available_gpus=[])
        assert (c.launcher, c.hosts, c.world_size) == ("ssh", ("x", "y"), 4)

    @pytest.mark.parametrize("kw,message", [
        ({"launcher": "mpirun"}, r"--launcher 'mpirun' is unknown; use one of local, slurm, ssh"),
        ({"nodes": 2}, "--nodes 2 needs ranks on other machines; use --launcher slurm or ssh"),
        ({"launcher": "slurm", "nodes": 0}, "--nodes 0 must be at least 1"),
        ({"launcher": "slurm", "ranks_per_node": 0}, "--ranks-per-node 0 must be at least 1"),
        ({"launcher": "slurm", "ranks_per_node": "x"}, "--ranks-per-node 'x' is not a whole number"),
        ({"launcher": "ssh"}, "--launcher ssh needs --hosts"),
        ({"hosts": "a,b"}, "--hosts a,b is for --launcher ssh"),
        ({"launcher": "slurm", "hosts": "a,b"}, "--nodelist"),
        ({"launcher": "ssh", "hosts": "a,,b"}, "empty host name"),
        ({"launcher": "ssh", "hosts": "a,b,a"}, "--hosts names a twice"),
        ({"launcher": "ssh", "hosts": "a,-oProxyCommand=x"}, "is not a host name"),
        ({"launcher": "ssh", "hosts": "a,b", "nodes": 3}, "--nodes 3 does not match the 2 host"),
        ({"launcher": "ssh", "hosts": "a", "slurm_args": "-p gpu"}, "--slurm-args is for --launcher slurm"),
        ({"slurm_args": "-p gpu"}, "--slurm-args is for --launcher slurm"),
        ({"launcher": "slurm", "slurm_args": "--comment 'open"}, "cannot be parsed"),
        ({"launcher": "slurm", "nodes": 2, "ranks": 5}, "--ranks 5 cannot be split evenly over 2 nodes"),
        ({"launcher": "slurm", "nodes": 2, "ranks": 6, "ranks_per_node": 2}, r"--ranks 6 is not --nodes 2 x --ranks-per-node 2 = 4"),
        ({"launcher": "slurm", "gpus": "0,x"}, "GPU ids on each node"),
        ({"launcher": "slurm", "gpus": "-1"}, "GPU ids on each node"),
        ({"launcher": "slurm", "gpus": "0,0"}, "lists a GPU twice"),
        ({"launcher": "slurm", "backend": "nccl"}, "name the GPU ids on each node with --gpus"),
        ({"launcher": "slurm", "gpus": "0,1", "ranks_per_node": 3, "backend": "nccl"}, "--ranks-per-node 3 with nccl needs 3 GPUs on each node"),
        ({"launcher": "slurm", "listen": "127.0.0.1"}, "classic listener bound to localhost"),
        ({"launcher": "slurm", "listen": "127.0.1.1"}, "loopback"),
        ({"launcher": "ssh", "hosts": "a", "listen": "::1"}, "loopback"),
        ({"launcher": "ssh", "hosts": "a", "listen": "localhost"}, "loopback"),
        ({"launcher": "slurm", "listen": "0.0.0.0"}, "not an address the nodes can connect to"),
        ({"launcher": "slurm", "listen": "10.0.0.5:5000"}, "without port"),
        ({"launcher": "slurm", "listen": "[fd00::5]"}, "without port"),
        ({"launcher": "slurm", "listen": "tcp://10.0.0.5"}, "without port"),
        ({"launcher": "slurm", "listen": "bad host"}, "neither an IP address nor a host name"),
        ({"launcher": "slurm", "port_range": "29500"}, "must be two port numbers A-B"),
        ({"launcher": "slurm", "port_range": "a-b"}, "must be two port numbers A-B"),
        ({"launcher": "slurm", "port_range": "80-90"}, "1024 <= A <= B <= 65535"),
        ({"launcher": "slurm", "port_range": "30000-29000"}, "1024 <= A <= B <= 65535"),
        ({"launcher": "slurm", "port_range": "60000-70000"}, "1024 <= A <= B <= 65535"),
        ({"launcher": "slurm", "port_range": "29500-29500"}, "at least 3"),
        ({"launcher": "slurm", "port_range": "29500-29501"}, "has 2 ports; slurm/ssh need at least 3"),
        ({"port_range": "1-2"}, "1024 <= A <= B <= 65535"),
        ({"listen": "a:1"}, "without port"),
    ])
    def test_bad_options_name_the_option_and_the_fix(self, kw, message):
        with pytest.raises(ConfigError, match=message) as e:
            remote(**kw)
        assert "restart the kernel" in str(e.value)

    @pytest.mark.parametrize("arg", [
        "--nodes 2", "--nodes=2", "-N 2", "-N2", "--ntasks 4", "--ntasks=4", "-n4", "-n 4",
        "--ntasks-per-node 2", "--ntasks-per-node=2", "--ntasks-per-gpu=1", "--input none", "-i none",
        "--output x.log", "--output=x.log", "-o x.log", "--error x.log", "-e x.log", "--jobid 12", "--jobid=12",
    ])
    def test_slurm_args_may_not_set_what_the_kernel_sets(self, arg):
        with pytest.raises(ConfigError, match="which the kernel sets itself") as e:
            remote(launcher="slurm", slurm_args=f"--partition gpu {arg}")
        if arg.startswith(("--nodes", "-N", "--ntasks", "-n")):
            assert "--nodes and --ranks-per-node instead" in str(e.value)

    @pytest.mark.parametrize("arg", ["--nodelist n[1-2]", "-w n1", "--exclusive", "--gres gpu:4", "--mem=0",
                                     "--export=ALL", "--account=proj", "-t 10"])
    def test_other_slurm_args_pass(self, arg):
        # (on a command line, a value that starts with "-" is written --slurm-args="--exclusive")
        c = config.resolve(argparse.Namespace(launcher="slurm", slurm_args=arg), environ={}, available_gpus=[])
        assert c.slurm_args == tuple(arg.split())

    def test_a_value_that_starts_with_a_dash_survives_kernel_json(self):
        from dist_kernel.cli import _parser

        parsed = _parser().parse_args(["install", "--launcher", "slurm", "--slurm-args=--exclusive"])
        argv = config.option_argv(parsed)
        assert argv == ["--launcher", "slurm", "--slurm-args=--exclusive"]
        again = _parser().parse_args(["kernel", "-f", "x.json", *argv])
        assert config.resolve(again, environ={}, available_gpus=[]).slurm_args == ("--exclusive",)

    def test_new_options_reach_the_cli_and_kernel_json(self):
        from dist_kernel.cli import _parser

        parsed = _parser().parse_args(["install", "--launcher", "slurm", "--nodes", "2", "--ranks-per-node", "4",
                                       "--gpus", "0,1,2,3", "--slurm-args", "--partition gpu --time 2:00:00",
                                       "--listen", "10.0.0.5", "--port-range", "29500-29509"])
        argv = config.option_argv(parsed)
        assert argv == ["--gpus", "0,1,2,3", "--launcher", "slurm", "--nodes", "2", "--ranks-per-node", "4",
                        "--slurm-args=--partition gpu --time 2:00:00", "--listen", "10.0.0.5",
                        "--port-range", "29500-29509"]
        c = config.resolve(_parser().parse_args(["kernel", "-f", "x.json", *argv]), environ={}, available_gpus=[])
        assert (c.world_size, c.backend, c.slurm_args[:2]) == (8, "nccl", ("--partition", "gpu"))
        hosts = _parser().parse_args(["run", "nb.ipynb", "--launcher", "ssh", "--hosts", "n1,n2"])
        assert config.option_argv(hosts) == ["--launcher", "ssh", "--hosts", "n1,n2"]


def test_the_readme_configuration_table_lists_every_option():
    from pathlib import Path

    readme = (Path(__file__).parents[2] / "README.md").read_text()
    section = readme.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `--")]
    for o in config.OPTIONS:
        (row,) = [r for r in rows if r.startswith((f"| `{o.flag} ", f"| `{o.flag}=", f"| `{o.flag}`"))]
        assert f"`{o.env}`" in row, o.name
        meaning = re.split(r"(?<!\\)\|", row)[3]  # cells split at unescaped pipes (`on\|off`)
        if o.default is not None:
            assert re.search(rf"(\(|default ){re.escape(o.default)}\b", meaning), f"{o.name}: no default {o.default}"
    # and the table names no option that is not declared
    assert len(rows) == len(config.OPTIONS)


# ------------------------------------------------------------------ one declaration per option
class TestDeclaration:
    def test_each_option_is_a_kernel_config_field_with_the_declared_default(self):
        fields = {f.name: f for f in dataclasses.fields(config.KernelConfig)}
        assert {o.attribute for o in config.OPTIONS} == set(fields) - {"warnings"}
        for o in config.OPTIONS:
            if o.default is not None:
                assert fields[o.attribute].default == o.default_value(), o.name

    def test_flags_help_and_environment_come_from_the_declaration(self):
        from dist_kernel.cli import _parser

        text = _parser().parse_args(["kernel", "-f", "x.json"])  # every option exists, unset
        assert all(getattr(text, o.name) is None for o in config.OPTIONS)
        kernel_help = next(a for a in _parser()._subparsers._group_actions[0].choices.items()
                           if a[0] == "kernel")[1].format_help()
        for o in config.OPTIONS:
            assert o.flag in kernel_help and o.env in kernel_help, o.name
        assert "(default 1800)" in kernel_help and "DIST_KERNEL_OVERSUBSCRIBE" in kernel_help

    def test_every_default_parses(self):
        assert config.OPTION["merge_window_ms"].default_value() == 0.1  # declared in ms, kept in seconds
        assert config.OPTION["empty_cache"].default_value() is True
        assert config.OPTION["oversubscribe"].default_value() is False

    @pytest.mark.parametrize("option", config.OPTIONS, ids=lambda o: o.name)
    def test_every_option_reaches_its_consumer(self, option):
        """The module the declaration names really reads the option's KernelConfig attribute."""
        import ast
        import importlib

        module = importlib.import_module(option.consumer)
        tree = ast.parse(Path(module.__file__).read_text())
        reads = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load)}
        reads |= {n.args[1].value for n in ast.walk(tree)  # getattr(config, "hosts", ())
                  if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "getattr" and len(n.args) > 1
                  and isinstance(n.args[1], ast.Constant)}
        # a rank switch is read with the others (KernelConfig.rank_switches(), sent in Join)
        wanted = "rank_switches" if option.rank_switch else option.attribute
        assert wanted in reads, f"{option.consumer} never reads .{wanted} ({option.flag})"


# ------------------------------------------------------------------ what this machine can hold
LAPTOP = capacity.Machine(cores=2, available_mb=32 * 1024)


class TestCapacity:
    def test_ranks_that_fit_start_without_a_word(self):
        c = config.resolve(ns(ranks=8), environ={}, available_gpus=[], machine=LAPTOP)
        assert c.world_size == 8 and not c.warnings
        assert capacity.most_ranks(LAPTOP) == 8

    def test_far_more_ranks_than_cores_is_refused_naming_the_numbers_and_the_fix(self):
        with pytest.raises(ConfigError) as e:
            config.resolve(ns(ranks=64), environ={}, available_gpus=[], machine=LAPTOP)
        text = str(e.value)
        assert "--ranks 64 is more than this machine can hold" in text
        assert "64 ranks on 2 CPU cores is more than 4 per core (at most 8)" in text
        assert "memory" not in text.split("Fix")[0]  # 64 x 300 MB fit in 32 GB: only the cores are named
        assert "use --ranks 8 or fewer, or add --oversubscribe on" in text and "restart the kernel" in text
        assert "No rank was started" in text

    def test_more_ranks_than_memory_is_refused_with_the_memory_figures(self):
        small = capacity.Machine(cores=64, available_mb=4 * 1024)
        with pytest.raises(ConfigError, match=r"20 ranks need about 6\.3 GB of memory \(300 MB each.*but 4\.0 GB is "
                                              r"available\. No rank was started\. Fix: use --ranks 12 or fewer"):
            config.resolve(ns(ranks=20), environ={}, available_gpus=[], machine=small)

    def test_a_thousand_ranks_names_both_limits(self):
        with pytest.raises(ConfigError, match="GB of memory .* and 1000 ranks on 2 CPU cores"):
            config.resolve(ns(ranks=1000), environ={}, available_gpus=[], machine=LAPTOP)

    def test_oversubscribe_on_starts_them_anyway_with_a_warning(self):
        c = config.resolve(ns(ranks=64, oversubscribe="on"), environ={}, available_gpus=[], machine=LAPTOP)
        assert c.world_size == 64
        assert c.warnings == ("--oversubscribe on: 64 ranks on 2 CPU cores is more than 4 per core (at most 8); "
                              "the ranks may be slow, or end in the out-of-memory killer.",)
        c = config.resolve(ns(ranks=64), environ={"DIST_KERNEL_OVERSUBSCRIBE": "on"}, available_gpus=[], machine=LAPTOP)
        assert c.world_size == 64

    def test_ranks_on_other_machines_are_not_measured_here(self):
        c = config.resolve(ns(launcher="slurm", nodes=16, ranks_per_node=8), environ={}, available_gpus=[],
                           machine=LAPTOP)
        assert c.world_size == 128 and not c.warnings

    def test_this_machine_is_measured_within_its_limits(self):
        m = capacity.this_machine()
        assert 1 <= m.cores <= (os.cpu_count() or 1) and 0 < m.available_mb


# ------------------------------------------------------------------ configuration warnings
def test_options_with_no_effect_on_local_ranks_are_a_warning():
    c = config.resolve(ns(listen="10.0.0.5", port_range="29500-29509"), environ={}, available_gpus=[])
    assert c.warnings == (
        "--listen is for --launcher slurm or ssh; the local ranks talk over IPC on this machine, so it has no effect.",
        "--port-range is for --launcher slurm or ssh; the local ranks talk over IPC on this machine, so it has no "
        "effect.")
    assert not remote(launcher="slurm", listen="10.0.0.5", port_range="29500-29509").warnings


# the options at work in a real kernel: tests/kernel/test_options_at_work.py (and, across
# machines, tests/cluster/test_cluster_options.py)
