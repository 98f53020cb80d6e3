"""Tensors for the kernels' tests (replica.ops): random ones of every dtype and size, and
the buffer they pack into; ``DEVICES``, the devices a kernel test runs on."""

from __future__ import annotations

import random

import pytest
import torch

from replica import ops

__all__ = ["DEVICES", "DTYPES", "MiB", "packed", "random_mix", "random_tensor"]

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
MiB = 1 << 20


def random_tensor(numel: int, dtype: torch.dtype, device: str, gen: torch.Generator) -> torch.Tensor:
    """``numel`` random values of ``dtype`` on ``device`` (integers over their whole range)."""
    if dtype.is_floating_point:
        t = torch.randn(numel, generator=gen).to(dtype)
    else:
        high = 256 if dtype == torch.uint8 else 1 << 62
        t = torch.randint(0, high, (numel,), generator=gen, dtype=dtype)
    return t.to(device)


def random_mix(count: int, max_numel: int, seed: int, device: str) -> list[torch.Tensor]:
    """``count`` tensors of every dtype and size (empty, one value, up to ``max_numel``; some 2-d)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    tensors = []
    for _ in range(count):
        numel = rng.choice([0, 1, rng.randint(2, 100), rng.randint(1, max_numel)])
        shape = (numel,) if numel % 3 else (numel // 3, 3) if numel else (0, 4)
        tensors.append(random_tensor(numel, rng.choice(DTYPES), device, gen).reshape(shape))
    return tensors


def packed(tensors, fill=0xA5):
    """A buffer for ``tensors`` packed at ``ops.aligned_offsets``, filled with ``fill``; and the offsets."""
    offsets, total = ops.aligned_offsets(tensors)
    out = torch.full((total,), fill, dtype=torch.uint8, device=tensors[0].device)
    return out, offsets
