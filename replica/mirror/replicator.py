"""``Replicator``: the trainer side of the mirror.

After each optimizer step ``commit(step)`` packs the rank's whole state into
one of two snapshot buffers (one pack call) and hands it to a background
stream to its standby. Snapshot N+1 is never packed before step N is globally
committed, so the survivors always hold the last commit locally; the time
``commit`` spends waiting for that is the mirror's overhead (``stats``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import Store

from replica.config import Config, token_from_env
from replica.distributed.resilient import ResilientProcessGroup
from replica.errors import ReplicaError, SnapshotCorruptedError
from replica.jobstore import Epoch, JobStore
from replica.jobstore.commit import NO_EPOCH, CommitRecord
from replica.mirror.stream import MirrorFaults, MirrorStream, StreamStats
from replica.session.backends import SHM_BACKEND
from replica.state import serialize
from replica.state.data import Batches, prepare_extras
from replica.state.divergence import Divergence, Measure, comparable
from replica.state.export import export_path, write_export
from replica.state.layout import StateLayout, state_tensors
from replica.state.placement import state_device
from replica.state.restore import bind_state, restore_snapshot
from replica.state.snapshot import Snapshot, Stateful, collect_extras
from replica.timing import Deadline
from replica.transport.base import nvtx_range

__all__ = ["CommitStats", "Replicator"]

#: How late a global commit may be before a waiting trainer asks whether its step's
#: answer was lost (a normal commit takes a few store round trips after the answer).
_RESEND_LOOK = timedelta(seconds=1)
#: Steps whose snapshot digests a replicator remembers, to check their redo against.
_DIGESTS_KEPT = 8

logger = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class CommitStats:
    """Per ``commit`` call: seconds waiting for the previous global commit
    (the mirror's overhead on the training loop), seconds collecting and
    encoding the extras (optimizer scalars, RNG states, ``extra`` objects:
    Python work whose cost does not grow with the model) and seconds packing
    the state tensors with their digests (``Snapshot.capture``)."""

    wait_s: list[float] = field(default_factory=list)
    extras_s: list[float] = field(default_factory=list)
    pack_s: list[float] = field(default_factory=list)


def _rank_and_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None or world_size is None:
        if not dist.is_initialized():
            raise ValueError("pass rank= and world_size=, or initialize torch.distributed first")
        rank = dist.get_rank() if rank is None else rank
        world_size = dist.get_world_size() if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    return rank, world_size


class Replicator:
    """Mirror one trainer rank's shard to its warm standby after every step.

    ``model`` is the rank's (FSDP2-sharded or plain) module, ``optimizer`` any
    torch optimizer whose per-parameter state is tensors, ``extra`` maps names
    to ``Stateful`` objects (LR scheduler, data position, ``replica.RNGState()``).
    ``store`` holds the commit record (the coordinator's store). ``rank`` and
    ``world_size`` default to the default process group's. ``epoch()`` says which
    trainer incarnation this is (a coordinator's runtime passes it): standbys
    refuse streams of a superseded epoch, and ``commit`` raises FencedError once
    this process's rank belongs to another.

    The layout is fixed at the first ``commit`` (optimizers create their state
    in their first step); it must not change afterwards.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        extra: Mapping[str, Stateful] | None = None,
        *,
        store: Store | JobStore,
        config: Config | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        epoch: Callable[[], Epoch] | None = None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.extra = prepare_extras(extra)
        self.config = config if config is not None else Config(token=token_from_env())
        self.rank, self.world_size = _rank_and_size(rank, world_size)
        self.record = CommitRecord(
            JobStore.of(store, token=self.config.token, prefix=self.config.store_prefix), world_size=self.world_size
        )
        #: This trainer's epoch (generation, member) as the coordinator's runtime knows it;
        #: without a coordinator, NO_EPOCH. Each stream carries the epoch its step ran in.
        self.epoch = epoch if epoch is not None else (lambda: NO_EPOCH)
        self.stats = CommitStats()
        #: Fault injection for tests: ``faults.corrupt_buckets = k`` damages the next k buckets on the wire.
        self.faults = MirrorFaults()
        #: Steps redone after a rollback (or an adoption) whose snapshot differs from the one
        #: packed before (``Config.verify``'s digests): the divergence guard's findings.
        self.divergences: list[Divergence] = []
        self._digests_of: dict[int, tuple[int, ...]] = {}  # step -> the digests of its snapshot, recent ones
        self._layout: StateLayout | None = None
        self._tensors: list[torch.Tensor] = []
        self._snapshots: list[Snapshot] = []
        self._next = 0
        self._last_step: int | None = None
        self._stream = MirrorStream(rank=self.rank, record=self.record, config=self.config, faults=self.faults)
        #: Set by a coordinator's runtime: returns True when a failover was announced,
        #: so a ``commit`` waiting for a commit that will never come gives up (returns False).
        self.interrupted: Callable[[], bool] | None = None

    @property
    def layout(self) -> StateLayout | None:
        return self._layout

    def batches(self, name: str) -> Batches:
        """The iterator over the data loader passed as ``extra[name]`` (wrapped in a
        ``Batches``): the training loop takes its batches from it, so that after a
        ``rollback`` the next batch is the one the failure-free run took."""
        found = self.extra.get(name)
        if not isinstance(found, Batches):
            loaders = sorted(k for k, v in self.extra.items() if isinstance(v, Batches))
            raise KeyError(f"extra[{name!r}] is not a data loader (the loaders: {loaders})")
        return found

    @property
    def stream_stats(self) -> StreamStats:
        return self._stream.stats

    def last_commit(self) -> int | None:
        """The last step every rank's standby acknowledged (None before the first)."""
        return self.record.last()

    def commit(self, step: int) -> bool:
        """Snapshot the state after optimizer step ``step`` and mirror it in the background.

        Waits only for the global commit of the previous ``commit`` (so its
        snapshot may be overwritten); raises StandbyLostError once this rank's
        standby is gone, CommitTimeoutError if another rank's never acknowledges.
        Returns False, committing nothing, when the step ran on a failed
        ``ResilientProcessGroup`` generation (its result is garbage; it is redone).
        """
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(f"commit({step}) after commit({self._last_step}): steps must increase")
        if self._failed_generation(step):
            return False
        self._raise_stream_error()
        start = time.perf_counter()
        if self._layout is None:
            self._build()
        with nvtx_range("replica::commit_wait"):
            try:
                self._wait_free()
            except _Interrupted:
                logger.warning("[trainer rank %d step %d] not committed: a failover was announced", self.rank, step)
                return False
        packed = time.perf_counter()
        snapshot = self._snapshots[self._next]
        with nvtx_range("replica::pack"):
            extras = serialize.encode(collect_extras(self.optimizer, self.extra))
            encoded = time.perf_counter()
            snapshot.capture(self._tensors, extras, step=step, digests=self.config.verify)
            if snapshot.ready is not None:
                # The snapshot's own event, recorded behind the pack: the stream's sends
                # wait for it too (and nothing queued later), so it travels with the snapshot.
                snapshot.ready.synchronize()
        # NCCL reports a dead peer only once the step's kernels have run: the
        # snapshot just packed may hold garbage, so look again after the synchronize.
        if self._failed_generation(step):
            snapshot.step = None  # never a rollback target; the other buffer holds the last commit
            return False
        self.stats.wait_s.append(packed - start)
        self.stats.extras_s.append(encoded - packed)
        self.stats.pack_s.append(time.perf_counter() - encoded)
        self._check_redo(snapshot, step)
        self._stream.submit(snapshot, step, self.epoch())
        self._next ^= 1
        self._last_step = step
        return True

    def wait_committed(self, timeout: timedelta | None = None) -> int:
        """Block until the last ``commit`` is globally committed (up to ``timeout``,
        ``config.commit_timeout`` by default; CommitTimeoutError after); returns the commit."""
        if self._last_step is None:
            raise ReplicaError("wait_committed() before the first commit()")
        timeout = self.config.commit_timeout if timeout is None else timeout
        return self.record.wait(self._last_step, timeout, abort=self._watch(self._last_step, interruptible=False))

    def rollback(
        self,
        *,
        step: int | None = None,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        extra: Mapping[str, Stateful] | None = None,
    ) -> int:
        """Restore this rank's own snapshot of the last global commit, in place, without network.

        Pass ``model``/``optimizer``/``extra`` to restore into replacements
        (e.g. rebuilt under a new process group) instead; the replicator then
        mirrors those. ``step`` (default: the last global commit) is the commit a
        coordinator fixed for a failover. Returns the step restored.

        The snapshot is first checked against the digests its stream carried
        (``Config.verify``): one whose memory changed since raises
        SnapshotCorruptedError and nothing is restored.
        """
        step = self.last_commit() if step is None else step
        if step is None:
            raise ReplicaError("rollback() before any global commit")
        held = {s.step: s for s in self._snapshots}
        if step not in held:
            raise ReplicaError(
                f"rank {self.rank} holds snapshots of steps {sorted(k for k in held if k is not None)}, "
                f"not of the last global commit {step}"
            )
        snapshot = held[step]
        self._check_at_rest(snapshot)
        # Restoring into the live objects needs no stream to finish; a later
        # commit still waits for the stream before it reuses the other buffer.
        target_model = self.model if model is None else model
        target_opt = self.optimizer if optimizer is None else optimizer
        target_extra = self.extra if extra is None else prepare_extras(extra)
        with nvtx_range("replica::rollback"):
            tensors = restore_snapshot(
                snapshot, target_model, target_opt, target_extra, rank=self.rank, world_size=self.world_size
            )
        self.model, self.optimizer, self.extra, self._tensors = target_model, target_opt, target_extra, tensors
        self._next = self._snapshots.index(snapshot) ^ 1
        self._last_step = step
        logger.info("[trainer rank %d] rolled back to commit %d from local memory", self.rank, step)
        return step

    def adopt(self, snapshot: Snapshot, spare: Snapshot | None = None) -> None:
        """Take ``snapshot``, a complete version of this rank's state at its ``step``
        (a promoted standby's committed version, already restored into this
        replicator's objects: ``Mirror.hand_over``), as this rank's own copy of that
        step, without copying it; ``spare`` (same layout), if given, is the buffer the
        next ``commit`` packs into. Call before the first ``commit``; then
        ``rollback(step=...)`` returns to it and ``protect()`` sends it to the rank's
        new standby, so the commit has two copies again."""
        if self._layout is not None:
            raise ReplicaError("adopt() after the first commit()")
        if snapshot.step is None:
            raise ReplicaError("adopt() of a snapshot that holds no step")
        self._check_at_rest(snapshot)
        snapshot.written_elsewhere()  # received: the next capture into it must not trust its extras region
        if spare is not None:
            if spare.step is not None and spare.digests is not None and spare.step > snapshot.step:
                # The step after the commit, as the rank's last trainer streamed it before it
                # died: its redo here is checked against it.
                self._digests_of[spare.step] = tuple(spare.digests)
            spare.step, spare.digests = None, None
            spare.written_elsewhere()
        self._build([snapshot] if spare is None else [snapshot, spare])
        self._next = 1
        self._last_step = snapshot.step
        logger.info("[trainer rank %d] holds step %d (adopted, not copied)", self.rank, snapshot.step)

    def held_steps(self) -> list[int]:
        """Steps of the snapshots this rank holds (the last commit, and a newer one in flight)."""
        return sorted(s.step for s in self._snapshots if s.step is not None)

    def export(self, directory: str | Path, *, step: int | None = None) -> Path:
        """Write this rank's snapshot of ``step`` (default: the last global commit) as
        ``rank{r}.safetensors`` in ``directory``, checked against its digests first."""
        step = self.last_commit() if step is None else step
        held = next((s for s in self._snapshots if step is not None and s.step == step), None)
        if held is None:
            raise ReplicaError(f"rank {self.rank} holds snapshots of steps {self.held_steps()}, not of step {step}")
        self._check_at_rest(held)
        return write_export(held, export_path(directory, self.rank))

    def protect(self) -> bool:
        """Make sure this rank's standby holds the last global commit: when the commit
        record says it does not (a new standby, after a promotion or a standby's
        replacement), stream this rank's copy of the commit to it again, ahead of the
        next step, in the current epoch. Returns True if a stream was queued."""
        commit = self.last_commit()
        if commit is None:
            return False
        held = next((s for s in self._snapshots if s.step == commit), None)
        if held is None or self.record.standby_holds(self.rank, commit):
            return False
        logger.info("[trainer rank %d] the rank's standby does not hold commit %d: sending it first", self.rank, commit)
        self._stream.submit(held, commit, self.epoch())
        return True

    def close(self) -> None:
        self._stream.close()

    def __enter__(self) -> Replicator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _build(self, adopted: Sequence[Snapshot] = ()) -> None:
        named = list(state_tensors(self.model, self.optimizer))
        if not named:
            raise ReplicaError("the model has no state to mirror")
        # A CUDA model's optimizer keeps some state on the host (AdamW's step
        # counters): the snapshot lives on the GPU and those are staged into it.
        device = state_device([t for _, t in named])
        layout = StateLayout.of(
            self.model,
            self.optimizer,
            world_size=self.world_size,
            rank=self.rank,
            extras_capacity=self.config.extras_capacity,
            bucket_bytes=self.config.bucket_bytes_for(device),
        )
        for snapshot in adopted:
            layout.check_matches(snapshot.layout)
        self._layout = layout
        self._tensors = bind_state(
            self.model, self.optimizer, rank=self.rank, world_size=self.world_size, like=self._layout
        )
        shared = SHM_BACKEND in self.config.backends  # the standby may be reached by shared memory
        self._snapshots = [
            *adopted,
            *(Snapshot(self._layout, device=device, shared=shared) for _ in range(2 - len(adopted))),
        ]
        logger.info(
            "[trainer rank %d] snapshot layout: %d tensors, %d bytes, %d buckets, fingerprint %s",
            self.rank,
            len(named),
            self._layout.total_bytes,
            len(self._layout.buckets()),
            self._layout.fingerprint,
        )

    def _check_redo(self, snapshot: Snapshot, step: int) -> None:
        """The divergence guard: a step packed before (and now redone) must pack the same bytes."""
        if snapshot.digests is None:
            return
        now = tuple(snapshot.digests)
        before = self._digests_of.get(step)
        if before is not None and before != now:
            bad = [i for i, (a, b) in enumerate(zip(before, now, strict=False)) if a != b]
            found = Divergence(
                rank=self.rank,
                step=step,
                measure=Measure.STATE,
                before=f"{before[bad[0]]:#x}",
                after=f"{now[bad[0]]:#x}",
                comparable=comparable(self.model),
                where=f"{len(bad)} of {len(now)} buckets (the first, bucket {bad[0]}, holds {self._names_in(bad[0])})",
            )
            self.divergences.append(found)
            (logger.error if found.comparable else logger.info)("[trainer rank %d] %s", self.rank, found.describe())
        self._digests_of[step] = now
        for old in sorted(self._digests_of)[:-_DIGESTS_KEPT]:
            del self._digests_of[old]

    def _names_in(self, bucket: int) -> str:
        layout = self._layout
        assert layout is not None  # a step was packed: the state is bound
        lo, hi = layout.buckets()[bucket]
        names = [e.name for e in layout.entries if e.offset < hi and e.offset + e.nbytes > lo]
        if layout.extras_offset < hi:
            names.append("the extras (optimizer scalars, RNG, data positions)")
        return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")

    def _check_at_rest(self, snapshot: Snapshot) -> None:
        if snapshot.digests is None:
            if self.config.verify:  # its stream was cut short before the digests were in
                logger.warning(
                    "[trainer rank %d step %d] the snapshot has no digests to check it against; restoring it unchecked",
                    self.rank,
                    snapshot.step,
                )
            return
        try:
            snapshot.verify()
        except SnapshotCorruptedError as exc:
            logger.error("[trainer rank %d] cannot roll back: %s", self.rank, exc)
            raise

    def _failed_generation(self, step: int) -> bool:
        group = dist.group.WORLD if dist.is_initialized() else None
        # check(), not errored: NCCL failures are found by polling the generation's works.
        if isinstance(group, ResilientProcessGroup) and group.check() is not None:
            logger.warning(
                "[trainer rank %d step %d] not committed: the step ran on a failed generation", self.rank, step
            )
            return True
        return False

    def _wait_free(self) -> None:
        """Wait until the buffer the next commit packs into is not needed any more."""
        if self._last_step is None:
            return
        timeout = self.config.commit_timeout

        self.record.wait(self._last_step, timeout, abort=self._watch(self._last_step, interruptible=True))
        # Only the buffer packed next must be free: the other may still be streaming (a
        # promoted trainer's commit goes to its new standby while it trains on).
        if not self._stream.wait_released(self._snapshots[self._next], timeout):
            self._raise_stream_error()
            raise ReplicaError(f"the mirror stream of rank {self.rank} did not finish within {timeout}")

    def _watch(self, step: int, *, interruptible: bool) -> Callable[[], None]:
        """What a wait for the last step's global commit calls between looks: raises the
        stream's error (and, when ``interruptible``, _Interrupted once a failover was
        announced), and once the commit is late, sends ``step`` (the last) again if the standby
        that received it left before recording it (``MirrorStream.resend_unrecorded``)."""
        snapshot = self._snapshots[self._next ^ 1]
        look = Deadline.after(_RESEND_LOOK)

        def abort() -> None:
            nonlocal look
            self._raise_stream_error()
            if interruptible and self.interrupted is not None and self.interrupted():
                raise _Interrupted
            if look.expired and snapshot.step == step:
                self._stream.resend_unrecorded(snapshot, step, self.epoch())
                look = Deadline.after(_RESEND_LOOK)

        return abort

    def _raise_stream_error(self) -> None:
        if self._stream.error is not None:
            raise self._stream.error


class _Interrupted(Exception):
    pass
