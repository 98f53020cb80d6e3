// The per-lane work of the CUDA pack_checksum kernel, free of torch so that
// host code can run it chunk by chunk to check it (copy_tiles_check.cpp).
//
// The kernel walks `out`, not the sources: every 16-byte chunk of out is
// produced by one lane, which knows every byte of it without reading what
// another lane writes -- source bytes from the source, gap bytes (alignment
// padding, the tail past the last source) from out, which pack never writes.
// So the digests of out come from the same registers the copy stores, in one
// launch, with no ordering between lanes. Chunks start on 16-byte boundaries
// of out (the caller guarantees out itself is 16-byte aligned); a segment
// starts on a 64-byte one, so a chunk never holds the start of a segment
// other than at its first byte, and holds the end of at most one.
#pragma once

#include "copy_tiles.cuh"
#include "../checksum_mix.h"

#include <cstdint>
#include <cstring>

namespace replica {
namespace cuda_pack_checksum {

constexpr int64_t kChunkBytes = 16;

// One segment as the kernel sees it: `dst` is its byte offset in out.
struct Row {
  int64_t src;
  int64_t dst;
  int64_t nbytes;
};

struct Args {
  const Row* rows;  // sorted by dst, none empty
  int64_t nrows;
  uint8_t* out;  // 16-byte aligned
  int64_t nbytes;
  uint64_t word_offset;
};

// The first row that ends after byte `at` of out (nrows if none): a binary
// search, for a warp's first chunk; later chunks advance from there.
__host__ __device__ inline int64_t first_row_after(const Args& a, int64_t at) {
  int64_t lo = 0;
  int64_t hi = a.nrows;
  while (lo < hi) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (a.rows[mid].dst + a.rows[mid].nbytes <= at) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

enum class Kind : int { kHashed, kSource, kGap };

// The low k bytes (0 to 16) of a 16-byte vector set, the others clear.
__host__ __device__ inline ulonglong2 low_bytes_mask(int64_t k) {
  const auto word = [](int64_t bytes) -> unsigned long long {
    return bytes >= 8 ? ~0ull : bytes <= 0 ? 0ull : (1ull << (8 * bytes)) - 1;
  };
  return ulonglong2{word(k), word(k - 8)};
}

// Stores the low k bytes (0 to 15) of v to the 16-byte aligned dst in at most
// four aligned stores: 8, 4, 2, then 1 bytes.
__host__ __device__ inline void store_low_bytes(uint8_t* dst, ulonglong2 v, int64_t k) {
  const auto put = [dst](int64_t at, uint64_t value, int bytes) {
#ifdef __CUDA_ARCH__
    if (bytes == 8) {
      *reinterpret_cast<uint64_t*>(dst + at) = value;
    } else if (bytes == 4) {
      *reinterpret_cast<uint32_t*>(dst + at) = static_cast<uint32_t>(value);
    } else if (bytes == 2) {
      *reinterpret_cast<uint16_t*>(dst + at) = static_cast<uint16_t>(value);
    } else {
      dst[at] = static_cast<uint8_t>(value);
    }
#else
    std::memcpy(dst + at, &value, static_cast<size_t>(bytes));  // little endian, as the GPU
#endif
  };
  int64_t at = 0;
  uint64_t word = v.x;
  for (int bytes = 8; bytes >= 1; bytes /= 2) {
    if (k - at >= bytes) {
      put(at, word, bytes);
      at += bytes;
      word = bytes == 8 ? v.y : word >> (8 * bytes);
    }
  }
}

// The 16 bytes at `src` (any alignment), of which the first `need` (1 to 16)
// are source bytes: straight, or funnel-shifted from the aligned vectors they
// straddle. A vector holding none of them is not read (it may not be mapped);
// the bytes past `need` are then undefined.
__host__ __device__ inline ulonglong2 load_source(const uint8_t* src, int64_t need) {
  const int shift = static_cast<int>(reinterpret_cast<uintptr_t>(src) % cuda_copy::kVectorBytes);
  const auto* words = reinterpret_cast<const ulonglong2*>(src - shift);
  const ulonglong2 lo = cuda_copy::load16(words);
  if (shift == 0) {
    return lo;
  }
  return cuda_copy::funnel(lo, shift + need > cuda_copy::kVectorBytes ? cuda_copy::load16(words + 1) : lo, shift);
}

// A chunk between its load and its store: `v` holds its 16 bytes (kSource,
// kGap), or the chunk (a segment's end, out's end) was stored already and `v`
// holds its two word terms (kHashed). Loads of several chunks are issued
// before the first store, so a lane keeps several in flight; five registers
// each.
struct Loaded {
  Kind kind;
  ulonglong2 v;
};

// Loads chunk `at` of out (a multiple of 16 below a.nbytes). `row` is a
// cursor: any row not after the chunk's; it is advanced past rows that end at
// or before it, so a lane visiting its chunks in order walks the rows once.
__host__ __device__ inline Loaded load_chunk(const Args& a, int64_t at, int64_t& row) {
  while (row < a.nrows && a.rows[row].dst + a.rows[row].nbytes <= at) {
    ++row;
  }
  const int64_t end = at + kChunkBytes < a.nbytes ? at + kChunkBytes : a.nbytes;
  const bool in_row = row < a.nrows && a.rows[row].dst <= at;
  Loaded l{};
  if (in_row && a.rows[row].dst + a.rows[row].nbytes >= at + kChunkBytes) {
    const Row& r = a.rows[row];  // entirely source bytes
    l.v = load_source(reinterpret_cast<const uint8_t*>(r.src) + (at - r.dst), kChunkBytes);
    l.kind = Kind::kSource;
    return l;
  }
  if (!in_row && end - at == kChunkBytes) {  // entirely gap: hashed as out holds it (never written)
    l.v = *reinterpret_cast<const ulonglong2*>(a.out + at);
    l.kind = Kind::kGap;
    return l;
  }
  // The end of a segment, or out's last chunk: the row's bytes (fewer than
  // 16) and out's own after them, from aligned 16-byte loads issued together
  // (each holds a byte of the source or of out, so none leaves their pages),
  // zero past out's end. Only the row's bytes are stored.
  const int64_t n = end - at;
  const int64_t nsrc = in_row ? a.rows[row].dst + a.rows[row].nbytes - at : 0;
  // out is written by this kernel: a coherent load, as for a gap chunk (its bytes
  // used here are ones nobody writes).
  const ulonglong2 own = *reinterpret_cast<const ulonglong2*>(a.out + at);
  ulonglong2 v = own;
  if (nsrc > 0) {
    const ulonglong2 got = load_source(reinterpret_cast<const uint8_t*>(a.rows[row].src) + (at - a.rows[row].dst), nsrc);
    const ulonglong2 from_src = low_bytes_mask(nsrc);
    v.x = (got.x & from_src.x) | (own.x & ~from_src.x);
    v.y = (got.y & from_src.y) | (own.y & ~from_src.y);
    store_low_bytes(a.out + at, v, nsrc);
  }
  const ulonglong2 in_out = low_bytes_mask(n);
  const uint64_t first = a.word_offset + static_cast<uint64_t>(at / 8);
  l.v.x = checksum::word_term(v.x & in_out.x, first);
  l.v.y = n > 8 ? checksum::word_term(v.y & in_out.y, first + 1) : 0;
  l.kind = Kind::kHashed;
  return l;
}

// Stores a source chunk and fills `term` with the word terms of chunk `at`:
// term[0] for word at/8, term[1] for the next (0 past out's end).
__host__ __device__ inline void finish_chunk(const Args& a, int64_t at, const Loaded& l, uint64_t term[2]) {
  if (l.kind == Kind::kHashed) {
    term[0] = l.v.x;
    term[1] = l.v.y;
    return;
  }
  if (l.kind == Kind::kSource) {
    cuda_copy::store16(reinterpret_cast<ulonglong2*>(a.out + at), l.v);
  }
  const uint64_t first = a.word_offset + static_cast<uint64_t>(at / 8);
  term[0] = checksum::word_term(l.v.x, first);
  term[1] = checksum::word_term(l.v.y, first + 1);
}


// --- one warp's tile ---
//
// A warp takes tiles of out, 1 to kMaxTileSteps steps of kStepBytes each: in
// a step, lane L handles chunks L, L + 32, ... (kChunksPerStep of them), so
// each of its loads is part of a 512-byte coalesced access. Almost every step of a
// large pack lies inside one source and one checksum block; such a step is
// copied and hashed as straight vectors, its keys added rather than
// multiplied (copy_hash_step, through the plain pack's copy_vectors_from). The
// others (segment ends, gaps, out's end, a block edge inside the step) go chunk
// by chunk through load_chunk.

constexpr int kChunksPerStep = 8;
constexpr int64_t kStepBytes = cuda_copy::kWarpSize * kChunksPerStep * kChunkBytes;  // 4 KiB
// A tile is 1 to kMaxTileSteps steps (tile_steps): the more, the fewer binary
// searches for a tile's first row; the fewer, the more warps a small call
// spreads over the GPU.
constexpr int64_t kMaxTileSteps = 4;

// Steps per tile for `nbytes` of out on a GPU of `sms` multiprocessors: as
// many as still leave every multiprocessor `warps_per_sm` warps' worth of tiles.
__host__ __device__ inline int64_t tile_steps(int64_t nbytes, int64_t sms, int64_t warps_per_sm) {
  const int64_t steps = (nbytes + kStepBytes - 1) / kStepBytes;
  const int64_t per_tile = steps / (sms * warps_per_sm);
  return per_tile < 1 ? 1 : per_tile > kMaxTileSteps ? kMaxTileSteps : per_tile;
}

// Key distance between a lane's chunk u and chunk u + 1 of a step (32 chunks,
// 64 words further on).
constexpr uint64_t kChunkRowKey = 2 * cuda_copy::kWarpSize * checksum::kKeyStep;
// Key distance between a lane's first word in a step and in the next.
constexpr uint64_t kStepKey = (kStepBytes / 8) * checksum::kKeyStep;

__host__ __device__ inline uint64_t pair_terms(ulonglong2 v, uint64_t key) {
  return checksum::mix(v.x ^ key) + checksum::mix(v.y ^ (key + checksum::kKeyStep));
}

// Lane `lane`'s share of one whole step whose kStepBytes all come from `src`
// (any alignment) to the 16-byte aligned `dst`: it stores them and returns the
// sum of their word terms. `key` is the key of the lane's first word; the
// lane's next chunk (32 chunks on) is kChunkRowKey further.
// kOrdered: all of the step's loads before its first store (load16_ordered),
// which takes the registers the fast tile loop has and the general one has not.
template <bool kOrdered>
__host__ __device__ inline uint64_t copy_hash_step(const uint8_t* src, uint8_t* dst, int lane, uint64_t key) {
  uint64_t acc = 0;
  auto hash = [&acc, &key](ulonglong2 v) {
    acc += pair_terms(v, key);
    key += kChunkRowKey;
  };
  cuda_copy::copy_vectors_from<kOrdered>(src, reinterpret_cast<ulonglong2*>(dst),
                               static_cast<int>(kStepBytes / cuda_copy::kVectorBytes), lane, hash);
  return acc;
}

// Lane `lane`'s share of tile `tile` (tiles of tile_bytes, a multiple of
// kStepBytes). The sink takes the lane's word terms:
// sink.flush(block, sum) with the lane's sum over a run of steps inside
// checksum block `block` (called at the same points by every lane of the warp,
// so a warp-wide reduction may sit in it), and sink.add(block, term) for a
// single word of a step that straddles two blocks. sink.whole_step(src) marks a
// step done as straight vectors from src (host checks count them; the kernel's
// does nothing).
template <typename Sink>
__host__ __device__ inline void pack_checksum_tile(const Args& a, int64_t block_bytes, int64_t tile_bytes,
                                                   int64_t tile, int lane, Sink& sink) {
  const int64_t lo = tile * tile_bytes;
  const int64_t hi = lo + tile_bytes < a.nbytes ? lo + tile_bytes : a.nbytes;
  int64_t row = first_row_after(a, lo);  // warp-uniform: the first row that ends after the step
  int64_t block = lo / block_bytes;
  // Most tiles of a large pack: whole steps, one source, one checksum block.
  // Checked once for the tile, so the loop below holds a source, a
  // destination, a key and a sum and nothing else: with the kernel's 64
  // registers, the compiler then issues all of a step's loads before its
  // first store (in the general loop below it issued four, and the other four
  // one by one between the hashes: several trips to memory a step).
  if ((hi - lo) % kStepBytes == 0 && (hi - 1) / block_bytes == block && row < a.nrows && a.rows[row].dst <= lo &&
      a.rows[row].dst + a.rows[row].nbytes >= hi) {
    const uint8_t* src = reinterpret_cast<const uint8_t*>(a.rows[row].src) + (lo - a.rows[row].dst);
    uint8_t* dst = a.out + lo;
    uint64_t key = checksum::word_key(a.word_offset + static_cast<uint64_t>(lo / 8) + 2 * lane);
    uint64_t sum = 0;
    for (int64_t at = 0; at < hi - lo; at += kStepBytes) {
      sum += copy_hash_step<true>(src + at, dst + at, lane, key);
      sink.whole_step(src + at);
      key += kStepKey;
    }
    sink.flush(block, sum);
    return;
  }
  uint64_t acc = 0;
  for (int64_t step = lo; step < hi; step += kStepBytes) {
    const int64_t step_end = step + kStepBytes < hi ? step + kStepBytes : hi;
    const int64_t first_block = step / block_bytes;
    const bool one_block = (step_end - 1) / block_bytes == first_block;
    if (first_block != block) {
      sink.flush(block, acc);
      acc = 0;
      block = first_block;
    }
    while (row < a.nrows && a.rows[row].dst + a.rows[row].nbytes <= step) {
      ++row;
    }
    if (one_block && step_end - step == kStepBytes && row < a.nrows && a.rows[row].dst <= step &&
        a.rows[row].dst + a.rows[row].nbytes >= step_end) {
      const Row& r = a.rows[row];
      const uint8_t* src = reinterpret_cast<const uint8_t*>(r.src) + (step - r.dst);
      const uint64_t key = checksum::word_key(a.word_offset + static_cast<uint64_t>(step / 8) + 2 * lane);
      acc += copy_hash_step<false>(src, a.out + step, lane, key);
      sink.whole_step(src);
      continue;
    }
    int64_t cursor = row;  // this lane's: its chunks lie at or after the step
    // Two chunks in flight at a time: this path is rare in a large pack, and
    // its registers cap the kernel's occupancy (four in flight: 80 registers, 3
    // blocks of 256 threads per multiprocessor, which ncu saw at 66% of DRAM
    // bandwidth on an H200; two: 64, 4 blocks, as the plain pack kernel has).
    constexpr int kInFlight = 2;
    for (int half = 0; half < kChunksPerStep / kInFlight; ++half) {
      Loaded loaded[kInFlight];
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int64_t at = step + (static_cast<int64_t>(half * kInFlight + u) * cuda_copy::kWarpSize + lane) * kChunkBytes;
        if (at < step_end) {
          loaded[u] = load_chunk(a, at, cursor);
        }
      }
#pragma unroll
      for (int u = 0; u < kInFlight; ++u) {
        const int64_t at = step + (static_cast<int64_t>(half * kInFlight + u) * cuda_copy::kWarpSize + lane) * kChunkBytes;
        if (at >= step_end) {
          continue;
        }
        uint64_t term[2];
        finish_chunk(a, at, loaded[u], term);
        if (one_block) {
          acc += term[0] + term[1];
        } else {
          sink.add(at / block_bytes, term[0]);
          if (at + 8 < a.nbytes) {
            sink.add((at + 8) / block_bytes, term[1]);
          }
        }
      }
    }
  }
  sink.flush(block, acc);
}

}  // namespace cuda_pack_checksum
}  // namespace replica
