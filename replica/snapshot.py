"""``Snapshot``: one packed copy of a rank's training state, laid out by a
``StateLayout``: every state tensor in one ``ops.pack`` call (``replica.placement``
when some live on another device), then the encoded
extras (optimizer hyperparameters and non-tensor state, and the ``state_dict()``
of each extra object) in the reserved region behind a length prefix.
Restoring unpacks in place: no allocation, no network."""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from replica import ops
from replica.errors import LayoutMismatchError, ReplicaError, SnapshotCorruptedError
from replica.layout import StateLayout, dtype_name, dtype_of
from replica.placement import pack_state, unpack_state

__all__ = ["Snapshot", "Stateful", "apply_extras", "bucket_digests", "collect_extras"]

_LENGTH = struct.Struct("<Q")


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
            for g in optimizer.param_groups for p in g["params"]
        ]
    return state


def apply_extras(state: Mapping[str, Any], optimizer: torch.optim.Optimizer | None,
                 extra: Mapping[str, Stateful]) -> None:
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


class Snapshot:
    """A snapshot buffer for one layout; ``capture`` and ``restore`` run in place.

    The buffer lives on ``device``; the state tensors may live there or on the
    host (``replica.placement``). ``pin_memory`` pins a host buffer when CUDA is
    present, so copies to and from a GPU run asynchronously at full speed.

    ``digests`` holds one digest per ``layout.buckets()`` entry, taken when the
    content was complete (received and verified, or sent); ``verify()`` checks
    the buffer against them before the content is used. None means none were
    taken (``Config(verify=False)``), and then ``verify()`` checks nothing.
    """

    def __init__(self, layout: StateLayout, *, device: torch.device | str = "cpu", pin_memory: bool = False):
        self.layout = layout
        device = torch.device(device)
        pin = pin_memory and device.type == "cpu" and torch.cuda.is_available()
        self.buffer = torch.zeros(layout.total_bytes, dtype=torch.uint8, device=device, pin_memory=pin)
        self.step: int | None = None
        self.digests: list[int] | None = None
        self._expected: list[tuple[torch.Size, torch.dtype]] | None = None  # per entry, for _check
        self._host: np.ndarray | None = None  # a numpy view of a host buffer, made at the first capture

    def compute_digests(self) -> list[int]:
        """The digests of every bucket as the buffer is now (to record, not to check)."""
        return [int(d) for d in ops.checksum(self.buffer, self.layout.bucket_bytes).tolist()]

    def bad_buckets(self, buckets: Iterable[int] | None = None) -> list[int]:
        """The indices among ``buckets`` (default: all) whose bytes no longer match
        their kept digest; none without digests."""
        if self.digests is None:
            return []
        ranges = self.layout.buckets()
        indices = list(range(len(ranges)) if buckets is None else buckets)
        now = bucket_digests(self.buffer, [ranges[i] for i in indices])
        return [i for i, digest in zip(indices, now, strict=True) if digest != self.digests[i]]

    def verify(self) -> None:
        """Raise SnapshotCorruptedError, naming the rank, step and bad buckets, if the
        buffer changed since its digests were taken (a bit flip at rest)."""
        bad = self.bad_buckets()
        if bad:
            raise SnapshotCorruptedError(
                f"rank {self.layout.rank}: the held version of step {self.step} changed in memory since it was "
                f"complete: bucket(s) {bad} of {len(self.layout.buckets())} fail their digests; it is not used",
                rank=self.layout.rank, step=self.step, buckets=tuple(bad))

    def capture(self, tensors: Sequence[torch.Tensor], extras: bytes, *, step: int, digests: bool = False) -> None:
        """Pack ``tensors`` and ``extras`` as the state of ``step``. With ``digests``,
        ``self.digests`` are those of the new content, taken while it is packed (a
        CUDA buffer's are read back, so this waits for its stream)."""
        self._check(tensors)
        room = self.layout.extras_capacity - _LENGTH.size
        if len(extras) > room:
            raise ReplicaError(f"the extras need {len(extras)} bytes, the layout reserves {room}; "
                               "build the layout with a larger extras_capacity")
        self.digests = None  # of the previous content
        # The extras first: the pack hashes the whole buffer, the extras region included.
        self._write_extras(extras)
        taken = pack_state(tensors, self.buffer, self.layout.offsets,
                           block_bytes=self.layout.bucket_bytes if digests else None)
        if taken is not None:
            self.digests = [int(d) for d in taken.tolist()]
        self.step = step

    def _write_extras(self, extras: bytes) -> None:
        """The extras region: the blob's length, the blob, then zeros. No bytes of a
        longer previous blob stay behind: the bytes are a function of the state alone,
        so an export (which keeps only the blob) loads back to the same digests."""
        at, end = self.layout.extras_offset, self.layout.extras_offset + self.layout.extras_capacity
        n = at + _LENGTH.size + len(extras)
        if self.buffer.device.type == "cpu":  # through numpy: a few microseconds, not torch's tens
            if self._host is None:
                self._host = self.buffer.numpy()
            self._host[at:at + _LENGTH.size] = np.frombuffer(_LENGTH.pack(len(extras)), dtype=np.uint8)
            self._host[at + _LENGTH.size:n] = np.frombuffer(extras, dtype=np.uint8)
            self._host[n:end] = 0
            return
        blob = torch.frombuffer(bytearray(_LENGTH.pack(len(extras)) + extras), dtype=torch.uint8)
        self.buffer[at:n].copy_(blob)
        self.buffer[n:end].zero_()

    def restore(self, tensors: Sequence[torch.Tensor]) -> bytes:
        """Write the captured state into ``tensors`` in place; returns the extras."""
        if self.step is None:
            raise ReplicaError("restore() of a snapshot that holds no state yet")
        self._check(tensors)
        unpack_state(self.buffer, tensors, self.layout.offsets)
        return self.extras()

    def extras(self) -> bytes:
        at = self.layout.extras_offset
        head = bytes(self.buffer[at:at + _LENGTH.size].cpu().numpy())
        (n,) = _LENGTH.unpack(head)
        if n > self.layout.extras_capacity - _LENGTH.size:
            raise ReplicaError("the snapshot's extras region is corrupt")
        return bytes(self.buffer[at + _LENGTH.size:at + _LENGTH.size + n].cpu().numpy())

    def _check(self, tensors: Sequence[torch.Tensor]) -> None:
        entries = self.layout.entries
        if len(tensors) != len(entries):
            raise LayoutMismatchError(f"{len(tensors)} state tensors, the layout has {len(entries)}")
        if self._expected is None:  # every step checks every tensor: compare torch's own objects
            self._expected = [(torch.Size(e.shape), dtype_of(e.dtype)) for e in entries]
        for t, (shape, dtype), e in zip(tensors, self._expected, entries):
            if t.shape != shape or t.dtype != dtype:
                raise LayoutMismatchError(
                    f"{e.name}: {dtype_name(t.dtype)} {tuple(t.shape)} here, the layout has {e.dtype} {e.shape}")

