"""What weights are pushed, and in which buckets: a source's tensors (an FSDP2 module's
full parameters, gathered; or any ``WeightSource``), their packed layout, and views of
a packed copy by name."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist

from replica.state.layout import StateLayout, dtype_of

__all__ = [
    "ModelSource",
    "ParamInfo",
    "TensorMeta",
    "WeightBucket",
    "WeightSource",
    "named_views",
    "tensor_buckets",
    "weight_layout",
]


class TensorMeta(Protocol):
    """One tensor a ``WeightSource`` yields, read-only (``ParamInfo``, vLLM's ``ParamMeta``)."""

    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> torch.dtype: ...


@runtime_checkable
class WeightSource(Protocol):
    """Full tensors a ``WeightSync`` pushes, for weights that are not one module's parameters
    (vLLM's ``WeightSource`` fits): ``metadata()`` names each tensor's name, shape and dtype
    with no transfer; iterating gives ``(name, full tensor)`` in that order, a fresh pass
    each push, on every trainer rank (gathers are collectives)."""

    def metadata(self) -> Sequence[TensorMeta]: ...

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]: ...


@dataclass(kw_only=True, frozen=True, slots=True)
class ParamInfo:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype


def _gather(p) -> torch.Tensor:
    """The full tensor of a DTensor parameter. FSDP2's dim-0 shards are gathered with
    one ``all_gather_into_tensor`` on the mesh's group (padded to equal chunks, as
    FSDP2 shards with ``torch.chunk``): that goes through the group's own methods,
    which a ``ResilientProcessGroup`` forwards, where ``full_tensor()``'s functional
    collectives need a C++ backend registered for the device. Other placements use
    ``full_tensor()``."""
    placements = p.placements
    if len(placements) != 1 or not placements[0].is_shard(0):
        return p.full_tensor()
    group = p.device_mesh.get_group()
    world, shape = group.size(), tuple(p.shape)
    rows = -(-shape[0] // world)
    local = p.to_local()
    padded = local.new_zeros((rows, *shape[1:]))
    padded[: local.shape[0]] = local
    out = local.new_empty((rows * world, *shape[1:]))
    dist.all_gather_into_tensor(out, padded, group=group)
    return out[: shape[0]]


class ModelSource:
    """The ``WeightSource`` of a model's parameters (FSDP2 or plain): each one's full tensor,
    gathered one at a time (a collective every rank joins), cast to ``dtype`` if given."""

    def __init__(self, model: torch.nn.Module, *, dtype: torch.dtype | None = None):
        self._params = list(model.named_parameters())
        self._dtype = dtype

    def metadata(self) -> list[ParamInfo]:
        return [ParamInfo(name=n, shape=tuple(p.shape), dtype=self._dtype or p.dtype) for n, p in self._params]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, p in self._params:
            full = _gather(p.detach()) if hasattr(p, "full_tensor") else p.detach()
            yield name, full if self._dtype is None or full.dtype == self._dtype else full.to(self._dtype)


@dataclass(kw_only=True, frozen=True, slots=True)
class WeightBucket:
    """Bytes [lo, hi) of the packed weights, holding whole tensors [first, end)."""

    lo: int
    hi: int
    first: int
    end: int


def weight_layout(named: list[tuple[str, torch.Tensor]], *, bucket_bytes: int) -> StateLayout:
    """The packed layout of full (unsharded) weights; tensors may be on the meta device."""
    return StateLayout.build(named, world_size=1, rank=0, extras_capacity=0, bucket_bytes=bucket_bytes)


def tensor_buckets(layout: StateLayout) -> list[WeightBucket]:
    """Group whole tensors into buckets of about ``layout.bucket_bytes`` (a larger
    tensor is a bucket of its own): each bucket is gathered, packed and sent as one."""
    entries = layout.entries
    buckets, first = [], 0
    for i in range(1, len(entries) + 1):
        end_of = entries[i].offset if i < len(entries) else layout.total_bytes
        if i == len(entries) or end_of - entries[first].offset + entries[i].nbytes > layout.bucket_bytes:
            buckets.append(WeightBucket(lo=entries[first].offset, hi=end_of, first=first, end=i))
            first = i
    return buckets


def named_views(buffer: torch.Tensor, layout: StateLayout) -> Iterator[tuple[str, torch.Tensor]]:
    for e in layout.entries:
        yield e.name, buffer[e.offset : e.offset + e.nbytes].view(dtype_of(e.dtype)).view(e.shape)
