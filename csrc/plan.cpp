// Argument validation shared by the CPU and CUDA kernels.
#include "replica.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <numeric>

namespace replica {

namespace {

bool ranges_overlap(const void* a, int64_t a_len, const void* b, int64_t b_len) {
  if (a_len == 0 || b_len == 0) {
    return false;
  }
  auto a0 = reinterpret_cast<uintptr_t>(a);
  auto b0 = reinterpret_cast<uintptr_t>(b);
  return a0 < b0 + static_cast<uintptr_t>(b_len) &&
      b0 < a0 + static_cast<uintptr_t>(a_len);
}

}  // namespace

std::vector<Segment> plan_segments(
    at::TensorList tensors,
    const at::Tensor& buffer,
    at::IntArrayRef offsets,
    Direction direction) {
  const bool pack = direction == Direction::kPack;
  const char* list_name = pack ? "srcs" : "dsts";
  const char* buf_name = pack ? "out" : "src";

  TORCH_CHECK(buffer.defined(), "replica: ", buf_name, " is undefined");
  TORCH_CHECK(
      buffer.scalar_type() == at::kByte,
      "replica: ", buf_name, " must be a uint8 tensor, got ", buffer.scalar_type());
  TORCH_CHECK(
      buffer.is_contiguous(),
      "replica: ", buf_name, " must be contiguous, got strides ", buffer.strides());
  TORCH_CHECK(
      offsets.size() == tensors.size(),
      "replica: got ", tensors.size(), " ", list_name, " but ", offsets.size(),
      " offsets");

  const int64_t capacity = buffer.numel();
  auto* base = static_cast<uint8_t*>(buffer.data_ptr());
  std::vector<Segment> segments;
  segments.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    const int64_t off = offsets[i];
    TORCH_CHECK(t.defined(), "replica: ", list_name, "[", i, "] is undefined");
    TORCH_CHECK(
        t.device() == buffer.device(),
        "replica: ", list_name, "[", i, "] is on ", t.device(), " but ", buf_name,
        " is on ", buffer.device());
    TORCH_CHECK(
        t.is_contiguous(),
        "replica: ", list_name, "[", i, "] is not contiguous (sizes ", t.sizes(),
        ", strides ", t.strides(), "); call .contiguous() first");
    TORCH_CHECK(
        off >= 0 && off % kSegmentAlignment == 0,
        "replica: offsets[", i, "] = ", off, " for ", list_name, "[", i,
        "] must be a non-negative multiple of ", kSegmentAlignment);
    const int64_t nbytes = t.numel() * static_cast<int64_t>(t.element_size());
    TORCH_CHECK(
        off <= capacity && nbytes <= capacity - off,
        "replica: ", list_name, "[", i, "] (", nbytes, " bytes at offset ", off,
        ") runs past the end of ", buf_name, " (", capacity, " bytes)");
    auto* tensor_bytes = static_cast<uint8_t*>(t.data_ptr());
    TORCH_CHECK(
        !ranges_overlap(tensor_bytes, nbytes, base, capacity),
        "replica: ", list_name, "[", i, "] shares memory with ", buf_name);
    if (pack) {
      segments.push_back({tensor_bytes, base + off, nbytes});
    } else {
      segments.push_back({base + off, tensor_bytes, nbytes});
    }
  }

  // Overlapping segments would make the result depend on copy order. Offsets
  // usually come in increasing order, which skips the sort.
  std::vector<size_t> order(segments.size());
  std::iota(order.begin(), order.end(), 0);
  if (!std::is_sorted(offsets.begin(), offsets.end())) {
    std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
      return offsets[a] < offsets[b];
    });
  }
  int64_t prev_end = 0;
  size_t prev = 0;
  bool have_prev = false;
  for (size_t idx : order) {
    if (segments[idx].nbytes == 0) {
      continue;
    }
    TORCH_CHECK(
        !have_prev || offsets[idx] >= prev_end,
        "replica: ", list_name, "[", idx, "] at offset ", offsets[idx],
        " overlaps ", list_name, "[", prev, "] which ends at byte ", prev_end);
    prev_end = offsets[idx] + segments[idx].nbytes;
    prev = idx;
    have_prev = true;
  }
  return segments;
}

int64_t plan_checksum(const at::Tensor& buf, int64_t block_bytes, int64_t word_offset) {
  TORCH_CHECK(buf.defined(), "replica: checksum buf is undefined");
  TORCH_CHECK(
      buf.is_contiguous(),
      "replica: checksum buf must be contiguous, got strides ", buf.strides());
  TORCH_CHECK(
      block_bytes > 0 && block_bytes % 8 == 0,
      "replica: checksum block_bytes must be a positive multiple of 8, got ",
      block_bytes);
  TORCH_CHECK(word_offset >= 0, "replica: checksum word_offset must be non-negative, got ", word_offset);
  const int64_t nbytes = buf.numel() * static_cast<int64_t>(buf.element_size());
  return (nbytes + block_bytes - 1) / block_bytes;
}

}  // namespace replica
