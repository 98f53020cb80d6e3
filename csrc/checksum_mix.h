// The checksum's mixing functions, which the CPU builds and the CUDA kernels
// must compute bit for bit alike. Free of torch, so host-side checks of the
// CUDA kernels' work split (csrc/cuda/*_check.cpp) compile without it.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define REPLICA_HOST_DEVICE __host__ __device__
#else
#define REPLICA_HOST_DEVICE
#endif

namespace replica {

namespace checksum {

// The digest of a block is finalize(sum over its 8-byte words w_i of
// word_term(w_i, i)), where i is the word's index in the whole buffer, sums
// wrap mod 2^64 and the last partial word is zero-padded. The index starts at
// the op's word_offset (0 unless given): a bucket of a larger buffer, hashed
// alone with word_offset = its byte offset / 8, gets the digest its block of
// the whole buffer has. word_term is a
// bijection of w_i for a fixed i (xor with a key, then xor-shifts and
// multiplications by odd constants), so any change confined to one word --
// in particular any single flipped bit -- changes exactly one term and hence
// the sum, and finalize is a bijection of the sum: such an error is detected
// with certainty. The position key makes a term depend on where a word sits,
// so swapped words or swapped blocks (with different contents) change the
// digests; finalize also mixes the block's length so a short last block does
// not collide with its zero-padded form. The sum is associative and
// commutative, so threads and CUDA blocks may add partial sums in any order
// and the result stays deterministic.
constexpr uint64_t kKeyStep = 0x9E3779B97F4A7C15ULL;  // 2^64 / golden ratio, odd
constexpr uint64_t kMul1 = 0xBF58476D1CE4E5B9ULL;     // splitmix64 finalizer
constexpr uint64_t kMul2 = 0x94D049BB133111EBULL;
constexpr uint64_t kLengthKey = 0xD6E8FEB86659FD93ULL;

REPLICA_HOST_DEVICE inline uint64_t mix(uint64_t x) {
  x ^= x >> 30;
  x *= kMul1;
  x ^= x >> 27;
  x *= kMul2;
  x ^= x >> 31;
  return x;
}

// The key of word `word_index`. Keys of successive words differ by kKeyStep,
// so a loop over words can add instead of multiply: key(i + n) = key(i) + n * kKeyStep.
REPLICA_HOST_DEVICE inline uint64_t word_key(uint64_t word_index) {
  return (word_index + 1) * kKeyStep;
}

REPLICA_HOST_DEVICE inline uint64_t word_term(uint64_t word, uint64_t word_index) {
  return mix(word ^ word_key(word_index));
}

REPLICA_HOST_DEVICE inline uint64_t finalize(uint64_t sum, uint64_t block_bytes) {
  return mix(sum ^ (block_bytes * kLengthKey));
}

}  // namespace checksum

}  // namespace replica
