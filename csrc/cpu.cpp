// CPU kernels: multi-threaded pack/unpack, checksum, and pack fused with checksum.
#include "replica.h"
#include "simd.h"

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
// 16 MiB per thread at least: waking OpenMP workers costs more than hashing a
// small bucket, badly so when a UCX progress thread is spinning beside them,
// and a receiver hashing one piece of a bucket (transport.base.PIECE_BYTES)
// while the next arrives must leave the other cores to the transport.
constexpr int64_t kChecksumGrainWords = 2 << 20;
// checksum_cpu_threads: 2 MiB per thread at least (~0.1 ms of hashing, well
// above what waking a thread costs).
constexpr int64_t kChecksumThreadMinWords = 256 << 10;
// pack_checksum hashes gaps shorter than this (alignment padding: < 64 bytes)
// inline, word by word.
constexpr int64_t kShortGapBytes = 256;
// ... and streams the stores of segments of at least this many bytes only.
constexpr int64_t kStreamSegmentBytes = 256 << 10;

// Calls that move at least this much use non-temporal stores: the output will
// not be read again soon (it is sent, or it is the model), and bypassing the
// cache saves the read-for-ownership of every destination line. glibc's
// memcpy does the same, but only for single copies of several MiB, never for
// the ~100 KiB segments a bucket is made of. From 2 MiB (above a core's L2):
// the mirror benchmark's 5.2 MiB snapshot, packed with digests into the buffer
// written two steps ago, took 0.36-0.40 ms streamed against 0.46-0.53 ms with
// 8 MiB as the bound (four runs each, 2026-11-27), the stream after it no slower.
constexpr int64_t kStreamingBytes = 2 << 20;

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

// `nbytes` rounded up to whole checksum windows (simd::kWindowBytes).
inline int64_t window_bytes(int64_t nbytes) {
  return (nbytes + simd::kWindowBytes - 1) / simd::kWindowBytes * simd::kWindowBytes;
}

// simd::prefetch_source of the segment kPrefetchSegmentsAhead on; called on reaching segment s.
inline void prefetch_ahead(const std::vector<Segment>& segments, size_t s) {
  const size_t next = s + simd::kPrefetchSegmentsAhead;
  if (next < segments.size()) {
    simd::prefetch_source(segments[next].src, segments[next].nbytes);
  }
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
      prefetch_ahead(segments, s);
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
  if (at + 8 <= nbytes) {
    std::memcpy(&w, bytes + at, 8);
    return w;
  }
  std::memcpy(&w, bytes + at, static_cast<size_t>(std::min<int64_t>(8, nbytes - at)));
  return w;
}

// Per-block sums of word terms, added by many threads, then finalized in place.
class BlockSums {
 public:
  BlockSums(at::Tensor& digests, int64_t block_bytes)
      : sums_(reinterpret_cast<uint64_t*>(digests.data_ptr<int64_t>())),
        nblocks_(digests.numel()),
        block_bytes_(block_bytes) {
    std::fill(sums_, sums_ + nblocks_, 0);
  }

  void add(int64_t block, uint64_t sum) {
    __atomic_fetch_add(&sums_[block], sum, __ATOMIC_RELAXED);
  }

  void finalize(int64_t nbytes) {
    for (int64_t b = 0; b < nblocks_; ++b) {
      const int64_t len = std::min(block_bytes_, nbytes - b * block_bytes_);
      sums_[b] = checksum::finalize(sums_[b], static_cast<uint64_t>(len));
    }
  }

 private:
  uint64_t* sums_;
  int64_t nblocks_;
  int64_t block_bytes_;
};

// Sum of the word terms of bytes [lo, hi) of `bytes` (nbytes long); lo is a
// multiple of 8, hi is one or nbytes, whose last word is zero-padded.
uint64_t hash_range(const uint8_t* bytes, int64_t nbytes, int64_t lo, int64_t hi, uint64_t word_offset) {
  const int64_t whole = (hi - lo) / 8;
  uint64_t sum = simd::active().hash_words(bytes + lo, whole, word_offset + lo / 8);
  if (lo + whole * 8 < hi) {
    const int64_t word = lo / 8 + whole;
    sum += checksum::word_term(load_word(bytes, nbytes, word), word_offset + word);
  }
  return sum;
}

