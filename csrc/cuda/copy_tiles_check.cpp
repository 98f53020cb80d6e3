// Runs the CUDA pack kernel's per-lane code (copy_tiles.cuh) and the CUDA
// pack_checksum kernel's (pack_checksum_chunks.cuh) on the host, lane by lane,
// tile by tile, so its edges are checked on machines without a GPU:
// every misalignment of source and destination, sizes around the vectors,
// steps and tiles, and byte offsets past 2^31 in one segment. Lanes of a warp
// touch disjoint bytes, so running them one after another is what the GPU
// computes. Built and run by tests/test_ops.py when nvcc is installed; prints
// "ok" or what went wrong.
#include "copy_tiles.cuh"
#include "pack_checksum_chunks.cuh"

#include <sys/mman.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

using replica::cuda_copy::CopySegment;
namespace cc = replica::cuda_copy;

namespace {

// What pack.cu does: rows and tile_begin, then every tile of every warp.
void run_kernel(const std::vector<CopySegment>& segments) {
  std::vector<int64_t> tile_begin;
  int64_t ntiles = 0;
  for (const CopySegment& s : segments) {
    tile_begin.push_back(ntiles);
    ntiles += cc::tile_count(s);
  }
  tile_begin.push_back(ntiles);
  const auto n = static_cast<int64_t>(segments.size());
  for (int64_t tile = 0; tile < ntiles; ++tile) {
    const int64_t s = cc::find_segment(tile_begin.data(), n, tile);
    for (int lane = 0; lane < cc::kWarpSize; ++lane) {
      cc::copy_tile(segments[s], tile - tile_begin[s], lane);
    }
  }
}

uint8_t* aligned16(std::vector<uint8_t>& v) {
  return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(v.data()) + 15) & ~uintptr_t{15});
}

bool check_funnel() {
  std::mt19937_64 rng(1);
  for (int r = 1; r < 16; ++r) {
    uint8_t bytes[32];
    for (uint8_t& b : bytes) {
      b = static_cast<uint8_t>(rng());
    }
    ulonglong2 lo, hi;
    std::memcpy(&lo, bytes, 16);
    std::memcpy(&hi, bytes + 16, 16);
    const ulonglong2 got = cc::funnel(lo, hi, r);
    if (std::memcmp(&got, bytes + r, 16) != 0) {
      std::printf("funnel wrong for r = %d\n", r);
      return false;
    }
  }
  return true;
}

// Random segments at every alignment; the destinations' neighbours must stay
// untouched. Source buffers end at the 16-byte boundary after their last byte,
// so a sanitizer build would catch a load past it.
bool check_random() {
  std::mt19937_64 rng(2);
  const int64_t sizes[] = {1, 15, 16, 17, 4095, 4096, 4097, cc::kTileBytes - 1, cc::kTileBytes,
                           cc::kTileBytes + 1, 3 * cc::kTileBytes + 17};
  for (int trial = 0; trial < 200; ++trial) {
    const int count = 1 + static_cast<int>(rng() % 20);
    std::vector<std::vector<uint8_t>> srcs(count), dsts(count);
    std::vector<CopySegment> segments;
    for (int i = 0; i < count; ++i) {
      const int64_t n = rng() % 2 ? sizes[rng() % std::size(sizes)] : 1 + rng() % 100000;
      const int64_t src_shift = rng() % 16;
      const int64_t dst_shift = rng() % 16;
      srcs[i].resize((src_shift + n + 15) / 16 * 16 + 15);
      for (uint8_t& b : srcs[i]) {
        b = static_cast<uint8_t>(rng());
      }
      dsts[i].assign(n + 48, 0xEE);
      segments.push_back({reinterpret_cast<int64_t>(aligned16(srcs[i]) + src_shift),
                          reinterpret_cast<int64_t>(aligned16(dsts[i]) + dst_shift), n});
    }
    run_kernel(segments);
    for (int i = 0; i < count; ++i) {
      const CopySegment& s = segments[i];
      const auto* src = reinterpret_cast<const uint8_t*>(s.src);
      const auto* dst = reinterpret_cast<const uint8_t*>(s.dst);
      if (std::memcmp(src, dst, s.nbytes) != 0) {
        std::printf("trial %d segment %d: %lld bytes from +%lld to +%lld differ\n", trial, i,
                    static_cast<long long>(s.nbytes), static_cast<long long>(s.src % 16),
                    static_cast<long long>(s.dst % 16));
        return false;
      }
      for (size_t b = 0; b < dsts[i].size(); ++b) {
        const uint8_t* p = dsts[i].data() + b;
        if ((p < dst || p >= dst + s.nbytes) && *p != 0xEE) {
          std::printf("trial %d segment %d: wrote outside the destination\n", trial, i);
          return false;
        }
      }
    }
  }
  return true;
}

