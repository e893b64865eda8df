"""Many local ranks get the open files they need, or a clear refusal naming the limit (issue 26)."""

from __future__ import annotations

import resource

import pytest

from dist_kernel.exceptions import ConfigError
from dist_kernel.parent.limits import fds_needed, most_local_ranks, plan

ZMQ_DEFAULT = 1023


def test_a_soft_limit_that_suffices_is_kept() -> None:
    assert plan(2, soft=1024, hard=4096, zmq_sockets=ZMQ_DEFAULT) == 1024


def test_a_soft_limit_too_low_for_512_ranks_is_raised_within_the_hard_limit() -> None:
    want = plan(512, soft=1024, hard=1 << 20, zmq_sockets=ZMQ_DEFAULT)
    assert want == fds_needed(512) > 1024


def test_an_unlimited_hard_limit_allows_any_soft_limit_needed() -> None:
    assert plan(512, soft=1024, hard=resource.RLIM_INFINITY, zmq_sockets=ZMQ_DEFAULT) == fds_needed(512)


def test_an_unlimited_soft_limit_is_never_lowered() -> None:
    assert plan(8, soft=resource.RLIM_INFINITY, hard=resource.RLIM_INFINITY,
                zmq_sockets=ZMQ_DEFAULT) == resource.RLIM_INFINITY


def test_a_hard_limit_too_low_is_refused_naming_it_the_fix_and_the_most_ranks() -> None:
    with pytest.raises(ConfigError) as err:
        plan(512, soft=1024, hard=4096, zmq_sockets=ZMQ_DEFAULT)
    text = str(err.value)
    most = most_local_ranks(4096, ZMQ_DEFAULT)
    assert "--ranks 512" in text and "hard limit is 4096" in text and "ulimit -Hn" in text
    assert f"at most {most} ranks" in text and 0 < most < 512


def test_zmqs_socket_limit_of_jupyter_clients_context_is_named_when_it_is_the_one_that_binds() -> None:
    with pytest.raises(ConfigError) as err:
        plan(2000, soft=1024, hard=resource.RLIM_INFINITY, zmq_sockets=ZMQ_DEFAULT)
    assert "ZMQ sockets" in str(err.value) and "limit is 1023" in str(err.value)
