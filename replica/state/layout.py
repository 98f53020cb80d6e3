"""``StateLayout``: where every tensor of a rank's state lives in its snapshot.

The layout enumerates, deterministically, the rank's local shards of the model
(FSDP2 DTensors are taken ``to_local()``), its persistent buffers, and the
optimizer state of each parameter (tensor entries, keys sorted), gives each a
64-byte-aligned byte range, reserves a region for the serialized extras, and
cuts the whole into fixed-size buckets. Names are the keys
``torch.distributed.checkpoint`` gives the state (``model.{fqn}``,
``optim.state.{fqn}.{key}``) and a sharded tensor's entry says where its shard
starts in the whole tensor, so a rank's file is one part of a DCP checkpoint
(``replica.state.export``). Its fingerprint covers names, dtypes, shapes (and
shard offsets), world size and rank; a mirror is applied only to a state whose
layout matches, and a mismatch names the first difference.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from replica.errors import LayoutMismatchError
from replica.ops import ALIGNMENT

__all__ = [
    "LAYOUT_VERSION",
    "StateLayout",
    "TensorEntry",
    "dtype_name",
    "dtype_of",
    "global_offsets",
    "local_tensor",
    "state_tensors",
]

LAYOUT_VERSION = 1


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``: how layouts and encoded state name dtypes."""
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16``: the inverse of ``dtype_name``."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{name!r} is not a torch dtype")
    return dtype


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local storage of ``t``: the shard of a DTensor, else ``t`` itself."""
    to_local: Callable[[], torch.Tensor] | None = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _named_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a rank's training state as the model and optimizer hold it (DTensors
    whole), named as ``torch.distributed.checkpoint`` flattens ``{"model":
    get_model_state_dict(...), "optim": get_optimizer_state_dict(...)}``: ``model.{fqn}`` for
    parameters and persistent buffers, ``optim.state.{fqn}.{key}`` for optimizer state."""
    names = {}
    for name, param in model.named_parameters():
        names[param] = name
        yield f"model.{name}", param.detach()
    persistent = {
        f"{prefix}.{n}" if prefix else n
        for prefix, module in model.named_modules()
        for n in module._buffers
        if n not in module._non_persistent_buffers_set
    }
    for name, buf in model.named_buffers():
        if name in persistent:
            yield f"model.{name}", buf
    if optimizer is None:
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param not in names:
                raise LayoutMismatchError("the optimizer holds a parameter that is not in the model")
            state = optimizer.state.get(param, {})
            for key in sorted(state):
                value = state[key]
                if isinstance(value, torch.Tensor):
                    yield f"optim.state.{names[param]}.{key}", value


