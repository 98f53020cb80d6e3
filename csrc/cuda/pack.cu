// CUDA pack/unpack: every segment of a call is copied by one kernel launch on
// the current stream. Segments are cut into chunks of at most kChunkBytes and
// each warp copies one chunk, so 10,000 tiny tensors and one huge one both
// fill the GPU.
#include "../replica.h"

#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace replica {
namespace {

constexpr int64_t kChunkBytes = 32 << 10;
constexpr int kWarpsPerBlock = 8;
constexpr int kWarpSize = 32;

// One chunk to copy: (src address, dst address, length) as int64 triples.
struct Chunk {
  int64_t src;
  int64_t dst;
  int64_t nbytes;
};

template <typename T>
__device__ void copy_as(const uint8_t* src, uint8_t* dst, int64_t nbytes, int lane) {
  const int64_t n = nbytes / static_cast<int64_t>(sizeof(T));
  const T* s = reinterpret_cast<const T*>(src);
  T* d = reinterpret_cast<T*>(dst);
  for (int64_t i = lane; i < n; i += kWarpSize) {
    d[i] = s[i];
  }
  for (int64_t i = n * sizeof(T) + lane; i < nbytes; i += kWarpSize) {
    dst[i] = src[i];
  }
}

__global__ void copy_chunks_kernel(const Chunk* chunks, int64_t nchunks) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock +
      threadIdx.x / kWarpSize;
  if (c >= nchunks) {
    return;
  }
  const int lane = threadIdx.x % kWarpSize;
  const Chunk chunk = chunks[c];
  const auto* src = reinterpret_cast<const uint8_t*>(chunk.src);
  auto* dst = reinterpret_cast<uint8_t*>(chunk.dst);
  const auto align = static_cast<uint64_t>(chunk.src | chunk.dst);
  if (align % 16 == 0) {
    copy_as<uint4>(src, dst, chunk.nbytes, lane);
  } else if (align % 8 == 0) {
    copy_as<uint64_t>(src, dst, chunk.nbytes, lane);
  } else if (align % 4 == 0) {
    copy_as<uint32_t>(src, dst, chunk.nbytes, lane);
  } else {
    copy_as<uint8_t>(src, dst, chunk.nbytes, lane);
  }
}

void copy_segments_cuda(const std::vector<Segment>& segments, const at::Tensor& buffer) {
  int64_t nchunks = 0;
  for (const Segment& s : segments) {
    nchunks += (s.nbytes + kChunkBytes - 1) / kChunkBytes;
  }
  if (nchunks == 0) {
    return;
  }
  // The chunk table travels host -> device through pinned memory on the
  // current stream; the caching host allocator keeps it alive until the copy
  // has run.
  at::Tensor table = at::empty(
      {nchunks * 3}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  auto* out = reinterpret_cast<Chunk*>(table.data_ptr<int64_t>());
  for (const Segment& s : segments) {
    for (int64_t at = 0; at < s.nbytes; at += kChunkBytes) {
      *out++ = Chunk{
          reinterpret_cast<int64_t>(s.src + at),
          reinterpret_cast<int64_t>(s.dst + at),
          std::min(kChunkBytes, s.nbytes - at)};
    }
  }
  at::Tensor device_table = table.to(buffer.device(), /*non_blocking=*/true);
  const int64_t blocks = (nchunks + kWarpsPerBlock - 1) / kWarpsPerBlock;
  copy_chunks_kernel<<<
      static_cast<unsigned int>(blocks), kWarpsPerBlock * kWarpSize, 0,
      c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const Chunk*>(device_table.data_ptr<int64_t>()), nchunks);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void pack_cuda(at::TensorList srcs, const at::Tensor& out, at::IntArrayRef offsets) {
  const c10::cuda::CUDAGuard guard(out.device());
  copy_segments_cuda(plan_segments(srcs, out, offsets, Direction::kPack), out);
}

void unpack_cuda(const at::Tensor& src, at::TensorList dsts, at::IntArrayRef offsets) {
  const c10::cuda::CUDAGuard guard(src.device());
  copy_segments_cuda(plan_segments(dsts, src, offsets, Direction::kUnpack), src);
}

}  // namespace

TORCH_LIBRARY_IMPL(replica, CUDA, m) {
  m.impl("pack", &pack_cuda);
  m.impl("unpack", &unpack_cuda);
}

}  // namespace replica
