// Builds of simd_body.inc per instruction set, and the run-time choice.
#include "simd.h"

#include "replica.h"

#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace replica {
namespace simd {

#if defined(__x86_64__)

// One 64-bit lane: SSE2 has no 64-bit multiply, and four scalar chains beat
// two-lane vectors built from 32-bit ones.
namespace portable {
#define REPLICA_LANES 1
#define REPLICA_UNROLL 4
#define REPLICA_STREAM(p, v) _mm_stream_si64(reinterpret_cast<long long*>(p), static_cast<long long>((v)[0]))
#include "simd_body.inc"
#undef REPLICA_STREAM
#undef REPLICA_UNROLL
#undef REPLICA_LANES
}  // namespace portable

#pragma GCC push_options
#pragma GCC target("avx2")
namespace avx2 {
// The low 64 bits of x * c from three instructions' products: x_lo * c_lo
// (vpmuludq) plus the cross terms x_lo * c_hi + x_hi * c_lo, whose low 32 bits
// are all that survive the shift and which one 32-bit multiply (vpmulld, on c
// with its halves swapped) gives side by side. The compiler's generic
// sequence takes three 64-bit products and rebuilds its constants each loop.
inline __m256i mul_const(__m256i x, uint64_t c) {
  const __m256i lo = _mm256_mul_epu32(x, _mm256_set1_epi64x(static_cast<long long>(c)));
  const __m256i cross = _mm256_mullo_epi32(x, _mm256_set1_epi64x(static_cast<long long>((c << 32) | (c >> 32))));
  const __m256i sum = _mm256_add_epi64(cross, _mm256_srli_epi64(cross, 32));
  return _mm256_add_epi64(lo, _mm256_slli_epi64(sum, 32));
}
#define REPLICA_MUL(x, c) ((Vec)mul_const((__m256i)(x), (c)))
#define REPLICA_LANES 4
#define REPLICA_UNROLL 4
#define REPLICA_STREAM(p, v) _mm256_stream_si256(reinterpret_cast<__m256i*>(p), (__m256i)(v))
#include "simd_body.inc"
#undef REPLICA_STREAM
#undef REPLICA_UNROLL
#undef REPLICA_LANES
#undef REPLICA_MUL
}  // namespace avx2
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512dq,avx512bw")
namespace avx512 {
#define REPLICA_MASKED_WINDOW 1
#define REPLICA_LANES 8
#define REPLICA_UNROLL 2
#define REPLICA_STREAM(p, v) _mm512_stream_si512(reinterpret_cast<__m512i*>(p), (__m512i)(v))
#include "simd_body.inc"
#undef REPLICA_STREAM
#undef REPLICA_UNROLL
#undef REPLICA_LANES
#undef REPLICA_MASKED_WINDOW
}  // namespace avx512
#pragma GCC pop_options

namespace {
const Kernels kBuilds[] = {
    {"avx512", &avx512::hash_words, &avx512::copy_and_hash, &avx512::copy_segments_and_hash},
    {"avx2", &avx2::hash_words, &avx2::copy_and_hash, &avx2::copy_segments_and_hash},
    {"portable", &portable::hash_words, &portable::copy_and_hash, &portable::copy_segments_and_hash},
};

bool runs_here(const Kernels& k) {
  __builtin_cpu_init();
  if (std::strcmp(k.name, "avx512") == 0) {
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
        __builtin_cpu_supports("avx512bw");
  }
  if (std::strcmp(k.name, "avx2") == 0) {
    return __builtin_cpu_supports("avx2");
  }
  return true;
}
}  // namespace

#else  // not x86-64: one portable build

namespace portable {
#define REPLICA_LANES 1
#define REPLICA_UNROLL 4
#define REPLICA_STREAM(p, v) store(p, v)
#include "simd_body.inc"
#undef REPLICA_STREAM
#undef REPLICA_UNROLL
#undef REPLICA_LANES
}  // namespace portable

namespace {
const Kernels kBuilds[] = {{"portable", &portable::hash_words, &portable::copy_and_hash, &portable::copy_segments_and_hash}};

bool runs_here(const Kernels&) {
  return true;
}
}  // namespace

#endif

namespace {

const Kernels* find(const std::string& name) {
  for (const Kernels& k : kBuilds) {
    if (name == k.name) {
      return &k;
    }
  }
  return nullptr;
}

const Kernels* best() {
  for (const Kernels& k : kBuilds) {
    if (runs_here(k)) {
      return &k;
    }
  }
  return &kBuilds[std::size(kBuilds) - 1];
}

// REPLICA_SIMD may name a lesser build (to compare, or to avoid AVX-512's clock
// drop on some CPUs); one the CPU cannot run is refused, not ignored.
const Kernels* initial() {
  const char* asked = std::getenv("REPLICA_SIMD");
  if (asked == nullptr || *asked == '\0') {
    return best();
  }
  const Kernels* k = find(asked);
  TORCH_CHECK(k != nullptr, "replica: REPLICA_SIMD=", asked, " names no build (have: avx512, avx2, portable)");
  TORCH_CHECK(runs_here(*k), "replica: REPLICA_SIMD=", asked, " but this CPU cannot run it");
  return k;
}

std::atomic<const Kernels*>& current() {
  static std::atomic<const Kernels*> chosen{initial()};
  return chosen;
}

}  // namespace

const Kernels& active() {
  return *current().load(std::memory_order_relaxed);
}

std::vector<std::string> supported() {
  std::vector<std::string> names;
  for (const Kernels& k : kBuilds) {
    if (runs_here(k)) {
      names.emplace_back(k.name);
    }
  }
  return names;
}

std::string select(const std::string& name) {
  const Kernels* k = find(name);
  TORCH_CHECK(k != nullptr, "replica: no checksum build named '", name, "'");
  TORCH_CHECK(runs_here(*k), "replica: this CPU cannot run the ", name, " build");
  return current().exchange(k)->name;
}

}  // namespace simd
}  // namespace replica
