"""The parent dates each rank's message by when the rank sent it, in the parent's own clock
(issue 19: at 8 ranks on 2 cores a rank's first output reached the merger 6.7 s after the
cell's first, though the rank sent it 2 s late; the rest waited in the pipes)."""

from __future__ import annotations

from datetime import datetime, timezone

from dist_kernel.parent.channels import SendClock

T0 = 1_795_696_277.0  # a wall-clock time (the rank's)


def date(wall: float, z: bool = True) -> str:
    iso = datetime.fromtimestamp(wall, timezone.utc).isoformat()
    return iso.replace("+00:00", "Z") if z else iso


def clock_at(now: list[float]) -> SendClock:
    return SendClock(clock=lambda: now[0])


def test_a_message_read_at_once_is_dated_when_it_arrived():
    now = [50.0]
    assert clock_at(now).sent(date(T0)) == 50.0


def test_a_message_that_waited_in_the_pipes_is_dated_when_the_rank_sent_it():
    now = [50.0]
    sc = clock_at(now)
    sc.sent(date(T0))  # read at once: teaches the offset
    now[0] = 60.0
    assert abs(sc.sent(date(T0 + 2.0)) - 52.0) < 1e-3  # sent 2 s later, read 10 s later


def test_the_quickest_message_sets_the_offset_and_no_date_is_after_its_arrival():
    now = [50.0]
    sc = clock_at(now)
    assert sc.sent(date(T0 - 3.0)) == 50.0  # the first message had waited 3 s: not known yet
    now[0] = 51.0
    assert sc.sent(date(T0 + 1.0)) == 51.0  # a quicker one corrects the offset
    now[0] = 55.0
    assert abs(sc.sent(date(T0 + 2.0)) - 52.0) < 1e-3


def test_a_rank_whose_clock_is_a_minute_off_is_dated_in_the_parents_clock():
    now = [50.0]
    sc = clock_at(now)
    sc.sent(date(T0 - 60.0))  # another machine, its clock a minute behind
    now[0] = 53.0
    assert abs(sc.sent(date(T0 - 59.0)) - 51.0) < 1e-3


def test_dates_with_an_offset_instead_of_z_are_read_too():
    now = [50.0]
    sc = clock_at(now)
    sc.sent(date(T0, z=False))
    now[0] = 52.0
    assert abs(sc.sent(date(T0 + 1.0, z=False)) - 51.0) < 1e-3


def test_an_undated_or_misdated_message_is_dated_when_it_arrived():
    now = [50.0]
    sc = clock_at(now)
    assert sc.sent(None) == 50.0
    assert sc.sent("yesterday") == 50.0
