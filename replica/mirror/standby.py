"""``Mirror``: the standby side. Receives a trainer rank's snapshots into a
staging version, verifies every bucket's digest (asking again for bad ones),
acknowledges the step in the commit record, and keeps the version that holds
the last global commit intact until a newer one is committed.

Two versions suffice: a trainer sends step N+1 only after N is globally
committed, so the version being overwritten is never the last commit.

Each version keeps the digests its buckets arrived with: restore, export and
fetch re-check it first, and a scrub thread re-checks the committed one every
``Config.scrub_interval``, refusing it once its memory changed and asking the
trainer to send the bad buckets again (``replica.mirror.repair``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Store

from replica.config import Config, token_from_env
from replica.errors import (
    LayoutMismatchError,
    PeerDisconnectedError,
    ReplicaError,
    SnapshotCorruptedError,
    TransportError,
)
from replica.jobstore import Epoch, JobStore
from replica.jobstore.commit import CommitRecord
from replica.mirror.repair import request_repair
from replica.session.backends import SHM_BACKEND, backend_class, connect
from replica.session.bucketstream import accept_sender, receive_versions, wait_first
from replica.session.listener import Listener
from replica.session.protocol import (
    BUCKET_BASE,
    FETCH,
    FETCHED,
    LAYOUT_SIZE,
    Begin,
    Reply,
    Status,
    answer_layout,
    as_tensor,
    fingerprint_int,
    post_reply,
    recv_layout,
    send_layout,
    send_reply,
)
from replica.state.export import export_path, write_export
from replica.state.layout import StateLayout, state_tensors
from replica.state.placement import state_device
from replica.state.restore import restore_snapshot
from replica.state.snapshot import Snapshot, Stateful
from replica.timing import Backoff
from replica.transport import Connection, MemoryKind
from replica.transport.base import After, memory_kind

__all__ = ["Mirror", "MirrorStats", "fetch_mirror"]

logger = logging.getLogger(__name__)

# The first and the longest pause between two reads of the global commit by a standby
# that waits to learn its newest version is committed, so it can post the next one's
# receives early (Mirror._prestage); the pause doubles from the first.
_COMMIT_READ_FIRST = timedelta(milliseconds=1)
_COMMIT_READ_MOST = timedelta(milliseconds=100)


@dataclass(kw_only=True, slots=True)
class MirrorStats:
    acked: list[int] = field(default_factory=list)
    corrupted_buckets: int = 0
    sessions: int = 0
    bytes_received: int = 0
    fenced: int = 0  # trainer sessions and steps refused for their epoch
    prestaged: int = 0  # versions whose receives were posted before their BEGIN arrived
    scrub_passes: int = 0  # complete re-checks of the committed version
    scrub_failures: int = 0  # passes that found it changed in memory
    repaired_buckets: int = 0  # buckets the trainer sent again that verified


class Mirror(Listener):
    """The warm standby of trainer rank ``rank``: listens, receives, verifies, acknowledges.

    Publishes its address in the commit record so the rank's ``Replicator``
    finds it; serves one trainer connection at a time (a restarted trainer may
    connect again with the same layout). Given ``model`` (and ``optimizer``, its
    state created), the objects it would restore into, it refuses a trainer whose
    state does not fit them, checked before the mirror is published (``expect``).

    The versions live on ``device`` (default: the device of ``model``'s state,
    else the host). A host mirror of a GPU model is pinned, and a promotion
    copies it to the GPU tensor by tensor (``replica.state.placement``).
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        store: Store | JobStore,
        config: Config | None = None,
        device: torch.device | str | None = None,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
    ):
        config = config if config is not None else Config(token=token_from_env())
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        if device is None:  # where the state it restores into lives (a GPU mirror restores by one unpack)
            device = state_device([t for _, t in state_tensors(model, optimizer)]) if model is not None else "cpu"
        self.device = torch.device(device)
        super().__init__(config=config, memory=memory_kind(self.device), name=f"standby rank {rank}")
        self.rank = rank
        self.world_size = world_size
        self.store = JobStore.of(store, token=self.config.token, prefix=self.config.store_prefix)
        self.record = CommitRecord(self.store, world_size=world_size)
        self.stats = MirrorStats()
        self._layout: StateLayout | None = None
        self._expected: StateLayout | None = None
        self._slots: list[Snapshot] = []
        self._trainer: Connection | None = None  # the current trainer session's connection
        self._receiving = threading.Lock()  # one session at a time writes the versions
        self._damaged: dict[Snapshot, tuple[int, ...]] = {}  # versions refused until repaired: their bad buckets
        self._scrubber: threading.Thread | None = None
        self._handed_over = False  # the versions belong to the rank's new trainer (hand_over)
        self._listeners: list[Callable[[int], None]] = []  # on_version's
        # _prestage's reads of the global commit: when the next one is due, and the pause after it.
        self._commit_reads = Backoff(first=_COMMIT_READ_FIRST, most=_COMMIT_READ_MOST)
        if model is not None:  # before anyone can find this mirror: no trainer gets in unchecked
            self.expect(model, optimizer)
        self._registration = self.record.publish_standby(rank, self.backend, self.address, self.fallback)
        self._start()
        if self.config.verify and self.config.scrub_interval.total_seconds() > 0:
            self._scrubber = threading.Thread(target=self._scrub_loop, name=f"replica-{self.name}-scrub", daemon=True)
            self._scrubber.start()

    @property
    def layout(self) -> StateLayout | None:
        return self._layout

    def held_steps(self) -> list[int]:
        """Steps of the complete, verified versions this mirror holds."""
        with self._cond:
            return sorted(s.step for s in self._slots if s.step is not None)

    def expect(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Refuse, from now on, a trainer whose state does not fit ``model``/``optimizer``
        (the objects this standby would restore into; the optimizer's state must
        exist, see ``materialize_optimizer_state``): a model that differs between
        roles fails at the first commit instead of at promotion."""
        self._expected = StateLayout.of(
            model,
            optimizer,
            world_size=self.world_size,
            rank=self.rank,
            extras_capacity=self.config.extras_capacity,
            bucket_bytes=self.config.bucket_bytes_for(state_device([t for _, t in state_tensors(model, optimizer)])),
        )

    def restore(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        extra: Mapping[str, Stateful] | None = None,
        *,
        step: int | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> int:
        """Write the committed state (the last global commit unless ``step`` says
        otherwise) in place into a freshly built model, optimizer and extras.

        ``rank``/``world_size`` describe the target (default: the default process
        group's, else this mirror's); a model, optimizer, dtype or world size that
        differs from the mirrored one raises LayoutMismatchError naming the first
        difference. Returns the step restored.
        """
        if rank is None or world_size is None:
            live = dist.is_initialized()
            rank = rank if rank is not None else (dist.get_rank() if live else self.rank)
            world_size = world_size if world_size is not None else (dist.get_world_size() if live else self.world_size)
        with self._cond:
            snapshot, step = self._checked_version(step)
            restore_snapshot(snapshot, model, optimizer, dict(extra or {}), rank=rank, world_size=world_size)
        logger.info("[standby rank %d] restored step %d into a fresh model", self.rank, step)
        return step

    def hand_over(self, step: int) -> tuple[Snapshot, Snapshot]:
        """Give both versions to this rank's new trainer (the promoted standby's own
        ``Replicator.adopt``): the committed version of ``step``, checked against its
        digests, and the other one, for its next snapshot. No copy: the mirror stops
        receiving first (a trainer session still writing is cut off and waited for),
        and refuses every later session; ``close()`` it after."""
        with self._cond:
            committed, step = self._checked_version(step)
            self._handed_over = True
            trainer = self._trainer
        if trainer is not None:
            trainer.close()
        with self._receiving:  # a receive in progress has left
            spare = next(s for s in self._slots if s is not committed)
        logger.info("[standby rank %d] handed step %d over to the rank's new trainer", self.rank, step)
        return committed, spare

    def held(self, step: int) -> tuple[Snapshot, list[int] | None]:
        """The version of ``step`` this mirror holds and its digests as received, without a copy
        and without holding the mirror: the next receive may overwrite its buffer, so a copy of it
        is checked against those digests (the durable floor's). ReplicaError when it holds none."""
        with self._cond:
            snapshot, _ = self._version(step)
            return snapshot, None if snapshot.digests is None else list(snapshot.digests)

    def export(self, directory: str | Path, *, step: int | None = None) -> Path:
        """Write the committed version as ``rank{r}.safetensors`` in ``directory``."""
        with self._cond:
            snapshot, _ = self._checked_version(step)
            return write_export(snapshot, export_path(directory, self.rank))

    def _version(self, step: int | None) -> tuple[Snapshot, int]:
        if step is None:
            step = self.record.last()
            if step is None:
                raise ReplicaError(f"standby of rank {self.rank}: nothing is globally committed yet")
        for snapshot in self._slots:
            if snapshot.step == step:
                return snapshot, step
        held = sorted(s.step for s in self._slots if s.step is not None)
        raise ReplicaError(f"standby of rank {self.rank} holds steps {held}, not step {step}")

    # --- digests at rest: every use re-checks; the scrub re-checks while idle and asks for repair ---

    def _checked_version(self, step: int | None) -> tuple[Snapshot, int]:
        """``_version``, re-checked against its kept digests (under ``_cond``): a
        version whose memory changed since it was received is never used."""
        snapshot, step = self._version(step)
        bad = self._damaged.get(snapshot)
        if bad is None:
            try:
                snapshot.verify()
                return snapshot, step
            except SnapshotCorruptedError as exc:
                bad = exc.buckets
                self._mark_damaged(snapshot, bad, found="before use")
        raise SnapshotCorruptedError(
            f"standby of rank {self.rank}: its version of step {step} changed in memory since it was received "
            f"(bucket(s) {list(bad)} fail their digests); it is not used",
            rank=self.rank,
            step=step,
            buckets=tuple(bad),
        )

    def _mark_damaged(self, snapshot: Snapshot, bad: tuple[int, ...], *, found: str) -> None:
        self._damaged[snapshot] = tuple(bad)
        logger.error(
            "[standby rank %d step %s] the held version changed in memory (found %s): bucket(s) %s fail "
            "the digests kept since it was received; restore, export and fetch refuse it",
            self.rank,
            snapshot.step,
            found,
            list(bad),
        )

    def _scrub_loop(self) -> None:
        interval = self.config.scrub_interval.total_seconds()
        while not self._closed.wait(interval):
            try:
                self._scrub()
            except Exception:
                logger.exception("[standby rank %d] scrub pass failed", self.rank)

    def _scrub(self) -> None:
        """Re-check the committed version bucket by bucket (the lock is held for one
        bucket at a time, so receiving and restoring go on between); on a mismatch
        mark it refused and ask the trainer for the bad buckets again."""
        commit = self.record.last()
        if commit is None:
            return
        with self._cond:
            snapshot = next((s for s in self._slots if s.step is not None and s.step == commit), None)
        if snapshot is None or snapshot.digests is None or self._handed_over:
            return
        bad = []
        for i in range(len(snapshot.layout.buckets())):
            if self._closed.is_set():
                return
            with self._cond:
                if snapshot.step != commit or self._handed_over:  # staged again: a newer commit replaced it
                    return
                bad += snapshot.bad_buckets([i])
            time.sleep(0)  # let the session thread in between buckets
        with self._cond:
            if snapshot.step != commit or self._handed_over:
                return
            self.stats.scrub_passes += 1
            if not bad:
                self._damaged.pop(snapshot, None)
                return
            if self._damaged.get(snapshot) != tuple(bad):  # news, not the damage a past pass reported
                self.stats.scrub_failures += 1
                self._mark_damaged(snapshot, tuple(bad), found="by the scrub")
            trainer = self._trainer
        if trainer is None or not trainer.alive:
            logger.error(
                "[standby rank %d step %d] no trainer is connected to send bucket(s) %s again: the "
                "version stays refused",
                self.rank,
                commit,
                bad,
            )
            return
        repaired = request_repair(
            trainer, snapshot, commit, bad, guard=self._cond, timeout=self.config.timeout, who=self.name
        )
        with self._cond:
            if snapshot.step != commit or not repaired:
                return
            still = snapshot.bad_buckets()
            if still:
                self._damaged[snapshot] = tuple(still)
            else:
                self._damaged.pop(snapshot, None)
            # Counted last: whoever sees the count (unlocked) sees the version's marks settled.
            self.stats.repaired_buckets += len(repaired)
            if still:
                logger.error(
                    "[standby rank %d step %d] after the repair bucket(s) %s still fail their digests",
                    self.rank,
                    commit,
                    still,
                )
                return
        logger.warning(
            "[standby rank %d step %d] repaired: the trainer sent bucket(s) %s again and the version verifies",
            self.rank,
            commit,
            repaired,
        )

    def close(self) -> None:
        super().close()
        if self._scrubber is not None:
            self._scrubber.join(timeout=self.config.timeout.total_seconds() + 5)

    # --- the receiving thread ---

    def _held(self) -> str:
        return f"; keeping steps {self.held_steps()}"

    def _peer_lost(self, conn: Connection, exc: PeerDisconnectedError) -> None:
        if not exc.graceful and self._trainer is conn:
            try:
                self.record.report_lost(self.rank)  # the coordinator weighs it against heartbeats
            except Exception as store_exc:  # noqa: BLE001 - cut off from the store too: its deadline finds it
                logger.warning(
                    "[standby rank %d] the trainer's connection vanished and the job store does not "
                    "answer either (%s); heartbeat deadlines decide",
                    self.rank,
                    store_exc,
                )

    def _session(self, conn: Connection) -> None:
        """A trainer's session (it sends its layout) or a fetch (a fresh process asks for a version)."""
        timeout = self.config.timeout
        size = torch.zeros(8, dtype=torch.uint8)
        wanted = torch.zeros(8, dtype=torch.uint8)
        layout_size, fetch = conn.irecv(size, tag=LAYOUT_SIZE), conn.irecv(wanted, tag=FETCH)
        first = wait_first(
            conn,
            [layout_size, fetch],
            gone=lambda: "mirror closed" if self._closed.is_set() else None,
            within=timeout,
            timeout=timeout,
        )
        if first is fetch:
            self._serve_fetch(conn, int.from_bytes(wanted.numpy().tobytes(), "little", signed=True))
            return

        def current_epoch() -> Epoch | None:
            return self.record.current_epoch(self.rank)

        # A fenced trainer (declared dead, still running) is refused before it displaces the current one.
        _, layout = accept_sender(
            conn, current_epoch=current_epoch, who=self.name, timeout=timeout, counts=self.stats, size=size
        )
        # This connection is the rank's trainer now; an older one (dead or not) is dropped.
        with self._cond:
            previous, self._trainer = self._trainer, conn
        if previous is not None:
            logger.warning("[standby rank %d] a new trainer connection replaces the previous one", self.rank)
            previous.close()
        with self._receiving:  # the previous session has left receive_versions
            answer_layout(conn, layout, self._adopt, timeout)
        receive_versions(
            conn,
            layout.buckets(),
            fingerprint=fingerprint_int(layout.fingerprint),
            timeout=timeout,
            who=self.name,
            counts=self.stats,
            current_epoch=current_epoch,
            closed=self._closed,
            sender=lambda: self._trainer,
            lock=self._receiving,
            stage=lambda begin: self._stage().buffer,
            complete=self._complete,
            acknowledged=self._acknowledge,
            fence_late=True,
            prestage=self._prestage,
        )

    def _serve_fetch(self, conn: Connection, step: int) -> None:
        """Send a complete version to a process that restores from it (a replacement trainer)."""
        timeout = self.config.timeout
        with self._cond:  # pinned: no step is staged into it while it is sent
            try:
                snapshot, step = self._checked_version(None if step < 0 else step)
            except SnapshotCorruptedError as exc:
                assert exc.step is not None  # _checked_version names the version's step
                send_reply(conn, Reply(step=exc.step, status=Status.DAMAGED, buckets=exc.buckets), timeout)
                raise
            except ReplicaError as exc:
                send_reply(conn, Reply(step=step, status=Status.NOT_HELD), timeout)
                raise ReplicaError(f"fetch refused: {exc}") from exc
            send_reply(conn, Reply(step=step, status=Status.ACCEPTED), timeout)
            send_layout(conn, snapshot.layout, timeout)
            fingerprint = fingerprint_int(snapshot.layout.fingerprint)
            # The digests kept since the version arrived, not new ones: a change in memory
            # after the check above still fails at the receiver.
            kept = snapshot.digests
            # A version is complete (received) and held under the lock: its sends wait for nothing.
            sends = [
                conn.isend(
                    snapshot.buffer[lo:hi],
                    tag=BUCKET_BASE + i,
                    step=step,
                    bucket=i,
                    offset=lo,
                    fingerprint=fingerprint,
                    digest=None if kept is None else kept[i],
                    after=After.NOTHING,
                )
                for i, (lo, hi) in enumerate(snapshot.layout.buckets())
            ]
            for transfer in sends:
                transfer.wait(timeout)
        try:  # the connection stays open until the fetcher has it all (FETCHED)
            conn.irecv(torch.zeros(1, dtype=torch.uint8), tag=FETCHED).wait(timeout)
        except PeerDisconnectedError as exc:
            if not exc.graceful:
                raise
        logger.info("[standby rank %d] sent step %d to %s", self.rank, step, conn.peer)

    def _adopt(self, layout: StateLayout) -> None:
        if layout.rank != self.rank or layout.world_size != self.world_size:
            raise LayoutMismatchError(
                f"a trainer of rank {layout.rank}/{layout.world_size} connected to the "
                f"standby of rank {self.rank}/{self.world_size}"
            )
        if self._expected is not None:
            try:
                self._expected.check_matches(layout)
            except LayoutMismatchError as exc:
                raise LayoutMismatchError(
                    f"the trainer's state does not fit the standby's model ({exc}; "
                    "'here' is the standby, 'in the mirror' the trainer)"
                ) from exc
        with self._cond:
            if self._layout is not None:
                self._layout.check_matches(layout)
                return
            self._slots = [
                Snapshot(layout, device=self.device, pin_memory=True, shared=self.backend == SHM_BACKEND)
                for _ in range(2)
            ]
            self._layout = layout
        logger.info(
            "[standby rank %d] mirroring %d bytes (%d tensors)", self.rank, layout.total_bytes, len(layout.entries)
        )

    def _stage(self) -> Snapshot:
        """The version to receive into: never the one holding the last global commit."""
        with self._cond:
            if self._handed_over:
                raise ReplicaError(
                    f"standby of rank {self.rank}: its versions were handed over to the rank's "
                    "new trainer; it receives nothing more"
                )
            slot = self._take_slot(ask_store=True)
            assert slot is not None  # asking the store always finds one
            return slot

    def _take_slot(self, *, ask_store: bool) -> Snapshot | None:
        """Under _cond: the slot the next version goes into, its step cleared (restore
        never picks it), never the one holding the last global commit. A free slot, or
        the older version once the commit seen here covers the newer (commits only move
        forward: nothing needs the older one again) are known without the store; else
        the store's commit decides (``ask_store``), or None."""
        held = {s: s.step for s in self._slots if s.step is not None}  # slot -> the step it holds
        newest = max(held, key=held.__getitem__) if held else None
        seen = self.record.last_seen()
        if len(held) < 2 or (seen is not None and newest is not None and held[newest] <= seen):
            keep = newest
        elif not ask_store:
            return None
        else:
            commit = self.record.last()
            keep = next((s for s in held if s.step == commit), newest)
        slot = self._slots[1] if keep is self._slots[0] else self._slots[0]
        slot.step = None
        return slot

    def _prestage(self) -> torch.Tensor | None:
        """The slot the next version may land in before its BEGIN arrives
        (``_take_slot`` without the store), or None while none is known to be free.
        Until one is, the commit is read from the store, the pauses between reads
        doubling from ``_COMMIT_READ_FIRST`` to ``_COMMIT_READ_MOST`` after each
        version's arrival: the trainer sends the next version only once that commit
        exists, so a few reads do."""

        def take() -> torch.Tensor | None:  # under _cond
            if self._handed_over or not self._slots:
                return None
            slot = self._take_slot(ask_store=False)
            return None if slot is None else slot.buffer

        with self._cond:
            buffer = take()
            if buffer is not None or self._handed_over or not self._commit_reads.due():
                return buffer
            self._commit_reads.failed()  # this read: the next one after a longer pause
        try:
            self.record.last()  # outside the lock: a store round trip
        except Exception as exc:  # noqa: BLE001 - the version is staged when it arrives instead
            logger.debug("[standby rank %d] reading the commit to post early: %s", self.rank, exc)
            return None
        with self._cond:
            return take()

    def _complete(self, begin: Begin, buffer: torch.Tensor, digests: list[int]) -> None:
        """The version staged in ``buffer`` holds ``begin.step`` complete and verified: keep it."""
        with self._cond:
            slot = next(s for s in self._slots if s.buffer is buffer)
            slot.step = begin.step
            slot.digests = digests if self.config.verify else None  # kept: checked before every use
            self._damaged.pop(slot, None)  # marks of the content this one replaced
            self._commit_reads.reset()  # its commit is read soon (_prestage)
            self.stats.acked.append(begin.step)
            self._cond.notify_all()
        for listener in self._listeners:
            listener(begin.step)

    def on_version(self, listener: Callable[[int], None]) -> None:
        """Call ``listener(step)`` (on the receiving thread: it must return at once) each time a
        version is kept, complete and verified (before its global commit)."""
        self._listeners.append(listener)

    def _acknowledge(self, begin: Begin) -> None:
        """Acknowledge a kept version in the job store, after the trainer's stream was
        answered: the global commit needs it, the trainer's next stream does not."""
        commit = self.record.acknowledge(self.rank, begin.step, begin.epoch, self._registration.nonce)
        logger.debug("[standby rank %d step %d] acknowledged; global commit %s", self.rank, begin.step, commit)


def fetch_mirror(
    *,
    rank: int,
    world_size: int,
    store: Store | JobStore,
    config: Config | None = None,
    step: int | None = None,
    device: torch.device | str | None = None,
) -> Snapshot:
    """Copy rank ``rank``'s committed version (the last global commit unless
    ``step`` says otherwise) from its standby into a new snapshot on ``device``:
    how a fresh process that replaces a trainer gets its state without a
    checkpoint. ``device`` defaults to the host (pinned when CUDA is present),
    or to the current GPU when the standby's transport moves device memory
    only (CUDA IPC). Restore it with ``replica.restore_snapshot``, into a model
    on any device. Digests are verified on receipt and kept in the snapshot;
    a standby whose copy changed in memory refuses (SnapshotCorruptedError)."""
    config = config if config is not None else Config(token=token_from_env())
    timeout = config.timeout
    record = CommitRecord(JobStore.of(store, token=config.token, prefix=config.store_prefix), world_size=world_size)
    registration = record.standby(rank, timeout)
    if device is None:
        moves = backend_class(registration.backend).capabilities.memory
        device = "cpu" if MemoryKind.HOST in moves else torch.device("cuda", torch.cuda.current_device())
    device = torch.device(device)
    transport, conn = connect(registration, memory_kind(device), config, peer=f"the standby of rank {rank}")
    with transport:
        # Posted before the request: a refusal the standby sends just before it hangs up is delivered.
        answer = post_reply(conn)
        conn.send(
            as_tensor((-1 if step is None else step).to_bytes(8, "little", signed=True)), tag=FETCH, timeout=timeout
        )
        reply = answer(timeout)
        if reply.status == Status.DAMAGED:
            raise SnapshotCorruptedError(
                f"the standby of rank {rank} refused to send step {reply.step}: its copy changed in memory since "
                f"it was received (bucket(s) {list(reply.buckets)} fail their digests)",
                rank=rank,
                step=reply.step,
                buckets=reply.buckets,
            )
        if reply.status != Status.ACCEPTED:
            raise ReplicaError(
                f"the standby of rank {rank} does not hold step {step if step is not None else 'of the last commit'}"
            )
        layout = recv_layout(conn, timeout)
        if layout.rank != rank or layout.world_size != world_size:
            raise LayoutMismatchError(
                f"the standby of rank {rank}/{world_size} holds a mirror of rank {layout.rank}/{layout.world_size}"
            )
        snapshot = Snapshot(layout, device=device, pin_memory=True)
        recvs = [conn.irecv(snapshot.buffer[lo:hi], tag=BUCKET_BASE + i) for i, (lo, hi) in enumerate(layout.buckets())]
        fingerprint = fingerprint_int(layout.fingerprint)
        digests = []
        for i, transfer in enumerate(recvs):
            header = transfer.wait(timeout)
            if (header.step, header.bucket, header.fingerprint) != (reply.step, i, fingerprint):
                raise TransportError(f"bucket {i} of the fetch arrived with header {header}")
            digests.append(header.digest)
        conn.send(torch.ones(1, dtype=torch.uint8), tag=FETCHED, timeout=timeout)
        conn.close()
    snapshot.digests = digests if config.verify else None  # a rollback to it re-checks them
    snapshot.step = reply.step
    logger.info("fetched step %d of rank %d (%d bytes) from %s", reply.step, rank, layout.total_bytes, conn.peer)
    return snapshot
