"""A role's side of a failover: it watches the generation (announced failovers, its
own replacement), heartbeats to the coordinator, waits as a standby for its promotion,
and rolls back to the last commit to join the next process-group generation; a role
whose job store went away ends (``ExitCode.COORDINATOR_LOST``)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import NoReturn


import replica
from replica.jobstore.commit import hint_generation
from replica.errors import StoreWaitTimeoutError
from replica.jobstore import Flag, Generation, JobStore, Promotion, Regroup, Stamp, Text, keys
from replica.roles import timing
from replica.timing import Deadline, pause
from replica.roles.env import Role

from replica.roles.exits import ExitCode, exit_now

__all__ = ["Recovery", "aim_beats"]

logger = logging.getLogger(__name__)
_HEARTBEAT_LOG_EVERY = 50  # repeated failures: one warning in 50 (5 s)
_STORE_RETRY = timedelta(milliseconds=200)  # a role whose store call failed tries it again this often
_JOB_ENDED = (-1, -1)  # _announced's answer when the job ended instead of a failover (not a generation)


def _endpoint(address: str) -> tuple[str, int]:
    """``host:port`` (as the coordinator publishes its liveness endpoint) split; ValueError if it is not."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"not a host:port: {address!r}")
    return host, int(port)


def aim_beats(beats: Sequence, store: JobStore, aimed: str | None, who: str) -> str | None:
    """Point ``beats`` (native ``Heartbeat``s) at the liveness endpoint the coordinator
    published, if it moved from ``aimed``; returns the address aimed at (None: none
    published, the beats stay in the store). ``who`` names them in the log."""
    published = store.get(keys.liveness())
    if published is None or published.value == aimed:
        return aimed
    try:
        endpoint = _endpoint(published.value)
        for beat in beats:
            beat.aim(*endpoint)
    except (RuntimeError, ValueError) as exc:  # unresolvable here: the store path goes on
        logger.warning("%s cannot beat to the liveness endpoint %s (%s); beating to the job store", who,
                       published.value, exc)
        return aimed
    logger.info("%s beating to the liveness endpoint %s", who, published.value)
    return published.value


