"""The commit record: which step every rank's standby holds, in the job store
(``replica.jobstate`` defines the keys and signs the values).

``standby/{rank}`` is where rank r's standby listens; ``ack/{rank}/{holder}`` is the
last step one standby incarnation (``holder``: its registration's nonce) verified,
with the epoch of the trainer that streamed it (``ack/{rank}/trainer``: the rank's
trainer acknowledging itself while unprotected); only the registered standby's
and the trainer's own count, so a replaced standby that still runs moves nothing;
``commit`` is the global commit, the minimum over ranks of ``ack``, only ever
raised (compare-and-set). When the coordinator has published the generation's
epochs, only acks of each rank's current epoch count: a fenced trainer (declared
dead, still running) cannot move the commit.

Per step the record costs O(N) store work, not O(N^2): each acknowledger writes its
ack, then adds one to the plain counter ``ack_count/{t}`` of every step ``t`` its ack
passes (the steps after its previous ack, or after the commit: one, as a rule). So
``ack_count/{t}`` counts the acks that reached ``t``; the store serializes it, and the
acknowledger that brings it to ``world_size`` (or past it: a replaced standby's acks
count there too) has every other ack that reached ``t`` visible: it alone reads every
rank's registration and ack (O(N)), and raises the commit to their minimum. Before, every acknowledger read them all (~3N
signed keys each: 8.4 s of store work per step at 256 ranks). The counter is
unsigned and only a hint: every ack it leads to is verified, a wrong count can only
delay a commit: a trainer that waits for one more than ``_RECHECK`` runs the check
itself when the step's counter said every ack is in at two looks a ``_RECHECK`` apart
(the raiser died), and every ``_RECHECK_FULL`` whatever it says.

Two more keys carry what the coordinator decides from: ``lost/{rank}`` counts the
times rank r's standby saw its trainer vanish (a transport-level sign of death), and
``unprotected/{rank}`` says no standby will come for rank r, so its trainer
acknowledges its own snapshots (survivors can still roll back to every commit;
the rank itself cannot be recovered if it dies).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

from replica.errors import CommitTimeoutError, StoreWaitTimeoutError
from replica.jobstate import Ack, Commit, Epoch, Flag, Generation, JobStore, LostReports, Number, Registration, keys
from replica.registry import publish, registration, wait_registration

__all__ = ["CommitRecord", "EpochRecord", "hint_generation", "publish_generation"]

#: The epoch of a library user's trainer that runs without a coordinator (no generation record).
NO_EPOCH = Epoch(generation=0, member=-1)
_MARKERS_KEPT = 64  # commit_reached markers kept behind the commit
_RECHECK = timedelta(seconds=1)  # a commit waiter reads the commit and the step's ack counter at least this often
_RECHECK_FULL = timedelta(seconds=10)  # and raises the commit itself this often, whatever the counter says


# job -> where this process can learn the job's generation number without a store request
_HINTS: dict[str, Callable[[], int | None]] = {}
_HINTS_LOCK = threading.Lock()


def hint_generation(store: JobStore, hint: Callable[[], int | None] | None) -> None:
    """Tell every ``EpochRecord`` of ``store``'s job in this process where the job's current
    generation number can be had without a store request: ``hint()`` returns it, or None
    when it does not know it now (a role's heartbeat: the number the coordinator's last
    liveness answer carried, while that answer is fresh). None removes the hint. A
    record then reads the store only when the number moved from the one it holds; the
    commit's raise always reads it (``generation(fresh=True)``)."""
    with _HINTS_LOCK:
        if hint is None:
            _HINTS.pop(store.job, None)
        else:
            _HINTS[store.job] = hint


def publish_generation(store: JobStore, generation: Generation) -> None:
    """Write the generation record, then its number (``EpochRecord`` reads the number
    first, and the whole record only when that moved)."""
    store.put(keys.generation(), generation)
    store.put(keys.generation_number(), Number(value=generation.number))


