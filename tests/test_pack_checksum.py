"""pack_checksum (pack fused with checksum), checksum's word_offset, and every CPU
build of the checksum loops (AVX-512, AVX2, portable: whichever this CPU runs),
each against the pure-torch references in replica.ops, and by opcheck."""

import ctypes
import mmap
import random
from pathlib import Path

import pytest
import torch

from replica import ops
from support.tensors import DEVICES, MiB, packed, random_mix

BUILDS = ops.simd_builds()


@pytest.fixture(params=BUILDS)
def build(request):
    previous = ops.select_simd_build(request.param)
    yield request.param
    ops.select_simd_build(previous)


def test_the_best_build_this_cpu_runs_is_in_use():
    assert BUILDS[-1] == "portable" and ops.simd_build() in BUILDS
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        flags = set()
    if "avx2" in flags:
        assert "avx2" in BUILDS
    if {"avx512f", "avx512dq", "avx512bw"} <= flags:
        assert BUILDS[0] == "avx512"


def test_selecting_an_unknown_build_fails():
    with pytest.raises(RuntimeError, match="no checksum build named 'sse9'"):
        ops.select_simd_build("sse9")


# --- checksum: every build, any length, alignment and word offset ---


@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 63, 64, 65, 127, 1000, 4096 + 24, 100_003, 9 * MiB + 5])
def test_every_build_gives_the_reference_digests(build, nbytes):
    gen = torch.Generator().manual_seed(nbytes)
    raw = torch.randint(0, 256, (nbytes + 5,), generator=gen, dtype=torch.uint8)
    for start in (0, 5):  # an aligned start and not
        buf = raw[start : start + nbytes]
        for block in (8, 72, 4096, MiB):
            assert torch.equal(ops.checksum(buf, block), ops.reference_checksum(buf, block)), (start, block)


@pytest.mark.parametrize("word_offset", [0, 1, 3, 1 << 20, (1 << 61) - 1])
def test_word_offset_keys_words_from_there(word_offset):
    buf = torch.randint(0, 256, (5000,), dtype=torch.uint8)
    got = ops.checksum(buf, 1024, word_offset)
    assert torch.equal(got, ops.reference_checksum(buf, 1024, word_offset))
    if word_offset:
        assert not torch.equal(got, ops.checksum(buf, 1024))


