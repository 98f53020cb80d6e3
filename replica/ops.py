"""Python face of the ``replica._C`` kernels, their fake (meta) kernels, and
pure-torch reference implementations that the tests compare against.

``pack(srcs, out, offsets)`` copies many contiguous tensors of any dtype into
one flat ``uint8`` buffer at byte offsets that are multiples of
:data:`ALIGNMENT`; ``unpack`` is its inverse, in place. ``checksum(buf,
block_bytes)`` returns one int64 digest per block of ``buf`` (the last block
may be short), so every bucket of a transfer can be verified on its own.
``pack_checksum(srcs, out, offsets, block_bytes)`` is ``pack`` and then
``checksum(out, block_bytes)`` in one pass over the bytes: each is hashed as
it is copied.

The checksum: for each 8-byte little-endian word ``w_i`` of the buffer (``i``
counted from the buffer's start, the last word zero-padded),
``t_i = mix(w_i ^ (i + 1) * K)`` (``i`` starts at ``word_offset``, 0 unless
given: a bucket at byte offset ``o`` of a larger buffer, hashed alone with
``word_offset = o // 8``, gets the digest its block of the whole buffer has) where ``mix`` is the
splitmix64 finalizer (a
bijection on 64-bit integers); a block's digest is
``mix(sum(t_i) ^ len_bytes * L)`` with wrapping 64-bit arithmetic. Why this
one: because ``t_i`` is a bijection of ``w_i``, any error confined to a single
word -- every single flipped bit -- is detected with certainty, not just with
high probability as with a plain hash; the position key makes swapped words
and swapped blocks visible; the sum is order-free, so CPU threads and CUDA
blocks reduce in parallel and still agree bit for bit; and it costs two
multiplications per 8 bytes, so it runs at memory speed (vectorized: AVX-512,
AVX2 or portable code, chosen at run time, see :func:`simd_build`). CRC32C would give the
same single-bit guarantee but only 32 bits and a serial dependency chain that
needs hardware instructions to keep up; it is not a defence against an
adversary (nor is this -- the job token guards the connection).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from replica import _C  # importing it registers torch.ops.replica.*

__all__ = [
    "ALIGNMENT",
    "ShapeCheck",
    "aligned_offsets",
    "checksum",
    "combine_digests",
    "pack",
    "pack_checksum",
    "reference_checksum",
    "reference_pack",
    "reference_pack_checksum",
    "reference_unpack",
    "select_simd_build",
    "simd_build",
    "simd_builds",
    "unpack",
]

#: Every segment of a packed buffer starts at a multiple of this many bytes.
ALIGNMENT = 64

#: ``ShapeCheck(like)``: the shapes and dtypes of the tensors ``like`` (meta tensors
#: will do); ``.first_mismatch(tensors)`` is the index of the first of ``tensors``
#: unlike its counterpart (or the shorter list's length), -1 when all match. One C++
#: pass: per tensor, a fraction of Python's ``t.shape``.
ShapeCheck = _C.ShapeCheck


def aligned_offsets(tensors: Sequence[torch.Tensor], alignment: int = ALIGNMENT) -> tuple[list[int], int]:
    """Byte offsets that lay ``tensors`` out back to back, each aligned, and the total size."""
    if alignment <= 0 or alignment % ALIGNMENT:
        raise ValueError(f"alignment must be a positive multiple of {ALIGNMENT}, got {alignment}")
    offsets = []
    end = 0
    for t in tensors:
        start = -(-end // alignment) * alignment
        offsets.append(start)
        end = start + t.numel() * t.element_size()
    return offsets, end


def pack(srcs: Sequence[torch.Tensor], out: torch.Tensor, offsets: Sequence[int]) -> None:
    """Copy every tensor of ``srcs`` into the uint8 buffer ``out`` at ``offsets`` (one call)."""
    if torch.compiler.is_compiling():
        torch.ops.replica.pack.default(srcs, out, offsets)
    else:  # same op, without boxing every list element (see csrc/ops.cpp)
        _C.pack(srcs, out, offsets)


def unpack(src: torch.Tensor, dsts: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    """Copy the bytes of ``src`` at ``offsets`` back into the tensors ``dsts``, in place."""
    if torch.compiler.is_compiling():
        torch.ops.replica.unpack.default(src, dsts, offsets)
    else:
        _C.unpack(src, dsts, offsets)


def checksum(buf: torch.Tensor, block_bytes: int, word_offset: int = 0, *, threads: int | None = None) -> torch.Tensor:
    """One int64 digest per ``block_bytes`` of ``buf`` (a multiple of 8; the last block may be short).

    ``threads``: on a CPU buffer, hash on up to this many threads of the call's own (at
    least 2 MiB each), whatever ``torch.set_num_threads`` says; the digests are the same.
    None: torch's intra-op threads, 16 MiB each at least. Ignored for CUDA buffers."""
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be an int >= 1 or None, got {threads!r}")
    if torch.compiler.is_compiling():
        return torch.ops.replica.checksum.default(buf, block_bytes, word_offset)
    return _C.checksum(buf, block_bytes, word_offset, threads or 0)  # the same op, without holding the GIL