def state_tensors(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of a rank's training state, named, in a fixed order: its rank-local storage."""
    for name, t in _named_state(model, optimizer):
        yield name, local_tensor(t)


def global_offsets(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
) -> dict[str, tuple[int, ...]]:
    """Where each sharded state tensor's local shard starts in the whole tensor (a DTensor's
    one chunk, as ``torch.distributed.checkpoint`` plans it); tensors that are whole on
    every rank are left out."""
    offsets = {}
    for name, t in _named_state(model, optimizer):
        chunks: Callable[[], list[Any]] | None = getattr(t, "__create_chunk_list__", None)  # (ChunkStorageMetadata)
        if callable(chunks):
            (chunk,) = chunks()
            offsets[name] = tuple(int(o) for o in chunk.offsets)
    return offsets


@dataclass(kw_only=True, frozen=True, slots=True)
class TensorEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    #: Where this rank's shard starts in the whole tensor; empty: the tensor is whole here.
    global_offset: tuple[int, ...] = ()


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


@dataclass(kw_only=True, frozen=True, slots=True)
class StateLayout:
    version: int
    world_size: int
    rank: int
    bucket_bytes: int
    entries: tuple[TensorEntry, ...]
    extras_offset: int
    extras_capacity: int
    total_bytes: int
    fingerprint: str

    @classmethod
    def of(
        cls,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        *,
        world_size: int,
        rank: int,
        extras_capacity: int,
        bucket_bytes: int,
    ) -> StateLayout:
        """The layout of a model's and optimizer's state (``extras_capacity`` rounded up to the alignment)."""
        return cls.build(
            list(state_tensors(model, optimizer)),
            world_size=world_size,
            rank=rank,
            extras_capacity=_align(extras_capacity),
            bucket_bytes=bucket_bytes,
            global_offsets=global_offsets(model, optimizer),
        )

    @classmethod
    def build(
        cls,
        tensors: Sequence[tuple[str, torch.Tensor]],
        *,
        world_size: int,
        rank: int,
        extras_capacity: int,
        bucket_bytes: int,
        global_offsets: Mapping[str, tuple[int, ...]] | None = None,
    ) -> StateLayout:
        """The layout of ``tensors`` (rank-local), each shard's place in its whole tensor from
        ``global_offsets`` (by name; the ones left out are whole)."""
        global_offsets = global_offsets or {}
        if bucket_bytes <= 0 or bucket_bytes % ALIGNMENT:
            raise ValueError(f"bucket_bytes must be a positive multiple of {ALIGNMENT}, got {bucket_bytes}")
        if extras_capacity < 0:
            raise ValueError(f"extras_capacity must be >= 0, got {extras_capacity}")
        entries = []
        end = 0
        seen = set()
        for name, t in tensors:
            if name in seen:
                raise ValueError(f"two state tensors are named {name!r}")
            seen.add(name)
            nbytes = t.numel() * t.element_size()
            where = tuple(global_offsets.get(name, ()))
            if where and len(where) != t.dim():
                raise ValueError(f"{name}: global offset {where} for a {t.dim()}-d tensor")
            entries.append(
                TensorEntry(
                    name=name,
                    dtype=dtype_name(t.dtype),
                    shape=tuple(t.shape),
                    offset=end,
                    nbytes=nbytes,
                    global_offset=where,
                )
            )
            end = _align(end + nbytes)
        extras_offset = end
        total = _align(extras_offset + extras_capacity)
        fingerprint = _fingerprint(world_size, rank, entries)
        return cls(
            version=LAYOUT_VERSION,
            world_size=world_size,
            rank=rank,
            bucket_bytes=bucket_bytes,
            entries=tuple(entries),
            extras_offset=extras_offset,
            extras_capacity=extras_capacity,
            total_bytes=total,
            fingerprint=fingerprint,
        )

    @property
    def offsets(self) -> list[int]:
        return [e.offset for e in self.entries]

    def buckets(self) -> list[tuple[int, int]]:
        """Byte ranges [start, end) of the fixed-size buckets covering the snapshot."""
        return [
            (s, min(s + self.bucket_bytes, self.total_bytes)) for s in range(0, self.total_bytes, self.bucket_bytes)
        ]

    def check_matches(self, other: StateLayout) -> None:
        """Raise LayoutMismatchError naming the first difference between two layouts."""
        for attr in ("version", "world_size", "rank"):
            mine, theirs = getattr(self, attr), getattr(other, attr)
            if mine != theirs:
                raise LayoutMismatchError(f"{attr} differs: {mine} here, {theirs} in the mirror")
        for i, (a, b) in enumerate(zip(self.entries, other.entries, strict=False)):
            for attr in ("name", "dtype", "shape"):
                if getattr(a, attr) != getattr(b, attr):
                    raise LayoutMismatchError(
                        f"state tensor {i} differs in {attr}: {a.name} {getattr(a, attr)} here, "
                        f"{b.name} {getattr(b, attr)} in the mirror"
                    )
        if len(self.entries) != len(other.entries):
            longer, where = (self, "here") if len(self.entries) > len(other.entries) else (other, "in the mirror")
            extra = longer.entries[min(len(self.entries), len(other.entries))]
            raise LayoutMismatchError(
                f"{len(self.entries)} state tensors here, {len(other.entries)} in the mirror; "
                f"first unmatched: {extra.name} ({where})"
            )
        if self.extras_capacity != other.extras_capacity:
            raise LayoutMismatchError(
                f"extras capacity differs: {self.extras_capacity} here, "
                f"{other.extras_capacity} in the mirror (Config.extras_capacity)"
            )
        if self.bucket_bytes != other.bucket_bytes:
            raise LayoutMismatchError(
                f"bucket size differs: {self.bucket_bytes} bytes here, {other.bucket_bytes} in the mirror "
                "(Config.bucket_bytes; unset, it follows the device the state lives on: set it alike on both)"
            )

    def to_json(self) -> str:
        data = {f: getattr(self, f) for f in self.__dataclass_fields__ if f != "entries"}
        # A shard's place in its whole tensor is a sixth field, only where there is one (older files have five).
        data["entries"] = [
            [e.name, e.dtype, list(e.shape), e.offset, e.nbytes] + ([list(e.global_offset)] if e.global_offset else [])
            for e in self.entries
        ]
        return json.dumps(data, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> StateLayout:
        data = json.loads(text)
        entries = tuple(
            TensorEntry(
                name=n, dtype=d, shape=tuple(s), offset=o, nbytes=b, global_offset=tuple(where[0]) if where else ()
            )
            for n, d, s, o, b, *where in data.pop("entries")
        )
        layout = cls(entries=entries, **data)
        expected = _fingerprint(layout.world_size, layout.rank, list(entries))
        if layout.fingerprint != expected:
            raise LayoutMismatchError("layout metadata is inconsistent with its fingerprint")
        return layout


def _fingerprint(world_size: int, rank: int, entries: Sequence[TensorEntry]) -> str:
    h = hashlib.sha256(f"replica-layout-v{LAYOUT_VERSION}|{world_size}|{rank}".encode())
    for e in entries:
        h.update(f"|{e.name}:{e.dtype}:{'x'.join(map(str, e.shape))}".encode())
        if e.global_offset:  # (layouts without offsets keep the fingerprint they always had)
            h.update(f"@{'x'.join(map(str, e.global_offset))}".encode())
    return h.hexdigest()[:32]
