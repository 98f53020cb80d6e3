// Shared declarations of the replica._C kernels: segment planning (argument
// validation) used by every device, and the checksum's mixing functions, which
// CPU and CUDA must compute bit for bit alike.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>

#include <cstdint>
#include <vector>

namespace replica {

// Every segment of a packed buffer starts at a multiple of this many bytes.
constexpr int64_t kSegmentAlignment = 64;

// One contiguous byte range to copy; pack and unpack differ only in direction.
struct Segment {
  const uint8_t* src;
  uint8_t* dst;
  int64_t nbytes;
};

enum class Direction { kPack, kUnpack };

// Validates the arguments of pack/unpack and returns the copies to perform,
// in the order of `tensors`. Errors name the offending tensor by its argument
// name and index (for example "srcs[3]").
std::vector<Segment> plan_segments(
    at::TensorList tensors,
    const at::Tensor& buffer,
    at::IntArrayRef offsets,
    Direction direction);

// Validates checksum's arguments; returns the number of digests (blocks).
int64_t plan_checksum(const at::Tensor& buf, int64_t block_bytes);

namespace checksum {

// The digest of a block is finalize(sum over its 8-byte words w_i of
// word_term(w_i, i)), where i is the word's index in the whole buffer, sums
// wrap mod 2^64 and the last partial word is zero-padded. word_term is a
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

C10_HOST_DEVICE inline uint64_t mix(uint64_t x) {
  x ^= x >> 30;
  x *= kMul1;
  x ^= x >> 27;
  x *= kMul2;
  x ^= x >> 31;
  return x;
}

C10_HOST_DEVICE inline uint64_t word_term(uint64_t word, uint64_t word_index) {
  return mix(word ^ ((word_index + 1) * kKeyStep));
}

C10_HOST_DEVICE inline uint64_t finalize(uint64_t sum, uint64_t block_bytes) {
  return mix(sum ^ (block_bytes * kLengthKey));
}

}  // namespace checksum
}  // namespace replica
