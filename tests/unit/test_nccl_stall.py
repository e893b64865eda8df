"""NCCL stalls (fault rule 8), from real flight-recorder dumps.

NCCL starts collectives asynchronously, so a rank whose peer never enters one blocks later, in
a CUDA synchronisation, with no torch.distributed call on its stack. torch's flight recorder
names what it waits for. The dumps under data/ are real ones, recorded on CPU with gloo (same
recorder, same JSON format) by data/record_flight_recorder.py: rank 0 started an all_reduce
(async, as NCCL does) that rank 1 never entered; and a healthy run where every collective
completed.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path

import pytest

from dist_kernel import protocol
from dist_kernel.parent.fault_policy import Cell, Judge
from dist_kernel.protocol import Pending, Place
from dist_kernel.rank import nccl

DATA = Path(__file__).parent / "data"
WORLD = (0, 1)


def dump(name: str) -> dict:
    return json.loads((DATA / f"fr_{name}.json").read_text())


def world_ranks(name: str) -> list[int]:
    """What the rank asks torch for a group's ranks (gloo's recorder does not write them)."""
    return {"0": [0, 1], "1": [0, 1]}[name]


STALL = nccl.parse_pending(dump("stall_rank0"), ranks_of=world_ranks)
#: how many collectives the idle rank's default group started (what its ``group_seq`` says)
IDLE_COUNT = nccl.enqueued(dump("stall_rank1"))["0"]


def waiting_on_gpu(pending: list[Pending], wait: str = "loss.item()") -> Place:
    """Rank 0's ``where`` reply, as the rank builds it: in a CUDA synchronisation, with its
    pending collectives (``native`` names the wait, so that the parent asks the idle ranks'
    counts, as it does for DDP's collectives started in C++)."""
    first = pending[0] if pending else None
    return Place(collective=None, group_ranks=first.group_ranks if first else [], peer=None,
                 seq=first.seq if first else None, stack=[], line=f"line 4: {wait}", busy=True,
                 group_seq=nccl.enqueued(dump("stall_rank0"))["0"], native=wait if pending else "",
                 cuda_wait=wait, pending=pending)


def only_rank0(**kw) -> Cell:
    """A ``%%rank 0`` cell: rank 1 is idle from the start; the look comes after the grace."""
    base = dict(ranks=(0,), world=WORLD, busy=(0,), started=0.0, hang_grace=10.0, idle_seqs={1: IDLE_COUNT})
    return Cell(**{**base, **kw})


# ------------------------------------------------------------------ reading the recorder
def test_a_collective_the_peer_never_entered_is_pending_with_its_group_number_and_output():
    assert STALL == [Pending(op="all_reduce", group="0", default=True, group_ranks=[0, 1], seq=2, p2p=False,
                             state="scheduled", output_sizes=[[4, 3]], output_dtypes=["Float"])]


def test_the_idle_peer_started_fewer_collectives_than_the_pending_ones_number():
    assert nccl.parse_pending(dump("stall_rank1"), ranks_of=world_ranks) == []
    assert IDLE_COUNT == 1 < STALL[0].seq


def test_collectives_that_completed_are_not_pending():
    assert nccl.parse_pending(dump("healthy_rank0"), ranks_of=world_ranks) == []


def test_entries_from_before_the_group_formed_again_are_not_pending():
    """An aborted group's collectives never complete: after a re-formation they are forgotten."""
    created = next(e["time_created_ns"] for e in dump("stall_rank0")["entries"] if not e["retired"])
    assert nccl.parse_pending(dump("stall_rank0"), ranks_of=world_ranks, since_ns=created + 1) == []


def test_a_groups_ranks_come_from_the_dump_when_it_names_them():
    """NCCL's recorder writes each group's ranks in ``pg_config`` (gloo's leaves it empty)."""
    named = copy.deepcopy(dump("stall_rank0"))
    named["pg_config"] = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}}
    assert [p.group_ranks for p in nccl.parse_pending(named)] == [[0, 1]]