// One segment of 2 GiB + 4099 bytes in sparse mappings; the first and last
// tiles run, where offsets pass 2^31.
bool check_over_2_gib() {
  const int64_t n = (int64_t{2} << 30) + 4099;
  const size_t map_bytes = static_cast<size_t>(n) + 64;
  for (int shift : {0, 1, 8, 13}) {
    void* a = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    void* b = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (a == MAP_FAILED || b == MAP_FAILED) {
      std::printf("2 GiB case skipped: no address space\n");
      return true;
    }
    uint8_t* src = static_cast<uint8_t*>(a) + shift;
    uint8_t* dst = static_cast<uint8_t*>(b) + 3;
    const CopySegment seg{reinterpret_cast<int64_t>(src), reinterpret_cast<int64_t>(dst), n};
    const int64_t ntiles = cc::tile_count(seg);
    const int64_t edge = 4;  // tiles run at each end
    const int64_t lo = cc::head_bytes(seg) + edge * cc::kTileBytes;
    const int64_t hi = cc::head_bytes(seg) + (ntiles - edge) * cc::kTileBytes;
    for (int64_t i = 0; i < lo; ++i) {
      src[i] = static_cast<uint8_t>(i * 2654435761u >> 7);
    }
    for (int64_t i = hi; i < n; ++i) {
      src[i] = static_cast<uint8_t>(i * 2654435761u >> 13);
    }
    for (int64_t tile = 0; tile < ntiles; tile = tile + 1 == edge ? ntiles - edge : tile + 1) {
      for (int lane = 0; lane < cc::kWarpSize; ++lane) {
        cc::copy_tile(seg, tile, lane);
      }
    }
    const bool same = std::memcmp(src, dst, lo) == 0 && std::memcmp(src + hi, dst + hi, n - hi) == 0;
    const bool past_end_untouched = dst[n] == 0;
    munmap(a, map_bytes);
    munmap(b, map_bytes);
    const bool past_2_gib = cc::head_bytes(seg) + (ntiles - 1) * cc::kTileBytes > (int64_t{1} << 31);
    if (!same || !past_end_untouched || !past_2_gib) {
      std::printf("2 GiB segment, source at +%d: wrong\n", shift);
      return false;
    }
  }
  return true;
}


// pack_checksum as the kernel runs it: every tile of out, every lane of its
// warp one after another (lanes write disjoint bytes and read only sources and
// gap bytes nobody writes), their terms summed per block as the kernel's
// atomics would. Random segments at every source alignment, lengths around
// words, vectors and steps, gaps of every size, an out that ends anywhere,
// blocks that are and are not multiples of a step, any word offset; out's bytes
// and the digests must equal pack then a scalar checksum, and large segments
// must take the whole-step path at both source alignments.
struct HostSums {
  std::vector<uint64_t>& sums;
  int64_t (&whole_steps)[2];  // lane-steps from an aligned source, from a shifted one
  void flush(int64_t block, uint64_t lane_sum) { sums[block] += lane_sum; }
  void add(int64_t block, uint64_t term) { sums[block] += term; }
  void whole_step(const uint8_t* src) { ++whole_steps[reinterpret_cast<uintptr_t>(src) % 16 != 0]; }
};