def pack_checksum(
    srcs: Sequence[torch.Tensor], out: torch.Tensor, offsets: Sequence[int], block_bytes: int, word_offset: int = 0
) -> torch.Tensor:
    """``pack(srcs, out, offsets)``, returning ``checksum(out, block_bytes, word_offset)``
    of the result (bit for bit), from one pass over the bytes. Bytes of ``out`` that
    no source covers (alignment gaps, the tail) are hashed as they are."""
    if torch.compiler.is_compiling():
        return torch.ops.replica.pack_checksum.default(srcs, out, offsets, block_bytes, word_offset)
    return _C.pack_checksum(srcs, out, offsets, block_bytes, word_offset)


def simd_build() -> str:
    """The CPU checksum build in use: ``"avx512"``, ``"avx2"`` or ``"portable"`` (the
    best this CPU runs, unless the environment variable ``REPLICA_SIMD`` names a lesser one)."""
    return _C.simd_build()


def simd_builds() -> list[str]:
    """The CPU checksum builds this CPU can run, best first."""
    return list(_C.simd_builds())


def select_simd_build(name: str) -> str:
    """Use the CPU checksum build ``name`` from now on, in this process; returns the
    previous one. For tests and benchmarks: every build gives the same digests."""
    return _C.select_simd_build(name)


def _check_devices(tensors, buffer, list_name: str, buf_name: str) -> None:
    # A meta tensor among CPU tensors dispatches here, not to the C++ kernel
    # that would otherwise refuse it, so the fake checks what it can, and raises
    # what the kernel raises (csrc/plan.cpp's TORCH_CHECK: a RuntimeError).
    if buffer.dtype != torch.uint8:
        raise RuntimeError(f"replica: {buf_name} must be a uint8 tensor, got {buffer.dtype}")
    for i, t in enumerate(tensors):
        if t.device != buffer.device:
            raise RuntimeError(f"replica: {list_name}[{i}] is on {t.device} but {buf_name} is on {buffer.device}")


@torch.library.register_fake("replica::pack")
def _pack_fake(srcs, out, offsets):
    _check_devices(srcs, out, "srcs", "out")


@torch.library.register_fake("replica::unpack")
def _unpack_fake(src, dsts, offsets):
    _check_devices(dsts, src, "dsts", "src")


def _num_blocks(buf, block_bytes) -> int:
    if block_bytes <= 0 or block_bytes % 8:  # the kernel's TORCH_CHECK (a RuntimeError), as above
        raise RuntimeError(f"replica: checksum block_bytes must be a positive multiple of 8, got {block_bytes}")
    nbytes = buf.numel() * buf.element_size()
    return (nbytes + block_bytes - 1) // block_bytes


@torch.library.register_fake("replica::checksum")
def _checksum_fake(buf, block_bytes, word_offset=0):
    return buf.new_empty((_num_blocks(buf, block_bytes),), dtype=torch.int64)


@torch.library.register_fake("replica::pack_checksum")
def _pack_checksum_fake(srcs, out, offsets, block_bytes, word_offset=0):
    _check_devices(srcs, out, "srcs", "out")
    return out.new_empty((_num_blocks(out, block_bytes),), dtype=torch.int64)


# --- pure-torch references (slow, obviously correct; used by the tests) ---


