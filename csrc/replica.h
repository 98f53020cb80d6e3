// Shared declarations of the replica._C kernels: segment planning (argument
// validation) used by every device; the checksum's mixing functions, which
// CPU and CUDA must compute bit for bit alike, are in checksum_mix.h.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/macros/Macros.h>

#include "checksum_mix.h"

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
int64_t plan_checksum(const at::Tensor& buf, int64_t block_bytes, int64_t word_offset);

// The CPU checksum on min(threads, one per 2 MiB of buf) OpenMP
// threads of its own, whatever torch's intra-op setting: a receiver verifying
// pieces on a machine with cores to spare (ops.checksum(threads=)).
at::Tensor checksum_cpu_threads(const at::Tensor& buf, int64_t block_bytes, int64_t word_offset, int64_t threads);

}  // namespace replica
