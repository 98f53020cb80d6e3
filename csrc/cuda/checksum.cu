// CUDA checksum: the same digests as the CPU kernel (see replica.h). Each
// thread block sums the word terms of one slice of one checksum block and
// adds its partial sum atomically; a second kernel finalizes the digests.
#include "../replica.h"

#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

namespace replica {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kWordsPerThread = 16;
constexpr int64_t kWordsPerSlice = kThreads * kWordsPerThread;

__device__ inline uint64_t load_word(
    const uint8_t* bytes, int64_t nbytes, int64_t word, bool aligned) {
  const int64_t at = word * 8;
  if (aligned && at + 8 <= nbytes) {
    return reinterpret_cast<const uint64_t*>(bytes)[word];
  }
  uint64_t w = 0;
  const int64_t n = nbytes - at < 8 ? nbytes - at : 8;
  for (int64_t i = 0; i < n; ++i) {
    w |= static_cast<uint64_t>(bytes[at + i]) << (8 * i);
  }
  return w;
}

__global__ void checksum_partial_kernel(
    const uint8_t* bytes,
    int64_t nbytes,
    int64_t words_per_block,
    int64_t slices_per_block,
    bool aligned,
    uint64_t word_offset,
    unsigned long long* sums) {
  const int64_t block = blockIdx.x / slices_per_block;
  const int64_t slice = blockIdx.x % slices_per_block;
  const int64_t nwords = (nbytes + 7) / 8;
  const int64_t block_end = min(nwords, (block + 1) * words_per_block);
  const int64_t begin = block * words_per_block + slice * kWordsPerSlice;
  const int64_t end = min(block_end, begin + kWordsPerSlice);

  uint64_t acc = 0;
  for (int64_t w = begin + threadIdx.x; w < end; w += kThreads) {
    acc += checksum::word_term(load_word(bytes, nbytes, w, aligned), word_offset + w);
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    acc += __shfl_down_sync(0xffffffffu, acc, offset);
  }
  __shared__ uint64_t warp_sums[kThreads / 32];
  if (threadIdx.x % 32 == 0) {
    warp_sums[threadIdx.x / 32] = acc;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    uint64_t total = 0;
    for (int i = 0; i < kThreads / 32; ++i) {
      total += warp_sums[i];
    }
    atomicAdd(&sums[block], static_cast<unsigned long long>(total));
  }
}

__global__ void checksum_finalize_kernel(
    unsigned long long* sums, int64_t nblocks, int64_t nbytes, int64_t block_bytes) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b < nblocks) {
    const int64_t len = min(block_bytes, nbytes - b * block_bytes);
    sums[b] = checksum::finalize(sums[b], static_cast<uint64_t>(len));
  }
}

at::Tensor checksum_cuda(const at::Tensor& buf, int64_t block_bytes, int64_t word_offset) {
  const c10::cuda::CUDAGuard guard(buf.device());
  const int64_t nblocks = plan_checksum(buf, block_bytes, word_offset);
  at::Tensor digests = at::zeros({nblocks}, buf.options().dtype(at::kLong));
  if (nblocks == 0) {
    return digests;
  }
  const int64_t nbytes = buf.numel() * static_cast<int64_t>(buf.element_size());
  const int64_t words_per_block = block_bytes / 8;
  const int64_t slices_per_block = (words_per_block + kWordsPerSlice - 1) / kWordsPerSlice;
  const int64_t grid = nblocks * slices_per_block;
  TORCH_CHECK(
      grid <= std::numeric_limits<int32_t>::max(),
      "replica: checksum of ", nbytes, " bytes in ", block_bytes,
      "-byte blocks needs too many CUDA blocks; use larger blocks");
  const auto* bytes = static_cast<const uint8_t*>(buf.data_ptr());
  const bool aligned = reinterpret_cast<uintptr_t>(bytes) % 8 == 0;
  auto* sums = reinterpret_cast<unsigned long long*>(digests.data_ptr<int64_t>());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(buf.device().index());
  checksum_partial_kernel<<<static_cast<unsigned int>(grid), kThreads, 0, stream>>>(
      bytes, nbytes, words_per_block, slices_per_block, aligned, static_cast<uint64_t>(word_offset), sums);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t finalize_blocks = (nblocks + kThreads - 1) / kThreads;
  checksum_finalize_kernel<<<static_cast<unsigned int>(finalize_blocks), kThreads, 0, stream>>>(
      sums, nblocks, nbytes, block_bytes);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return digests;
}

}  // namespace

TORCH_LIBRARY_IMPL(replica, CUDA, m) {
  m.impl("checksum", &checksum_cuda);
}

}  // namespace replica
