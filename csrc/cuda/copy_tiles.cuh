// The work split of the CUDA pack/unpack kernel, free of torch so that host
// code can run it lane by lane to check it (copy_tiles_check.cpp).
//
// Every segment is cut into tiles of at most kTileBytes and one warp copies
// one tile, so a 2 GiB tensor spreads over the whole GPU and a 256-byte one
// costs one warp. A segment's first tile also copies its head, the bytes
// before the destination's first 16-byte boundary; from there on every store
// is a 16-byte vector. When the source is not 16-byte aligned at that point,
// the lane loads the two aligned 16-byte words its bytes straddle and
// funnel-shifts them into place, so misaligned tensors still move at full
// width instead of byte by byte.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace replica {
namespace cuda_copy {

constexpr int kWarpSize = 32;
constexpr int kVectorBytes = 16;
// 16-byte loads a lane keeps in flight before storing them: one warp step
// moves 4 KiB, enough in flight per SM to cover HBM latency at full occupancy.
constexpr int kAlignedUnroll = 8;
// The shifted path loads two words per vector, so half as many vectors.
constexpr int kShiftedUnroll = 4;
// Four warp steps per tile: large enough that finding the tile's segment (a
// binary search over L1-resident rows) and starting a block are small beside
// the copy, small enough that a 256 MiB call makes ~2,000 blocks for the
// scheduler to balance and the last ones end close together.
constexpr int64_t kTileBytes = 4 * kWarpSize * kAlignedUnroll * kVectorBytes;

// One copy as the kernel sees it: addresses as integers so the table is a
// plain int64 tensor.
struct CopySegment {
  int64_t src;
  int64_t dst;
  int64_t nbytes;
};

// Bytes copied one by one before the destination reaches a 16-byte boundary.
__host__ __device__ inline int64_t head_bytes(const CopySegment& seg) {
  const int64_t to_boundary =
      static_cast<int64_t>((0 - static_cast<uint64_t>(seg.dst)) % kVectorBytes);
  return to_boundary < seg.nbytes ? to_boundary : seg.nbytes;
}

// Tiles of a non-empty segment: at least one, which also copies the head.
__host__ __device__ inline int64_t tile_count(const CopySegment& seg) {
  const int64_t body = seg.nbytes - head_bytes(seg);
  return body <= kTileBytes ? 1 : (body + kTileBytes - 1) / kTileBytes;
}

// The table holds addresses as integers, so without these the compiler emits
// generic loads and stores; the kernel never writes what it reads (sources and
// destinations are disjoint, which plan_segments checks), so loads may take
// the read-only path.
__host__ __device__ inline ulonglong2 load16(const ulonglong2* p) {
#ifdef __CUDA_ARCH__
  return __ldg(p);
#else
  return *p;
#endif
}

// A load the compiler may not move past a store: ld.global without .nc, so it
// must assume the store may write what it reads. copy_vectors with it keeps
// all of a step's loads before its first store even when what it does with
// each stored vector (pack_checksum's hash) competes for registers; with
// load16 the compiler sank loads past the stores and hashes of earlier
// vectors, a trip to memory for each.
__host__ __device__ inline ulonglong2 load16_ordered(const ulonglong2* p) {
#ifdef __CUDA_ARCH__
  ulonglong2 v;
  asm volatile("ld.global.v2.u64 {%0, %1}, [%2];" : "=l"(v.x), "=l"(v.y) : "l"(p) : "memory");
  return v;
#else
  return *p;
#endif
}

__host__ __device__ inline void store16(ulonglong2* p, ulonglong2 v) {
#ifdef __CUDA_ARCH__
  __stwb(p, v);
#else
  *p = v;
#endif
}

// Bytes r..r+15 of the 32 bytes lo:hi (little endian), 0 < r < 16.
__host__ __device__ inline ulonglong2 funnel(ulonglong2 lo, ulonglong2 hi, int r) {
  const bool second = r >= 8;
  const unsigned bits = 8u * static_cast<unsigned>(r % 8);
  const unsigned long long w0 = second ? lo.y : lo.x;
  const unsigned long long w1 = second ? hi.x : lo.y;
  const unsigned long long w2 = second ? hi.y : hi.x;
  // (w << 1) << (63 - bits) is w << (64 - bits) without an undefined shift
  // by 64 when bits == 0.
  ulonglong2 out;
  out.x = (w0 >> bits) | ((w1 << 1) << (63 - bits));
  out.y = (w1 >> bits) | ((w2 << 1) << (63 - bits));
  return out;
}

// Lane `lane`'s share of storing `nvec` 16-byte vectors to a 16-byte aligned
// `dst`, vector i being load(i); stored(v) sees each vector the lane stores, in
// the order of i. All kUnroll loads of a step are issued before its first
// store, so each lane keeps kUnroll loads in flight.
template <int kUnroll, typename Load, typename Stored>
__host__ __device__ inline void copy_vectors(Load load, ulonglong2* dst, int nvec, int lane, Stored& stored) {
  for (int base = 0; base < nvec; base += kWarpSize * kUnroll) {
    ulonglong2 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kWarpSize + lane;
      if (i < nvec) {
        v[u] = load(i);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int i = base + u * kWarpSize + lane;
      if (i < nvec) {
        store16(dst + i, v[u]);
        stored(v[u]);
      }
    }
  }
}

// copy_vectors from a source at any alignment: straight loads when it is
// 16-byte aligned; otherwise vector i takes bytes from aligned words i and
// i + 1, each holding at least one byte of the source, so neither load leaves
// the source's pages.
// kOrdered: loads by load16_ordered rather than load16.
template <bool kOrdered = false, typename Stored>
__host__ __device__ inline void copy_vectors_from(const uint8_t* src, ulonglong2* dst, int nvec, int lane,
                                                  Stored& stored) {
  const auto load = [](const ulonglong2* p) { return kOrdered ? load16_ordered(p) : load16(p); };
  const int r = static_cast<int>(reinterpret_cast<uintptr_t>(src) % kVectorBytes);
  if (r == 0) {
    const auto* sv = reinterpret_cast<const ulonglong2*>(src);
    copy_vectors<kAlignedUnroll>([sv, load](int i) { return load(sv + i); }, dst, nvec, lane, stored);
  } else {
    const auto* words = reinterpret_cast<const ulonglong2*>(src - r);
    copy_vectors<kShiftedUnroll>(
        [words, r, load](int i) { return funnel(load(words + i), load(words + i + 1), r); }, dst, nvec, lane, stored);
  }
}

// Lane `lane`'s share of tile `tile` of `seg`.
__host__ __device__ inline void copy_tile(const CopySegment& seg, int64_t tile, int lane) {
  const auto* src = reinterpret_cast<const uint8_t*>(seg.src);
  auto* dst = reinterpret_cast<uint8_t*>(seg.dst);
  const int64_t head = head_bytes(seg);
  if (tile == 0 && lane < head) {
    dst[lane] = src[lane];
  }
  const int64_t begin = head + tile * kTileBytes;
  const int64_t left = seg.nbytes - begin;
  if (left <= 0) {
    return;  // the segment ended within its head
  }
  const int len = static_cast<int>(left < kTileBytes ? left : kTileBytes);
  const uint8_t* s = src + begin;
  uint8_t* d = dst + begin;
  const int nvec = len / kVectorBytes;
  auto nothing = [](ulonglong2) {};
  copy_vectors_from(s, reinterpret_cast<ulonglong2*>(d), nvec, lane, nothing);
  const int tail = len - nvec * kVectorBytes;
  if (lane < tail) {
    d[nvec * kVectorBytes + lane] = s[nvec * kVectorBytes + lane];
  }
}

// The segment that tile `tile` belongs to: the last s with
// tile_begin[s] <= tile, where tile_begin[0] == 0 and tile_begin[nsegs] is the
// total. Every lane searches; the loads are warp-wide broadcasts and the top
// of the table stays in L1.
__host__ __device__ inline int64_t find_segment(
    const int64_t* tile_begin, int64_t nsegs, int64_t tile) {
  int64_t lo = 0;
  int64_t hi = nsegs;
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (tile_begin[mid] <= tile) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

}  // namespace cuda_copy
}  // namespace replica
