"""What sends a role's beats (``HeartbeatSender``, which ``JobStore.heartbeat_sender``
returns), and its Python-thread kind for stores the native sender does not speak.

The beat itself, the signed ``Heartbeat(member, beat)`` record, is in ``records``."""

from __future__ import annotations

import threading
import time
import typing
from datetime import timedelta
from typing import Protocol, runtime_checkable

from replica.jobstore.keys import keys
from replica.jobstore.records import Heartbeat

if typing.TYPE_CHECKING:
    from replica.jobstore.store import JobStore

__all__ = ["HeartbeatSender", "ThreadHeartbeatSender"]


@runtime_checkable
class HeartbeatSender(Protocol):
    """A thread that writes a role's rising, signed ``Heartbeat`` values (``JobStore.heartbeat_sender``).

    Of two kinds: ``replica._C.NativeHeartbeatSender`` (a native thread that needs no GIL, to
    a TCPStore or etcd's HTTP gateway, or as datagrams to the coordinator's liveness endpoint)
    and ``ThreadHeartbeatSender`` (a Python thread, to the store only: etcd over https). What
    the roles, the tests and the benchmarks use of either is here."""

    @property
    def beats(self) -> int:
        """The beats sent so far."""
        ...

    @property
    def paused(self) -> bool:
        """Whether the beats stopped because ``touch()`` was not called within the grace."""
        ...

    @property
    def failing_for(self) -> float:
        """Seconds since the beats started failing (0.0: they get through)."""
        ...

    @property
    def last_error(self) -> str:
        """Why the last beat that failed did ("" if none did)."""
        ...

    @property
    def generation(self) -> int:
        """The newest generation number an answer of the liveness endpoint carried (-1: none came)."""
        ...

    @property
    def reply_age(self) -> float:
        """Seconds since the liveness endpoint's last answer (infinite: none came)."""
        ...

    @property
    def replies(self) -> int:
        """The liveness endpoint's answers received so far."""
        ...

    def touch(self) -> None:
        """Say the interpreter lives: the beats go on for the grace after this."""

    def aim(self, host: str, port: int) -> None:
        """Send the beats to the liveness endpoint at ``host:port`` from now on."""

    def stop(self) -> None:
        """End the beats (returns once the thread ended)."""


class ThreadHeartbeatSender(HeartbeatSender):
    """``HeartbeatSender`` on a Python thread, for stores the native sender does not speak
    (etcd over https): the same signed ``Heartbeat`` values, in the store only (``aim`` is
    accepted and changes nothing: no answer ever comes, so ``reply_age`` stays infinite and
    readers go to the store as without an endpoint)."""

    def __init__(self, store: JobStore, member: int, *, period: timedelta, python_grace: timedelta):
        for name, value in (("period", period), ("python_grace", python_grace)):
            if value <= timedelta(0):
                raise ValueError(f"the heartbeat's {name} must be > 0, got {value}")
        self._store, self._member = store, member
        self._period, self._grace = period.total_seconds(), python_grace.total_seconds()
        self._touched = time.monotonic()
        self._stop = threading.Event()
        self._beats = 0
        self._paused = False
        self._last_error = ""
        self._failing_since = 0.0
        self._thread = threading.Thread(target=self._run, name=f"replica-heartbeat-{member}", daemon=True)
        self._thread.start()

    @property
    def beats(self) -> int:
        return self._beats

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def last_error(self) -> str:
        return self._last_error

    def touch(self) -> None:
        self._touched = time.monotonic()

    def aim(self, host: str, port: int) -> None:
        return None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def failing_for(self) -> float:
        return time.monotonic() - self._failing_since if self._failing_since else 0.0

    @property
    def generation(self) -> int:
        return -1

    @property
    def reply_age(self) -> float:
        return float("inf")

    @property
    def replies(self) -> int:
        return 0

    def _run(self) -> None:
        while not self._stop.is_set():
            self._paused = time.monotonic() - self._touched >= self._grace
            if not self._paused:
                try:
                    self._store.put(keys.heartbeat(self._member), Heartbeat(member=self._member, beat=self._beats + 1))
                    self._beats += 1
                    self._failing_since = 0.0
                except Exception as exc:  # noqa: BLE001 - the beat goes on; failing_for tells the role
                    self._failing_since = self._failing_since or time.monotonic()
                    self._last_error = str(exc)
            self._stop.wait(self._period)
