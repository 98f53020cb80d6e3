// CUDA pack/unpack: every segment of a call is copied by one kernel launch on
// the current stream of the buffer's device. The host sends one table row per
// segment (not per chunk), so its work and the table's upload grow with the
// number of tensors, not with their bytes; the kernel cuts segments into tiles
// (see copy_tiles.cuh), one warp per tile, and the block scheduler balances
// them over the GPU.
#include "../replica.h"
#include "copy_tiles.cuh"
#include "pack_checksum_chunks.cuh"

#include <ATen/core/CachingHostAllocator.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <utility>

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

// A pinned int64 host table, copied to the device on `stream`. The upload as
// Tensor::to(device, non_blocking) does it (Copy.cu), without its dispatch and
// TensorIterator: every microsecond here is one the GPU waits. The caching
// host allocator keeps the pinned block until the copy has run
// (record_event); the device table, freed when the caller returns, is reused
// only after the kernel that reads it, the caching allocator ordering both on
// this stream.
at::Tensor upload(const at::Tensor& table, c10::Device device, const c10::cuda::CUDAStream& stream) {
  at::Tensor device_table = at::empty({table.numel()}, at::TensorOptions().dtype(at::kLong).device(device));
  C10_CUDA_CHECK(cudaMemcpyAsync(
      device_table.data_ptr(), table.data_ptr(), table.numel() * sizeof(int64_t),
      cudaMemcpyHostToDevice, stream.stream()));
  at::getHostAllocator(at::kCUDA)->record_event(
      table.data_ptr(), table.storage().data_ptr().get_context(), stream.unwrap());
  return device_table;
}

// Device copies of recent tables, found by their bytes. A mirror packs the same
// tensors into the same buffer every step and a weight sync the same parameters,
// so their tables repeat byte for byte; such a call finds its table on the device
// and skips the upload, which otherwise stands on the stream before the kernel
// (about 10 microseconds of an H200's stream for a 24 KB table). Equal bytes make
// an equal table: a hit is never stale, whatever was freed or moved between calls.
class TableCache {
 public:
  at::Tensor get(const at::Tensor& table, c10::Device device, const c10::cuda::CUDAStream& stream) {
    const auto n = static_cast<size_t>(table.numel());
    const auto* rows = table.data_ptr<int64_t>();
    if (n * sizeof(int64_t) > kMaxTableBytes) {
      return upload(table, device, stream);
    }
    const std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& e : entries_) {
      if (e->device_index == device.index() && e->rows.size() == n &&
          std::memcmp(e->rows.data(), rows, n * sizeof(int64_t)) == 0) {
        e->last_use = ++clock_;
        // Its upload, on whichever stream made it, runs first.
        C10_CUDA_CHECK(cudaStreamWaitEvent(stream.stream(), e->ready, 0));
        c10::cuda::CUDACachingAllocator::recordStream(e->table.storage().data_ptr(), stream);
        return e->table;
      }
    }
    auto entry = std::make_unique<Entry>();
    entry->table = upload(table, device, stream);
    entry->rows.assign(rows, rows + n);
    entry->device_index = device.index();
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&entry->ready, cudaEventDisableTiming));  // on the caller's device (its guard)
    C10_CUDA_CHECK(cudaEventRecord(entry->ready, stream.stream()));
    entry->last_use = ++clock_;
    at::Tensor result = entry->table;
    if (entries_.size() < kEntries) {
      entries_.push_back(std::move(entry));
    } else {  // the least recently used goes; streams that read it were recorded on it
      *std::min_element(entries_.begin(), entries_.end(), [](const auto& x, const auto& y) {
        return x->last_use < y->last_use;
      }) = std::move(entry);
    }
    return result;
  }

 private:
  static constexpr size_t kEntries = 16;
  static constexpr size_t kMaxTableBytes = 4 << 20;  // 170,000 tensors or so
  struct Entry {
    std::vector<int64_t> rows;
    at::Tensor table;
    c10::DeviceIndex device_index = -1;
    cudaEvent_t ready = nullptr;
    uint64_t last_use = 0;
    Entry() = default;
    Entry(const Entry&) = delete;
    Entry& operator=(const Entry&) = delete;
    ~Entry() {
      if (ready != nullptr) {
        cudaEventDestroy(ready);  // no check: nothing to do about a failure here
      }
    }
  };
  std::mutex mutex_;
  std::vector<std::unique_ptr<Entry>> entries_;
  uint64_t clock_ = 0;
};

