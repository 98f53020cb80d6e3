"""The trainer side's background sender: streams each snapshot to the rank's
standby in buckets and collects its acknowledgement, off the training thread."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from datetime import timedelta

from replica.backends import backend_class, make_backend
from replica.commit import NO_EPOCH, CommitRecord
from replica.config import Config
from replica.errors import FencedError, LayoutMismatchError, ReplicaError, StandbyLostError, TransportError
from replica.jobstate import Epoch
from replica.layout import StateLayout
from replica.protocol import (
    BEGIN,
    BUCKET_BASE,
    Begin,
    Reply,
    Status,
    as_tensor,
    fingerprint_int,
    recv_reply,
    send_epoch,
    send_layout,
)
from replica.repair import serve_repairs
from replica.snapshot import Snapshot
from replica.transport import Connection, Transport
from replica.transport.base import memory_kind

__all__ = ["MirrorFaults", "MirrorStream", "StreamStats"]

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class MirrorFaults:
    """Fault injection for tests: ``corrupt_buckets = k`` flips a byte in each of
    the next k buckets after their digest is taken, as a bad link would;
    ``corrupted`` counts how many times that fired."""

    corrupt_buckets: int = 0
    corrupted: int = 0


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
    repaired_buckets: int = 0  # buckets sent again because the standby found them changed in its memory


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
        self._registration: str | None = None  # the registration of the standby connected to
        self._lost: str | None = None  # the registration of the last standby lost
        self._conn: Connection | None = None
        self._layout_sent: StateLayout | None = None
        self._streamed: list[Snapshot] = []  # the snapshots streamed (the Replicator's two): repairs come from them
        self._current: Snapshot | None = None  # the one the stream thread works on
        self._thread = threading.Thread(target=self._run, name=f"replica-mirror-stream-{rank}", daemon=True)
        self._thread.start()
        self._repairs = threading.Thread(target=self._serve_repairs, name=f"replica-mirror-repair-{rank}",
                                         daemon=True)
        self._repairs.start()

    @property
    def error(self) -> ReplicaError | None:
        return self._error

    def submit(self, snapshot: Snapshot, step: int, epoch: Epoch = NO_EPOCH) -> None:
        """Queue the stream of ``snapshot`` (step ``step``, computed by the trainer of ``epoch``)."""
        with self._idle:
            self._queued[id(snapshot)] = self._queued.get(id(snapshot), 0) + 1
        self._queue.put((snapshot, step, epoch))

    def wait_released(self, snapshot: Snapshot, timeout_s: float) -> bool:
        """True once no stream of ``snapshot`` is queued or in flight (it is free to
        overwrite), while streams of the other buffer may still be."""
        with self._idle:
            return self._idle.wait_for(lambda: self._queued.get(id(snapshot), 0) == 0, timeout_s)

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

        serve_repairs(lambda: self._conn, lambda: list(self._streamed), stop=self._closing,
                      timeout=self._config.timeout, who=f"trainer rank {self.rank}", repaired=repaired)

    def _keep_digests(self, snapshot: Snapshot) -> None:
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
                self._error = exc if isinstance(exc, kept) else StandbyLostError(
                    f"the standby of rank {self.rank} is lost at step {step}: {exc}; this rank is unprotected "
                    f"(last global commit: {self._record.last()})")
                self._error.__cause__ = exc
                logger.error("[trainer rank %d step %d] %s", self.rank, step, self._error)
                if self._conn is not None:
                    self._conn.close()
            except Exception as exc:  # noqa: BLE001 - never die silently; the next commit() raises it
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
        if current is None or current == epoch or epoch == NO_EPOCH:
            return False
        if current.member != epoch.member:
            raise FencedError(f"trainer rank {self.rank} ({epoch}) was declared dead; the rank belongs to "
                              f"{current} now, so this process must stop (step {step} is not mirrored)")
        logger.info("[trainer rank %d step %d] the step ran in generation %d, the job is in %d: not mirrored "
                    "(it is redone)", self.rank, step, epoch.generation, current.generation)
        return True

    def _stream_or_reattach(self, snapshot: Snapshot, step: int, epoch: Epoch) -> None:
        """Stream; if the standby is lost, wait up to ``standby_wait`` for a
        replacement and send it this snapshot (the one the next commit needs).
        A rank the coordinator marked unprotected acknowledges its own snapshot.
        A step of a superseded generation is dropped; a fenced trainer raises."""
        if self._superseded(step, epoch):
            return
        if self._conn is None and self._acknowledge_unprotected(step, epoch):
            return
        try:
            self._stream(snapshot, step, epoch)
            return
        except (LayoutMismatchError, StandbyLostError):
            raise
        except (FencedError, TransportError) as exc:
            if self._superseded(step, epoch):  # refused (or cut off) because the job moved on
                self._drop()
                return
            if isinstance(exc, FencedError):
                raise
            self._lost = self._registration
            self._drop()
            if self._acknowledge_unprotected(step, epoch):
                return
            if self._config.standby_wait <= timedelta(0):
                raise
            first = exc
        logger.error("[trainer rank %d step %d] the standby is lost (%s); rank %d is UNPROTECTED until a "
                     "replacement registers (waiting up to %s)", self.rank, step, first, self.rank,
                     self._config.standby_wait)
        deadline = time.monotonic() + self._config.standby_wait.total_seconds()
        while time.monotonic() < deadline and not self._closing.is_set():
            if self._superseded(step, epoch):
                return
            if self._record.registration(self.rank) not in (None, self._lost):
                try:
                    self._stream(snapshot, step, epoch)
                except (LayoutMismatchError, StandbyLostError, FencedError):
                    raise
                except TransportError as exc:  # the replacement died too: keep waiting
                    self._lost = self._registration
                    self._drop()
                    logger.error("[trainer rank %d step %d] replacement standby lost too: %s", self.rank, step, exc)
                    continue
                logger.warning("[trainer rank %d step %d] protected again by the standby at %s", self.rank, step,
                               self._registration)
                self.stats.reattached += 1
                return
            if self._acknowledge_unprotected(step, epoch):
                return
            time.sleep(0.05)
        raise StandbyLostError(f"no standby of rank {self.rank} registered within {self._config.standby_wait} "
                               f"after {first}") from first

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
            logger.error("[trainer rank %d step %d] rank %d is UNPROTECTED: it has no standby; training goes on, "
                         "but if this trainer dies the job cannot recover it", self.rank, step, self.rank)
        return True

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.close()
        if self._transport is not None:
            self._transport.close()
        self._conn = self._transport = self._registration = None

    def _connect(self, snapshot: Snapshot, epoch: Epoch) -> Connection:
        timeout = self._config.timeout
        self._registration = self._record.standby(self.rank, timeout)
        backend, address = self._registration.backend, self._registration.address
        memory = memory_kind(snapshot.buffer)
        if memory not in backend_class(backend).capabilities.memory:
            raise TransportError(f"the standby of rank {self.rank} listens on {backend}, which cannot move "
                                 f"{memory.name} memory")
        self._transport = make_backend(backend, self._config)
        conn = self._transport.connect(address, timeout)
        send_epoch(conn, epoch, timeout)
        send_layout(conn, snapshot.layout, timeout)
        reply = self._reply(conn, -1)
        if reply.status == Status.LAYOUT_MISMATCH:
            raise LayoutMismatchError(f"the standby of rank {self.rank} refused this trainer's state layout: it "
                                      "mirrors or would restore into a different model, optimizer or world size "
                                      "(its log names the first difference)")
        if reply.status == Status.FENCED:
            raise FencedError(f"the standby of rank {self.rank} refused {epoch}: it is not the rank's current one")
        if reply.status != Status.ACCEPTED:
            raise TransportError(f"standby answered {reply.status.name} to the layout")
        logger.info("[trainer rank %d] mirroring %d bytes in %d buckets to %s over %s", self.rank,
                    snapshot.layout.total_bytes, len(snapshot.layout.buckets()), address, backend)
        return conn

    def _reply(self, conn: Connection, step: int) -> Reply:
        reply = recv_reply(conn, self._config.timeout)
        if reply.step != step:
            raise TransportError(f"standby answered for step {reply.step}, expected {step}")
        return reply

    def _stream(self, snapshot: Snapshot, step: int, epoch: Epoch) -> None:
        start = time.perf_counter()
        if self._conn is None or self._layout_sent is not snapshot.layout:
            self._conn = self._connect(snapshot, epoch)
            self._layout_sent = snapshot.layout
        conn, layout, timeout = self._conn, snapshot.layout, self._config.timeout
        buckets = layout.buckets()
        fingerprint = fingerprint_int(layout.fingerprint)
        if snapshot not in self._streamed:  # the Replicator's two buffers: a repair may need either
            self._streamed = [*self._streamed[-1:], snapshot]
        # The digests the sends take anyway (of the snapshot's bytes, before any fault
        # injection) are kept with the snapshot: no second pass over it.
        digests = [0] * len(buckets)
        conn.send(as_tensor(Begin(step=step, num_buckets=len(buckets), epoch=epoch).encode()), tag=BEGIN,
                  timeout=timeout)
        todo = list(range(len(buckets)))
        for attempt in range(self._config.max_resends + 1):
            inflight = deque()
            for i in todo:
                if len(inflight) >= self._config.num_inflight_buckets:
                    header = inflight.popleft().wait(timeout)
                    digests[header.bucket] = header.digest
                lo, hi = buckets[i]
                if self._faults.corrupt_buckets > 0:
                    self._faults.corrupt_buckets -= 1
                    self._faults.corrupted += 1
                    conn.faults.corrupt_next = 1
                inflight.append(conn.isend(snapshot.buffer[lo:hi], tag=BUCKET_BASE + i, step=step, bucket=i,
                                           offset=lo, fingerprint=fingerprint))
                self.stats.bytes_sent += hi - lo
            while inflight:
                header = inflight.popleft().wait(timeout)
                digests[header.bucket] = header.digest
            if attempt == 0 and self._config.verify:  # before the reply: the standby acknowledges first
                snapshot.digests = digests
            reply = self._reply(conn, step)
            if reply.status == Status.ACKED:
                self.stats.acked_step = step
                self.stats.num_acked += 1
                self.stats.stream_s.append(time.perf_counter() - start)
                return
            if reply.status == Status.FENCED:
                raise FencedError(f"the standby of rank {self.rank} refused step {step} of {epoch}")
            if reply.status != Status.RESEND or not reply.buckets:
                raise TransportError(f"standby answered {reply.status.name} for step {step}")
            logger.warning("[trainer rank %d step %d] standby asks again for buckets %s (attempt %d)",
                           self.rank, step, list(reply.buckets), attempt + 1)
            self.stats.resent_buckets += len(reply.buckets)
            todo = list(reply.buckets)
        raise TransportError(f"step {step}: buckets {todo} still failed their digests after "
                             f"{self._config.max_resends} resends")
