"""The two cases of bench/test_pack.py (1,000 mixed tensors, 256 MiB; 10,000 small ones): a
few calls of each pack kernel, for ncu to profile (tools/gpu_check.sh, one case at a time: it
skips the first three launches and profiles the next three). Run from the repository root:
``python3 tools/ncu_pack.py [large] [small]`` (both when none is named)."""

import sys

import torch

sys.path.insert(0, "bench")
import pack_cases as cases

from replica import ops


def run(name: str, tensors: list[torch.Tensor]) -> None:
    offsets, total = ops.aligned_offsets(tensors)
    tensors = [t.cuda() for t in tensors]
    out = torch.zeros(total, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        digests = ops.pack_checksum(tensors, out, offsets, cases.PACK_CHECKSUM_BLOCK)
        ops.pack(tensors, out, offsets)
        ops.checksum(out, cases.CHECKSUM_BLOCK)
    torch.cuda.synchronize()
    assert torch.equal(digests, ops.checksum(out, cases.PACK_CHECKSUM_BLOCK)), f"{name}: pack_checksum digests differ"
    print(f"ncu_pack {name}: ok, {len(tensors)} tensors, {total} bytes")


CASES = {"large": cases.large_tensors, "small": cases.small_tensors}
for case in sys.argv[1:] or list(CASES):
    run(case, CASES[case]())
