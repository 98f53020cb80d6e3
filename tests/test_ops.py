"""The kernels of replica._C, each tested three ways: against the pure-torch
reference in replica.ops, by round trip, and with torch.library.opcheck."""

import itertools
import random
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from replica import ops
from support.tensors import DEVICES, DTYPES, MiB, packed, random_mix, random_tensor

# --- pack / unpack ---


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed,count,max_numel", [(s, 40, 20_000) for s in range(6)] + [(7, 10_000, 1024)])
def test_pack_matches_reference(device, seed, count, max_numel):
    tensors = random_mix(count, max_numel, seed, device)
    out, offsets = packed(tensors)
    expected = out.clone()
    ops.pack(tensors, out, offsets)
    ops.reference_pack(tensors, expected, offsets)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(6))
def test_unpack_matches_reference(device, seed):
    sources = random_mix(40, 20_000, seed, device)
    buf, offsets = packed(sources)
    ops.reference_pack(sources, buf, offsets)
    got = [torch.full_like(t, 7) for t in sources]
    expected = [torch.full_like(t, 7) for t in sources]
    ops.unpack(buf, got, offsets)
    ops.reference_unpack(buf, expected, offsets)
    for g, e in zip(got, expected, strict=True):
        assert torch.equal(g, e)


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_up_to_64_mib(device):
    gen = torch.Generator().manual_seed(0)
    sizes = [0, 1, 3, 63, 64, 65, 4095, 1 * MiB + 1, 64 * MiB]
    tensors = []
    for nbytes, dtype in zip(sizes, itertools.cycle(DTYPES)):
        itemsize = torch.empty(0, dtype=dtype).element_size()
        tensors.append(random_tensor(nbytes // itemsize, dtype, device, gen))
    buf, offsets = packed(tensors)
    ops.pack(tensors, buf, offsets)
    back = [torch.empty_like(t) for t in tensors]
    ops.unpack(buf, back, offsets)
    for t, b in zip(tensors, back, strict=True):
        assert t.dtype == b.dtype and torch.equal(t, b)
    assert buf.numel() >= 64 * MiB


@pytest.mark.parametrize("device", DEVICES)
def test_pack_leaves_gaps_untouched(device):
    tensors = [torch.ones(3, device=device), torch.ones(5, dtype=torch.int64, device=device)]
    out, offsets = packed(tensors, fill=0xEE)
    ops.pack(tensors, out, offsets)
    assert offsets == [0, 64]
    assert torch.all(out[12:64] == 0xEE) and torch.all(out[104:] == 0xEE)


@pytest.mark.parametrize("device", DEVICES)
def test_views_at_offsets_and_scalars(device):
    base = torch.arange(1000, dtype=torch.float32, device=device)
    tensors = [base[3:500], base[501:502], torch.tensor(2.5, device=device), base.view(10, 100)[2:4]]
    out, offsets = packed(tensors)
    ops.pack(tensors, out, offsets)
    back = [torch.empty_like(t) for t in tensors]
    ops.unpack(out, back, offsets)
    for t, b in zip(tensors, back, strict=True):
        assert torch.equal(t, b)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_list_is_a_no_op(device):
    out = torch.full((64,), 3, dtype=torch.uint8, device=device)
    ops.pack([], out, [])
    ops.unpack(out, [], [])
    ops.pack([torch.empty(0, device=device)], out, [0])
    assert torch.all(out == 3)


# Sizes around the CUDA kernel's edges: its 16-byte vectors, its 4 KiB warp steps, its
# 16 KiB tiles.
ODD_SIZES = [1, 7, 15, 16, 17, 31, 100, 1000, 4099, 16384, 16384 + 17, 3 * 16384 + 1, 300_007]


def view_at(nbytes: int, shift: int, device: str, gen: torch.Generator) -> torch.Tensor:
    """A contiguous tensor of `nbytes` whose data starts `shift` bytes into its storage
    (storages are at least 64-byte aligned), of the widest dtype that allows it."""
    itemsize = next(s for s in (8, 4, 2, 1) if shift % s == 0 and nbytes % s == 0)
    dtype = {8: torch.int64, 4: torch.float32, 2: torch.bfloat16, 1: torch.uint8}[itemsize]
    storage = torch.randint(0, 256, (shift + nbytes,), generator=gen, dtype=torch.uint8).to(device)
    t = storage[shift:].view(dtype)
    assert t.data_ptr() % 16 == shift % 16
    return t


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_shift", [0, 3, 8])
@pytest.mark.parametrize("src_shift", [0, 1, 3, 5, 7, 8, 12])
def test_pack_unpack_at_odd_addresses(device, src_shift, out_shift):
    """Tensors starting 1..15 bytes past a 16-byte boundary (the byte path, the 8-byte
    path), into and out of a buffer that is itself a view at an odd address."""
    gen = torch.Generator().manual_seed(src_shift * 16 + out_shift)
    tensors = [view_at(n, src_shift, device, gen) for n in ODD_SIZES]
    offsets, total = ops.aligned_offsets(tensors)
    base = torch.full((out_shift + total + 64,), 0xA5, dtype=torch.uint8, device=device)
    out = base[out_shift : out_shift + total]
    assert out.data_ptr() % 16 == out_shift % 16
    expected = base.clone()
    ops.pack(tensors, out, offsets)
    ops.reference_pack(tensors, expected[out_shift : out_shift + total], offsets)
    assert torch.equal(base, expected)  # the gaps and the bytes around out untouched too

    dsts = [view_at(t.numel() * t.element_size(), src_shift, device, gen) for t in tensors]
    want = [d.clone() for d in dsts]
    ops.unpack(out, dsts, offsets)
    ops.reference_unpack(out, want, offsets)
    for d, w, t in zip(dsts, want, tensors, strict=True):  # as bytes: random floats hold NaNs
        assert torch.equal(d.view(torch.uint8), w.view(torch.uint8))
        assert torch.equal(d.view(torch.uint8), t.view(torch.uint8))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(3))
def test_pack_unpack_random_addresses(device, seed):
    """Many segments in one call, each at its own misalignment, sizes up to a few tiles."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    sizes = [rng.choice([rng.randint(1, 40), rng.randint(1, 5000), rng.randint(1, 70_000)]) for _ in range(150)]
    tensors = [view_at(n, rng.randrange(16), device, gen) for n in sizes]
    offsets, total = ops.aligned_offsets(tensors)
    out_shift = rng.randrange(16)
    base = torch.zeros(out_shift + total, dtype=torch.uint8, device=device)
    out = base[out_shift:]
    expected = base.clone()
    ops.pack(tensors, out, offsets)
    ops.reference_pack(tensors, expected[out_shift:], offsets)
    assert torch.equal(base, expected)
    dsts = [view_at(n, rng.randrange(16), device, gen) for n in sizes]
    ops.unpack(out, dsts, offsets)
    for d, t in zip(dsts, tensors, strict=True):
        assert torch.equal(d.view(torch.uint8), t.view(torch.uint8))


def test_cuda_copy_tiles_on_the_host(tmp_path):
    """The CUDA kernel's per-lane code, run lane by lane on the host (no GPU needed):
    every alignment, sizes around its vectors and tiles, offsets past 2^31."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("needs nvcc")
    source = Path(__file__).resolve().parents[1] / "csrc" / "cuda" / "copy_tiles_check.cpp"
    exe = tmp_path / "copy_tiles_check"
    subprocess.run([nvcc, "-O1", "-std=c++17", str(source), "-o", str(exe)], check=True, timeout=300)
    result = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr


def _equal_in_chunks(a: torch.Tensor, b: torch.Tensor, chunk: int = 256 * MiB) -> bool:
    # torch.equal of the whole would allocate a temporary as large as the tensors.
    assert a.numel() == b.numel()
    return all(torch.equal(a[i : i + chunk], b[i : i + chunk]) for i in range(0, a.numel(), chunk))


@pytest.mark.gpu
@pytest.mark.parametrize("shift", [0, 1])
def test_cuda_segment_over_2_gib(shift):
    """Byte offsets past 2^31 inside one segment, both directions."""
    nbytes = (2 << 30) + 4099
    free, _ = torch.cuda.mem_get_info()
    if free < 6 << 30:
        pytest.skip(f"needs 6 GiB of free GPU memory, {free / 2**30:.1f} GiB free")
    storage = torch.empty(shift + nbytes, dtype=torch.uint8, device="cuda")
    big = storage[shift:]
    big.random_()
    small = torch.arange(10, dtype=torch.float32, device="cuda")
    out = torch.zeros(64 + nbytes, dtype=torch.uint8, device="cuda")
    ops.pack([small, big], out, [0, 64])
    assert torch.equal(out[:40].view(torch.float32), small) and torch.all(out[40:64] == 0)
    assert _equal_in_chunks(out[64:], big)
    big.zero_()
    small_back = torch.zeros_like(small)
    ops.unpack(out, [small_back, big], [0, 64])
    assert torch.equal(small_back, small) and _equal_in_chunks(big, out[64:])


@pytest.mark.gpu
def test_cuda_ops_run_on_the_current_stream():
    """Work queued on a side stream before the op (a long sleep, then the inputs) must be
    finished before the op reads its inputs: it runs on that stream, not the default one."""
    tensors = random_mix(40, 20_000, seed=11, device="cuda")
    out, offsets = packed(tensors)
    expected = out.clone()
    ops.reference_pack(tensors, expected, offsets)
    sources = [torch.zeros_like(t) for t in tensors]
    dsts = [torch.zeros_like(t) for t in tensors]
    staged = torch.zeros_like(out)
    digests = ops.checksum(expected, 4096)
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # ~50 ms of GPU time on the side stream
        for s, t in zip(sources, tensors, strict=True):
            s.copy_(t)
        ops.pack(sources, out, offsets)
        staged.copy_(out)
        side_digests = ops.checksum(staged, 4096)
        ops.unpack(staged, dsts, offsets)
    assert not side.query(), "the side stream finished within the host's work; the test proves nothing"
    side.synchronize()
    assert torch.equal(out, expected)
    assert torch.equal(side_digests, digests)
    for d, t in zip(dsts, tensors, strict=True):
        assert torch.equal(d, t)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    tensors = random_mix(8, 500, seed=3, device=device)
    out, offsets = packed(tensors)
    torch.library.opcheck(torch.ops.replica.pack.default, (tensors, out, offsets))
    torch.library.opcheck(torch.ops.replica.unpack.default, (out, [torch.empty_like(t) for t in tensors], offsets))
    torch.library.opcheck(torch.ops.replica.checksum.default, (out, 64))
    torch.library.opcheck(torch.ops.replica.checksum.default, (out[:0], 64))


# --- bad input ---


def _pack_error(srcs, out, offsets) -> str:
    with pytest.raises(RuntimeError) as info:
        ops.pack(srcs, out, offsets)
    return str(info.value)


def test_error_non_contiguous_source():
    msg = _pack_error([torch.ones(3), torch.ones(4, 4).t()], torch.empty(256, dtype=torch.uint8), [0, 64])
    assert "srcs[1] is not contiguous" in msg


def test_error_wrong_out_dtype():
    msg = _pack_error([torch.ones(3)], torch.empty(64, dtype=torch.float32), [0])
    assert "out must be a uint8 tensor" in msg


def test_error_non_contiguous_out():
    out = torch.empty(256, dtype=torch.uint8)[::2]
    assert "out must be contiguous" in _pack_error([torch.ones(3)], out, [0])


def test_error_mismatched_device():
    msg = _pack_error([torch.ones(3), torch.ones(3, device="meta")], torch.empty(256, dtype=torch.uint8), [0, 64])
    assert "srcs[1] is on meta but out is on cpu" in msg


@pytest.mark.gpu
@pytest.mark.parametrize("tensor_device,buffer_device", [("cuda", "cpu"), ("cpu", "cuda")])
def test_error_mismatched_device_cuda(tensor_device, buffer_device):
    t = torch.ones(3, device=tensor_device)
    buf = torch.empty(256, dtype=torch.uint8, device=buffer_device)
    msg = _pack_error([t], buf, [0])
    assert f"srcs[0] is on {t.device} but out is on {buf.device}" in msg
    with pytest.raises(RuntimeError, match=rf"dsts\[0\] is on {t.device} but src is on {buf.device}"):
        ops.unpack(buf, [t], [0])
    other = torch.ones(3, device=buffer_device)
    msg = _pack_error([other, t], buf, [0, 64])
    assert f"srcs[1] is on {t.device} but out is on {buf.device}" in msg


def test_error_unaligned_offset():
    msg = _pack_error([torch.ones(3), torch.ones(3)], torch.empty(256, dtype=torch.uint8), [0, 32])
    assert "offsets[1] = 32" in msg and "multiple of 64" in msg


def test_error_negative_offset():
    assert "offsets[0] = -64" in _pack_error([torch.ones(3)], torch.empty(256, dtype=torch.uint8), [-64])


def test_error_out_of_range():
    msg = _pack_error([torch.ones(3), torch.ones(20)], torch.empty(128, dtype=torch.uint8), [0, 64])
    assert "srcs[1] (80 bytes at offset 64) runs past the end of out (128 bytes)" in msg


def test_error_overlapping_offsets():
    msg = _pack_error([torch.ones(32), torch.ones(3)], torch.empty(256, dtype=torch.uint8), [64, 128])
    assert "srcs[1] at offset 128 overlaps srcs[0]" in msg


def test_zero_sized_segments_may_share_offsets():
    out = torch.zeros(128, dtype=torch.uint8)
    ops.pack([torch.empty(0), torch.ones(2), torch.empty(0)], out, [0, 0, 0])
    assert torch.equal(out[:8].view(torch.float32), torch.ones(2))


def test_error_offsets_count():
    assert "got 2 srcs but 1 offsets" in _pack_error(
        [torch.ones(1), torch.ones(1)], torch.empty(256, dtype=torch.uint8), [0]
    )


def test_error_source_aliases_out():
    out = torch.zeros(256, dtype=torch.uint8)
    assert "srcs[0] shares memory with out" in _pack_error([out[:8]], out, [64])


def test_unpack_errors_name_dsts():
    with pytest.raises(RuntimeError, match=r"dsts\[0\] is not contiguous"):
        ops.unpack(torch.empty(256, dtype=torch.uint8), [torch.ones(4, 4).t()], [0])
    with pytest.raises(RuntimeError, match="src must be a uint8 tensor"):
        ops.unpack(torch.empty(64), [torch.ones(1)], [0])


# --- checksum ---


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "nbytes,block", [(0, 64), (1, 8), (7, 64), (8, 8), (1000, 64), (4096, 4096), (12_345, 1024), (3 * MiB + 5, MiB)]
)
def test_checksum_matches_reference(device, nbytes, block):
    gen = torch.Generator().manual_seed(nbytes)
    buf = torch.randint(0, 256, (nbytes,), generator=gen, dtype=torch.uint8).to(device)
    got = ops.checksum(buf, block)
    assert got.dtype == torch.int64 and got.device == buf.device
    assert got.shape == (-(-nbytes // block),)
    assert torch.equal(got.cpu(), ops.reference_checksum(buf, block).cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_checksum_64_mib_and_unaligned_start(device):
    gen = torch.Generator().manual_seed(1)
    buf = torch.randint(0, 256, (64 * MiB + 3,), generator=gen, dtype=torch.uint8).to(device)
    assert torch.equal(ops.checksum(buf, MiB).cpu(), ops.reference_checksum(buf, MiB).cpu())
    tail = buf[3:]
    assert torch.equal(ops.checksum(tail, MiB).cpu(), ops.reference_checksum(tail, MiB).cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_checksum_detects_every_single_bit_flip(device):
    gen = torch.Generator().manual_seed(2)
    block = 64
    buf = torch.randint(0, 256, (300,), generator=gen, dtype=torch.uint8).to(device)
    clean = ops.checksum(buf, block).cpu()
    for byte in range(buf.numel()):
        for bit in range(8):
            flipped = buf.clone()
            flipped[byte] ^= 1 << bit
            digests = ops.checksum(flipped, block).cpu()
            changed = (digests != clean).nonzero().flatten().tolist()
            assert changed == [byte // block], (byte, bit)


@pytest.mark.parametrize("device", DEVICES)
def test_checksum_detects_any_two_swapped_blocks(device):
    gen = torch.Generator().manual_seed(3)
    block, nblocks = 256, 24
    buf = torch.randint(0, 256, (block * nblocks,), generator=gen, dtype=torch.uint8).to(device)
    clean = ops.checksum(buf, block).cpu()
    blocks = buf.view(nblocks, block)
    for i, j in itertools.combinations(range(nblocks), 2):
        swapped = blocks.clone()
        swapped[[i, j]] = swapped[[j, i]]
        digests = ops.checksum(swapped.flatten(), block).cpu()
        assert (digests != clean).nonzero().flatten().tolist() == [i, j]


def test_checksum_detects_swapped_words_in_a_block():
    buf = torch.arange(64, dtype=torch.uint8)
    swapped = buf.view(8, 8)[[1, 0, 2, 3, 4, 5, 6, 7]].flatten()
    assert not torch.equal(ops.checksum(buf, 64), ops.checksum(swapped, 64))


def test_checksum_short_block_differs_from_zero_padding():
    data = torch.tensor([1, 2, 3], dtype=torch.uint8)
    padded = torch.tensor([1, 2, 3, 0, 0, 0, 0, 0], dtype=torch.uint8)
    assert ops.checksum(data, 8).item() != ops.checksum(padded, 8).item()


def test_checksum_reads_any_dtype_as_bytes():
    t = torch.randn(1000)
    assert torch.equal(ops.checksum(t, 512), ops.checksum(t.view(torch.uint8), 512))


def test_checksum_independent_of_thread_count():
    buf = torch.randint(0, 256, (8 * MiB + 11,), dtype=torch.uint8)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.checksum(buf, 3 * MiB)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, ops.checksum(buf, 3 * MiB))


@pytest.mark.parametrize("block", [0, -8, 12])
def test_checksum_rejects_bad_block_size(block):
    with pytest.raises(RuntimeError, match="block_bytes must be a positive multiple of 8"):
        ops.checksum(torch.zeros(64, dtype=torch.uint8), block)


def test_checksum_rejects_non_contiguous():
    with pytest.raises(RuntimeError, match="checksum buf must be contiguous"):
        ops.checksum(torch.zeros(128, dtype=torch.uint8)[::2], 64)


@pytest.mark.gpu
def test_cpu_and_cuda_digests_agree():
    buf = torch.randint(0, 256, (5 * MiB + 13,), dtype=torch.uint8)
    assert torch.equal(ops.checksum(buf, MiB), ops.checksum(buf.cuda(), MiB).cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("block", [8, 24, 1000, 4104, 33_000, 65_544])
def test_checksum_blocks_not_multiples_of_32_kib(device, block):
    """The CUDA kernel slices blocks into 32 KiB pieces; other block sizes, and buffers
    that end mid-block, give the CPU's and the reference's digests."""
    gen = torch.Generator().manual_seed(block)
    for nbytes in [block - 5, block, 3 * block + 5, 200_003]:
        buf = torch.randint(0, 256, (nbytes + 3,), generator=gen, dtype=torch.uint8)
        on_device = buf.to(device)
        for start in (0, 3):  # an 8-byte aligned start and not
            want = ops.reference_checksum(buf[start : start + nbytes], block)
            assert torch.equal(ops.checksum(buf[start : start + nbytes], block), want)
            assert torch.equal(ops.checksum(on_device[start : start + nbytes], block).cpu(), want)


def test_aligned_offsets():
    offsets, total = ops.aligned_offsets([torch.empty(3), torch.empty(0), torch.empty(17, dtype=torch.uint8)])
    assert offsets == [0, 64, 64] and total == 81
    with pytest.raises(ValueError):
        ops.aligned_offsets([], alignment=32)


# --- the fast Python entry (replica._C.pack/unpack) keeps the op's semantics ---


def test_fast_path_bumps_versions_like_the_dispatcher():
    tensors = [torch.ones(3), torch.ones(2, dtype=torch.int64)]
    out, offsets = packed(tensors)
    before = out._version
    ops.pack(tensors, out, offsets)
    assert out._version == before + 1
    dst_versions = [t._version for t in tensors]
    ops.unpack(out, tensors, offsets)
    assert [t._version for t in tensors] == [v + 1 for v in dst_versions]


def test_fast_path_accepts_tuples_and_iterables():
    tensors = (torch.arange(4.0), torch.arange(3))
    out, offsets = packed(list(tensors))
    ops.pack(tensors, out, tuple(offsets))
    back = [torch.empty_like(t) for t in tensors]
    ops.unpack(out, iter(back), iter(offsets))
    assert all(torch.equal(a, b) for a, b in zip(tensors, back, strict=True))


def test_fast_path_rejects_non_tensors_and_bad_offsets():
    out = torch.empty(128, dtype=torch.uint8)
    with pytest.raises(TypeError, match=r"srcs\[1\] is not a tensor"):
        ops.pack([torch.ones(1), [1.0]], out, [0, 64])
    with pytest.raises(TypeError):
        ops.pack([torch.ones(1)], out, ["0"])


def test_fast_path_in_inference_mode():
    with torch.inference_mode():
        tensors = [torch.ones(5)]
        out, offsets = packed(tensors)
        ops.pack(tensors, out, offsets)
    assert torch.equal(out[:20].view(torch.float32), torch.ones(5))


def test_restore_into_parameters_under_no_grad():
    param = torch.nn.Parameter(torch.zeros(4))
    buf, offsets = packed([torch.arange(4.0)])
    ops.pack([torch.arange(4.0)], buf, offsets)
    with torch.no_grad():
        ops.unpack(buf, [param], offsets)
    assert torch.equal(param.detach(), torch.arange(4.0)) and param.requires_grad


def test_shape_check_finds_the_first_tensor_unlike_its_counterpart():
    like = [
        torch.empty(3, 4, device="meta"),
        torch.empty(5, dtype=torch.bfloat16, device="meta"),
        torch.empty((), dtype=torch.int64, device="meta"),
    ]
    check = ops.ShapeCheck(like)
    same = [torch.zeros(3, 4), torch.zeros(5, dtype=torch.bfloat16), torch.tensor(7)]
    assert check.first_mismatch(same) == -1
    assert check.first_mismatch(tuple(same)) == -1
    assert check.first_mismatch([same[0].view(12)] + same[1:]) == 0  # same bytes, other shape
    assert check.first_mismatch([same[0], same[1].half(), same[2]]) == 1  # same bytes, other dtype
    assert check.first_mismatch(same[:2]) == 2  # fewer
    assert check.first_mismatch(same + [torch.zeros(1)]) == 3  # more
    assert check.first_mismatch([same[0], "x", same[2]]) == 1
    assert ops.ShapeCheck([]).first_mismatch([]) == -1