class EpochRecord:
    """The epochs receivers accept, from the coordinator's signed generation record:
    what a standby (the epoch of its rank's trainer) and an engine's weight receiver
    (the epoch of the trainers' leader rank) fence with. Once a record was verified
    here, a forged or deleted one never replaces it with an older one or with none:
    fencing cannot be switched off from the store.

    The record lists every rank's trainer (O(N) bytes); each role reads it every step and
    every heartbeat period, so a read asks for the small signed ``generation_number``
    first and the record itself only when the number differs from the one held here
    (O(N^2) bytes a step across the job before, O(N) now)."""

    def __init__(self, store: JobStore):
        self.store = store
        self._generation: Generation | None = None  # the newest generation record verified here
        self._lock = threading.Lock()
        self._job = store.job

    def generation(self, store: JobStore | None = None, *, fresh: bool = False) -> Generation | None:
        """The coordinator's current generation and trainers (None without a coordinator);
        over ``store`` (another connection to the job store) if given. Without a request
        when this process's hint (``hint_generation``) vouches for the number held here,
        unless ``fresh``."""
        with self._lock:
            held = self._generation
        hint = None if fresh or held is None else _HINTS.get(self._job)
        if hint is not None and hint() == held.number:
            return held
        store = store or self.store
        number = store.get(keys.generation_number())
        with self._lock:
            held = self._generation
        if number is not None and held is not None and number.value == held.number:
            return held
        current = store.get(keys.generation())  # new, or no number published (an older writer)
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
        self._passed: dict[tuple[int, str, Epoch], int] = {}  # (rank, holder, epoch) -> the newest step it acked
        self.epochs = EpochRecord(store)  # likewise the newest generation record
        self._lock = threading.Lock()

    def publish_standby(self, rank: int, backend: str, address: str,
                        fallback: tuple[str, str] | None = None) -> Registration:
        return publish(self.store, keys.standby(rank), backend, address, fallback)

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
        returns the newest global commit this record has seen (read from the store by the
        acknowledgement that completes a step, ``raise_commit``; the others ask nothing more)."""
        self.store.put(keys.ack(rank, holder), Ack(rank=rank, step=step, generation=epoch.generation,
                                                   member=epoch.member, holder=holder))
        acker = (rank, holder, epoch)
        with self._lock:
            previous = self._passed.get(acker)
            self._passed[acker] = step if previous is None else max(previous, step)
        if previous is None:  # this acknowledger's first: the steps after the commit are the new ones
            commit = self.last()
            # Without a commit, every step from the first (a bounded few, should the commit be gone).
            previous = commit if commit is not None else max(-1, step - _MARKERS_KEPT)
        complete = False
        for passed in range(previous + 1, step + 1):
            complete |= self.store.count(keys.ack_count(passed), 1) >= self.world_size
        # Not the last ack to reach any step: another rank's ack is still to come, and that one looks.
        return self.raise_commit(step) if complete else self.last_seen()

    def raise_commit(self, target: int | None = None) -> int | None:
        """Raise the global commit to the minimum of the acks that count, if that is higher
        (reads every rank's registration and its standby's ack: O(N) keys in a few
        requests); returns the commit after. ``target``: the step the caller needs; a
        rank's own trainer's ack (unprotected) is then read only where its standby's is
        below it (None: everywhere)."""
        generation = self.epochs.generation(fresh=True)  # the epochs that count: never from a hint
        acks = self._acks(generation, target)
        if acks is None:
            return self.last()
        low = min(a.step for a in acks)
        number = generation.number if generation is not None else 0
        current, raw = self.store.read(keys.commit())
        below = None if current is None else current.step
        while current is None or current.step < low:
            current, raw = self.store.compare_set(keys.commit(), raw, Commit(step=low, generation=number))
        if below is None or below < low <= current.step:
            self._reached(below, low)
        return self._seen(current.step)

    def seed(self, step: int) -> None:
        """Start the record at ``step`` (a job resumed from an export of that step)."""
        self.store.put(keys.commit(), Commit(step=step, generation=0))
        self._reached(None, step)

    def _reached(self, below: int | None, step: int) -> None:
        """Announce that the commit rose from ``below`` to ``step``: the markers ``wait``
        blocks on (existence hints; ``wait`` reads the signed commit). The markers of
        steps _MARKERS_KEPT behind go (a waiter is never that far behind: a trainer
        packs N+1 only once N is committed)."""
        first = step if below is None else max(below + 1, step - _MARKERS_KEPT + 1)
        raw = self.store.raw
        raw.multi_set([self.store.full(keys.commit_reached(s)) for s in range(first, step + 1)],
                      [b""] * (step + 1 - first))
        for old in range(max(0, first - _MARKERS_KEPT), step + 1 - _MARKERS_KEPT):
            raw.delete_key(self.store.full(keys.commit_reached(old)))
            raw.delete_key(self.store.full(keys.ack_count(old)))

    def _acks(self, generation: Generation | None, target: int | None = None) -> list[Ack] | None:
        """Each rank's ack that counts (None while a rank has none): the newest of its
        registered standby's and its own trainer's (while unprotected), streamed in the
        rank's current epoch (``generation``'s; any without one). A replaced standby's
        acks (its own key) and a fenced trainer's (another epoch) never count.

        The standbys' acks come in one request; a trainer's own ack is read only for a
        rank whose standby's is missing or below ``target`` (None: every rank): past
        ``target`` it cannot lower the minimum below it."""
        def counts(ack: Ack | None, r: int, holder: str) -> bool:
            return (ack is not None and ack.rank == r and ack.holder == holder
                    and (generation is None or ack.epoch == generation.epoch(r)))

        registrations = self.store.get_many([keys.standby(r) for r in range(self.world_size)])
        registered = [r for r, reg in enumerate(registrations) if reg is not None]
        standby_acks = dict(zip(registered, self.store.get_many([keys.ack(r, registrations[r].nonce)
                                                                 for r in registered])))
        counted: list[Ack] = []
        for r in range(self.world_size):
            ack = standby_acks.get(r)
            best = ack if ack is not None and counts(ack, r, registrations[r].nonce) else None
            if best is None or target is None or best.step < target:
                own = self.store.get(keys.ack(r, ""))
                if counts(own, r, "") and (best is None or own.step > best.step):
                    best = own
            if best is None:
                return None
            counted.append(best)
        return counted

    def standby_holds(self, rank: int, step: int) -> bool:
        """True when rank ``rank``'s registered standby acknowledged ``step`` or later
        itself (so it holds ``step``: a standby keeps the commit's version until a newer
        one is committed)."""
        registration = self.registration(rank)
        ack = None if registration is None else self.store.get(keys.ack(rank, registration.nonce))
        return ack is not None and ack.rank == rank and ack.holder == registration.nonce and ack.step >= step

    def report_lost(self, rank: int) -> None:
        """Rank ``rank``'s standby saw its trainer's connection vanish without a goodbye
        (only that standby writes this key)."""
        with self._lock:
            self.store.put(keys.lost(rank), LostReports(rank=rank, count=self.lost_reports(rank) + 1))
        self.store.count(keys.lost_count(), 1)  # the coordinator reads the reports when this moves

    def lost_reports(self, rank: int) -> int:
        """How many times rank ``rank``'s trainer was reported vanished (a counter, so
        readers on other machines need no common clock)."""
        reports = self.store.get(keys.lost(rank))
        return reports.count if reports is not None and reports.rank == rank else 0

    def all_lost_reports(self) -> dict[int, int]:
        """``lost_reports`` of every rank (one request per rank on a TCPStore, whose reads
        cannot return absent keys together; a few on etcd)."""
        reports = self.store.get_many([keys.lost(r) for r in range(self.world_size)])
        return {r: report.count if report is not None and report.rank == r else 0 for r, report in enumerate(reports)}

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

    def wait(self, step: int, timeout: timedelta, *, abort: Callable[[], None] | None = None) -> int:
        """Block until the global commit is at least ``step``; ``abort()`` may raise to stop early.
        Waits on the calling thread's own store connection for the step's marker."""
        checked = raised = time.monotonic()
        raised_at_count = looked_count = -1

        def reached(_: JobStore) -> int | None:
            nonlocal checked, raised, raised_at_count, looked_count
            last = self.last()
            now = time.monotonic()
            if (last is None or last < step) and now - checked >= _RECHECK.total_seconds():
                # A commit that late may never be raised by the step's last acknowledger: it died
                # between its ack and the raise (the step's counter says every ack is in, it said so
                # at the look before too, a _RECHECK ago: no raise under way took that long, and it
                # moved since this waiter last raised), or the unsigned counter was tampered with
                # or missed an add (every _RECHECK_FULL, whatever it says). Then raise it from
                # here: O(N), so not while acks are still coming or a raise is under way, nor
                # again while the counter stands still (a rank whose ack does not count yet: its
                # new standby is on its way). N waiters each reading every ack each second was
                # O(N^2) a second.
                checked = now
                count = self.store.count(keys.ack_count(step))
                stale = count == looked_count
                looked_count = count
                if count >= self.world_size and stale and count != raised_at_count or \
                        now - raised >= _RECHECK_FULL.total_seconds():
                    raised, raised_at_count = now, count
                    last = self.raise_commit()
            return last if last is not None and last >= step else None

        try:
            return self.store.wait_for(reached, wake=lambda: [keys.commit_reached(step)], timeout=timeout,
                                       what=f"global commit of step {step}", abort=abort, every=_RECHECK)
        except StoreWaitTimeoutError:
            raise CommitTimeoutError(
                f"step {step} was not globally committed within {timeout} (last commit: {self.last()}); "
                "a standby is missing or too slow") from None
