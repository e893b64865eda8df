"""A launcher owns its kind (issue 37): a node starter records what it started, with its kind, and
ends a recorded start itself; ``python -m dist_kernel clean`` and the reaper find it by kind in the
table of kinds (dist_kernel/launchers.py) and name no batch system. No process is started here:
the fake kind's "end" records what it was asked, and Slurm's commands are caught before they run.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
from pathlib import Path

import pytest

from dist_kernel import cleanup, cli, launchers
from dist_kernel.cleanup import LAUNCH_FILE, LaunchRecord, Proc
from dist_kernel.launchers import LauncherKind
from dist_kernel.options import KernelConfig
from dist_kernel.parent import reaper
from dist_kernel.parent.launch.node_starters import end_launch, node_starter_class
from dist_kernel.parent.launch.node_starters import slurm as slurm_starter
from dist_kernel.parent.launch.node_starters.base import NodeStarter

DEAD_KERNEL = 5_000_000  # above Linux's largest pid_max: no kernel has this pid


class PodStarter(NodeStarter):
    """A third kind, as a Kubernetes starter would be: it starts pods (here: nothing), records
    them, and deletes them when asked to end a recorded start."""

    kind = "pods"
    asked: list[LaunchRecord] = []

    def started(self) -> dict:
        return {"namespace": "lab", "pods": ["dk-abc-0", "dk-abc-1"]}

    @classmethod
    def end_recorded(cls, record: LaunchRecord, term_wait: float = 2.0) -> tuple[list[Proc], list[str]]:
        ended, words = super().end_recorded(record, term_wait)
        cls.asked.append(record)
        return ended, [*words, f"deleted pods {', '.join(record.started['pods'])} in {record.started['namespace']}"]


@pytest.fixture
def pods_kind(monkeypatch: pytest.MonkeyPatch) -> type[PodStarter]:
    """The fake kind, added to the table of kinds and nowhere else."""
    row = LauncherKind("pods", "pods a cluster schedules", f"{__name__}:PodStarter")
    monkeypatch.setattr(launchers, "KINDS", (*launchers.KINDS, row))
    monkeypatch.setattr(cleanup, "processes", dict)  # no process of this machine is looked at, or ended
    PodStarter.asked = []
    return PodStarter


def dead_kernels_dir(base: Path, tag: str) -> str:
    d = base / f"dist_kernel-{DEAD_KERNEL}-{tag}"
    d.mkdir()
    return str(d)


def recorded_by(cls: type[NodeStarter], runtime_dir: str) -> LaunchRecord:
    """What a starter of ``cls``'s kind writes once it started (no process here, so only its own record)."""
    starter = cls(KernelConfig(world_size=2, backend="gloo", launcher=cls.kind, nodes=2), lambda node: [],
                  runtime_dir, logging.getLogger("test"), print)
    starter.record()
    record = cleanup.read_launch(runtime_dir)
    assert record == LaunchRecord(cls.kind, (), starter.started())
    return record


