"""A role's side of a failover (``Recovery``): it watches the generation (announced
failovers, its own replacement), heartbeats to the coordinator, waits as a standby for its
promotion, and has a survivor's state rolled back to the fixed commit to join the next
process-group generation; a role whose job store went away ends (``ExitCode.COORDINATOR_LOST``)."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import NoReturn

import replica
from replica.errors import StoreWaitTimeoutError
from replica.jobstore import Flag, Generation, HeartbeatSender, JobStore, Promotion, Regroup, Stamp, keys
from replica.jobstore.commit import EpochRecord, hint_generation
from replica.roles import timing
from replica.roles.env import Role, RoleState, process_group
from replica.roles.exits import ExitCode, exit_now
from replica.timing import Deadline, pause

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


def aim_beats(senders: Sequence[HeartbeatSender], store: JobStore, aimed: str | None, who: str) -> str | None:
    """Point the beats of ``senders`` at the liveness endpoint the coordinator published,
    if it moved from ``aimed``; returns the address aimed at (None: none published, the
    beats stay in the store). ``who`` names them in the log."""
    published = store.get(keys.liveness())
    if published is None or published.value == aimed:
        return aimed
    try:
        endpoint = _endpoint(published.value)
        for sender in senders:
            sender.aim(*endpoint)
    except (RuntimeError, ValueError) as exc:  # unresolvable here: the store path goes on
        logger.warning(
            "%s cannot beat to the liveness endpoint %s (%s); beating to the job store", who, published.value, exc
        )
        return aimed
    logger.info("%s beating to the liveness endpoint %s", who, published.value)
    return published.value


class Recovery:
    """A role process's side of every failover, held by its ``replica.roles.runtime.Job``.

    Owns: the role's view of the coordinator's generation record (an ``EpochRecord``), the
    newest generation it failed to join, and the watch: a thread started by ``start``,
    which keeps the native heartbeat going and aimed at the coordinator's liveness endpoint,
    from the join to ``close``, and gets a survivor out of a collective with a dead peer
    (it aborts the group's generation once a failover is announced).

    Decides: whether a failover was announced (``failover_announced``); whether this
    process was declared dead and its rank given to another (it then exits,
    ``ExitCode.FENCED``); which generation a survivor (``rejoin``) or a promoted standby
    (``wait_promotion``, ``join_promoted``) joins and the commit it resumes from; and that
    the job store is gone (``store_guard``, the watch): the coordinator died, the held
    versions are exported (``export_held``) and the role exits (``ExitCode.COORDINATOR_LOST``).

    The training state is not its own: it rolls back or restores through the callables the
    job gives it. It reads the role and the process group as they are at each call
    (``role``: a ``RoleState``; the group comes after the join, the role changes at a
    promotion). Its waits and periods are ``replica.roles.timing``'s, read at each use."""

    def __init__(
        self,
        role: RoleState,
        *,
        store: JobStore,
        rank: int,
        member: int,
        export_dir: str,
        export_held: Callable[[], None],
    ):
        """``store``: the role's connection to the job store (its attempt's); ``rank``, ``member``:
        the role's rank and member id (its join's); ``export_dir``: where the versions go when the
        store is lost, which ``export_held()`` writes them to."""
        self._role = role
        self._store = store
        self._rank = rank
        self._member = member
        self._export_dir = export_dir
        self._export_held = export_held
        self._epochs = EpochRecord(store)  # the generation record, read whole only when its number moved
        self._failed_generation = -1  # the newest generation this process could not join
        self._stop = threading.Event()
        self._lost = threading.Lock()  # held once the job store is found gone (the role is exiting)
        self._sender: HeartbeatSender | None = None  # sends the role's beats, once the watch started it
        self._watcher = threading.Thread(target=self._watch, daemon=True, name="replica-watch")

    def start(self) -> None:
        """Start the watch: the role beats from now on (the coordinator's deadline runs from the join)."""
        self._watcher.start()

    def close(self) -> None:
        """Stop the watch and its heartbeat (waiting for them, unless called from the watch)."""
        self._stop.set()
        if threading.current_thread() is not self._watcher:
            # Its native beat thread is joined here, not torn down with the interpreter.
            self._watcher.join(timeout=(timing.HEARTBEAT_IO + timing.HEARTBEAT_PERIOD).total_seconds() * 2)

    def failover_announced(self, store: JobStore | None = None) -> bool:
        """Whether the coordinator announced a generation after the group's (over ``store``, a
        connection of the caller's thread, if given)."""
        return self._generation_number(store) > process_group(self._role).generation

    def _superseded(self, store: JobStore | None = None) -> bool:
        """True when the coordinator gave this trainer's rank to another process. Never on a
        hint alone (``hint_generation``): a standby promoted a moment ago still holds the
        generation before its promotion, which the liveness answers may still vouch for (the
        endpoint learns the new number after the store): what would stop it is read again."""

        def given_away(current: Generation | None) -> bool:
            return (
                self._role.role == Role.TRAINER
                and current is not None
                and self._rank < len(current.trainers)
                and current.trainers[self._rank] not in (-1, self._member)
            )

        return given_away(self._epochs.generation(store)) and given_away(self._epochs.generation(store, fresh=True))

    def _announced(self) -> tuple[int, int]:
        """The newer generation and the commit it resumes from. A step that failed
        without one (a rendezvous or collective timed out on a loaded machine, no
        one died) waits for the coordinator's decision: a death is announced, or
        the slow peer catches up and the step is simply redone in a fresh generation.
        Blocks in the store until the next generation's failover record exists."""
        floor = max(process_group(self._role).generation, self._failed_generation)
        asked = False

        def announced(store: JobStore) -> tuple[int, int] | None:
            nonlocal asked
            current = store.get(keys.generation())
            if current is not None and current.number > floor:
                return current.number, store.wait(keys.failover(current.number), timing.ROLE_WAIT).commit
            if store.has(keys.finished()):
                return _JOB_ENDED  # it failed, or starts again from its start or its floor
            if current is not None and not asked:  # no death announced (yet): ask for a fresh generation
                store.put(keys.regroup(self._rank), Regroup(rank=self._rank, generation=current.number))
                store.count(keys.regroup_count(), 1)
                asked = True
            return None

        try:
            # Woken by the next generation's failover record; the job's end is looked for every
            # timing.STANDBY_LOOK (a store waits for every key it is given, not for the first).
            found = self._store.wait_for(
                announced,
                wake=lambda: [keys.failover(floor + 1)],
                timeout=timing.ROLE_WAIT,
                what="failover or regroup",
                every=timing.STANDBY_LOOK,
            )
        except StoreWaitTimeoutError:
            raise replica.ReplicaError(
                f"the step failed but no coordinator announced a failover or a regroup within {timing.ROLE_WAIT}"
            ) from None
        if found is _JOB_ENDED:
            # Nothing to resume here: the coordinator said why. Leave now, not at its linger's end.
            logger.error(
                "[%s rank %d] the job ended while this process waited for a failover after its failed "
                "step; it stops (exit code %d)",
                self._role.role,
                self._rank,
                ExitCode.FAILED,
            )
            exit_now(ExitCode.FAILED)
        return found

    def rejoin(self, rollback: Callable[[int], int]) -> tuple[int, int]:
        """A survivor's failover, after its step failed: wait for the coordinator's decision,
        ``rollback(commit)`` to the commit it fixed (returns the step restored) and join the
        new generation, again until one is joined. Returns the step restored and the
        generation joined. A trainer whose rank was given away exits (``ExitCode.FENCED``)."""
        while True:
            generation, commit = self._announced()
            if self._superseded():
                # Declared dead (a missed deadline) while alive: its standby has taken the rank over.
                self.fenced_exit()
            restored = rollback(commit)
            if self._configure(generation):
                return restored, generation

    def _configure(self, generation: int) -> bool:
        """Join ``generation``; False if it failed or was superseded before every member
        arrived (the caller then waits for the next one)."""
        group = process_group(self._role)
        try:
            group.configure(
                generation, ready_timeout=timing.ROLE_WAIT, ready_abort=lambda: self._generation_number() > generation
            )
            return True
        except (replica.ReplicaError, RuntimeError) as exc:  # gloo reports a failed rendezvous as RuntimeError
            self._failed_generation = max(self._failed_generation, generation)
            logger.warning(
                "[%s rank %d] generation %d could not be joined (%s); waiting for the next",
                self._role.role,
                self._rank,
                generation,
                exc,
            )
            return False

    def _generation_number(self, store: JobStore | None = None) -> int:
        """The coordinator's current generation (-1 while none is readable)."""
        current = self._epochs.generation(store)
        return -1 if current is None else current.number

    def wait_promotion(
        self, look: Callable[[JobStore], None], fire: Callable[[JobStore], None] | None
    ) -> tuple[int, int] | None:
        """Wait (on a store connection of this thread's own) until the coordinator promotes
        this standby: the generation it is promoted in and the commit that resumes from; None
        when the job ended first. Each look at the store calls ``look(store)`` first (the job
        serves an export request), then, unless the job ended, ``fire(store)`` (the standby's
        injected faults: with them the store is looked at every STANDBY_POLL)."""
        key = keys.promote(self._rank)
        generation = -1  # the newest generation seen: a promotion comes with the next one

        def promoted(store: JobStore) -> Promotion | Flag | None:
            nonlocal generation
            generation = max(generation, self._generation_number(store))
            promotion = store.get(key)
            if promotion is not None and promotion.member == self._member:  # meant for this standby only
                return promotion
            look(store)
            if store.has(keys.finished()):
                return Flag()
            if fire is not None:
                fire(store)
            return None

        with self.store_guard():
            # Woken by the next generation's failover record (written before its promotion);
            # the job's end and an export request are looked for every timing.STANDBY_LOOK.
            # While a fresh liveness answer says the generation did not move, no promotion can have
            # come: the store is not asked for one (1,024 waiting standbys asked ~100,000 times a second).
            promotion = self._store.wait_for(
                promoted,
                wake=lambda: [keys.failover(generation + 1)],
                timeout=timing.PROMOTION_WAIT,
                what="promotion",
                every=timing.STANDBY_POLL if fire else timing.STANDBY_LOOK,
                poll=timing.STANDBY_POLL,
                quiet=lambda: self._fresh_generation() == generation,
                quiet_every=timing.STANDBY_POLL if fire else timing.STANDBY_QUIET_LOOK,
            )
        if isinstance(promotion, Flag):
            return None
        return promotion.generation, self._store.wait(keys.failover(promotion.generation), timing.ROLE_WAIT).commit

    def join_promoted(self, generation: int, commit: int, restore: Callable[[int], None]) -> tuple[int, int]:
        """A promoted standby whose state was restored to ``commit``, the commit of
        ``generation``: join it; when a regroup or another death overtook it, wait for the
        next, ``restore(commit)`` to its commit and join that. Returns the generation joined
        and its commit."""
        self._store.put(keys.restored(generation), Stamp(at=time.time()))
        while not self._configure(generation):  # a regroup or another death overtook this generation
            generation, commit = self._announced()
            restore(commit)
        self._store.put(keys.reconnected(generation), Stamp(at=time.time()))
        return generation, commit

    def _coordinator_lost(self, exc: BaseException) -> NoReturn:
        """The job store is unreachable (the coordinator died): nobody can decide a failover
        any more. Standbys and trainers write every version they hold to the export folder
        (the newest step all ranks wrote is where ``replica launch --resume`` starts); every
        role exits (ExitCode.COORDINATOR_LOST). Runs once, from whichever thread finds it first."""
        if not self._lost.acquire(blocking=False):  # another thread is at it, and exits the process
            while True:
                pause(timedelta(seconds=1))
        role = self._role.role
        logger.error(
            "[%s rank %d] the job store is gone (%s): the coordinator died or is cut off; this %s "
            "exports the versions it holds to %s and stops",
            role,
            self._rank,
            exc,
            role,
            self._export_dir,
        )
        self._export_held()
        exit_now(ExitCode.COORDINATOR_LOST)

    @contextlib.contextmanager
    def store_guard(self) -> Iterator[None]:
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
                self._store.reconnect(timing.HEARTBEAT_IO).get(keys.generation())
            except (RuntimeError, OSError):  # still unreachable
                pause(_STORE_RETRY, deadline=deadline)
                continue
            raise exc  # the store answers: the failure was something else
        self._coordinator_lost(exc)

    def _watch(self) -> None:
        """The role's liveness, from the moment it joined. The beat itself comes from a
        native thread (``JobStore.heartbeat_sender``: a Python thread waiting for the GIL behind
        a busy main thread was silent for seconds on a loaded machine); this thread tells
        it the interpreter lives, every HEARTBEAT_PERIOD, on a store connection of its own
        (the role's shared one sits in blocking waits for seconds). It also stops a
        trainer whose rank the coordinator gave to another process (declared dead:
        frozen, partitioned), gets a survivor out of a collective with a dead peer,
        and ends the role when the store stays unreachable (the coordinator is gone).
        An error is logged and the watch goes on (reconnecting)."""
        try:  # aimed from the first beat where the coordinator has an endpoint
            published = self._store.own().get(keys.liveness())
            aimed, endpoint = (published.value, _endpoint(published.value)) if published is not None else (None, None)
        except Exception as exc:  # noqa: BLE001 - the store path beats meanwhile; the loop looks again
            logger.warning("[%s rank %d] no liveness endpoint yet (%s)", self._role.role, self._rank, exc)
            aimed, endpoint = None, None
        sender = self._store.heartbeat_sender(
            self._member,
            period=timing.HEARTBEAT_PERIOD,
            io_timeout=timing.HEARTBEAT_IO,
            python_grace=timing.PYTHON_GRACE,
            store_after=timing.LIVENESS_STORE_AFTER,
            store_period=timing.LIVENESS_STORE_PERIOD,
            liveness=endpoint,
        )
        self._sender = sender
        hint_generation(self._store, self._fresh_generation)
        store: JobStore | None = None
        failures = 0
        failing_since = 0.0
        beats_failing = False
        aimed_at = time.monotonic() if endpoint is not None else -float("inf")  # aimed: the address the beat goes to
        try:
            while not self._stop.is_set():
                sender.touch()
                if (sender.failing_for > timing.HEARTBEAT_IO.total_seconds()) != beats_failing:
                    beats_failing = not beats_failing
                    logger.warning(
                        "[%s rank %d] heartbeats %s",
                        self._role.role,
                        self._rank,
                        f"fail: {sender.last_error}" if beats_failing else "get through again",
                    )
                try:
                    if store is None:
                        store = self._store.reconnect(timing.HEARTBEAT_IO)
                    reaim = timing.LIVENESS_REAIM.total_seconds()
                    if sender.reply_age > reaim and time.monotonic() - aimed_at > reaim:
                        aimed_at = time.monotonic()  # first, and while no answer comes: the coordinator may have moved
                        aimed = aim_beats([sender], store, aimed, f"[{self._role.role} rank {self._rank}]")
                    if self._superseded(store):
                        self.fenced_exit()
                    group = self._role.group
                    if (
                        group is not None
                        and self._role.role == Role.TRAINER
                        and group.errored is None
                        and self.failover_announced(store)
                    ):
                        # NCCL does not fail a collective whose peer died, nor does gloo before its timeout
                        # when the peer's host is lost (no reset): get this survivor out of it.
                        group.abort("the coordinator announced a failover")
                    failures = 0
                except Exception as exc:  # noqa: BLE001 - the watch must never end the thread
                    failures += 1
                    failing_since = failing_since if failures > 1 else time.monotonic()
                    if failures == 1 or failures % _HEARTBEAT_LOG_EVERY == 0:
                        logger.warning(
                            "[%s rank %d] the job store does not answer (%d in a row): %s; beats: %s",
                            self._role.role,
                            self._rank,
                            failures,
                            exc,
                            sender.last_error or "getting through",
                        )
                    store = None
                    if time.monotonic() - failing_since > timing.STORE_LOST.total_seconds():
                        self._coordinator_lost(exc)
                self._stop.wait(timing.HEARTBEAT_PERIOD.total_seconds())
        finally:
            hint_generation(self._store, None)
            sender.stop()

    def _fresh_generation(self) -> int | None:
        """The generation number the coordinator's last liveness answer carried, while that
        answer is fresh (LIVENESS_FRESH); None otherwise (the store is asked)."""
        sender = self._sender
        if sender is None or sender.reply_age > timing.LIVENESS_FRESH.total_seconds() or sender.generation < 0:
            return None
        return sender.generation

    def fenced_exit(self) -> NoReturn:
        """This trainer was declared dead and replaced: whatever it does now would be a
        zombie's. Exit at once (the standbys and engines refuse its epoch anyway)."""
        logger.error(
            "[trainer rank %d] this process was declared dead and its rank given to another "
            "process; it stops now (exit code %d)",
            self._rank,
            ExitCode.FENCED,
        )
        exit_now(ExitCode.FENCED)