bool check_pack_checksum() {
  namespace pc = replica::cuda_pack_checksum;
  std::mt19937_64 rng(3);
  int64_t whole_steps[2] = {0, 0};  // aligned source, shifted source
  for (int trial = 0; trial < 400; ++trial) {
    const int count = static_cast<int>(rng() % 12);
    const bool large = trial % 4 == 0;
    std::vector<std::vector<uint8_t>> srcs(count);
    std::vector<pc::Row> rows;
    int64_t end = 0;
    for (int i = 0; i < count; ++i) {
      end = (end + 63) / 64 * 64 + 64 * static_cast<int64_t>(rng() % 3);
      int64_t n = large ? pc::kStepBytes * static_cast<int64_t>(rng() % 10) + static_cast<int64_t>(rng() % 300)
                        : rng() % 3 ? 1 + rng() % 40 : 1 + rng() % 5000;
      if (large && rng() % 2) {  // ending within a few bytes of a step's end
        const int64_t step_end = (end + pc::kStepBytes * static_cast<int64_t>(1 + rng() % 4)) / pc::kStepBytes *
                                 pc::kStepBytes;
        n = step_end - end + static_cast<int64_t>(rng() % 35) - 17;
      }
      if (n <= 0) {
        continue;
      }
      const int64_t shift = rng() % 4 == 0 ? 0 : rng() % 16;
      srcs[i].resize((shift + n + 15) / 16 * 16 + 15);
      for (uint8_t& b : srcs[i]) {
        b = static_cast<uint8_t>(rng());
      }
      rows.push_back({reinterpret_cast<int64_t>(aligned16(srcs[i]) + shift), end, n});
      end += n;
    }
    const int64_t nbytes = end + static_cast<int64_t>(rng() % 100);
    std::vector<uint8_t> storage(nbytes + 32);
    uint8_t* out = aligned16(storage);
    for (int64_t i = 0; i < nbytes; ++i) {
      out[i] = static_cast<uint8_t>(rng());
    }
    std::vector<uint8_t> expected(out, out + nbytes);
    for (const pc::Row& r : rows) {
      std::memcpy(expected.data() + r.dst, reinterpret_cast<const uint8_t*>(r.src), r.nbytes);
    }
    const int64_t block = rng() % 2 ? 8 * (1 + static_cast<int64_t>(rng() % 100))
                                    : pc::kStepBytes * (1 + static_cast<int64_t>(rng() % 3));
    const uint64_t word_offset = rng() % 2 ? rng() : rng() % 1000;
    const int64_t nblocks = (nbytes + block - 1) / block;
    std::vector<uint64_t> want(nblocks, 0), got(nblocks, 0);
    for (int64_t w = 0; w * 8 < nbytes; ++w) {
      uint64_t word = 0;
      std::memcpy(&word, expected.data() + 8 * w, static_cast<size_t>(std::min<int64_t>(8, nbytes - 8 * w)));
      want[8 * w / block] += replica::checksum::word_term(word, word_offset + w);
    }
    const pc::Args args{rows.data(), static_cast<int64_t>(rows.size()), out, nbytes, word_offset};
    HostSums sink{got, whole_steps};
    const int64_t tile_bytes = pc::kStepBytes * (1 + trial / 4 % pc::kMaxTileSteps);
    const int64_t ntiles = (nbytes + tile_bytes - 1) / tile_bytes;
    for (int64_t tile = 0; tile < ntiles; ++tile) {
      for (int lane = 0; lane < cc::kWarpSize; ++lane) {
        pc::pack_checksum_tile(args, block, tile_bytes, tile, lane, sink);
      }
    }
    if (std::memcmp(out, expected.data(), nbytes) != 0 || got != want) {
      std::printf("pack_checksum trial %d (%d rows, %lld bytes, %lld-byte blocks): %s differ\n", trial, count,
                  static_cast<long long>(nbytes), static_cast<long long>(block),
                  got != want ? "digests" : "bytes");
      return false;
    }
    const int64_t mid = nbytes / 2 / 16 * 16;  // a warp's cursor starts mid-buffer
    const int64_t row = pc::first_row_after(args, mid);
    for (int64_t r = 0; r < row; ++r) {
      if (rows[r].dst + rows[r].nbytes > mid) {
        std::printf("pack_checksum trial %d: first_row_after(%lld) skipped row %lld\n", trial,
                    static_cast<long long>(mid), static_cast<long long>(r));
        return false;
      }
    }
  }
  // Tile sizes: every multiprocessor gets its warps, then tiles grow to the most.
  if (pc::tile_steps(21 << 20, 132, 32) != 1 || pc::tile_steps(256 << 20, 132, 32) != pc::kMaxTileSteps ||
      pc::tile_steps(1, 132, 32) != 1 || pc::tile_steps(int64_t{3} * pc::kStepBytes * 132 * 32, 132, 32) != 3) {
    std::printf("pack_checksum: tile_steps wrong\n");
    return false;
  }
  if (whole_steps[0] == 0 || whole_steps[1] == 0) {
    std::printf("pack_checksum: the whole-step path never ran (aligned %lld, shifted %lld)\n",
                static_cast<long long>(whole_steps[0]), static_cast<long long>(whole_steps[1]));
    return false;
  }
  return true;
}

}  // namespace

int main() {
  if (check_funnel() && check_random() && check_over_2_gib() && check_pack_checksum()) {
    std::printf("ok\n");
    return 0;
  }
  return 1;
}
