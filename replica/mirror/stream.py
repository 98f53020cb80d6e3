"""The trainer side's background sender: streams each snapshot to the rank's
standby in buckets and collects its acknowledgement, off the training thread."""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

from replica.config import Config
from replica.errors import (
    FencedError,
    LayoutMismatchError,
    ReplicaError,
    ResendsExhaustedError,
    StandbyLostError,
    TransportError,
)
from replica.jobstore import Epoch, Registration
from replica.jobstore.commit import NO_EPOCH, CommitRecord
from replica.mirror.repair import serve_repairs
from replica.session.backends import backend_name
from replica.session.bucketstream import RETRY_FIRST, MirrorFaults, Outgoing, open_session, registration_backoff
from replica.session.protocol import fingerprint_int
from replica.state.layout import StateLayout
from replica.state.snapshot import Snapshot
from replica.timing import Deadline
from replica.transport import Connection, Transport
from replica.transport.base import memory_kind

__all__ = ["MirrorFaults", "MirrorStream", "StreamStats"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class StreamStats:
    """What the stream did, for tests and benchmarks."""

    acked_step: int | None = None
    num_acked: int = 0
    bytes_sent: int = 0
    resent_buckets: int = 0
    reattached: int = 0
    unprotected_steps: int = 0  # steps acknowledged by the trainer itself, with no standby
    stream_s: list[float] = field(default_factory=list)
    # Where each stream_s went: until its last bucket was posted (BEGIN, the sends, and
    # waits for the window when there are more buckets than it holds), then until every
    # send had finished (the bytes in flight), then until the standby's answer (its
    # verification of the last buckets, the ACK's way back).
    post_s: list[float] = field(default_factory=list)
    flush_s: list[float] = field(default_factory=list)
    reply_s: list[float] = field(default_factory=list)
    repaired_buckets: int = 0  # buckets sent again because the standby found them changed in its memory
    resent_steps: int = 0  # steps sent again: the standby that answered left before recording them


class MirrorStream:
    """Owns the connection to one standby; ``submit(snapshot, step)`` queues a stream."""

    def __init__(self, *, rank: int, record: CommitRecord, config: Config, faults: MirrorFaults):
        self.rank = rank
        self.stats = StreamStats()
        self._record = record
        self._config = config
        self._faults = faults
        self._queue: queue.Queue[tuple[Snapshot, int, Epoch] | None] = queue.Queue()
        self._idle = threading.Condition()
        self._queued: dict[int, int] = {}  # id(snapshot) -> streams of it queued or in flight
        self._error: ReplicaError | None = None
        self._closing = threading.Event()
        self._transport: Transport | None = None
        self._registration: Registration | None = None  # the registration of the standby connected to
        self._lost: Registration | None = None  # the registration of the last standby lost
        self._conn: Connection | None = None
        self._layout_sent: StateLayout | None = None
        self._streamed: list[Snapshot] = []  # the snapshots streamed (the Replicator's two): repairs come from them
        self._current: Snapshot | None = None  # the one the stream thread works on
        self._answered: tuple[int, str] | None = None  # (step, nonce): the last ACKED and the standby that sent it
        self._thread = threading.Thread(target=self._run, name=f"replica-mirror-stream-{rank}", daemon=True)
        self._thread.start()
        self._repairs = threading.Thread(target=self._serve_repairs, name=f"replica-mirror-repair-{rank}", daemon=True)
        self._repairs.start()

    @property
    def error(self) -> ReplicaError | None:
        return self._error

    def submit(self, snapshot: Snapshot, step: int, epoch: Epoch = NO_EPOCH) -> None:
        """Queue the stream of ``snapshot`` (step ``step``, computed by the trainer of ``epoch``)."""
        with self._idle:
            self._queued[id(snapshot)] = self._queued.get(id(snapshot), 0) + 1
        self._queue.put((snapshot, step, epoch))

    def resend_unrecorded(self, snapshot: Snapshot, step: int, epoch: Epoch = NO_EPOCH) -> bool:
        """Queue ``snapshot`` (step ``step``) again when its stream was answered but the
        answer never reached the job store: a standby acknowledges in the store only after
        its ACKED, so one that dies in between leaves a step no standby records. That is
        so when the rank's standby does not hold ``step`` and is not the one that answered
        (a replacement registered) or the rank was marked unprotected. Nothing while a
        stream of ``snapshot`` is queued or in flight, or after a stream error. Returns
        True if a stream was queued."""
        with self._idle:
            if self._queued.get(id(snapshot), 0) or self._error is not None:
                return False
        answered = self._answered
        if answered is None or answered[0] != step or self._record.standby_holds(self.rank, step):
            return False
        current = self._record.registration(self.rank)
        if current is not None and current.nonce == answered[1] and not self._record.unprotected(self.rank):
            return False  # the standby that answered is only slow to record it
        logger.warning(
            "[trainer rank %d step %d] the standby that received the step left before recording it; "
            "sending the step again",
            self.rank,
            step,
        )
        self.stats.resent_steps += 1
        self.submit(snapshot, step, epoch)
        return True

    def wait_released(self, snapshot: Snapshot, timeout: timedelta) -> bool:
        """True once no stream of ``snapshot`` is queued or in flight (it is free to
        overwrite), while streams of the other buffer may still be."""
        with self._idle:
            return self._idle.wait_for(lambda: self._queued.get(id(snapshot), 0) == 0, timeout.total_seconds())

    def close(self) -> None:
        self._closing.set()
        self._queue.put(None)
        self._thread.join(timeout=self._config.timeout.total_seconds() + 5)
        if self._transport is not None:
            self._transport.close()
        self._repairs.join(timeout=self._config.timeout.total_seconds() + 5)

    # --- the repair thread: answers a standby that found its copy changed in memory ---

    def _serve_repairs(self) -> None:
        def repaired(n: int) -> None:
            self.stats.repaired_buckets += n

        serve_repairs(
            lambda: self._conn,
            lambda: list(self._streamed),
            stop=self._closing,
            timeout=self._config.timeout,
            who=f"trainer rank {self.rank}",
            repaired=repaired,
        )

    def _keep_digests(self, snapshot: Snapshot | None) -> None:
        """Give ``snapshot`` its digests before anything acknowledges it, when no send
        carried them (no standby; a stream cut short), so a rollback can check it."""
        if self._config.verify and snapshot is not None and snapshot.digests is None:
            snapshot.digests = snapshot.compute_digests()

    # --- the stream thread ---

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            snapshot, step, epoch = item
            self._current = snapshot
            try:
                if self._error is None:
                    self._stream_or_reattach(snapshot, step, epoch)
            except ReplicaError as exc:
                kept = LayoutMismatchError | StandbyLostError | FencedError
                self._error = (
                    exc
                    if isinstance(exc, kept)
                    else StandbyLostError(
                        f"the standby of rank {self.rank} is lost at step {step}: {exc}; this rank is unprotected "
                        f"(last global commit: {self._record.last()})"
                    )
                )
                self._error.__cause__ = exc
                logger.error("[trainer rank %d step %d] %s", self.rank, step, self._error)
                if self._conn is not None:
                    self._conn.close()
            except Exception as exc:
                self._error = ReplicaError(f"mirror stream of rank {self.rank} failed at step {step}: {exc!r}")
                self._error.__cause__ = exc
                logger.exception("[trainer rank %d step %d] mirror stream failed", self.rank, step)
            finally:
                with self._idle:
                    self._queued[id(snapshot)] -= 1
                    self._idle.notify_all()

    def _superseded(self, step: int, epoch: Epoch) -> bool:
        """True when the coordinator has moved past ``epoch`` to a later generation of this
        same trainer (a failover elsewhere: the step is redone, its stream is moot).
        Raises FencedError when the rank belongs to another process now."""
        current = self._record.current_epoch(self.rank)
        if current is not None and current != epoch and epoch != NO_EPOCH:
            # Never stop or skip on the liveness hint alone: a trainer promoted a moment ago streams in
            # an epoch newer than the generation its answers may still vouch for.
            current = self._record.current_epoch(self.rank, fresh=True)
        if current is None or current == epoch or epoch == NO_EPOCH:
            return False
        if current.member != epoch.member:
            raise FencedError(
                f"trainer rank {self.rank} ({epoch}) was declared dead; the rank belongs to "
                f"{current} now, so this process must stop (step {step} is not mirrored)"
            )
        logger.info(
            "[trainer rank %d step %d] the step ran in generation %d, the job is in %d: not mirrored (it is redone)",
            self.rank,
            step,
            epoch.generation,
            current.generation,
        )
        return True

    def _stream_or_reattach(self, snapshot: Snapshot, step: int, epoch: Epoch) -> None:
        """Stream to the rank's standby. A standby not registered yet, or one that
        cannot be reached (or is lost), is waited for: its registration is tried again
        with backoff, a newer one at once, until ``standby_wait`` runs out (at least
        ``timeout`` for a first registration); then StandbyLostError. A rank the
        coordinator marked unprotected acknowledges its own snapshot. A step of a
        superseded generation is dropped; a fenced trainer raises."""
        if self._superseded(step, epoch):
            return
        retry, tried = registration_backoff(), None
        first: TransportError | None = None  # the failure that left the rank unprotected
        deadline, budget = None, timedelta(0)  # from the first failure, or while none is registered
        while True:
            if self._conn is None and self._acknowledge_unprotected(step, epoch):
                return
            current = self._registration if self._conn is not None else self._record.registration(self.rank)
            if current is not None and (current != tried or retry.due()):
                if current != tried:
                    retry, tried = registration_backoff(), current
                try:
                    self._stream(snapshot, step, epoch, current)
                except (LayoutMismatchError, StandbyLostError):
                    raise
                except (FencedError, TransportError) as exc:
                    if self._superseded(step, epoch):  # refused (or cut off) because the job moved on
                        self._drop()
                        return
                    if isinstance(exc, FencedError):
                        raise
                    self._lost = current
                    self._drop()
                    pause = retry.failed()
                    if first is None:
                        logger.error(
                            "[trainer rank %d step %d] the standby is lost (%s); rank %d is UNPROTECTED "
                            "until it is reached again or a replacement registers (waiting up to %s)",
                            self.rank,
                            step,
                            exc,
                            self.rank,
                            self._config.standby_wait,
                        )
                        first, budget = exc, self._config.standby_wait
                        deadline = Deadline.after(budget)
                    else:
                        logger.info(
                            "[trainer rank %d step %d] the standby at %s is still unreachable (%s); next try in %s",
                            self.rank,
                            step,
                            current,
                            exc,
                            pause,
                        )
                    if self._acknowledge_unprotected(step, epoch):
                        return
                    if self._config.standby_wait <= timedelta(0):
                        raise
                    continue
                if first is not None:
                    logger.warning(
                        "[trainer rank %d step %d] protected again by the standby at %s", self.rank, step, current
                    )
                    self.stats.reattached += 1
                return
            if deadline is None:  # no standby registered yet
                budget = max(self._config.timeout, self._config.standby_wait)
                deadline = Deadline.after(budget)
            if deadline.expired or self._closing.is_set():
                raise StandbyLostError(
                    f"no standby of rank {self.rank} could be reached within {budget}"
                    + (f" after {first}" if first is not None else "")
                ) from first
            if self._superseded(step, epoch):
                return
            self._closing.wait(RETRY_FIRST.total_seconds())  # a close ends the wait at once

    def _acknowledge_unprotected(self, step: int, epoch: Epoch) -> bool:
        """When the coordinator says no standby will come for this rank (and none has
        registered since the last one was lost), acknowledge the snapshot here: the
        survivors can still roll back to every commit, this rank cannot be recovered."""
        if not self._record.unprotected(self.rank) or self._record.registration(self.rank) not in (None, self._lost):
            return False
        self._keep_digests(self._current)
        self._record.acknowledge(self.rank, step, epoch)
        self.stats.unprotected_steps += 1
        if self.stats.unprotected_steps == 1:
            logger.error(
                "[trainer rank %d step %d] rank %d is UNPROTECTED: it has no standby; training goes on, "
                "but if this trainer dies the job cannot recover it",
                self.rank,
                step,
                self.rank,
            )
        return True

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._transport is not None:
            self._transport.close()
        self._conn = self._transport = self._registration = None

    def _connect(self, registration: Registration, snapshot: Snapshot, epoch: Epoch) -> Connection:
        self._drop()
        self._registration = registration
        self._transport, conn = open_session(
            registration,
            memory=memory_kind(snapshot.buffer),
            config=self._config,
            epoch=epoch,
            layout=snapshot.layout,
            peer=f"the standby of rank {self.rank}",
            mismatch="this trainer's state layout: it mirrors or would restore into a different model, optimizer "
            "or world size (its log names the first difference)",
        )
        logger.info(
            "[trainer rank %d] mirroring %d bytes in %d buckets to %s over %s",
            self.rank,
            snapshot.layout.total_bytes,
            len(snapshot.layout.buckets()),
            conn.peer,
            backend_name(self._transport),
        )
        return conn

    def _stream(self, snapshot: Snapshot, step: int, epoch: Epoch, registration: Registration) -> None:
        start = time.perf_counter()
        if self._conn is None or self._layout_sent is not snapshot.layout:
            self._conn = self._connect(registration, snapshot, epoch)
            self._layout_sent = snapshot.layout
        layout = snapshot.layout
        if snapshot not in self._streamed:  # the Replicator's two buffers: a repair may need either
            self._streamed = [*self._streamed[-1:], snapshot]
        # The digests the pack took (Snapshot.capture) travel in the bucket headers: no
        # pass over the bytes here. A snapshot without them has them taken by the sends
        # and kept, before the reply: the standby acknowledges first.
        out = Outgoing(
            self._conn,
            snapshot.buffer,
            layout.buckets(),
            step=step,
            epoch=epoch,
            fingerprint=fingerprint_int(layout.fingerprint),
            config=self._config,
            faults=self._faults,
            counts=self.stats,
            peer=f"the standby of rank {self.rank}",
            digests=snapshot.digests,
            ready=snapshot.ready,
        )
        out.send_all()
        if self._config.verify and snapshot.digests is None:
            snapshot.digests = out.digests
        try:
            out.settle()
        except ResendsExhaustedError as exc:
            # The buckets the standby kept refusing may have changed here, in this rank's own
            # memory, since the pack: said so, and the zeros past the extras blob (which no
            # later capture rewrites) mended before the next try (Snapshot.bad_buckets).
            bad = snapshot.bad_buckets(exc.buckets)
            if bad:
                logger.error(
                    "[trainer rank %d step %d] bucket(s) %s of its own snapshot changed in memory since the pack",
                    self.rank,
                    step,
                    bad,
                )
            raise
        self._answered = (step, registration.nonce)
        self.stats.acked_step = step
        self.stats.num_acked += 1
        end = time.perf_counter()
        self.stats.stream_s.append(end - start)
        self.stats.post_s.append(out.posted_at - start)
        self.stats.flush_s.append(out.flushed_at - out.posted_at)
        self.stats.reply_s.append(end - out.flushed_at)
