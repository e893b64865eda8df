"""The ranks' rendezvous store (issue 22): a wait in it ends at a release from another thread
or at an interrupt, where torch's own store would wait out the collective timeout. Real
torch FileStore, no processes."""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta

import pytest

dist = pytest.importorskip("torch.distributed")

from dist_kernel.rank import store  # noqa: E402


@pytest.fixture
def endable(tmp_path):
    inner = dist.FileStore(str(tmp_path / "store"), 1)
    inner.set_timeout(timedelta(seconds=60))
    s = store.endable(inner)
    yield s
    store.formed()


def waits_until_ended(endable, end) -> BaseException:
    """Start a wait for a key nobody sets, end it with ``end()`` once it waits; what it raised."""
    threading.Thread(target=lambda: (_until(store.waiting), end()), daemon=True).start()
    with pytest.raises(BaseException) as raised:
        endable.get("never-set")
    return raised.value


def _until(cond) -> None:
    while not cond():
        time.sleep(0.01)


def test_what_is_set_is_read_back_through_it(endable):
    endable.set("key", b"value")
    assert endable.get("key") == b"value" and endable.add("n", 2) == 2 and endable.check(["key"])
    assert not store.abandoned()


def test_a_wait_ends_when_released_and_says_the_group_must_form_again(endable):
    err = waits_until_ended(endable, store.release)
    assert isinstance(err, store.WaitReleased) and "never entered" in str(err)
    assert store.abandoned() and not store.waiting()
    store.formed()
    assert not store.abandoned()


def test_a_wait_ends_at_an_interrupt(endable):
    err = waits_until_ended(endable, lambda: os.kill(os.getpid(), signal.SIGINT))
    assert isinstance(err, KeyboardInterrupt) and store.abandoned()


def test_a_wait_still_times_out_and_that_alone_breaks_nothing(endable):
    with pytest.raises(dist.DistStoreError):
        endable.wait(["never-set"], timedelta(seconds=0.2))
    assert not store.abandoned()


def test_a_release_with_no_wait_under_way_ends_no_later_wait(endable):
    store.release()
    threading.Timer(0.2, lambda: endable.set("late", b"1")).start()
    assert endable.get("late") == b"1"


def test_rank_0s_tcp_store_across_machines_is_wrapped_alike_and_clones():
    server = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    wrapped = store.endable(dist.PrefixStore("gen1", server))
    wrapped.clone().set("key", b"1")
    assert wrapped.get("key") == b"1"
