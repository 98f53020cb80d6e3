// CUDA pack/unpack: every segment of a call is copied by one kernel launch on
// the current stream of the buffer's device. The host sends one table row per
// segment (not per chunk), so its work and the table's upload grow with the
// number of tensors, not with their bytes; the kernel cuts segments into tiles
// (see copy_tiles.cuh), one warp per tile, and the block scheduler balances
// them over the GPU.
#include "../replica.h"
#include "copy_tiles.cuh"

#include <ATen/core/CachingHostAllocator.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <limits>

namespace replica {
namespace {

using cuda_copy::CopySegment;

constexpr int kWarpsPerBlock = 8;
constexpr int kThreads = kWarpsPerBlock * cuda_copy::kWarpSize;

__global__ void __launch_bounds__(kThreads) copy_tiles_kernel(
    const int64_t* tile_begin, const CopySegment* segments, int64_t nsegments,
    int64_t ntiles) {
  const int64_t tile = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock +
      threadIdx.x / cuda_copy::kWarpSize;
  if (tile >= ntiles) {
    return;
  }
  const int lane = static_cast<int>(threadIdx.x % cuda_copy::kWarpSize);
  const int64_t s = cuda_copy::find_segment(tile_begin, nsegments, tile);
  cuda_copy::copy_tile(segments[s], tile - tile_begin[s], lane);
}

void copy_segments_cuda(const std::vector<Segment>& segments, const at::Tensor& buffer) {
  int64_t nsegments = 0;
  for (const Segment& s : segments) {
    nsegments += s.nbytes > 0 ? 1 : 0;
  }
  if (nsegments == 0) {
    return;
  }
  // Table: tile_begin[nsegments + 1], then the segments. It travels host ->
  // device through pinned memory on the current stream; the caching host
  // allocator keeps the pinned block until that copy has run (record_event).
  static_assert(sizeof(CopySegment) == 3 * sizeof(int64_t));
  const int64_t table_len = nsegments + 1 + 3 * nsegments;
  at::Tensor table =
      at::empty({table_len}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* tile_begin = table.data_ptr<int64_t>();
  auto* rows = reinterpret_cast<CopySegment*>(tile_begin + nsegments + 1);
  int64_t ntiles = 0;
  int64_t k = 0;
  for (const Segment& s : segments) {
    if (s.nbytes == 0) {
      continue;
    }
    rows[k] = CopySegment{
        reinterpret_cast<int64_t>(s.src), reinterpret_cast<int64_t>(s.dst), s.nbytes};
    tile_begin[k] = ntiles;
    ntiles += cuda_copy::tile_count(rows[k]);
    ++k;
  }
  tile_begin[nsegments] = ntiles;

  const int64_t blocks = (ntiles + kWarpsPerBlock - 1) / kWarpsPerBlock;
  TORCH_CHECK(
      blocks <= std::numeric_limits<int32_t>::max(),
      "replica: ", ntiles * cuda_copy::kTileBytes, " bytes is more than one call can copy");

  // The upload as Tensor::to(device, non_blocking) does it (Copy.cu), without
  // its dispatch and TensorIterator: every microsecond here is one the GPU
  // waits. The device table is freed when this returns, which the caching
  // allocator orders after the kernel on this stream.
  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(buffer.device().index());
  const at::Tensor device_table =
      at::empty({table_len}, at::TensorOptions().dtype(at::kLong).device(buffer.device()));
  C10_CUDA_CHECK(cudaMemcpyAsync(
      device_table.data_ptr(), table.data_ptr(), table_len * sizeof(int64_t),
      cudaMemcpyHostToDevice, stream.stream()));
  at::getHostAllocator(at::kCUDA)->record_event(
      table.data_ptr(), table.storage().data_ptr().get_context(), stream.unwrap());

  const int64_t* device_begin = device_table.data_ptr<int64_t>();
  copy_tiles_kernel<<<static_cast<unsigned int>(blocks), kThreads, 0, stream.stream()>>>(
      device_begin, reinterpret_cast<const CopySegment*>(device_begin + nsegments + 1),
      nsegments, ntiles);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// plan_segments runs before the guard is built: CUDA tensors beside a CPU
// buffer (or the reverse) dispatch here too, and must get its message naming
// the tensor, not the guard's.
void copy_on_device(const std::vector<Segment>& segments, const at::Tensor& buffer) {
  TORCH_CHECK(
      buffer.is_cuda(), "replica: the CUDA kernel got a buffer on ", buffer.device());
  const c10::cuda::CUDAGuard guard(buffer.device());
  copy_segments_cuda(segments, buffer);
}

void pack_cuda(at::TensorList srcs, const at::Tensor& out, at::IntArrayRef offsets) {
  copy_on_device(plan_segments(srcs, out, offsets, Direction::kPack), out);
}

void unpack_cuda(const at::Tensor& src, at::TensorList dsts, at::IntArrayRef offsets) {
  copy_on_device(plan_segments(dsts, src, offsets, Direction::kUnpack), src);
}

}  // namespace

TORCH_LIBRARY_IMPL(replica, CUDA, m) {
  m.impl("pack", &pack_cuda);
  m.impl("unpack", &unpack_cuda);
}

}  // namespace replica
