"""A role's heartbeat on a Python thread, for stores the native beat does not speak."""

from __future__ import annotations

import threading
import time
import typing
from datetime import timedelta

from replica.jobstore.keys import keys
from replica.jobstore.records import Heartbeat

if typing.TYPE_CHECKING:
    from replica.jobstore.store import JobStore

__all__ = ["ThreadHeartbeat"]


class ThreadHeartbeat:
    """``JobStore.heartbeat`` on a Python thread, for stores the native beat does not
    speak (etcd over https): the same attributes (``touch``, ``stop``, ``beats``,
    ``failing_for``, ``paused``, ``last_error``), the same signed ``Heartbeat`` values, in
    the store only (``aim`` is accepted and changes nothing: no answer ever comes, so
    ``reply_age`` stays infinite and readers go to the store as without an endpoint)."""

    generation = -1
    reply_age = float("inf")
    replies = 0

    def __init__(self, store: JobStore, member: int, *, period: timedelta, python_grace: timedelta):
        for name, value in (("period", period), ("python_grace", python_grace)):
            if value <= timedelta(0):
                raise ValueError(f"the heartbeat's {name} must be > 0, got {value}")
        self._store, self._member = store, member
        self._period, self._grace = period.total_seconds(), python_grace.total_seconds()
        self._touched = time.monotonic()
        self._stop = threading.Event()
        self.beats = 0
        self.paused = False
        self.last_error = ""
        self._failing_since = 0.0
        self._thread = threading.Thread(target=self._run, name=f"replica-heartbeat-{member}", daemon=True)
        self._thread.start()

    def touch(self) -> None:
        self._touched = time.monotonic()

    def aim(self, host: str, port: int) -> None:  # noqa: ARG002 - the store path only (see the class)
        return None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def failing_for(self) -> float:
        return time.monotonic() - self._failing_since if self._failing_since else 0.0

    def _run(self) -> None:
        while not self._stop.is_set():
            self.paused = time.monotonic() - self._touched >= self._grace
            if not self.paused:
                try:
                    self._store.put(keys.heartbeat(self._member), Heartbeat(member=self._member, beat=self.beats + 1))
                    self.beats += 1
                    self._failing_since = 0.0
                except Exception as exc:  # noqa: BLE001 - the beat goes on; failing_for tells the role
                    self._failing_since = self._failing_since or time.monotonic()
                    self.last_error = str(exc)
            self._stop.wait(self._period)
