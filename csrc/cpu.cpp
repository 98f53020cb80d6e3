// CPU kernels: multi-threaded pack/unpack and checksum.
#include "replica.h"

#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace replica {
namespace {

// Below this many bytes per task, thread start-up costs more than it saves.
constexpr int64_t kCopyGrainBytes = 256 << 10;
// 4 MiB per thread at least: waking OpenMP workers costs more than hashing a
// small bucket, badly so when a UCX progress thread is spinning beside them.
constexpr int64_t kChecksumGrainWords = 512 << 10;
constexpr size_t kPrefetchAhead = 4;
constexpr int64_t kPrefetchBytes = 4096;

// Calls that move at least this much use non-temporal stores: the output will
// not be read again soon (it is sent, or it is the model), and bypassing the
// cache saves the read-for-ownership of every destination line. glibc's
// memcpy does the same, but only for single copies of several MiB, never for
// the ~100 KiB segments a bucket is made of.
constexpr int64_t kStreamingBytes = 8 << 20;

void copy_bytes(uint8_t* dst, const uint8_t* src, int64_t n, bool streaming) {
#if defined(__SSE2__)
  if (streaming && n >= 256) {
    const int64_t head = static_cast<int64_t>(-reinterpret_cast<uintptr_t>(dst) & 15);
    std::memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    auto* d = reinterpret_cast<__m128i*>(dst);
    const auto* s = reinterpret_cast<const __m128i*>(src);
    const int64_t lines = n / 64;
    for (int64_t i = 0; i < lines; ++i, d += 4, s += 4) {
      const __m128i a = _mm_loadu_si128(s);
      const __m128i b = _mm_loadu_si128(s + 1);
      const __m128i c = _mm_loadu_si128(s + 2);
      const __m128i e = _mm_loadu_si128(s + 3);
      _mm_stream_si128(d, a);
      _mm_stream_si128(d + 1, b);
      _mm_stream_si128(d + 2, c);
      _mm_stream_si128(d + 3, e);
    }
    std::memcpy(dst + lines * 64, src + lines * 64, n - lines * 64);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

// Splits the concatenation of all segments into equal byte ranges, one per
// thread, so a mix of one huge and many tiny tensors balances as well as one
// large memcpy would.
void copy_segments(const std::vector<Segment>& segments) {
  std::vector<int64_t> starts(segments.size() + 1, 0);
  for (size_t i = 0; i < segments.size(); ++i) {
    starts[i + 1] = starts[i] + segments[i].nbytes;
  }
  const int64_t total = starts.back();
  if (total == 0) {
    return;
  }
  const bool streaming = total >= kStreamingBytes;
  at::parallel_for(0, total, kCopyGrainBytes, [&](int64_t begin, int64_t end) {
    size_t s = std::upper_bound(starts.begin(), starts.end(), begin) -
        starts.begin() - 1;
    int64_t pos = begin;
    while (pos < end) {
      const int64_t lo = pos - starts[s];
      const int64_t hi = std::min(end, starts[s + 1]) - starts[s];
      // Small sources lie scattered over the heap; without a prefetch each
      // one starts with a full memory round trip.
      if (s + kPrefetchAhead < segments.size()) {
        const Segment& next = segments[s + kPrefetchAhead];
        const int64_t lines = std::min<int64_t>(next.nbytes, kPrefetchBytes);
        for (int64_t at = 0; at < lines; at += 64) {
          __builtin_prefetch(next.src + at);
        }
      }
      if (hi > lo) {
        copy_bytes(segments[s].dst + lo, segments[s].src + lo, hi - lo, streaming);
      }
      pos = starts[s] + hi;
      ++s;
    }
#if defined(__SSE2__)
    if (streaming) {
      _mm_sfence();  // make the streamed stores visible before the op returns
    }
#endif
  });
}

void pack_cpu(at::TensorList srcs, const at::Tensor& out, at::IntArrayRef offsets) {
  copy_segments(plan_segments(srcs, out, offsets, Direction::kPack));
}

void unpack_cpu(const at::Tensor& src, at::TensorList dsts, at::IntArrayRef offsets) {
  copy_segments(plan_segments(dsts, src, offsets, Direction::kUnpack));
}

inline uint64_t load_word(const uint8_t* bytes, int64_t nbytes, int64_t word) {
  uint64_t w = 0;
  const int64_t at = word * 8;
  std::memcpy(&w, bytes + at, static_cast<size_t>(std::min<int64_t>(8, nbytes - at)));
  return w;
}

at::Tensor checksum_cpu(const at::Tensor& buf, int64_t block_bytes) {
  const int64_t nblocks = plan_checksum(buf, block_bytes);
  at::Tensor digests = at::empty({nblocks}, buf.options().dtype(at::kLong));
  if (nblocks == 0) {
    return digests;
  }
  const auto* bytes = static_cast<const uint8_t*>(buf.data_ptr());
  const int64_t nbytes = buf.numel() * static_cast<int64_t>(buf.element_size());
  const int64_t nwords = (nbytes + 7) / 8;
  const int64_t words_per_block = block_bytes / 8;
  auto* sums = reinterpret_cast<uint64_t*>(digests.data_ptr<int64_t>());
  std::fill(sums, sums + nblocks, 0);

  at::parallel_for(0, nwords, kChecksumGrainWords, [&](int64_t begin, int64_t end) {
    // The last word may be partial; load it separately so the hot loop does
    // plain 8-byte loads.
    const int64_t full_end = std::min(end, nbytes / 8);
    int64_t w = begin;
    while (w < end) {
      const int64_t block = w / words_per_block;
      const int64_t block_end = std::min(end, (block + 1) * words_per_block);
      uint64_t acc = 0;
      uint64_t key = static_cast<uint64_t>(w + 1) * checksum::kKeyStep;
      const int64_t fast_end = std::min(block_end, full_end);
      // Four independent words per iteration keep both multipliers busy.
      uint64_t acc1 = 0, acc2 = 0, acc3 = 0;
      for (; w + 4 <= fast_end; w += 4) {
        uint64_t word[4];
        std::memcpy(word, bytes + w * 8, 32);
        acc += checksum::mix(word[0] ^ key);
        acc1 += checksum::mix(word[1] ^ (key + checksum::kKeyStep));
        acc2 += checksum::mix(word[2] ^ (key + 2 * checksum::kKeyStep));
        acc3 += checksum::mix(word[3] ^ (key + 3 * checksum::kKeyStep));
        key += 4 * checksum::kKeyStep;
      }
      acc += acc1 + acc2 + acc3;
      for (; w < fast_end; ++w) {
        uint64_t word;
        std::memcpy(&word, bytes + w * 8, 8);
        acc += checksum::mix(word ^ key);
        key += checksum::kKeyStep;
      }
      for (; w < block_end; ++w) {
        acc += checksum::word_term(load_word(bytes, nbytes, w), w);
      }
      __atomic_fetch_add(&sums[block], acc, __ATOMIC_RELAXED);
    }
  });

  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t len = std::min(block_bytes, nbytes - b * block_bytes);
    sums[b] = checksum::finalize(sums[b], static_cast<uint64_t>(len));
  }
  return digests;
}

}  // namespace

TORCH_LIBRARY_IMPL(replica, CPU, m) {
  m.impl("pack", &pack_cpu);
  m.impl("unpack", &unpack_cpu);
  m.impl("checksum", &checksum_cpu);
}

}  // namespace replica
