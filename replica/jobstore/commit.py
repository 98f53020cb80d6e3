"""The commit record: which step every rank's standby holds, in the job store
(``replica.jobstore`` defines the keys and signs the values).

``standby/{rank}`` is where rank r's standby listens; ``ack/{rank}/{holder}`` is the
last step one standby incarnation (``holder``: its registration's nonce) verified,
with the epoch of the trainer that streamed it (``ack/{rank}/trainer``: the rank's
trainer acknowledging itself while unprotected); only the registered standby's
and the trainer's own count, so a replaced standby that still runs moves nothing;
``commit`` is the global commit, the minimum over ranks of ``ack``, only ever
raised (compare-and-set). When the coordinator has published the generation's
epochs, only acks of each rank's current epoch count: a fenced trainer (declared
dead, still running) cannot move the commit.

Per step the record costs O(N) store work, not O(N^2), and the commit is raised a few
small reads after the last ack, not after a read of every rank's. Ranks go in groups
of ``_GROUP`` (group g: ranks g*_GROUP ...). Each acknowledger writes its ack, then adds
one to the plain counter ``ack_count/{t}/{g}`` of its group for every step ``t`` its ack
passes (the steps after its previous ack, or after the commit: one, as a rule). The
acknowledger that brings a group's counter to the group's size (or past it: a replaced
standby's acks count there too) has every other ack of the group that reached ``t``
visible: it reads the group's registrations and acks (O(_GROUP)) and raises the group's
signed summary ``ack_summary/{g}`` (the minimum of the acks that count, and the
generation it read them in; compare-and-set, raised only). Then it adds one to
``summary_count/{t}`` for every step its summary passed; the one that brings that to the
number of groups reads every group's summary and raises the commit to their minimum
(a summary of another generation, or below the step, is replaced by a read of that
group's acks). At 1,024 ranks the raise read 2,048 signed keys after the last ack (88 ms
on etcd); now 64 and 32. Before, every acknowledger read them all (~3N signed keys each:
8.4 s of store work per step at 256 ranks). The counters are unsigned and only hints:
every summary and ack they lead to is verified, a wrong count can only delay a commit.
A trainer that waits for one more than ``_RECHECK`` raises it from the summaries itself
when the step's ``summary_count`` said every group is in at two looks a ``_RECHECK``
apart (the raiser died), and reads every rank's ack itself (``raise_commit``) every
``_RECHECK_FULL`` whatever the counters say (a group's summarizer died: until the next
ack of the group, as a replaced standby's first, summarizes it again).

A summary is as trustworthy as the acks it stands for (signed with the job's key, as
they are) and as current as the registrations it read: a standby replaced after its
group was summarized still counts in the commit that summary raises, as it would had
it been replaced just after a raise that read it directly.

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
from typing import TypeGuard

from replica.errors import CommitTimeoutError, StoreWaitTimeoutError
from replica.jobstore import (
    Ack,
    AckSummary,
    Commit,
    Epoch,
    Flag,
    Generation,
    JobStore,
    LostReports,
    Number,
    Registration,
    keys,
)
from replica.jobstore.registry import publish, registration, wait_registration

__all__ = ["CommitRecord", "EpochRecord", "hint_generation", "publish_generation"]

#: The epoch of a library user's trainer that runs without a coordinator (no generation record).
NO_EPOCH = Epoch(generation=0, member=-1)
_MARKERS_KEPT = 64  # commit_reached markers kept behind the commit
_GROUP = 32  # ranks per group of the commit's aggregation (their acks summarized together)
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
        if hint is not None and held is not None and hint() == held.number:
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

    def current_epoch(self, rank: int, *, fresh: bool = False) -> Epoch | None:
        """The epoch rank ``rank``'s trainer must send with now; None when no
        coordinator publishes epochs (every epoch is accepted then). ``fresh``: read from
        the store, never on the hint (``generation``)."""
        generation = self.generation(fresh=fresh)
        return None if generation is None else generation.epoch(rank) or Epoch(generation=generation.number, member=-2)


class CommitRecord:
    def __init__(self, store: JobStore, *, world_size: int):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not isinstance(store, JobStore):
            raise TypeError(f"the commit record needs a replica.jobstore.JobStore, got {type(store).__name__}")
        self.store = store
        self.world_size = world_size
        self._last: int | None = None  # the last commit verified here (a forged value does not lower it)
        self._commit_raw: bytes | None = None  # the commit's signed bytes as read or written here last
        self._passed: dict[tuple[int, str, Epoch], int] = {}  # (rank, holder, epoch) -> the newest step it acked
        self.epochs = EpochRecord(store)  # likewise the newest generation record
        self._lock = threading.Lock()

    def publish_standby(
        self, rank: int, backend: str, address: str, fallback: tuple[str, str] | None = None
    ) -> Registration:
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

    def current_epoch(self, rank: int, *, fresh: bool = False) -> Epoch | None:
        """The epoch rank ``rank``'s trainer must stream with now (``EpochRecord.current_epoch``)."""
        return self.epochs.current_epoch(rank, fresh=fresh)

    def acknowledge(self, rank: int, step: int, epoch: Epoch = NO_EPOCH, holder: str = "") -> int | None:
        """Record that rank ``rank``'s standby (registered with nonce ``holder``; "" for a
        trainer acknowledging itself) holds ``step`` as streamed by the trainer of ``epoch``;
        returns the newest global commit this record has seen (read from the store by the
        acknowledgement that completes a step, ``raise_commit``; the others ask nothing more)."""
        self.store.put(
            keys.ack(rank, holder),
            Ack(rank=rank, step=step, generation=epoch.generation, member=epoch.member, holder=holder),
        )
        acker = (rank, holder, epoch)
        with self._lock:
            previous = self._passed.get(acker)
            self._passed[acker] = step if previous is None else max(previous, step)
        if previous is None:  # this acknowledger's first: the steps after the commit are the new ones
            previous = self._since(step)
        group = rank // _GROUP
        size = len(self._ranks(group))
        complete = False
        for passed in range(previous + 1, step + 1):
            complete |= self.store.count(keys.ack_count(passed, group), 1) >= size
        # Not the last ack of its group to reach any step: another rank's is still to come, and that one looks.
        return self._summarize(group, step) if complete else self.last_seen()

    def _since(self, step: int) -> int:
        """The step after which a counter of acks or summaries has not been told about a
        newcomer's passing: the commit (without one, a bounded few steps back from ``step``,
        should the commit be gone)."""
        commit = self.last()
        return commit if commit is not None else max(-1, step - _MARKERS_KEPT)

    def _ranks(self, group: int) -> range:
        return range(group * _GROUP, min(self.world_size, (group + 1) * _GROUP))

    def _groups(self) -> int:
        return -(-self.world_size // _GROUP)

    def _summarize(self, group: int, target: int) -> int | None:
        """Raise ``group``'s summary to the minimum of its ranks' acks that count; count the
        steps it passed, and raise the commit when this summary was the last to reach one."""
        generation = self.epochs.generation(fresh=True)  # the epochs that count: never from a hint
        low = self._low(group, generation, target)
        if low is None:
            return self.last_seen()
        if self._groups() == 1:  # the group's acks are every rank's: no summary to go through
            return self._raise_to(low, generation)
        number = generation.number if generation is not None else -1
        key = keys.ack_summary(group)
        current, raw = self.store.read(key)
        before = current.step if current is not None and current.generation == number else None
        while not (
            current is not None
            and current.group == group
            and (current.generation > number or current.generation == number and current.step >= low)
        ):
            current, raw = self.store.compare_set(key, raw, AckSummary(group=group, step=low, generation=number))
        if current.generation != number or (before is not None and before >= low):
            return self.last_seen()  # a newer generation's, or another summarizer got there first
        complete = False
        for passed in range((before if before is not None else self._since(low)) + 1, low + 1):
            complete |= self.store.count(keys.summary_count(passed), 1) >= self._groups()
        return self._raise_from_summaries(low, generation) if complete else self.last_seen()

    def _raise_from_summaries(self, target: int, generation: Generation | None = None) -> int | None:
        """Raise the commit to the minimum of the groups' summaries (``_GROUP`` times fewer
        keys than the acks); a group whose summary is missing, of another generation or
        below ``target`` is read in full instead. Returns the commit after. ``generation``:
        the one the caller read from the store just before (its summary's), else read here."""
        generation = generation or self.epochs.generation(fresh=True)
        number = generation.number if generation is not None else -1
        summaries = self.store.get_many([keys.ack_summary(g) for g in range(self._groups())])
        lows: list[int] = []
        for g, summary in enumerate(summaries):
            if summary is not None and summary.group == g and summary.generation == number and summary.step >= target:
                lows.append(summary.step)
                continue
            low = self._low(g, generation, target)
            if low is None:
                return self.last()
            lows.append(low)
        return self._raise_to(min(lows), generation)

    def _low(self, group: int, generation: Generation | None, target: int | None) -> int | None:
        acks = self._acks(generation, target, self._ranks(group))
        return None if acks is None else min(a.step for a in acks)

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
        return self._raise_to(min(a.step for a in acks), generation)

    def _raise_to(self, low: int, generation: Generation | None) -> int | None:
        """Raise the commit to ``low`` if that is higher (compare-and-set); the commit after."""
        number = generation.number if generation is not None else 0
        with self._lock:
            raw = self._commit_raw
        # The commit as this process read or wrote it last: the compare-and-set tells when it moved since
        # (and answers with it), so no read first (a request less in the chain after the last ack).
        current = None if raw is None else self.store.verify(keys.commit(), raw)
        below, wrote = None, False
        while current is None or current.step < low:
            below = None if current is None else current.step
            desired = Commit(step=low, generation=number)
            current, raw = self.store.compare_set(keys.commit(), raw, desired)
            wrote = current is desired  # else it answered with what it holds: look again
        with self._lock:
            self._commit_raw = raw
        if wrote:
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
        # (torch's stub lacks Store.multi_set, which the binding and every store here have)
        raw.multi_set(  # pyright: ignore[reportAttributeAccessIssue]
            [self.store.full(keys.commit_reached(s)) for s in range(first, step + 1)], [b""] * (step + 1 - first)
        )
        summaries = (keys.summary_count,) if self._groups() > 1 else ()
        for old in range(max(0, first - _MARKERS_KEPT), step + 1 - _MARKERS_KEPT):
            for name in (
                keys.commit_reached(old),
                *(count(old) for count in summaries),
                *(keys.ack_count(old, g) for g in range(self._groups())),
            ):
                raw.delete_key(self.store.full(name))

    def _acks(
        self, generation: Generation | None, target: int | None = None, ranks: range | None = None
    ) -> list[Ack] | None:
        """Each rank's (of ``ranks``; None: every rank) ack that counts (None while a rank has none): the newest of its
        registered standby's and its own trainer's (while unprotected), streamed in the
        rank's current epoch (``generation``'s; any without one). A replaced standby's
        acks (its own key) and a fenced trainer's (another epoch) never count.

        The standbys' acks come in one request; a trainer's own ack is read only for a
        rank whose standby's is missing or below ``target`` (None: every rank): past
        ``target`` it cannot lower the minimum below it."""

        def counts(ack: Ack | None, r: int, holder: str) -> TypeGuard[Ack]:
            return (
                ack is not None
                and ack.rank == r
                and ack.holder == holder
                and (generation is None or ack.epoch == generation.epoch(r))
            )

        ranks = range(self.world_size) if ranks is None else ranks
        registrations = zip(ranks, self.store.get_many([keys.standby(r) for r in ranks]), strict=False)
        nonces = {r: registration.nonce for r, registration in registrations if registration is not None}
        registered = list(nonces)
        standby_acks = dict(
            zip(registered, self.store.get_many([keys.ack(r, nonces[r]) for r in registered]), strict=False)
        )
        counted: list[Ack] = []
        for r in ranks:
            ack = standby_acks.get(r)
            best = ack if ack is not None and counts(ack, r, nonces[r]) else None
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
        if registration is None:
            return False
        ack = self.store.get(keys.ack(rank, registration.nonce))
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
        commit, raw = self.store.read(keys.commit())
        if commit is not None:
            with self._lock:
                self._commit_raw = raw
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
                # A commit that late may never be raised by the step's last summarizer: it died
                # between its summary and the raise (the step's counter says every group's summary
                # is in, it said so at the look before too, a _RECHECK ago: no raise under way took
                # that long, and it moved since this waiter last raised): raise it from the
                # summaries here. Or a group's summarizer died, or the unsigned counters were
                # tampered with or missed an add: every _RECHECK_FULL, whatever they say, read
                # every ack (O(N), so not each second: N waiters doing that each second was
                # O(N^2) a second).
                checked = now
                single = self._groups() == 1  # (one group: its acks' counter, and its raise reads them all)
                count = self.store.count(keys.ack_count(step, 0) if single else keys.summary_count(step))
                stale = count == looked_count
                looked_count = count
                if now - raised >= _RECHECK_FULL.total_seconds():
                    raised, raised_at_count = now, count
                    last = self.raise_commit()
                elif count >= (self.world_size if single else self._groups()) and stale and count != raised_at_count:
                    raised_at_count = count
                    last = self.raise_commit() if single else self._raise_from_summaries(step)
            return last if last is not None and last >= step else None

        try:
            return self.store.wait_for(
                reached,
                wake=lambda: [keys.commit_reached(step)],
                timeout=timeout,
                what=f"global commit of step {step}",
                abort=abort,
                every=_RECHECK,
            )
        except StoreWaitTimeoutError:
            raise CommitTimeoutError(
                f"step {step} was not globally committed within {timeout} (last commit: {self.last()}); "
                "a standby is missing or too slow"
            ) from None