// Never destroyed: its device tensors would outlive the CUDA context at exit.
at::Tensor device_table_of(const at::Tensor& table, c10::Device device, const c10::cuda::CUDAStream& stream) {
  static auto* cache = new TableCache();
  return cache->get(table, device, stream);
}

void copy_segments_cuda(const std::vector<Segment>& segments, const at::Tensor& buffer) {
  int64_t nsegments = 0;
  for (const Segment& s : segments) {
    nsegments += s.nbytes > 0 ? 1 : 0;
  }
  if (nsegments == 0) {
    return;
  }
  // Table: tile_begin[nsegments + 1], then the segments, uploaded through
  // pinned memory on the current stream.
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

  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(buffer.device().index());
  const at::Tensor device_table = device_table_of(table, buffer.device(), stream);

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


// --- pack_checksum: pack and checksum(out) in one launch ---
//
// One warp per tile of out (pack_checksum_tile in pack_checksum_chunks.cuh).
// Lanes add their word terms up per checksum block: a warp-wide sum and one
// atomic per block a tile touches, or, in a step that straddles two blocks
// (block sizes not a multiple of the step), one atomic per word. The last CUDA
// block to finish finalizes every digest (and zeroes the sums for the next
// call), so the op is one launch.

namespace pc = cuda_pack_checksum;

__device__ inline uint64_t warp_sum(uint64_t v) {
  for (int offset = cuda_copy::kWarpSize / 2; offset > 0; offset /= 2) {
    v += __shfl_down_sync(0xffffffffu, v, offset);
  }
  return v;
}

// Where a warp's lanes put their terms: per-block sums in global memory.
struct AtomicSums {
  unsigned long long* sums;
  int lane;
  __device__ void flush(int64_t block, uint64_t lane_sum) const {  // every lane of the warp calls it
    const uint64_t total = warp_sum(lane_sum);
    if (lane == 0 && total != 0) {
      atomicAdd(&sums[block], static_cast<unsigned long long>(total));
    }
  }
  __device__ void add(int64_t block, uint64_t term) const {
    atomicAdd(&sums[block], static_cast<unsigned long long>(term));
  }
  __device__ void whole_step(const uint8_t* /*src*/) const {}
};

// Four blocks per multiprocessor: at most 64 registers (see pack_checksum_tile's
// slow path), half the warps a multiprocessor holds.
__global__ void __launch_bounds__(kThreads, 4) pack_checksum_kernel(
    pc::Args a, int64_t block_bytes, int64_t tile_bytes, int64_t ntiles, unsigned long long* sums,
    int64_t nblocks, unsigned int* finished, int64_t* digests) {
  const int64_t tile = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + threadIdx.x / cuda_copy::kWarpSize;
  const int lane = static_cast<int>(threadIdx.x % cuda_copy::kWarpSize);
  if (tile < ntiles) {  // warp-uniform
    AtomicSums sink{sums, lane};
    pc::pack_checksum_tile(a, block_bytes, tile_bytes, tile, lane, sink);
  }
  // The last block to get here finalizes: every other block's atomics are
  // visible to it after its fence and theirs. It leaves the sums and the count
  // zero again for the next call on this stream.
  __threadfence();
  __syncthreads();
  __shared__ bool last;
  if (threadIdx.x == 0) {
    last = atomicAdd(finished, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (last) {
    __threadfence();
    for (int64_t b = threadIdx.x; b < nblocks; b += blockDim.x) {
      const uint64_t sum = atomicExch(&sums[b], 0ull);
      const int64_t len = min(block_bytes, a.nbytes - b * block_bytes);
      digests[b] = static_cast<int64_t>(checksum::finalize(sum, static_cast<uint64_t>(len)));
    }
    if (threadIdx.x == 0) {
      *finished = 0;
    }
  }
}

// pack_checksum's accumulators (a sum per digest, then the count of finished
// CUDA blocks), one set per stream: zero before a call's kernel, left zero by
// its last block, so a call needs no memset before its launch (about 2
// microseconds of the stream). Calls on one stream run one after another, so
// none sees another's sums; a set grows (zeroed once) for a call with more digests.
unsigned long long* zeroed_sums(int64_t n, const at::Tensor& like, const c10::cuda::CUDAStream& stream) {
  static auto* mutex = new std::mutex();
  static auto* sets = new std::map<std::pair<c10::DeviceIndex, cudaStream_t>, at::Tensor>();
  const std::lock_guard<std::mutex> lock(*mutex);
  at::Tensor& set = (*sets)[{stream.device_index(), stream.stream()}];
  if (!set.defined() || set.numel() < n) {
    const c10::cuda::CUDAStreamGuard on(stream);  // allocated for, and used by, this stream only
    set = at::zeros({std::max<int64_t>(n, set.defined() ? 2 * set.numel() : 1024)},
                    like.options().dtype(at::kLong));
  }
  return reinterpret_cast<unsigned long long*>(set.data_ptr<int64_t>());
}

at::Tensor checksum_cuda_op(const at::Tensor& buf, int64_t block_bytes, int64_t word_offset) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("replica::checksum", "")
                       .typed<at::Tensor(const at::Tensor&, int64_t, int64_t)>();
  return op.call(buf, block_bytes, word_offset);
}

at::Tensor pack_checksum_cuda(
    at::TensorList srcs, const at::Tensor& out, at::IntArrayRef offsets, int64_t block_bytes,
    int64_t word_offset) {
  std::vector<Segment> segments = plan_segments(srcs, out, offsets, Direction::kPack);
  const int64_t nblocks = plan_checksum(out, block_bytes, word_offset);
  TORCH_CHECK(out.is_cuda(), "replica: the CUDA kernel got a buffer on ", out.device());
  const c10::cuda::CUDAGuard guard(out.device());
  auto* base = static_cast<uint8_t*>(out.data_ptr());
  if (nblocks == 0 || reinterpret_cast<uintptr_t>(base) % cuda_copy::kVectorBytes != 0) {
    // A view of out that starts off a 16-byte boundary: its chunks would not be
    // vectors. Rare (allocations are 256-byte aligned); two launches instead.
    copy_segments_cuda(segments, out);
    return checksum_cuda_op(out, block_bytes, word_offset);
  }
  segments.erase(std::remove_if(segments.begin(), segments.end(), [](const Segment& s) { return s.nbytes == 0; }),
                 segments.end());
  const auto by_dst = [](const Segment& x, const Segment& y) { return x.dst < y.dst; };
  if (!std::is_sorted(segments.begin(), segments.end(), by_dst)) {  // offsets usually come in order
    std::sort(segments.begin(), segments.end(), by_dst);
  }
  const auto nrows = static_cast<int64_t>(segments.size());
  static_assert(sizeof(pc::Row) == 3 * sizeof(int64_t));
  at::Tensor table = at::empty({std::max<int64_t>(3 * nrows, 1)},
                               at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  auto* rows = reinterpret_cast<pc::Row*>(table.data_ptr<int64_t>());
  for (int64_t i = 0; i < nrows; ++i) {
    rows[i] = pc::Row{reinterpret_cast<int64_t>(segments[i].src), segments[i].dst - base, segments[i].nbytes};
  }
  const int64_t nbytes = out.numel();
  // Four blocks' worth of warps per multiprocessor at least (as many as fit at once), then longer tiles.
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, out.device().index()));
  const int64_t tile_bytes = pc::kStepBytes * pc::tile_steps(nbytes, sms, 4 * kWarpsPerBlock);
  const int64_t ntiles = (nbytes + tile_bytes - 1) / tile_bytes;
  const int64_t grid = (ntiles + kWarpsPerBlock - 1) / kWarpsPerBlock;
  TORCH_CHECK(grid <= std::numeric_limits<int32_t>::max(), "replica: ", nbytes, " bytes is more than one call can pack");

  const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(out.device().index());
  const at::Tensor device_table = device_table_of(table, out.device(), stream);
  unsigned long long* sums = zeroed_sums(nblocks + 1, out, stream);
  auto* finished = reinterpret_cast<unsigned int*>(sums + nblocks);
  at::Tensor digests = at::empty({nblocks}, out.options().dtype(at::kLong));  // all written by the last block
  const pc::Args args{reinterpret_cast<const pc::Row*>(device_table.data_ptr<int64_t>()), nrows, base, nbytes,
                      static_cast<uint64_t>(word_offset)};
  pack_checksum_kernel<<<static_cast<unsigned int>(grid), kThreads, 0, stream.stream()>>>(
      args, block_bytes, tile_bytes, ntiles, sums, nblocks, finished, digests.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return digests;
}

}  // namespace

TORCH_LIBRARY_IMPL(replica, CUDA, m) {
  m.impl("pack", &pack_cuda);
  m.impl("unpack", &unpack_cuda);
  m.impl("pack_checksum", &pack_checksum_cuda);
}

}  // namespace replica
