"""replica.timing: deadlines and backoffs."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest

from replica.timing import Backoff, Deadline, pause

MS = timedelta(milliseconds=1)


def test_deadline_remaining_counts_down_and_never_goes_negative():
    deadline = Deadline.after(timedelta(seconds=60))
    assert timedelta(seconds=55) < deadline.remaining() <= timedelta(seconds=60)
    assert 55.0 < deadline.remaining_s() <= 60.0
    assert not deadline.expired

    past = Deadline.after(timedelta(seconds=-5))
    assert past.expired
    assert past.remaining() == timedelta(0)
    assert past.remaining_s() == 0.0

    now = Deadline.after(timedelta(0))
    assert now.expired
    assert now.remaining() == timedelta(0)


def test_deadline_expires_after_its_timeout():
    deadline = Deadline.after(20 * MS)
    time.sleep(0.03)
    assert deadline.expired
    assert deadline.remaining() == timedelta(0)


def test_deadline_never_and_ordering():
    never = Deadline.never()
    assert not never.expired
    assert never.remaining() == timedelta.max
    assert never.remaining_s() == threading.TIMEOUT_MAX
    soon, late = Deadline.after(timedelta(seconds=1)), Deadline.after(timedelta(seconds=100))
    assert min(late, never, soon) is soon
    assert soon < late < never
    assert soon.cap(timedelta(seconds=30)) <= timedelta(seconds=1)
    assert late.cap(MS) == MS


def test_deadline_now_plus_a_timedelta():
    stamp = Deadline.now()
    assert stamp.expired
    later = stamp + timedelta(seconds=60)
    assert isinstance(later, Deadline) and not later.expired
    assert later.at == stamp.at + 60
    assert timedelta(seconds=55) < later.remaining() <= timedelta(seconds=60)
    assert (stamp + timedelta(seconds=-1)).expired


def test_deadline_takes_only_timedeltas():
    with pytest.raises(TypeError):
        Deadline.after(1.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Deadline.now() + 1.0  # type: ignore[operator]


def test_deadline_wait_returns_when_set_or_expired():
    event = threading.Event()
    assert not Deadline.after(10 * MS).wait(event)
    event.set()
    start = time.monotonic()
    assert Deadline.after(timedelta(seconds=30)).wait(event)
    assert time.monotonic() - start < 5.0


def test_backoff_doubles_up_to_its_cap():
    backoff = Backoff(first=50 * MS, most=timedelta(seconds=2))
    pauses = [backoff.next() for _ in range(8)]
    assert pauses == [50 * MS, 100 * MS, 200 * MS, 400 * MS, 800 * MS, 1600 * MS, 2000 * MS, 2000 * MS]
    assert backoff.failures == 0  # next() is a poll's pause, not a failure


def test_backoff_factor_and_sub_millisecond_pauses():
    backoff = Backoff(first=timedelta(microseconds=50), most=timedelta(microseconds=500))
    assert [backoff.next() for _ in range(6)] == [timedelta(microseconds=us) for us in (50, 100, 200, 400, 500, 500)]
    triple = Backoff(first=MS, most=10 * MS, factor=3)
    assert [triple.next() for _ in range(4)] == [MS, 3 * MS, 9 * MS, 10 * MS]


def test_backoff_jitter_stays_within_its_fraction():
    backoff = Backoff(first=100 * MS, most=100 * MS, jitter=0.5)
    for _ in range(50):
        assert 100 * MS <= backoff.next() <= 150 * MS


def test_backoff_due_after_failed_pause():
    backoff = Backoff(first=30 * MS, most=timedelta(seconds=1))
    assert backoff.due()  # before any failure
    assert backoff.failed() == 30 * MS
    assert backoff.failures == 1
    assert not backoff.due()
    time.sleep(0.05)
    assert backoff.due()
    assert backoff.failed() == 60 * MS
    assert backoff.failures == 2
    assert not backoff.due()


def test_backoff_reset_starts_over():
    backoff = Backoff(first=10 * MS, most=timedelta(seconds=10))
    for _ in range(4):
        backoff.failed()
    assert not backoff.due()
    backoff.reset()
    assert backoff.due()
    assert backoff.failures == 0
    assert backoff.next() == 10 * MS


def test_backoff_rejects_bad_settings():
    with pytest.raises(TypeError):
        Backoff(first=0.05, most=timedelta(seconds=1))  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        Backoff(first=timedelta(0), most=timedelta(seconds=1))
    with pytest.raises(ValueError):
        Backoff(first=timedelta(seconds=2), most=timedelta(seconds=1))
    with pytest.raises(ValueError):
        Backoff(first=MS, most=MS, factor=0.5)
    with pytest.raises(ValueError):
        Backoff(first=MS, most=MS, jitter=2.0)


def test_backoff_sleep_returns_at_once_when_stopped():
    stop = threading.Event()
    stop.set()
    backoff = Backoff(first=timedelta(seconds=30), most=timedelta(seconds=30))
    start = time.monotonic()
    assert backoff.sleep(stop)
    assert time.monotonic() - start < 5.0


def test_backoff_sleep_wakes_when_stop_is_set_meanwhile():
    stop = threading.Event()
    threading.Timer(0.05, stop.set).start()
    backoff = Backoff(first=timedelta(seconds=30), most=timedelta(seconds=30))
    start = time.monotonic()
    assert backoff.sleep(stop)
    assert time.monotonic() - start < 5.0


def test_backoff_sleep_never_passes_the_deadline():
    backoff = Backoff(first=timedelta(seconds=30), most=timedelta(seconds=30))
    deadline = Deadline.after(50 * MS)
    start = time.monotonic()
    assert not backoff.sleep(deadline=deadline)
    assert time.monotonic() - start < 5 * 0.05 + 0.5
    assert not backoff.sleep(threading.Event(), deadline=deadline)  # expired: no pause at all


def test_backoff_sleep_waits_its_pause():
    backoff = Backoff(first=20 * MS, most=20 * MS)
    start = time.monotonic()
    assert not backoff.sleep()
    assert time.monotonic() - start >= 0.019


def test_pause_waits_stops_and_keeps_to_the_deadline():
    start = time.monotonic()
    assert not pause(20 * MS)
    assert time.monotonic() - start >= 0.019
    stop = threading.Event()
    stop.set()
    start = time.monotonic()
    assert pause(timedelta(seconds=30), stop)
    assert pause(timedelta.max, stop)  # longer than threading accepts: still a valid wait
    assert time.monotonic() - start < 5.0
    start = time.monotonic()
    assert not pause(timedelta(seconds=30), threading.Event(), Deadline.after(30 * MS))
    assert not pause(timedelta(seconds=30), deadline=Deadline.after(timedelta(seconds=-1)))
    assert time.monotonic() - start < 5 * 0.03 + 0.5