class Recovery:
    """``Job``'s part: failovers, promotion, heartbeats and the job store's loss. Mixed into ``replica.roles.runtime.Job``, whose state
    it uses."""

    def _failover_announced(self, store: JobStore | None = None) -> bool:
        return self._generation_number(store) > self.group.generation

    def _superseded(self, store: JobStore | None = None) -> bool:
        """True when the coordinator gave this trainer's rank to another process. Never on a
        hint alone (``hint_generation``): a standby promoted a moment ago still holds the
        generation before its promotion, which the liveness answers may still vouch for (the
        endpoint learns the new number after the store): what would stop it is read again."""
        def given_away(current: Generation | None) -> bool:
            return (self.role == Role.TRAINER and current is not None and self.rank < len(current.trainers)
                    and current.trainers[self.rank] not in (-1, self.member))

        return given_away(self._epochs.generation(store)) and given_away(self._epochs.generation(store, fresh=True))

    def _announced(self) -> tuple[int, int]:
        """The newer generation and the commit it resumes from. A step that failed
        without one (a rendezvous or collective timed out on a loaded machine, no
        one died) waits for the coordinator's decision: a death is announced, or
        the slow peer catches up and the step is simply redone in a fresh generation.
        Blocks in the store until the next generation's failover record exists."""
        floor = max(self.group.generation, self._failed_generation)
        asked = False

        def announced(store: JobStore) -> tuple[int, int] | None:
            nonlocal asked
            current = store.get(keys.generation())
            if current is not None and current.number > floor:
                return current.number, store.wait(keys.failover(current.number), timing.ROLE_WAIT).commit
            if store.has(keys.finished()):
                return _JOB_ENDED  # it failed, or starts again from its start or its floor
            if current is not None and not asked:  # no death announced (yet): ask for a fresh generation
                store.put(keys.regroup(self.rank), Regroup(rank=self.rank, generation=current.number))
                store.count(keys.regroup_count(), 1)
                asked = True
            return None

        try:
            # Woken by the next generation's failover record; the job's end is looked for every
            # timing.STANDBY_LOOK (a store waits for every key it is given, not for the first).
            found = self.store.wait_for(announced, wake=lambda: [keys.failover(floor + 1)], timeout=timing.ROLE_WAIT,
                                        what="failover or regroup", every=timing.STANDBY_LOOK)
        except StoreWaitTimeoutError:
            raise replica.ReplicaError("the step failed but no coordinator announced a failover or a regroup "
                                       f"within {timing.ROLE_WAIT}") from None
        if found is _JOB_ENDED:
            # Nothing to resume here: the coordinator said why. Leave now, not at its linger's end.
            logger.error("[%s rank %d] the job ended while this process waited for a failover after its failed "
                         "step; it stops (exit code %d)", self.role, self.rank, ExitCode.FAILED)
            exit_now(ExitCode.FAILED)
        return found

    def _recover(self) -> int:
        while True:
            generation, commit = self._announced()
            if self._superseded():
                # Declared dead (a missed deadline) while alive: its standby has taken the rank over.
                self._fenced_exit()
            restored = self._rep.rollback(step=commit)
            if self._configure(generation):
                break
        self._rep.protect()  # a standby that does not hold the commit (a new one) receives it first
        self._restored_to(restored)
        logger.warning("[trainer rank %d] survived: rolled back to %d, generation %d", self.rank, restored, generation)
        return restored

    def _configure(self, generation: int) -> bool:
        """Join ``generation``; False if it failed or was superseded before every member
        arrived (the caller then waits for the next one)."""
        try:
            self.group.configure(generation, ready_timeout=timing.ROLE_WAIT,
                                 ready_abort=lambda: self._generation_number() > generation)
            return True
        except (replica.ReplicaError, RuntimeError) as exc:  # gloo reports a failed rendezvous as RuntimeError
            self._failed_generation = max(self._failed_generation, generation)
            logger.warning("[%s rank %d] generation %d could not be joined (%s); waiting for the next", self.role,
                           self.rank, generation, exc)
            return False

    def _generation_number(self, store: JobStore | None = None) -> int:
        """The coordinator's current generation (-1 while none is readable)."""
        current = self._epochs.generation(store)
        return -1 if current is None else current.number

    def _wait_promotion(self) -> int | None:
        """Wait (on a store connection of this thread's own) until the coordinator
        promotes this standby; None when the job ended first. Meanwhile, export the
        commit when asked (a rank's state is lost) and fire this standby's faults."""
        key = keys.promote(self.rank)
        faults = [f for f in self.env.faults if f.role == Role.STANDBY and f.rank == self.rank]
        generation = -1  # the newest generation seen: a promotion comes with the next one

        def promoted(store: JobStore) -> Promotion | Flag | None:
            nonlocal generation
            generation = max(generation, self._generation_number(store))
            promotion = store.get(key)
            if promotion is not None and promotion.member == self.member:  # meant for this standby only
                return promotion
            if not self._exported and (request := store.get(keys.export())) is not None:
                self._export(request.directory, [request.commit])  # the job is ending: a rank's state is lost
            if store.has(keys.finished()):
                return Flag()
            for f in faults:  # a standby's fault fires once its trainer has finished that step
                if store.has(keys.loss(self.rank, f.step)):
                    self._fault(f.phase, f.step)
            return None

        with self._store_guard():
            # Woken by the next generation's failover record (written before its promotion);
            # the job's end and an export request are looked for every timing.STANDBY_LOOK.
            # While a fresh liveness answer says the generation did not move, no promotion can have
            # come: the store is not asked for one (1,024 waiting standbys asked ~100,000 times a second).
            promotion = self.store.wait_for(
                promoted, wake=lambda: [keys.failover(generation + 1)], timeout=timing.PROMOTION_WAIT,
                what="promotion", every=timing.STANDBY_POLL if faults else timing.STANDBY_LOOK, poll=timing.STANDBY_POLL,
                quiet=lambda: self._fresh_generation() == generation,
                quiet_every=timing.STANDBY_POLL if faults else timing.STANDBY_QUIET_LOOK)
        if isinstance(promotion, Flag):
            self.close()
            return None
        generation = promotion.generation
        commit = self.store.wait(keys.failover(generation), timing.ROLE_WAIT).commit
        model, optimizer, extra = self._bound
        try:
            self._mirror.restore(model, optimizer, extra, step=commit, rank=self.rank,
                                 world_size=self.env.world_size)
        except replica.LayoutMismatchError as exc:
            self._report_fatal(exc)
            raise
        self.store.put(keys.restored(generation), Stamp(at=time.time()))
        while not self._configure(generation):  # a regroup or another death overtook this generation
            generation, commit = self._announced()
            self._mirror.restore(model, optimizer, extra, step=commit, rank=self.rank,
                                 world_size=self.env.world_size)
        self.store.put(keys.reconnected(generation), Stamp(at=time.time()))
        # The committed version restored from stays this rank's copy of the commit (no copy),
        # the other version takes the next step; closing the mirror waits for its threads.
        if self._floor is not None:  # a trainer now: its new standby writes the rank's floor
            floor, self._floor = self._floor, None
            threading.Thread(target=floor.close, daemon=True, name="replica-floor-close").start()
        held = self._mirror.hand_over(commit)
        mirror, self._mirror = self._mirror, None
        threading.Thread(target=mirror.close, daemon=True, name="replica-mirror-close").start()
        self.role = Role.TRAINER
        self._start_replicator(held)
        self._rep.protect()  # the rank's new standby receives the commit first: it has two copies again
        # The steps after the commit that the rank's last trainer logged are redone here: the
        # guard checks them against its losses (at most the two in flight when it died).
        self._redo_in_store = {commit + 1, commit + 2}
        self._restored_to(commit)
        logger.warning("[standby rank %d] promoted to trainer at commit %d, generation %d", self.rank, commit,
                       generation)
        return commit

    def _coordinator_lost(self, exc: BaseException) -> NoReturn:
        """The job store is unreachable (the coordinator died): nobody can decide a failover
        any more. Standbys and trainers write every version they hold to the export folder
        (the newest step all ranks wrote is where ``replica launch --resume`` starts); every
        role exits (ExitCode.COORDINATOR_LOST). Runs once, from whichever thread finds it first."""
        if not self._lost.acquire(blocking=False):  # another thread is at it, and exits the process
            while True:
                pause(timedelta(seconds=1))
        logger.error("[%s rank %d] the job store is gone (%s): the coordinator died or is cut off; this %s "
                     "exports the versions it holds to %s and stops", self.role, self.rank, exc, self.role,
                     self.env.export_dir)
        if self._holder() is not None:
            self._export(self.env.export_dir, self._holder().held_steps())
        exit_now(ExitCode.COORDINATOR_LOST)

    @contextlib.contextmanager
    def _store_guard(self) -> Iterator[None]:
        """Store calls of the role's own thread: a failure that is the store going away
        ends the role as ``_coordinator_lost`` says, not with a traceback."""
        try:
            yield
        except replica.ReplicaError:
            raise
        except RuntimeError as exc:  # torch's DistStoreError and DistNetworkError are RuntimeErrors
            self._store_failed(exc)

    def _store_failed(self, exc: RuntimeError) -> None:
        """A store call of the role's own thread failed: if the store stays unreachable for
        timing.STORE_LOST, the coordinator is gone (``_coordinator_lost``); else ``exc`` was
        something else, and it is raised again."""
        deadline = Deadline.after(timing.STORE_LOST)
        while not deadline.expired:
            try:
                self.store.reconnect(timing.HEARTBEAT_IO).get(keys.generation())
            except (RuntimeError, OSError):  # still unreachable
                pause(_STORE_RETRY, deadline=deadline)
                continue
            raise exc  # the store answers: the failure was something else
        self._coordinator_lost(exc)

    def _report_fatal(self, exc: Exception) -> None:
        """An error no failover can fix (the roles disagree on the model): the job must stop."""
        message = f"{self.role} rank {self.rank}: {exc}"
        logger.error("[%s rank %d] fatal: %s", self.role, self.rank, exc)
        self.store.put(keys.fatal(), Text(value=message))

    def _watch(self) -> None:
        """The role's liveness, from the moment it joined. The beat itself comes from a
        native thread (``JobStore.heartbeat``: a Python thread waiting for the GIL behind
        a busy main thread was silent for seconds on a loaded machine); this thread tells
        it the interpreter lives, every HEARTBEAT_PERIOD, on a store connection of its own
        (the role's shared one sits in blocking waits for seconds). It also stops a
        trainer whose rank the coordinator gave to another process (declared dead:
        frozen, partitioned), gets a survivor out of a collective with a dead peer,
        and ends the role when the store stays unreachable (the coordinator is gone).
        An error is logged and the watch goes on (reconnecting)."""
        try:  # aimed from the first beat where the coordinator has an endpoint
            published = self.store.own().get(keys.liveness())
            aimed, endpoint = (published.value, _endpoint(published.value)) if published is not None else (None, None)
        except Exception as exc:  # noqa: BLE001 - the store path beats meanwhile; the loop looks again
            logger.warning("[%s rank %d] no liveness endpoint yet (%s)", self.role, self.rank, exc)
            aimed, endpoint = None, None
        beat = self.store.heartbeat(self.member, period=timing.HEARTBEAT_PERIOD, io_timeout=timing.HEARTBEAT_IO,
                                    python_grace=timing.PYTHON_GRACE, store_after=timing.LIVENESS_STORE_AFTER,
                                    store_period=timing.LIVENESS_STORE_PERIOD, liveness=endpoint)
        self._beat = beat
        hint_generation(self.store, self._fresh_generation)
        store: JobStore | None = None
        failures = 0
        failing_since = 0.0
        beats_failing = False
        aimed_at = time.monotonic() if endpoint is not None else -float("inf")  # aimed: the address the beat goes to
        try:
            while not self._stop.is_set():
                beat.touch()
                if (beat.failing_for > timing.HEARTBEAT_IO.total_seconds()) != beats_failing:
                    beats_failing = not beats_failing
                    logger.warning("[%s rank %d] heartbeats %s", self.role, self.rank,
                                   f"fail: {beat.last_error}" if beats_failing else "get through again")
                try:
                    if store is None:
                        store = self.store.reconnect(timing.HEARTBEAT_IO)
                    reaim = timing.LIVENESS_REAIM.total_seconds()
                    if beat.reply_age > reaim and time.monotonic() - aimed_at > reaim:
                        aimed_at = time.monotonic()  # first, and while no answer comes: the coordinator may have moved
                        aimed = aim_beats([beat], store, aimed, f"[{self.role} rank {self.rank}]")
                    if self._superseded(store):
                        self._fenced_exit()
                    if self.group is not None and self.role == Role.TRAINER and \
                            self.group.errored is None and self._failover_announced(store):
                        # NCCL does not fail a collective whose peer died, nor does gloo before its timeout
                        # when the peer's host is lost (no reset): get this survivor out of it.
                        self.group.abort("the coordinator announced a failover")
                    failures = 0
                except Exception as exc:  # noqa: BLE001 - the watch must never end the thread
                    failures += 1
                    failing_since = failing_since if failures > 1 else time.monotonic()
                    if failures == 1 or failures % _HEARTBEAT_LOG_EVERY == 0:
                        logger.warning("[%s rank %d] the job store does not answer (%d in a row): %s; beats: %s",
                                       self.role, self.rank, failures, exc, beat.last_error or "getting through")
                    store = None
                    if time.monotonic() - failing_since > timing.STORE_LOST.total_seconds():
                        self._coordinator_lost(exc)
                self._stop.wait(timing.HEARTBEAT_PERIOD.total_seconds())
        finally:
            hint_generation(self.store, None)
            beat.stop()

    def _fresh_generation(self) -> int | None:
        """The generation number the coordinator's last liveness answer carried, while that
        answer is fresh (LIVENESS_FRESH); None otherwise (the store is asked)."""
        beat = self._beat
        if beat is None or beat.reply_age > timing.LIVENESS_FRESH.total_seconds() or beat.generation < 0:
            return None
        return beat.generation

    def _fenced_exit(self) -> None:
        """This trainer was declared dead and replaced: whatever it does now would be a
        zombie's. Exit at once (the standbys and engines refuse its epoch anyway)."""
        logger.error("[trainer rank %d] this process was declared dead and its rank given to another "
                     "process; it stops now (exit code %d)", self.rank, ExitCode.FENCED)
        exit_now(ExitCode.FENCED)
