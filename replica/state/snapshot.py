"""``Snapshot``: one packed copy of a rank's training state, laid out by a
``StateLayout``: every state tensor in one ``ops.pack`` call (``replica.state.placement``
when some live on another device), then the encoded
extras (optimizer hyperparameters and non-tensor state, and the ``state_dict()``
of each extra object) in the reserved region behind a length prefix.
Restoring unpacks in place: no allocation, no network."""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from replica import ops
from replica.errors import LayoutMismatchError, ReplicaError, SnapshotCorruptedError
from replica.state.layout import StateLayout, dtype_name, dtype_of
from replica.state.placement import on_device, pack_state, unpack_state
from replica.transport.base import bucket_digest
from replica.transport.buffers import transfer_buffer

__all__ = ["Snapshot", "Stateful", "apply_extras", "bucket_digests", "collect_extras"]

logger = logging.getLogger(__name__)

_LENGTH = struct.Struct("<Q")
_BLOB_GRAIN = 64 << 10  # the extras' host copy grows in steps of this many bytes


def bucket_digests(buffer: torch.Tensor, ranges: Iterable[tuple[int, int]]) -> list[int]:
    """The digest of ``buffer[lo:hi]`` for each range, each equal to the one its
    bucket carries on the wire (``transport.base.bucket_digest``): the bucket's
    words keyed from its offset in ``buffer`` (``word_offset = lo // 8``), which is
    also the digest of its block in ``ops.checksum(buffer, bucket_bytes)``. The
    results are read back once, not once per bucket."""
    parts = [ops.checksum(buffer[lo:hi], -(-(hi - lo) // 8) * 8, lo // 8) for lo, hi in ranges]
    return [int(d) for d in torch.cat(parts).tolist()] if parts else []


class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def collect_extras(optimizer: torch.optim.Optimizer | None, extra: Mapping[str, Stateful]) -> dict[str, Any]:
    """Everything of a rank's state that is not a state tensor, as plain data."""
    state: dict[str, Any] = {"extra": {name: obj.state_dict() for name, obj in sorted(extra.items())}}
    if optimizer is not None:
        state["param_groups"] = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        state["optim_scalars"] = [
            {k: v for k, v in optimizer.state.get(p, {}).items() if not isinstance(v, torch.Tensor)}
            for g in optimizer.param_groups
            for p in g["params"]
        ]
    return state


def apply_extras(
    state: Mapping[str, Any], optimizer: torch.optim.Optimizer | None, extra: Mapping[str, Stateful]
) -> None:
    if set(state["extra"]) != set(extra):
        raise LayoutMismatchError(f"extras differ: {sorted(state['extra'])} in the snapshot, {sorted(extra)} here")
    for name, obj in extra.items():
        obj.load_state_dict(state["extra"][name])
    if optimizer is not None:
        for group, saved in zip(optimizer.param_groups, state["param_groups"], strict=True):
            group.update(saved)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        for p, scalars in zip(params, state["optim_scalars"], strict=True):
            optimizer.state[p].update(scalars)


class _ZeroTail:
    """The digests of a buffer of ``total`` bytes in buckets of ``bucket_bytes`` whose
    bytes from ``cut`` (a multiple of 8, set by ``move``) on are zeros, from the digests
    of its bytes before ``cut`` alone. The zeros' own are taken when ``cut`` moves: those
    of the buckets after cut's only when it moves into another bucket."""

    def __init__(self, total: int, bucket_bytes: int):
        self._total, self._bucket_bytes = total, bucket_bytes
        self.cut: int | None = None
        self._within = 0  # bytes of cut's bucket before cut
        self._partial: tuple[int, int] | None = None  # the zeros that end cut's bucket: (digest, bytes)
        self._boundary: int | None = None  # where the bucket after cut's starts (or cut, on a boundary)
        self._rest: list[int] = []  # the digests of the buckets from there on

    def move(self, cut: int) -> None:
        """Zeros from ``cut`` on (its one caller, ``Snapshot._head``, moves only to a new cut)."""
        self.cut, self._within = cut, cut % self._bucket_bytes
        boundary = min(cut - self._within + self._bucket_bytes, self._total) if self._within else cut
        zeros = torch.zeros(boundary - cut, dtype=torch.uint8)
        self._partial = (bucket_digest(zeros, offset=cut), zeros.numel()) if zeros.numel() else None
        if boundary != self._boundary:
            rest = torch.zeros(self._total - boundary, dtype=torch.uint8)
            self._boundary = boundary
            self._rest = ops.checksum(rest, self._bucket_bytes, boundary // 8).tolist() if rest.numel() else []

    def digests(self, head: list[int]) -> list[int]:
        """Every bucket's digest, from ``head``: those of the buffer's first ``cut`` bytes."""
        if self._partial is not None:
            digest, nbytes = self._partial
            head[-1] = ops.combine_digests([head[-1], digest], [self._within, nbytes])
        return head + self._rest


class Snapshot:
    """A snapshot buffer for one layout; ``capture`` and ``restore`` run in place.

    The buffer lives on ``device``; the state tensors may live there or on the
    host (``replica.state.placement``). ``pin_memory`` pins a host buffer when CUDA is
    present, so copies to and from a GPU run asynchronously at full speed.
    ``shared`` puts a host buffer that is not pinned in shared memory
    (``replica.transport.memfd``), so the shm backend sends its buckets without a
    staging copy (``replica.transport.buffers.transfer_buffer``).

    ``digests`` holds one digest per ``layout.buckets()`` entry, taken when the
    content was complete (received and verified, or sent); ``verify()`` checks
    the buffer against them before the content is used. None means none were
    taken (``Config(verify=False)``), and then ``verify()`` checks nothing.
    """

    def __init__(
        self, layout: StateLayout, *, device: torch.device | str = "cpu", pin_memory: bool = False, shared: bool = False
    ):
        self.layout = layout
        self.buffer = transfer_buffer(layout.total_bytes, device=device, pin_memory=pin_memory, shared=shared)
        self._on_host = self.buffer.device.type == "cpu"  # asked once: ~20 us a step with the caches cold
        self.step: int | None = None
        self.digests: list[int] | None = None
        #: A CUDA buffer's content is complete once this event has (recorded behind the
        #: pack, on the stream it ran on); None: complete now. Sends of the snapshot wait
        #: for it and nothing else (``Connection.isend``'s ``after``), never for a
        #: thread's current stream, where the next step may be queued by then.
        self.ready: torch.cuda.Event | None = None
        self._expected: ops.ShapeCheck | None = None  # the entries' shapes and dtypes, for _check
        # Where the pack puts each state tensor, then the extras blob (built once: every
        # capture passes them).
        self._offsets = [*layout.offsets, layout.extras_offset]
        self._host: np.ndarray | None = None  # a numpy view of a host buffer, made at the first capture
        self._zeros = _ZeroTail(layout.total_bytes, layout.bucket_bytes)  # the zeros past the blob (_head)
        self._head_view: torch.Tensor | None = None  # the buffer up to them
        # The length and blob of the extras, as the pack takes them: host memory kept from one
        # capture to the next (grown when a blob outgrows it), and its view of the last length
        # (the blob's length seldom changes; each new tensor costs the step's budget).
        self._blob_store: torch.Tensor | None = None
        self._blob_bytes: memoryview | None = None  # the store's bytes, for Python to write
        self._blob_view: torch.Tensor | None = None
        # Where the extras region holds zeros only, from there to its end, as the
        # last capture left it; None once anything else may have written the
        # buffer (a receive, a repair): the next capture zeroes the whole region.
        self._zeros_from: int | None = None
        # Whether every state tensor lives on the buffer's device, as the first
        # capture found them (then one kernel call packs them all).
        self._same_device: bool | None = None

    def compute_digests(self) -> list[int]:
        """The digests of every bucket as the buffer is now (to record, not to check)."""
        return [int(d) for d in ops.checksum(self.buffer, self.layout.bucket_bytes).tolist()]

    def bad_buckets(self, buckets: Iterable[int] | None = None) -> list[int]:
        """The indices among ``buckets`` (default: all) whose bytes no longer match
        their kept digest; none without digests.

        Bytes past the extras blob that the last capture left zero (the digests say
        zeros there: the pack did not read them) hold no state: where they changed
        since (a memory error), they are zeroed again first, and a bucket that then
        matches is not bad. No later capture would rewrite them otherwise."""
        digests = self.digests
        if digests is None:
            return []
        ranges = self.layout.buckets()
        indices = list(range(len(ranges)) if buckets is None else buckets)
        bad = self._mismatched(indices, ranges, digests)
        if bad and self._zeros_from is not None and any(ranges[i][1] > self._zeros_from for i in bad):
            self.buffer[self._zeros_from : self.layout.extras_offset + self.layout.extras_capacity].zero_()
            still = self._mismatched(bad, ranges, digests)
            if len(still) < len(bad):
                logger.warning(
                    "rank %d step %s: bytes past the extras blob changed in memory (bucket(s) %s); "
                    "zeroed again, as the capture left them",
                    self.layout.rank,
                    self.step,
                    sorted(set(bad) - set(still)),
                )
            bad = still
        return bad

    def _mismatched(self, indices: list[int], ranges: list[tuple[int, int]], digests: list[int]) -> list[int]:
        now = bucket_digests(self.buffer, [ranges[i] for i in indices])
        return [i for i, digest in zip(indices, now, strict=True) if digest != digests[i]]

    def verify(self) -> None:
        """Raise SnapshotCorruptedError, naming the rank, step and bad buckets, if the
        buffer changed since its digests were taken (a bit flip at rest)."""
        bad = self.bad_buckets()
        if bad:
            raise SnapshotCorruptedError(
                f"rank {self.layout.rank}: the held version of step {self.step} changed in memory since it was "
                f"complete: bucket(s) {bad} of {len(self.layout.buckets())} fail their digests; it is not used",
                rank=self.layout.rank,
                step=self.step,
                buckets=tuple(bad),
            )

    def capture(self, tensors: Sequence[torch.Tensor], extras: bytes, *, step: int, digests: bool = False) -> None:
        """Pack ``tensors`` and ``extras`` as the state of ``step``. With ``digests``,
        ``self.digests`` are those of the new content, taken while it is packed (a
        CUDA buffer's are read back, so this waits for its stream). On an error the
        snapshot holds no step.

        Per-tensor Python work costs more than the bytes' copy here (204 tensors of a
        5 MiB shard: the Python layout check and the device split took ~0.2 ms of a
        ~0.5 ms pack in the mirror benchmark), so the tensors go straight to the
        kernel once the first capture found them all on the buffer's device (it
        validates everything before it writes a byte), and the layout check that
        follows is one C++ pass (``ops.ShapeCheck``).
        """
        room = self.layout.extras_capacity - _LENGTH.size
        if len(extras) > room:
            raise ReplicaError(
                f"the extras need {len(extras)} bytes, the layout reserves {room}; "
                "build the layout with a larger extras_capacity"
            )
        self.digests, self.step = None, None  # of the previous content
        # The extras before the pack hashes the whole buffer, the extras region included.
        # In host memory the blob is one more source of the pack: copied and hashed in
        # its pass (a write of its own, into a region the step left cold, cost a tenth
        # of the pack in the mirror benchmark).
        blob = self._write_extras(extras)
        block_bytes = self.layout.bucket_bytes if digests else None
        self._check_count(tensors)
        if self._same_device is None:
            self._same_device = on_device(tensors, self.buffer.device)
        sources, offsets = ([*tensors, blob], self._offsets) if blob is not None else (tensors, self._offsets[:-1])
        # A host buffer's extras region holds zeros past the blob, as _write_extras left it:
        # the pack hashes up to there, and the zeros' digests are known (a read of the rest
        # of the 1 MiB region, cold after a step, cost a sixth of the pack).
        target = self._head() if blob is not None and digests else self.buffer
        try:
            taken = pack_state(sources, target, offsets, block_bytes=block_bytes, same_device=self._same_device)
        except RuntimeError:
            self._check(tensors)  # a tensor unlike the layout's entry: name it
            if not self._same_device or on_device(tensors, self.buffer.device):
                raise
            self._same_device = False  # a tensor moved: stage it from now on
            taken = pack_state(sources, target, offsets, block_bytes=block_bytes)
        if not self._on_host:
            self.ready = torch.cuda.Event(blocking=True)  # a wait for it sleeps, never spins
            # The stream the pack ran on: the caller's, in the caller's thread, right behind it.
            self.ready.record(torch.cuda.current_stream(self.buffer.device))
        self._check(tensors)
        if taken is not None:
            self.digests = taken.tolist() if target is self.buffer else self._zeros.digests(taken.tolist())
        self.step = step

    def _head(self) -> torch.Tensor:
        """The buffer up to the zeros past the extras blob (rounded up to a word), and
        ``self._zeros`` the digests of what follows."""
        zeros_from = self._zeros_from
        assert zeros_from is not None  # capture's _write_extras set it just before
        cut = min(-(-zeros_from // 8) * 8, self.layout.total_bytes)
        view = self._head_view
        if view is None or self._zeros.cut != cut:  # (None: no cut yet)
            self._zeros.move(cut)
            view = self._head_view = self.buffer[:cut]
        return view

    def written_elsewhere(self) -> None:
        """Note that something other than ``capture`` wrote the buffer (a receive, a
        repair): the next capture zeroes all of the extras region past its blob, not
        only what the last capture's blob left behind."""
        self._zeros_from = None
        self.ready = None  # whoever wrote it finished: a receive completes once its bytes landed

    def _write_extras(self, extras: bytes) -> torch.Tensor | None:
        """The extras region: the blob's length, the blob, then zeros. No bytes of a
        longer previous blob stay behind: the bytes are a function of the state alone,
        so an export (which keeps only the blob) loads back to the same digests. Only
        what the last capture's blob covered is zeroed again (the region is 1 MiB by
        default, and zeroing it all each step cost a third of the pack).

        Zeroes the region past the blob. A host buffer's length and blob are returned,
        as one tensor for the pack to copy to ``extras_offset``; a device buffer's are
        written here (and None returned)."""
        at, end = self.layout.extras_offset, self.layout.extras_offset + self.layout.extras_capacity
        n = at + _LENGTH.size + len(extras)
        dirty_to = end if self._zeros_from is None else max(self._zeros_from, n)
        blob = self._blob(extras)
        self._zeros_from = n
        if self._on_host:  # through numpy: a few microseconds, not torch's tens
            if dirty_to > n:
                if self._host is None:
                    self._host = self.buffer.numpy()
                self._host[n:dirty_to] = 0
            return blob
        self.buffer[at:n].copy_(blob)
        self.buffer[n:dirty_to].zero_()
        return None

    def _blob(self, extras: bytes) -> torch.Tensor:
        """The extras' length and bytes, in a host tensor of exactly their size."""
        size = _LENGTH.size + len(extras)
        store, data = self._blob_store, self._blob_bytes
        if store is None or data is None or store.numel() < size:  # (both None, or neither)
            store = self._blob_store = torch.empty(-(-size // _BLOB_GRAIN) * _BLOB_GRAIN, dtype=torch.uint8)
            data = self._blob_bytes = store.numpy().data  # (the array's memoryview)
            self._blob_view = None
        view = self._blob_view
        if view is None or view.numel() != size:
            view = self._blob_view = store[:size]
        _LENGTH.pack_into(data, 0, len(extras))
        data[_LENGTH.size : size] = extras
        return view

    def restore(self, tensors: Sequence[torch.Tensor]) -> bytes:
        """Write the captured state into ``tensors`` in place; returns the extras."""
        if self.step is None:
            raise ReplicaError("restore() of a snapshot that holds no state yet")
        self._check(tensors)
        unpack_state(self.buffer, tensors, self._offsets[:-1])
        return self.extras()

    def extras(self) -> bytes:
        at = self.layout.extras_offset
        head = bytes(self.buffer[at : at + _LENGTH.size].cpu().numpy())
        (n,) = _LENGTH.unpack(head)
        if n > self.layout.extras_capacity - _LENGTH.size:
            raise ReplicaError("the snapshot's extras region is corrupt")
        return bytes(self.buffer[at + _LENGTH.size : at + _LENGTH.size + n].cpu().numpy())

    def _check_count(self, tensors: Sequence[torch.Tensor]) -> None:
        if len(tensors) != len(self.layout.entries):
            raise LayoutMismatchError(f"{len(tensors)} state tensors, the layout has {len(self.layout.entries)}")

    def _check(self, tensors: Sequence[torch.Tensor]) -> None:
        self._check_count(tensors)
        entries = self.layout.entries
        expected = self._expected
        if expected is None:  # every step checks every tensor: in C++, against meta tensors
            expected = self._expected = ops.ShapeCheck(
                [torch.empty(e.shape, dtype=dtype_of(e.dtype), device="meta") for e in entries]
            )
        bad = expected.first_mismatch(tensors)
        if bad >= 0:
            t, e = tensors[bad], entries[bad]
            raise LayoutMismatchError(
                f"{e.name}: {dtype_name(t.dtype)} {tuple(t.shape)} here, the layout has {e.dtype} {e.shape}"
            )
