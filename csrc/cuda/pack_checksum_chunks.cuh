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

// A chunk between its load and its store: `v` holds its 16 bytes (kSource,
// kGap), or the chunk was done byte by byte and `term` holds its word terms
// (kHashed). Loads of several chunks are issued before the first store, so a
// lane keeps several in flight.
struct Loaded {
  Kind kind;
  ulonglong2 v;
  uint64_t term[2];
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
    // Entirely source bytes: loaded whole, or funnel-shifted from the two
    // aligned vectors it straddles (each holds a byte of the source).
    const Row& r = a.rows[row];
    const uint8_t* src = reinterpret_cast<const uint8_t*>(r.src) + (at - r.dst);
    const int shift = static_cast<int>(reinterpret_cast<uintptr_t>(src) % cuda_copy::kVectorBytes);
    if (shift == 0) {
      l.v = cuda_copy::load16(reinterpret_cast<const ulonglong2*>(src));
    } else {
      const auto* words = reinterpret_cast<const ulonglong2*>(src - shift);
      l.v = cuda_copy::funnel(cuda_copy::load16(words), cuda_copy::load16(words + 1), shift);
    }
    l.kind = Kind::kSource;
    return l;
  }
  if (!in_row && end - at == kChunkBytes) {  // entirely gap: hashed as out holds it (never written)
    l.v = *reinterpret_cast<const ulonglong2*>(a.out + at);
    l.kind = Kind::kGap;
    return l;
  }
  // The end of a segment, or the end of out: byte by byte. The row's bytes are
  // copied; the others are out's own; past out's end, zero padding.
  const uint64_t first = a.word_offset + static_cast<uint64_t>(at / 8);
  const int64_t row_end = in_row ? a.rows[row].dst + a.rows[row].nbytes : at;
  const uint8_t* src = in_row ? reinterpret_cast<const uint8_t*>(a.rows[row].src) + (at - a.rows[row].dst) : nullptr;
  uint64_t w[2] = {0, 0};
  for (int64_t i = 0; at + i < end; ++i) {
    uint8_t byte;
    if (at + i < row_end) {
      byte = src[i];
      a.out[at + i] = byte;
    } else {
      byte = a.out[at + i];
    }
    w[i / 8] |= static_cast<uint64_t>(byte) << (8 * (i % 8));
  }
  l.term[0] = checksum::word_term(w[0], first);
  l.term[1] = end - at > 8 ? checksum::word_term(w[1], first + 1) : 0;
  l.kind = Kind::kHashed;
  return l;
}

// Stores a source chunk and fills `term` with the word terms of chunk `at`:
// term[0] for word at/8, term[1] for the next (0 past out's end).
__host__ __device__ inline void finish_chunk(const Args& a, int64_t at, const Loaded& l, uint64_t term[2]) {
  if (l.kind == Kind::kHashed) {
    term[0] = l.term[0];
    term[1] = l.term[1];
    return;
  }
  if (l.kind == Kind::kSource) {
    cuda_copy::store16(reinterpret_cast<ulonglong2*>(a.out + at), l.v);
  }
  const uint64_t first = a.word_offset + static_cast<uint64_t>(at / 8);
  term[0] = checksum::word_term(l.v.x, first);
  term[1] = checksum::word_term(l.v.y, first + 1);
}

}  // namespace cuda_pack_checksum
}  // namespace replica
