"""The commit record: which step every rank's standby holds, in the job store
(``replica.jobstate`` defines the keys and signs the values).

``standby/{rank}`` is where rank r's standby listens; ``ack/{rank}`` is the last
step that standby verified, with the epoch of the trainer that streamed it;
``commit`` is the global commit, the minimum over ranks of ``ack``, only ever
raised (compare-and-set). When the coordinator has published the generation's
epochs, only acks of each rank's current epoch count: a fenced trainer (declared
dead, still running) cannot move the commit. The standby writing the last
missing ack sees every other ack (the store serializes requests) and raises the
commit.

Two more keys carry what the coordinator decides from: ``lost/{rank}`` counts the
times rank r's standby saw its trainer vanish (a transport-level sign of death), and
``unprotected/{rank}`` says no standby will come for rank r, so its trainer
acknowledges its own snapshots (survivors can still roll back to every commit;
the rank itself cannot be recovered if it dies).
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

from replica.errors import CommitTimeoutError
from replica.jobstate import Ack, Commit, Epoch, Flag, Generation, JobStore, LostReports, Registration, keys
from replica.registry import publish, registration, wait_registration

__all__ = ["CommitRecord", "EpochRecord"]

#: The epoch of a library user's trainer that runs without a coordinator (no generation record).
NO_EPOCH = Epoch(generation=0, member=-1)


class EpochRecord:
    """The epochs receivers accept, from the coordinator's signed generation record:
    what a standby (the epoch of its rank's trainer) and an engine's weight receiver
    (the epoch of the trainers' leader rank) fence with. Once a record was verified
    here, a forged or deleted one never replaces it with an older one or with none:
    fencing cannot be switched off from the store."""

    def __init__(self, store: JobStore):
        self.store = store
        self._generation: Generation | None = None  # the newest generation record verified here
        self._lock = threading.Lock()

    def generation(self) -> Generation | None:
        """The coordinator's current generation and trainers (None without a coordinator)."""
        current = self.store.get(keys.generation())
        with self._lock:
            if current is not None and (self._generation is None or current.number >= self._generation.number):
                self._generation = current
            return self._generation

    def current_epoch(self, rank: int) -> Epoch | None:
        """The epoch rank ``rank``'s trainer must send with now; None when no
        coordinator publishes epochs (every epoch is accepted then)."""
        generation = self.generation()
        return None if generation is None else generation.epoch(rank) or Epoch(generation=generation.number,
                                                                                 member=-2)


class CommitRecord:
    def __init__(self, store: JobStore, *, world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not isinstance(store, JobStore):
            raise TypeError(f"the commit record needs a replica.jobstate.JobStore, got {type(store).__name__}")
        self.store = store
        self.world_size = world_size
        self._last: int | None = None  # the last commit verified here (a forged value does not lower it)
        self.epochs = EpochRecord(store)  # likewise the newest generation record
        self._lock = threading.Lock()

    def publish_standby(self, rank: int, backend: str, address: str) -> Registration:
        return publish(self.store, keys.standby(rank), backend, address)

    def registration(self, rank: int) -> Registration | None:
        """Rank ``rank``'s standby registration as published (None before the first)."""
        return registration(self.store, keys.standby(rank))

    def standby(self, rank: int, timeout: timedelta) -> Registration:
        """Rank ``rank``'s standby registration; waits for it to publish. The
        registration's nonce tells one standby incarnation from the next."""
        return wait_registration(self.store, keys.standby(rank), timeout, f"standby of rank {rank}")

    def generation(self) -> Generation | None:
        """The coordinator's current generation and trainers (``EpochRecord.generation``)."""
        return self.epochs.generation()

    def current_epoch(self, rank: int) -> Epoch | None:
        """The epoch rank ``rank``'s trainer must stream with now (``EpochRecord.current_epoch``)."""
        return self.epochs.current_epoch(rank)

    def acknowledge(self, rank: int, step: int, epoch: Epoch = NO_EPOCH, holder: str = "") -> int | None:
        """Record that rank ``rank``'s standby (registered with nonce ``holder``; "" for a
        trainer acknowledging itself) holds ``step`` as streamed by the trainer of ``epoch``;
        returns the global commit after."""
        self.store.put(keys.ack(rank), Ack(rank=rank, step=step, generation=epoch.generation, member=epoch.member,
                                           holder=holder))
        acks = self.store.get_many([keys.ack(r) for r in range(self.world_size)])
        generation = self.generation()
        for r, ack in enumerate(acks):
            if ack is None or ack.rank != r:
                return self.last()
            if generation is not None and ack.epoch != generation.epoch(r):
                return self.last()  # not of the current epoch: a fenced stream, or a stale one
        low = min(a.step for a in acks)
        number = generation.number if generation is not None else 0
        current, raw = self.store.read(keys.commit())
        while current is None or current.step < low:
            current, raw = self.store.compare_set(keys.commit(), raw, Commit(step=low, generation=number))
        return self._seen(current.step)

    def standby_holds(self, rank: int, step: int) -> bool:
        """True when rank ``rank``'s registered standby acknowledged ``step`` or later
        itself (so it holds ``step``: a standby keeps the commit's version until a newer
        one is committed)."""
        registration, ack = self.registration(rank), self.store.get(keys.ack(rank))
        return (registration is not None and ack is not None and ack.holder == registration.nonce
                and ack.step >= step)

    def report_lost(self, rank: int) -> None:
        """Rank ``rank``'s standby saw its trainer's connection vanish without a goodbye
        (only that standby writes this key)."""
        with self._lock:
            self.store.put(keys.lost(rank), LostReports(rank=rank, count=self.lost_reports(rank) + 1))

    def lost_reports(self, rank: int) -> int:
        """How many times rank ``rank``'s trainer was reported vanished (a counter, so
        readers on other machines need no common clock)."""
        reports = self.store.get(keys.lost(rank))
        return reports.count if reports is not None and reports.rank == rank else 0

    def set_unprotected(self, rank: int, unprotected: bool) -> None:
        if unprotected:
            self.store.put(keys.unprotected(rank), Flag())
        elif self.store.raw.check([self.store.full(keys.unprotected(rank))]):
            self.store.delete(keys.unprotected(rank))

    def unprotected(self, rank: int) -> bool:
        """True when no standby will come for rank ``rank`` (its trainer acknowledges itself)."""
        return self.store.has(keys.unprotected(rank))

    def last(self) -> int | None:
        """The last global commit, or None before the first."""
        commit = self.store.get(keys.commit())
        return self._seen(None if commit is None else commit.step)

    def last_seen(self) -> int | None:
        """The newest commit verified here, without asking the store (which may be gone)."""
        with self._lock:
            return self._last

    def _seen(self, step: int | None) -> int | None:
        with self._lock:
            if step is not None and (self._last is None or step > self._last):
                self._last = step
            return self._last

    def wait(self, step: int, timeout: timedelta, *, abort=None) -> int:
        """Block until the global commit is at least ``step``; ``abort()`` may raise to stop early."""
        deadline = time.monotonic() + timeout.total_seconds()
        delay = 50e-6
        while True:
            last = self.last()
            if last is not None and last >= step:
                return last
            if abort is not None:
                abort()
            if time.monotonic() >= deadline:
                raise CommitTimeoutError(
                    f"step {step} was not globally committed within {timeout} (last commit: {last}); "
                    "a standby is missing or too slow")
            time.sleep(delay)
            delay = min(delay * 2, 2e-3)