// The digests of buf, its words' ranges handed out by for_ranges(nwords, body).
template <typename ForRanges>
at::Tensor checksum_with(const at::Tensor& buf, int64_t block_bytes, int64_t word_offset, ForRanges for_ranges) {
  const int64_t nblocks = plan_checksum(buf, block_bytes, word_offset);
  at::Tensor digests = at::empty({nblocks}, buf.options().dtype(at::kLong));
  if (nblocks == 0) {
    return digests;
  }
  const auto* bytes = static_cast<const uint8_t*>(buf.data_ptr());
  const int64_t nbytes = buf.numel() * static_cast<int64_t>(buf.element_size());
  const int64_t nwords = (nbytes + 7) / 8;
  const int64_t words_per_block = block_bytes / 8;
  BlockSums sums(digests, block_bytes);
  for_ranges(nwords, [&](int64_t begin, int64_t end) {
    for (int64_t w = begin; w < end;) {
      const int64_t block = w / words_per_block;
      const int64_t block_end = std::min(end, (block + 1) * words_per_block);
      sums.add(block, hash_range(bytes, nbytes, w * 8, std::min(block_end * 8, nbytes), word_offset));
      w = block_end;
    }
  });
  sums.finalize(nbytes);
  return digests;
}

at::Tensor checksum_cpu(const at::Tensor& buf, int64_t block_bytes, int64_t word_offset) {
  return checksum_with(buf, block_bytes, word_offset, [](int64_t nwords, const auto& body) {
    at::parallel_for(0, nwords, kChecksumGrainWords, body);
  });
}