def _bytes(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("reference ops need contiguous tensors")
    return t.reshape(-1).view(torch.uint8)


def reference_pack(srcs: Sequence[torch.Tensor], out: torch.Tensor, offsets: Sequence[int]) -> None:
    for t, off in zip(srcs, offsets, strict=True):
        b = _bytes(t)
        out[off : off + b.numel()].copy_(b)


def reference_unpack(src: torch.Tensor, dsts: Sequence[torch.Tensor], offsets: Sequence[int]) -> None:
    for t, off in zip(dsts, offsets, strict=True):
        b = _bytes(t)
        b.copy_(src[off : off + b.numel()])


# Constants of csrc/replica.h, as signed int64 so torch's wrapping int64
# arithmetic reproduces the kernel's uint64 arithmetic bit for bit.
def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


_KEY_STEP = _signed(0x9E3779B97F4A7C15)
_MUL1 = _signed(0xBF58476D1CE4E5B9)
_MUL2 = _signed(0x94D049BB133111EB)
_LENGTH_KEY = _signed(0xD6E8FEB86659FD93)


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    return (x >> s) & ((1 << (64 - s)) - 1)  # logical shift of int64


def _mix(x: torch.Tensor) -> torch.Tensor:
    x = x ^ _shr(x, 30)
    x = x * _MUL1
    x = x ^ _shr(x, 27)
    x = x * _MUL2
    return x ^ _shr(x, 31)


def reference_checksum(buf: torch.Tensor, block_bytes: int, word_offset: int = 0) -> torch.Tensor:
    if block_bytes <= 0 or block_bytes % 8:
        raise ValueError(f"block_bytes must be a positive multiple of 8, got {block_bytes}")
    data = _bytes(buf.detach()).cpu()
    n = data.numel()
    nblocks = -(-n // block_bytes)
    if nblocks == 0:
        return torch.empty(0, dtype=torch.int64, device=buf.device)
    words = torch.cat([data, data.new_zeros(-n % 8)]).view(torch.int64)
    index = torch.arange(words.numel(), dtype=torch.int64)
    terms = _mix(words ^ ((index + word_offset + 1) * _KEY_STEP))
    sums = torch.zeros(nblocks, dtype=torch.int64).index_add_(0, index // (block_bytes // 8), terms)
    lengths = (n - torch.arange(nblocks, dtype=torch.int64) * block_bytes).clamp(max=block_bytes)
    return _mix(sums ^ (lengths * _LENGTH_KEY)).to(buf.device)


def reference_pack_checksum(
    srcs: Sequence[torch.Tensor], out: torch.Tensor, offsets: Sequence[int], block_bytes: int, word_offset: int = 0
) -> torch.Tensor:
    reference_pack(srcs, out, offsets)
    return reference_checksum(out, block_bytes, word_offset)


# --- digests of adjacent blocks, combined without the bytes ---

_M64 = (1 << 64) - 1
_INV_MUL1 = pow(0xBF58476D1CE4E5B9, -1, 1 << 64)
_INV_MUL2 = pow(0x94D049BB133111EB, -1, 1 << 64)


def _unshift(x: int, s: int) -> int:
    """The inverse of ``x ^= x >> s`` on 64 bits."""
    y = x
    for _ in range(64 // s):
        y = x ^ (y >> s)
    return y


def _unmix(x: int) -> int:
    x = _unshift(x, 31)
    x = (x * _INV_MUL2) & _M64
    x = _unshift(x, 27)
    x = (x * _INV_MUL1) & _M64
    return _unshift(x, 30)


def _mix_int(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def combine_digests(digests: Sequence[int], lengths: Sequence[int]) -> int:
    """The digest of adjacent blocks as one block, from each block's digest and byte
    length: every block but the last a multiple of 8 bytes long, and each hashed with
    the ``word_offset`` of its place in the whole. ``finalize`` is a bijection, so each
    block's sum of word terms is recovered and the sums add up."""
    total = 0
    for digest, nbytes in zip(digests, lengths, strict=True):
        total += _unmix(digest & _M64) ^ ((nbytes * 0xD6E8FEB86659FD93) & _M64)
    length = sum(lengths)
    combined = _mix_int((total & _M64) ^ ((length * 0xD6E8FEB86659FD93) & _M64))
    return combined - (1 << 64) if combined >= 1 << 63 else combined
