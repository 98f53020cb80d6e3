"""The large case of bench/test_pack.py (1,000 mixed tensors, 256 MiB): a few calls of each
pack kernel, for ncu to profile (tools/gpu_check.sh). Run from the repository root."""

import sys

import torch

sys.path.insert(0, "bench")
import test_pack as tp  # noqa: E402

from replica import ops  # noqa: E402

tensors = tp._mixed_tensors(tp.LARGE_COUNT, tp._large_sizes(0), seed=0)
offsets, total = ops.aligned_offsets(tensors)
tensors = [t.cuda() for t in tensors]
out = torch.zeros(total, dtype=torch.uint8, device="cuda")
for _ in range(3):
    digests = ops.pack_checksum(tensors, out, offsets, tp.PACK_CHECKSUM_BLOCK)
    ops.pack(tensors, out, offsets)
    ops.checksum(out, tp.CHECKSUM_BLOCK)
torch.cuda.synchronize()
assert torch.equal(digests, ops.checksum(out, tp.PACK_CHECKSUM_BLOCK)), "pack_checksum digests differ"
print("ncu_pack: ok,", total, "bytes")