// pack, and the checksum of `out` after it, in one pass: every byte of out is
// hashed where it is in a register anyway -- as it is copied from its source,
// or (alignment gaps, and whatever out holds past the sources: bytes pack does
// not write) read from out. Threads take equal ranges of out's words, so
// sources and gaps balance as in copy_segments. A segment's last word, when
// its length is not a multiple of 8, is half source and half gap; it is
// copied first and then hashed from out. No other segment shares that word:
// each starts on a 64-byte boundary of out.
at::Tensor pack_checksum_cpu(
    at::TensorList srcs, const at::Tensor& out, at::IntArrayRef offsets, int64_t block_bytes,
    int64_t word_offset) {
  std::vector<Segment> segments = plan_segments(srcs, out, offsets, Direction::kPack);
  const int64_t nblocks = plan_checksum(out, block_bytes, word_offset);
  at::Tensor digests = at::empty({nblocks}, out.options().dtype(at::kLong));
  if (nblocks == 0) {
    return digests;
  }
  segments.erase(std::remove_if(segments.begin(), segments.end(), [](const Segment& s) { return s.nbytes == 0; }),
                 segments.end());
  std::sort(segments.begin(), segments.end(), [](const Segment& a, const Segment& b) { return a.dst < b.dst; });
  auto* base = static_cast<uint8_t*>(out.data_ptr());
  const int64_t nbytes = out.numel();
  std::vector<int64_t> starts(segments.size());  // offsets in out
  int64_t copied = 0;
  for (size_t i = 0; i < segments.size(); ++i) {
    starts[i] = segments[i].dst - base;
    copied += segments[i].nbytes;
  }
  const bool streaming = copied >= kStreamingBytes;
  const int64_t nwords = (nbytes + 7) / 8;
  BlockSums sums(digests, block_bytes);
  const simd::Kernels& kernels = simd::active();
  at::parallel_for(0, nwords, kCopyGrainBytes / 8, [&](int64_t begin, int64_t end) {
    int64_t pos = begin * 8;
    const int64_t stop = std::min(end * 8, nbytes);
    // The first segment that ends after pos.
    size_t s = std::upper_bound(starts.begin(), starts.end(), pos) - starts.begin();
    if (s > 0 && starts[s - 1] + segments[s - 1].nbytes > pos) {
      --s;
    }
    while (pos < stop) {
      const int64_t block = pos / block_bytes;
      const int64_t block_end = std::min(stop, (block + 1) * block_bytes);
      uint64_t acc = 0;
      while (pos < block_end) {
        const int64_t seg_lo = s < segments.size() ? starts[s] : nbytes;
        if (pos < seg_lo) {  // a gap: hashed as out holds it
          const int64_t hi = std::min(seg_lo, block_end);
          if (hi - pos < kShortGapBytes) {  // alignment padding: cheaper word by word than a call
            for (; pos < hi; pos += 8) {
              acc += checksum::word_term(load_word(base, nbytes, pos / 8), word_offset + pos / 8);
            }
          } else {
            acc += hash_range(base, nbytes, pos, hi, word_offset);
          }
          pos = std::min(hi, nbytes);
          continue;
        }
        const Segment& seg = segments[s];
        const int64_t seg_hi = seg_lo + seg.nbytes;
        const int64_t whole_end = seg_lo + seg.nbytes / 8 * 8;
        const bool stream_segment = streaming && seg.nbytes >= kStreamSegmentBytes;
        // A run of segments that each lie whole in this block with the alignment gap
        // after them, up to the next window boundary, where the next one starts: one
        // call, not vectors, then words, then the gap word by word, per segment.
        size_t run = s;
        int64_t run_end = pos;
        while (pos == seg_lo && run < segments.size() && run_end == starts[run]) {
          const int64_t window_end = starts[run] + window_bytes(segments[run].nbytes);
          const int64_t next = run + 1 < segments.size() ? starts[run + 1] : nbytes;
          if ((streaming && segments[run].nbytes >= kStreamSegmentBytes) || window_end > block_end ||
              window_end > next) {
            break;
          }
          run_end = window_end;
          ++run;
        }
        if (run > s) {
          // Its whole windows are streamed in a large call: each segment's partial last
          // window (read back from out with the gap after it) is a line of its own.
          acc += kernels.copy_segments_and_hash(&segments[s], static_cast<int64_t>(run - s), base, word_offset,
                                                streaming);
          pos = run_end;
          s = run;
          continue;
        }
        if (pos == seg_lo) {  // (a run's kernel fetches ahead itself)
          prefetch_ahead(segments, s);
        }
        if (pos < whole_end) {
          const int64_t hi = std::min(whole_end, block_end);
          // Streamed only when large: the segment's last word and the gap after
          // it are read back from out, and a load from a line with streamed
          // stores still in flight waits for them to reach memory.
          acc += kernels.copy_and_hash(base + pos, seg.src + (pos - seg_lo), (hi - pos) / 8, word_offset + pos / 8,
                                       stream_segment);
          pos = hi;
        } else {  // the segment's last, partial word
          std::memcpy(base + pos, seg.src + (pos - seg_lo), seg_hi - pos);
          acc += checksum::word_term(load_word(base, nbytes, pos / 8), word_offset + pos / 8);
          pos = std::min(pos + 8, nbytes);
        }
        if (pos >= seg_hi) {
          ++s;
        }
      }
      sums.add(block, acc);
    }
#if defined(__SSE2__)
    if (streaming) {
      _mm_sfence();
    }
#endif
  });
  sums.finalize(nbytes);
  return digests;
}

}  // namespace

at::Tensor checksum_cpu_threads(const at::Tensor& buf, int64_t block_bytes, int64_t word_offset, int64_t threads) {
  TORCH_CHECK(threads >= 1, "replica: threads must be >= 1, got ", threads);
  TORCH_CHECK(buf.device().is_cpu(), "replica: checksum threads are for CPU buffers, got one on ", buf.device());
  return checksum_with(buf, block_bytes, word_offset, [threads](int64_t nwords, const auto& body) {
    const int64_t chunks = std::clamp<int64_t>((nwords + kChecksumThreadMinWords - 1) / kChecksumThreadMinWords, 1,
                                               threads);
    if (chunks == 1) {
      body(0, nwords);
      return;
    }
    const int64_t per_chunk = (nwords + chunks - 1) / chunks;
#pragma omp parallel for num_threads(static_cast<int>(chunks)) schedule(static, 1)
    for (int64_t c = 0; c < chunks; ++c) {
      body(c * per_chunk, std::min(nwords, (c + 1) * per_chunk));
    }
  });
}

TORCH_LIBRARY_IMPL(replica, CPU, m) {
  m.impl("pack", &pack_cpu);
  m.impl("unpack", &unpack_cpu);
  m.impl("checksum", &checksum_cpu);
  m.impl("pack_checksum", &pack_checksum_cpu);
}

}  // namespace replica