def test_a_bucket_hashed_alone_at_its_offset_has_its_blocks_digest(build):
    buf = torch.randint(0, 256, (10 * 4096 + 100,), dtype=torch.uint8)
    whole = ops.checksum(buf, 4096)
    for k, lo in enumerate(range(0, buf.numel(), 4096)):
        bucket = buf[lo : lo + 4096]
        assert ops.checksum(bucket, 4096, lo // 8).item() == whole[k].item()


def test_word_offset_must_not_be_negative():
    with pytest.raises(RuntimeError, match="word_offset must be non-negative"):
        ops.checksum(torch.zeros(64, dtype=torch.uint8), 64, -1)


def test_every_build_detects_every_single_bit_flip(build):
    buf = torch.randint(0, 256, (200,), dtype=torch.uint8)
    clean = ops.checksum(buf, 64)
    for byte in range(buf.numel()):
        for bit in range(8):
            flipped = buf.clone()
            flipped[byte] ^= 1 << bit
            changed = (ops.checksum(flipped, 64) != clean).nonzero().flatten().tolist()
            assert changed == [byte // 64], (byte, bit)


# --- pack_checksum ---


def _case(tensors, fill, block, word_offset=0, *, tail=0, unsorted=False, start=0):
    """pack_checksum into a buffer `start` bytes into an allocation, `tail` bytes longer
    than the sources need, its gaps holding `fill`; checks bytes and digests."""
    offsets, total = ops.aligned_offsets(tensors)
    if unsorted:
        order = list(range(len(tensors)))
        random.Random(len(tensors)).shuffle(order)
        tensors, offsets = [tensors[i] for i in order], [offsets[i] for i in order]
    device = tensors[0].device if tensors else "cpu"
    raw = torch.full((start + total + tail,), fill, dtype=torch.uint8, device=device)
    out = raw[start:]
    expected = out.clone()
    want = ops.reference_pack_checksum(tensors, expected, offsets, block, word_offset)
    got = ops.pack_checksum(tensors, out, offsets, block, word_offset)
    assert torch.equal(out, expected), "the bytes differ from pack's"
    assert got.dtype == torch.int64 and got.device == out.device
    assert torch.equal(got.cpu(), want.cpu()), "the digests differ from checksum's"
    assert torch.equal(got, ops.checksum(out, block, word_offset))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("block", [8, 64, 200, 4096, 1 << 30])
def test_pack_checksum_matches_pack_then_checksum(device, seed, block, build):
    tensors = random_mix(40, 20_000, seed, device)
    _case(tensors, 0xA5, block, tail=seed * 13, unsorted=seed % 2 == 1, start=(0, 8, 3, 64)[seed])


@pytest.mark.parametrize("device", DEVICES)
def test_pack_checksum_10_000_small_tensors(device, build):
    _case(random_mix(10_000, 1024, 7, device), 0x5A, 64 * 1024, word_offset=17)


@pytest.mark.parametrize("block", [8, 64, 72, 200, 4096])
def test_pack_checksum_small_segments_spaced_apart(build, block):
    """Segments of 1 to 200 bytes at offsets with gaps of 0 to 3 alignment units
    between them: a segment's last window and its gap are hashed in one step
    only when both lie in one block, and word by word when a block ends inside."""
    rng = random.Random(block)
    tensors = [torch.randint(0, 256, (rng.randint(1, 200),), dtype=torch.uint8) for _ in range(300)]
    offsets, at = [], 64 * rng.randint(0, 2)
    for t in tensors:
        offsets.append(at)
        at += (t.numel() + 63) // 64 * 64 + 64 * rng.randint(0, 3)
    out = torch.full((at + rng.randint(0, 100),), 0x77, dtype=torch.uint8)
    expected = out.clone()
    want = ops.reference_pack_checksum(tensors, expected, offsets, block, 3)
    assert torch.equal(ops.pack_checksum(tensors, out, offsets, block, 3), want)
    assert torch.equal(out, expected)


def test_pack_checksum_reads_no_source_byte_past_its_end(build):
    """A source ending right before a page that cannot be read: the last partial
    window is copied with a masked load (AVX-512) or a short memcpy, never a whole
    vector's read."""
    page = mmap.PAGESIZE
    region = mmap.mmap(-1, 2 * page, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    libc = ctypes.CDLL(None, use_errno=True)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(region))
    assert libc.mprotect(ctypes.c_void_p(addr + page), page, 0) == 0, ctypes.get_errno()
    try:
        whole = torch.frombuffer(region, dtype=torch.uint8, count=page)
        whole.copy_(torch.randint(0, 256, (page,), dtype=torch.uint8))
        for n in (1, 7, 63, 65, 100, 4000):
            tensors = [whole[page - n :], torch.arange(5, dtype=torch.uint8)]
            _case(tensors, 0x99, 128)
        del whole, tensors
    finally:
        libc.mprotect(ctypes.c_void_p(addr + page), page, mmap.PROT_READ | mmap.PROT_WRITE)


@pytest.mark.parametrize("device", DEVICES)
def test_pack_checksum_streams_large_copies(device, build):
    """From 2 MiB per call the CPU kernel uses non-temporal stores; threads split
    segments anywhere, including inside odd-length ones."""
    gen = torch.Generator().manual_seed(5)
    sizes = [3 * MiB + 3, 5, 6 * MiB + 1, 1, 2 * MiB + 7]
    tensors = [torch.randint(0, 256, (n,), generator=gen, dtype=torch.uint8).to(device) for n in sizes]
    _case(tensors, 0x3C, MiB + 8, word_offset=1 << 40, tail=100)


@pytest.mark.parametrize("start", [0, 8, 3])
def test_pack_checksum_streams_runs_of_small_segments(build, start):
    """Over 2 MiB of small segments: a run of them goes to one kernel call, which streams
    each one's whole windows when out's segments start on a vector boundary (start 0)
    and stores them plainly when not (8, 3); each partial last window and the gap after
    it are hashed as out holds them."""
    gen = torch.Generator().manual_seed(11)
    rng = random.Random(11)
    tensors = [torch.randint(0, 256, (rng.randint(1, 4096),), generator=gen, dtype=torch.uint8) for _ in range(5000)]
    assert sum(t.numel() for t in tensors) > 2 * MiB  # the kernel streams from 2 MiB per call
    _case(tensors, 0xC3, 64 * 1024, word_offset=5, tail=37, start=start)


def test_pack_checksum_independent_of_thread_count():
    tensors = random_mix(30, 400_000, 9, "cpu")
    out, offsets = packed(tensors)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.pack_checksum(tensors, out.clone(), offsets, 65_536)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, ops.pack_checksum(tensors, out, offsets, 65_536))


@pytest.mark.parametrize("device", DEVICES)
def test_pack_checksum_without_sources_hashes_out_as_it_is(device):
    out = torch.randint(0, 256, (1000,), dtype=torch.uint8).to(device)
    before = out.clone()
    assert torch.equal(ops.pack_checksum([], out, [], 128).cpu(), ops.reference_checksum(before, 128).cpu())
    assert torch.equal(out, before)
    assert ops.pack_checksum([], out[:0], [], 128).numel() == 0


def test_pack_checksum_detects_what_the_sources_held():
    """A flipped bit in any source changes exactly the digest of the block it lands in."""
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (100, 37, 300)]
    out, offsets = packed(tensors)
    clean = ops.pack_checksum(tensors, out, offsets, 64)
    for i, t in enumerate(tensors):
        for byte in range(0, t.numel(), 7):
            t[byte] ^= 0x10
            changed = (ops.pack_checksum(tensors, out, offsets, 64) != clean).nonzero().flatten().tolist()
            t[byte] ^= 0x10
            assert changed == [(offsets[i] + byte) // 64], (i, byte)


def test_pack_checksum_rejects_what_pack_and_checksum_reject():
    t = [torch.ones(16, dtype=torch.uint8)]
    out = torch.zeros(128, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="must be a non-negative multiple of 64"):
        ops.pack_checksum(t, out, [8], 64)
    with pytest.raises(RuntimeError, match="runs past the end of out"):
        ops.pack_checksum(t, out, [128], 64)
    with pytest.raises(RuntimeError, match="block_bytes must be a positive multiple of 8"):
        ops.pack_checksum(t, out, [0], 12)
    with pytest.raises(RuntimeError, match="word_offset must be non-negative"):
        ops.pack_checksum(t, out, [0], 64, -8)
    with pytest.raises(RuntimeError, match="must be a uint8 tensor"):
        ops.pack_checksum(t, out.view(torch.int64), [0], 64)


def test_pack_checksum_bumps_the_version_of_out():
    tensors = [torch.ones(3)]
    out, offsets = packed(tensors)
    before = out._version
    ops.pack_checksum(tensors, out, offsets, 64)
    assert out._version == before + 1


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    tensors = random_mix(8, 500, seed=4, device=device)
    out, offsets = packed(tensors)
    torch.library.opcheck(torch.ops.replica.pack_checksum.default, (tensors, out, offsets, 64))
    torch.library.opcheck(torch.ops.replica.pack_checksum.default, (tensors, out, offsets, 4096, 9))
    torch.library.opcheck(torch.ops.replica.checksum.default, (out, 64, 5))


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_checksum_on_threads_of_its_own_gives_the_same_digests(threads):
    """ops.checksum(threads=k): the call's own k threads (2 MiB each at least), whatever
    torch's setting; blocks that straddle the threads' ranges, a short last word, any
    word offset."""
    buf = torch.randint(
        0, 256, (5 * 2 * MiB + 13,), dtype=torch.uint8, generator=torch.Generator().manual_seed(threads)
    )
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for block, word_offset in ((8, 0), (3 * MiB + 8, 12345), (buf.numel() + 3 & ~7, 7), (MiB, 0)):
            assert torch.equal(
                ops.checksum(buf, block, word_offset, threads=threads), ops.checksum(buf, block, word_offset)
            ), (block, word_offset)
        small = buf[: 3 * MiB + 5]
        assert torch.equal(ops.checksum(small, 4096, 3, threads=threads), ops.reference_checksum(small, 4096, 3))
    finally:
        torch.set_num_threads(before)


def test_checksum_threads_must_be_a_positive_int():
    buf = torch.zeros(64, dtype=torch.uint8)
    for bad in (0, -1, True, 2.0):
        with pytest.raises(ValueError, match="threads"):
            ops.checksum(buf, 64, threads=bad)


@pytest.mark.gpu
def test_repeated_calls_reuse_their_device_table_and_stay_exact():
    """The same tensors packed again (a mirror's every step) find the first call's
    table on the device: exact on another stream, after the sources' bytes changed,
    after other tensors took the freed sources' place, and for pack and unpack too."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for seed in (0, 1, 0, 2):  # the second 0: same sizes, likely the freed tensors' addresses
        tensors = random_mix(300, 50_000, seed, "cuda")
        out, offsets = packed(tensors)
        for i in range(4):
            stream = torch.cuda.Stream() if i % 2 else torch.cuda.current_stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for t in tensors:  # new bytes, same addresses
                    if t.numel():
                        t.view(torch.uint8).add_(1)
                _case(tensors, 0x3C, 4096)
                ops.pack(tensors, out, offsets)
                back = [torch.empty_like(t) for t in tensors]
                ops.unpack(out, back, offsets)
                assert all(torch.equal(b, t) for b, t in zip(back, tensors, strict=False)), (
                    f"round {seed}/{i}: unpack differs"
                )
            torch.cuda.current_stream().wait_stream(stream)
        del tensors, out
