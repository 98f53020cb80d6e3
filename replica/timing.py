"""One home for time: every wait and every retry in replica goes through a
``Deadline`` or a ``Backoff``, and every duration is a ``datetime.timedelta``.

``Deadline.after(timeout)`` fixes a moment on the monotonic clock; ``remaining()``
says how long is left (never negative), ``expired`` whether it has passed, and
``remaining_s()`` gives float seconds for the few APIs that take them (socket
timeouts, ``threading.Event.wait``). ``pause(duration, stop, deadline)`` is the one
sleep: never past a deadline, over at once when a stop event is set. ``Backoff``
paces retries and polls: a pause of ``first``, multiplied by ``factor`` each time
up to ``most``; ``failed()`` schedules the next try (``due()``), ``sleep()`` pauses
for the next pause the way ``pause`` does.

Nothing else writes ``time.monotonic() + x``: this module is the bottom layer
(standard library only), importable from every package, ``replica.transport``
included.
"""

from __future__ import annotations

import math
import random
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

__all__ = ["Backoff", "Deadline", "pause"]

_ZERO = timedelta(0)
# threading's waits refuse a timeout above this (OverflowError); a wait "forever" waits this long at a time.
_LONGEST_WAIT_S = threading.TIMEOUT_MAX


@dataclass(frozen=True, slots=True, order=True)
class Deadline:
    """A moment on the monotonic clock (``at``, ``time.monotonic()`` seconds;
    ``math.inf`` for none). Deadlines compare by that moment, so
    ``min(a, b)`` is the sooner of two."""

    at: float

    @classmethod
    def after(cls, timeout: timedelta) -> Deadline:
        """``timeout`` from now (a negative or zero timeout has expired already)."""
        if not isinstance(timeout, timedelta):
            raise TypeError(f"a timeout must be a datetime.timedelta, got {timeout!r}")
        return cls(time.monotonic() + timeout.total_seconds())

    @classmethod
    def never(cls) -> Deadline:
        """A deadline that never expires."""
        return cls(math.inf)

    @classmethod
    def now(cls) -> Deadline:
        """This moment (expired at once): a time stamp that ``+ timedelta`` turns into a deadline."""
        return cls(time.monotonic())

    def __add__(self, delta: timedelta) -> Deadline:
        """The moment ``delta`` after this one."""
        if not isinstance(delta, timedelta):
            return NotImplemented
        return Deadline(self.at + delta.total_seconds())

    @property
    def expired(self) -> bool:
        """Whether the moment has come."""
        return time.monotonic() >= self.at

    def remaining(self) -> timedelta:
        """How long is left, never negative (``timedelta.max`` for ``never()``)."""
        if self.at == math.inf:
            return timedelta.max
        return max(_ZERO, timedelta(seconds=self.at - time.monotonic()))

    def remaining_s(self) -> float:
        """How long is left in float seconds, never negative: for socket timeouts and
        ``Event.wait``. A deadline that never expires gives the longest wait
        ``threading`` accepts."""
        return min(max(0.0, self.at - time.monotonic()), _LONGEST_WAIT_S)

    def cap(self, duration: timedelta) -> timedelta:
        """``duration``, shortened to what is left of this deadline."""
        return min(duration, self.remaining())

    def wait(self, event: threading.Event) -> bool:
        """Wait for ``event`` until this deadline; whether it was set."""
        while True:
            if event.wait(self.remaining_s()):
                return True
            if self.expired:
                return False


def pause(duration: timedelta, stop: threading.Event | None = None, deadline: Deadline | None = None) -> bool:
    """Wait ``duration``, but never past ``deadline``, and return as soon as ``stop``
    is set; whether ``stop`` is set."""
    if deadline is not None:
        duration = deadline.cap(duration)
    seconds = min(duration.total_seconds(), _LONGEST_WAIT_S)
    if stop is not None:
        return stop.wait(max(0.0, seconds))
    if seconds > 0:
        time.sleep(seconds)
    return False


@dataclass(kw_only=True, slots=True)
class Backoff:
    """When to try again after a failure, and how long to pause between polls: a
    pause of ``first``, multiplied by ``factor`` each time up to ``most``, with up to
    ``jitter`` (a fraction, 0 by default) of each pause added at random so that many
    retrying processes spread out.

    ``failed()`` records a failed try and returns the pause before the next one;
    ``due()`` says whether that pause is over (at once before any failure).
    ``next()`` returns the next pause without scheduling anything (a poll loop's
    sleep); ``sleep()`` waits it. ``reset()`` starts over from ``first``."""

    first: timedelta
    most: timedelta
    factor: float = 2.0
    jitter: float = 0.0
    failures: int = field(default=0, init=False)
    _pause: timedelta = field(init=False, repr=False)
    _due: Deadline = field(default=Deadline(-math.inf), init=False, repr=False)  # the next try

    def __post_init__(self) -> None:
        if not isinstance(self.first, timedelta) or not isinstance(self.most, timedelta):
            raise TypeError(f"a backoff's pauses must be datetime.timedeltas, got {self.first!r} and {self.most!r}")
        if self.first <= _ZERO or self.most < self.first:
            raise ValueError(f"a backoff needs 0 < first <= most, got first={self.first} most={self.most}")
        if self.factor < 1.0:
            raise ValueError(f"a backoff's factor must be at least 1, got {self.factor}")
        if not 0.0 <= self.jitter <= 1.0:
            raise ValueError(f"a backoff's jitter must be a fraction in [0, 1], got {self.jitter}")
        self._pause = self.first

    def next(self) -> timedelta:
        """The next pause; the one after it is ``factor`` times longer (``most`` at most)."""
        delay = self._pause
        self._pause = min(delay * self.factor, self.most)
        if self.jitter:
            delay += delay * (self.jitter * random.random())
        return delay

    def failed(self) -> timedelta:
        """Record a failed try; returns the pause before the next one (``due()`` after it)."""
        delay = self.next()
        self._due = Deadline.after(delay)
        self.failures += 1
        return delay

    def due(self) -> bool:
        """Whether the pause after the last failure is over (True before any failure)."""
        return self._due.expired

    def reset(self) -> None:
        """Start over: the next pause is ``first`` again, a try is due at once."""
        self._pause = self.first
        self._due = Deadline(-math.inf)
        self.failures = 0

    def sleep(self, stop: threading.Event | None = None, deadline: Deadline | None = None) -> bool:
        """Pause for ``next()``, but never past ``deadline``, and return as soon as
        ``stop`` is set; whether ``stop`` is set."""
        return pause(self.next(), stop, deadline)
