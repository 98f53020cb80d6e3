"""The coordinator's own stalls: spans in which it did not run (its process stopped, starved of
the cores, its memory map locked by a fork, paged out), measured as gaps between its polls.
A member's silence that overlaps such a span does not count toward its deadline: the
coordinator could not hear it then, so its silence is no evidence."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from datetime import timedelta

__all__ = ["Stall", "StallLog"]


@dataclass(kw_only=True, frozen=True, slots=True)
class Stall:
    """A span (``time.time()`` seconds) in which the coordinator did not poll."""

    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


class StallLog:
    """``tick(now)`` at every poll; a gap longer than ``after`` is a stall from ``after``
    past the previous poll to this one (a poll's own work, up to ``after``, is not one).
    Stalls older than ``keep`` are forgotten (longer than any deadline)."""

    def __init__(self, *, after: timedelta, keep: timedelta):
        if after <= timedelta(0) or keep <= after:
            raise ValueError(f"need 0 < after < keep, got after={after}, keep={keep}")
        self._after, self._keep = after.total_seconds(), keep.total_seconds()
        self._last: float | None = None
        self._stalls: deque[Stall] = deque()
        self.count = 0
        self.total_s = 0.0
        self.longest_s = 0.0

    def tick(self, now: float) -> Stall | None:
        """This poll runs at ``now``; returns the stall it ends, if any."""
        last, self._last = self._last, now
        while self._stalls and self._stalls[0].end < now - self._keep:
            self._stalls.popleft()
        if last is None or now - last <= self._after:
            return None
        stall = Stall(start=last + self._after, end=now)
        self._stalls.append(stall)
        self.count += 1
        self.total_s += stall.seconds
        self.longest_s = max(self.longest_s, stall.seconds)
        return stall

    def overlap(self, start: float, end: float) -> float:
        """Seconds of [start, end] the coordinator spent stalled. Asked for every member at every
        poll, for silences that mostly began a beat ago: the stalls are in time order, newest
        last, and the look stops at the first one that ended before ``start``."""
        total = 0.0
        for stall in reversed(self._stalls):
            if stall.end <= start:
                break
            total += max(0.0, min(end, stall.end) - max(start, stall.start))
        return total

    def silence(self, since: float, until: float) -> float:
        """The seconds from ``since`` to ``until`` that count as a member's silence: those in
        which the coordinator ran."""
        return max(0.0, until - since - self.overlap(since, until))

    def summary(self) -> dict:
        """For the report."""
        return {"count": self.count, "total_s": round(self.total_s, 3), "longest_s": round(self.longest_s, 3)}
