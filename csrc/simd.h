// The CPU checksum loops, one build per instruction set, chosen at run time:
// AVX-512 (F + DQ: 64-bit multiplies in one instruction; BW: byte masks), AVX2, or portable
// code, the best the CPU has unless REPLICA_SIMD names a lesser one. All give
// the same digests bit for bit (simd_body.inc).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace replica {

struct Segment;  // replica.h

namespace simd {

// copy_segments_and_hash hashes whole windows of this many bytes: the alignment
// of a packed buffer's segments (kSegmentAlignment in replica.h).
constexpr int64_t kWindowBytes = 64;

// Small sources lie scattered over the heap; without a prefetch each one starts
// with a full memory round trip. Copies over a list of segments fetch the first
// kPrefetchSourceBytes of the source kPrefetchSegmentsAhead segments on.
constexpr int64_t kPrefetchSegmentsAhead = 4;
constexpr int64_t kPrefetchSourceBytes = 4096;

inline void prefetch_source(const uint8_t* src, int64_t nbytes) {
  const int64_t bytes = nbytes < kPrefetchSourceBytes ? nbytes : kPrefetchSourceBytes;
  for (int64_t at = 0; at < bytes; at += 64) {
    __builtin_prefetch(src + at);
  }
}

struct Kernels {
  const char* name;
  // Sum of checksum::word_term over `nwords` whole words at `bytes`, the first
  // having index `index` in its buffer.
  uint64_t (*hash_words)(const uint8_t* bytes, int64_t nwords, uint64_t index);
  // The same sum, while copying the words to `dst` (streamed when asked).
  uint64_t (*copy_and_hash)(uint8_t* dst, const uint8_t* bytes, int64_t nwords, uint64_t index, bool streaming);
  // Copies each of `count` segments (nbytes > 0) to its dst; returns the sum over
  // each one's dst up to nbytes rounded up to kWindowBytes, word indices counted
  // from `base` plus `word_offset`; whole windows streamed when `streaming` (the
  // caller fences).
  uint64_t (*copy_segments_and_hash)(const Segment* segments, int64_t count, const uint8_t* base,
                                     uint64_t word_offset, bool streaming);
};

// The kernels in use.
const Kernels& active();
// Names of the builds this CPU can run, best first ("avx512", "avx2", "portable").
std::vector<std::string> supported();
// Use the build `name` from now on (tests and benchmarks); returns the previous
// one's name. Throws c10::Error for a build this CPU cannot run.
std::string select(const std::string& name);

}  // namespace simd
}  // namespace replica
