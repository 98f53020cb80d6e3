"""The pack benchmark's inputs (bench/test_pack.py), also profiled by tools/ncu_pack.py:
1,000 mixed tensors of 256 MiB in all (``large_tensors``) and 10,000 small ones of
256 B to 4 KiB (``small_tensors``), in the dtypes a model's state holds; and the block
sizes of the checksums."""

from __future__ import annotations

import random

import torch

__all__ = [
    "CHECKSUM_BLOCK",
    "DTYPES",
    "LARGE_BYTES",
    "LARGE_COUNT",
    "MiB",
    "PACK_CHECKSUM_BLOCK",
    "SMALL_COUNT",
    "large_tensors",
    "small_tensors",
]

MiB = 1 << 20
LARGE_BYTES = 256 * MiB
LARGE_COUNT = 1000
SMALL_COUNT = 10_000
CHECKSUM_BLOCK = 1 * MiB
# The bucket size the mirror uses by default (Config.bucket_bytes): pack_checksum's blocks.
PACK_CHECKSUM_BLOCK = 4 * MiB
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8]


def _mixed_tensors(count: int, sizes: list[int], seed: int) -> list[torch.Tensor]:
    rng = random.Random(seed)
    tensors = []
    for nbytes in sizes[:count]:
        dtype = rng.choice(DTYPES)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        tensors.append(torch.randint(0, 100, (max(nbytes // itemsize, 1),)).to(dtype))
    return tensors


def _large_sizes(seed: int) -> list[int]:
    rng = random.Random(seed)
    weights = [rng.lognormvariate(0, 1.5) for _ in range(LARGE_COUNT)]
    scale = LARGE_BYTES / sum(weights)
    return [max(64, int(w * scale) // 64 * 64) for w in weights]


def large_tensors() -> list[torch.Tensor]:
    """LARGE_COUNT tensors of lognormal sizes, LARGE_BYTES in all."""
    return _mixed_tensors(LARGE_COUNT, _large_sizes(0), seed=0)


def small_tensors() -> list[torch.Tensor]:
    """SMALL_COUNT tensors of 256 B to 4 KiB."""
    rng = random.Random(1)
    sizes = [rng.randint(256, 4096) for _ in range(SMALL_COUNT)]
    return _mixed_tensors(SMALL_COUNT, sizes, seed=1)