def test_pending_collectives_cross_the_wire_in_the_where_reply():
    place = waiting_on_gpu(STALL)
    wire = json.loads(json.dumps(protocol.reply_content("where", place)))
    assert protocol.parse_reply(wire, "where") == place


# ------------------------------------------------------------------ the rule
def test_a_rank_waiting_on_the_gpu_behind_a_collective_an_idle_rank_never_entered_is_a_stall():
    verdict = Judge().judge(only_rank0(), {0: waiting_on_gpu(STALL)}, now=10.0)
    assert verdict.action == "teardown"
    assert verdict.teardown_on == WORLD  # NCCL frees a rank only by aborting its own communicators
    reason = verdict.stuck[0]
    assert "loss.item(), a CUDA synchronisation behind NCCL all_reduce #2 of the default group" in reason
    assert "which rank 1 never entered" in reason
    assert "may hold a partial result (all_reduce #2 of the default group: float32[4, 3])" in reason
    assert "run collectives on every rank" in reason


def test_an_idle_rank_that_entered_the_collective_is_waited_for():
    """Its GPU may still be on its way there: the collective completes once it arrives."""
    entered = only_rank0(idle_seqs={1: STALL[0].seq})
    assert Judge().judge(entered, {0: waiting_on_gpu(STALL)}, now=10.0).action == "wait"


def test_an_idle_rank_whose_count_is_unknown_is_never_blamed():
    assert Judge().judge(only_rank0(idle_seqs={}), {0: waiting_on_gpu(STALL)}, now=10.0).action == "wait"


def test_a_rank_still_computing_is_not_cut_even_with_a_pending_collective():
    computing = waiting_on_gpu(STALL, wait="")
    assert Judge().judge(only_rank0(), {0: computing}, now=10.0).action == "wait"


def test_a_rank_waiting_on_the_gpu_with_nothing_pending_is_computing_there():
    assert Judge().judge(only_rank0(), {0: waiting_on_gpu([])}, now=10.0).action == "wait"


@pytest.mark.parametrize("other", [dict(default=False, group="1"), dict(p2p=True)],
                         ids=["another group", "point-to-point"])
def test_collectives_whose_count_idle_ranks_do_not_report_are_not_judged(other):
    pending = [Pending(**{**STALL[0].__dict__, **other})]
    assert Judge().judge(only_rank0(), {0: waiting_on_gpu(pending)}, now=10.0).action == "wait"


def test_the_stop_button_frees_a_rank_waiting_on_the_gpu_within_a_second_and_names_its_collective():
    stopped = only_rank0(interrupted_at=20.0)
    verdict = Judge().judge(stopped, {0: waiting_on_gpu(STALL)}, now=21.0)
    assert (verdict.action, verdict.ename, verdict.teardown_on) == ("teardown", "KeyboardInterrupt", WORLD)
    assert "interrupted while blocked in loss.item(), a CUDA synchronisation behind NCCL all_reduce #2" \
        in verdict.stuck[0]


# ------------------------------------------------------------------ the rank side
class FakeTensor:
    """Stands for a CUDA tensor whose ``item()`` waits for the GPU: meanwhile it reads what the
    control thread reads of the main thread (the caller's frame, on the line that called it)."""

    def item(self) -> str:
        return nccl.cuda_wait(sys._getframe(1))


def test_the_wait_is_named_from_the_line_the_main_thread_is_on():
    loss = FakeTensor()
    assert loss.item() == "loss.item()"
    assert [FakeTensor()][0].item() == "[FakeTensor()][0].item()"


def test_a_line_that_copies_nothing_to_the_host_is_no_wait():
    frame = sys._getframe()
    assert nccl.cuda_wait(frame) == ""


def test_the_recorder_is_switched_on_for_nccl_only_and_a_users_own_size_wins(monkeypatch):
    for var in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.delenv(var, raising=False)
    nccl.enable("gloo")
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ
    nccl.enable("nccl")
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == str(nccl.BUFFER)
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE")
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    nccl.enable("nccl")
    assert "TORCH_FR_BUFFER_SIZE" not in os.environ
