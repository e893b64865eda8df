"""The in-rank agent's pure logic, on CPU (the CUDA part is proven on a GPU by issue 7)."""

from __future__ import annotations

import sys
import types

import pytest

from dist_kernel.rank import agent as rank_agent


class FakeCuda:
    """Stands in for torch.cuda on a machine without a GPU; records what was asked of it."""

    def __init__(self, initialized: bool) -> None:
        self.initialized = initialized
        self.emptied = 0

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return self.initialized

    def empty_cache(self) -> None:
        self.emptied += 1


@pytest.fixture
def cuda(monkeypatch):
    def make(initialized: bool) -> FakeCuda:
        fake = FakeCuda(initialized)
        monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=fake))
        return fake
    yield make
    rank_agent.set_empty_cache(True)


def test_after_each_cell_the_cuda_cache_is_emptied(cuda):
    fake = cuda(initialized=True)
    rank_agent.set_empty_cache(True)
    rank_agent.after_cell()
    assert fake.emptied == 1


def test_the_switch_turns_cache_freeing_off(cuda):
    fake = cuda(initialized=True)
    rank_agent.set_empty_cache(False)
    rank_agent.after_cell()
    assert fake.emptied == 0


def test_a_rank_that_never_used_cuda_does_not_touch_it(cuda):
    fake = cuda(initialized=False)
    rank_agent.after_cell()
    assert fake.emptied == 0


def test_where_reports_the_main_thread_outside_any_collective():
    info = rank_agent.where()
    assert info.collective is None and info.group_ranks == [] and not info.busy


def test_a_rank_that_cannot_reach_rank_0s_rendezvous_names_the_address_instead_of_hanging(monkeypatch):
    import socket

    from dist_kernel.rank import rendezvous

    with socket.socket() as s:  # a port nothing listens on (bound, never listening)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        monkeypatch.setattr(rendezvous, "REACH_TIMEOUT", 1.0)
        with pytest.raises(RuntimeError, match=rf"rank 3 on .* cannot reach rank 0's rendezvous at 127\.0\.0\.1:{port}"):
            rendezvous._check_reachable(3, "127.0.0.1", port)


def test_a_rank_reaches_rank_0s_rendezvous_once_it_listens():
    import socket

    from dist_kernel.rank import rendezvous

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        rendezvous._check_reachable(1, "127.0.0.1", s.getsockname()[1])  # returns: no error