def test_clean_ends_a_new_kinds_recorded_start_through_its_starter(pods_kind, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cleanup, "runtime_bases", lambda: [str(tmp_path)])
    rd = dead_kernels_dir(tmp_path, "pods")
    record = recorded_by(node_starter_class("pods"), rd)
    assert cli.main(["clean"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert pods_kind.asked == [record]
    assert out == ["removed " + rd, "deleted pods dk-abc-0, dk-abc-1 in lab"]
    assert not os.path.exists(rd)


def test_the_reaper_ends_a_new_kinds_recorded_start_once_the_parent_is_gone(pods_kind, tmp_path, monkeypatch):
    rd = dead_kernels_dir(tmp_path, "reaped")
    record = recorded_by(pods_kind, rd)
    parents = iter([4242])  # the parent lives for the reaper's first look (it sees the record), then dies
    monkeypatch.setattr(os, "getppid", lambda: next(parents, 1))
    reaper.main(4242, rd, interval=0.01)
    assert pods_kind.asked == [record]
    assert not os.path.exists(rd)


def test_the_reaper_ends_the_start_it_remembered_when_the_directory_went_first(pods_kind, tmp_path):
    """A sweep by another kernel may remove the directory the moment the parent dies."""
    record = LaunchRecord("pods", (), {"namespace": "lab", "pods": ["dk-xyz-0"]})
    reaper.reap(str(tmp_path / "gone"), [], record)
    assert pods_kind.asked == [record]


def test_a_kind_this_version_does_not_know_still_has_its_processes_ended(monkeypatch):
    monkeypatch.setattr(cleanup, "processes", dict)
    ended, words = end_launch(LaunchRecord("pbs", ((DEAD_KERNEL, 1),), {"job": "12.pbs"}))
    assert ended == [] and len(words) == 1 and "'pbs'" in words[0] and "processes" in words[0]


class SlurmCommands:
    """Slurm's commands as the Slurm starter runs them, caught before they start."""

    def __init__(self, squeue_says: str = "") -> None:
        self.squeue_says = squeue_says
        self.ran: list[tuple[list[str], str | None]] = []

    def __call__(self, argv: list[str], slurm_conf: str | None, timeout: float = 5.0):
        self.ran.append((argv, slurm_conf))
        return subprocess.CompletedProcess(argv, 0, self.squeue_says if argv[0] == "squeue" else "", "")


def test_a_launch_record_of_the_version_before_kinds_is_still_cleaned(tmp_path, monkeypatch, capsys):
    """A kernel killed before an upgrade: its launch.json has no kind, its job under "slurm"."""
    monkeypatch.setattr(cleanup, "runtime_bases", lambda: [str(tmp_path)])
    monkeypatch.setattr(cleanup, "processes", dict)
    commands = SlurmCommands()
    monkeypatch.setattr(slurm_starter, "_slurm_run", commands)
    rd = dead_kernels_dir(tmp_path, "old")
    job = {"job": "77", "name": os.path.basename(rd), "user": "me", "own_job": True, "slurm_conf": "/lab/slurm.conf"}
    Path(rd, LAUNCH_FILE).write_text(json.dumps({"pids": [[DEAD_KERNEL, 123]], "slurm": job}))
    assert cleanup.read_launch(rd) == LaunchRecord("slurm", ((DEAD_KERNEL, 123),), job)
    assert cli.main(["clean"]) == 0
    assert commands.ran == [(["scancel", "--user=me", f"--name={job['name']}", "77"], "/lab/slurm.conf")]
    assert f"cancelled Slurm job: scancel --user=me --name={job['name']} 77" in capsys.readouterr().out
    # and one of ssh (no job: its processes alone)
    Path(rd).mkdir()
    Path(rd, LAUNCH_FILE).write_text(json.dumps({"pids": [[DEAD_KERNEL, 123]], "slurm": None}))
    assert cleanup.read_launch(rd) == LaunchRecord("", ((DEAD_KERNEL, 123),), {})


def test_inside_the_users_allocation_only_the_kernels_step_is_cancelled(monkeypatch):
    commands = SlurmCommands(squeue_says="77.0 dist_kernel-9-abc\n77.1 users-own-step\n")
    monkeypatch.setattr(slurm_starter, "_slurm_run", commands)
    monkeypatch.setattr(cleanup, "processes", dict)
    job = {"job": "77", "name": "dist_kernel-9-abc", "user": "me", "own_job": False, "slurm_conf": None}
    ended, words = end_launch(LaunchRecord("slurm", (), job))
    assert [argv for argv, _ in commands.ran] == [["squeue", "-h", "-s", "-j", "77", "-o", "%i %j"], ["scancel", "77.0"]]
    assert words == ["cancelled Slurm job: scancel 77.0"]


def test_a_record_is_its_kind_its_processes_and_what_else_was_started(tmp_path):
    record = LaunchRecord("pods", ((10, 5), (11, None)), {"pods": ["a"]})
    record.write(str(tmp_path))
    assert json.loads((tmp_path / LAUNCH_FILE).read_text()) == {
        "version": 2, "kind": "pods", "pids": [[10, 5], [11, None]], "started": {"pods": ["a"]}}
    assert cleanup.read_launch(str(tmp_path)) == record
    assert LaunchRecord.from_json({"version": 2, "kind": 3, "pids": [], "started": {}}) is None
    assert LaunchRecord.from_json(["not", "a", "record"]) is None
