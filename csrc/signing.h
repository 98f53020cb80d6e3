// SHA-256 (FIPS 180-4), HMAC (RFC 2104) and the job store's signed values, for the
// native threads that sign or verify without the GIL (heartbeat.cpp, liveness.cpp).
//
// A signed value is what replica.jobstore.JobStore.put writes: the JSON body, a
// newline, and the hex HMAC-SHA256 of "<full key>\0<body>" under the job's derived
// key. tests/test_heartbeat.py checks both languages agree.
#pragma once

#include <array>
#include <cstdint>
#include <string>

namespace replica::signing {

// --- SHA-256 (FIPS 180-4) and HMAC (RFC 2104) ---

inline constexpr std::array<uint32_t, 64> kRound = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

using Digest = std::array<uint8_t, 32>;

inline uint32_t rotr(uint32_t x, int n) {
  return (x >> n) | (x << (32 - n));
}

inline Digest sha256(const std::string& message) {
  std::array<uint32_t, 8> h = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                               0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
  std::string data = message;
  const uint64_t bits = static_cast<uint64_t>(message.size()) * 8;
  data.push_back(static_cast<char>(0x80));
  while (data.size() % 64 != 56) {
    data.push_back('\0');
  }
  for (int i = 7; i >= 0; --i) {
    data.push_back(static_cast<char>((bits >> (8 * i)) & 0xff));
  }
  for (size_t block = 0; block < data.size(); block += 64) {
    std::array<uint32_t, 64> w{};
    for (int t = 0; t < 16; ++t) {
      const auto* p = reinterpret_cast<const uint8_t*>(data.data() + block + 4 * t);
      w[t] = (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
    }
    for (int t = 16; t < 64; ++t) {
      const uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
      const uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
      w[t] = w[t - 16] + s0 + w[t - 7] + s1;
    }
    auto [a, b, c, d, e, f, g, k] = h;
    for (int t = 0; t < 64; ++t) {
      const uint32_t t1 = k + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + kRound[t] + w[t];
      const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
      k = g;
      g = f;
      f = e;
      e = d + t1;
      d = c;
      c = b;
      b = a;
      a = t1 + t2;
    }
    const std::array<uint32_t, 8> add = {a, b, c, d, e, f, g, k};
    for (int i = 0; i < 8; ++i) {
      h[i] += add[i];
    }
  }
  Digest out{};
  for (int i = 0; i < 8; ++i) {
    for (int j = 0; j < 4; ++j) {
      out[4 * i + j] = static_cast<uint8_t>(h[i] >> (24 - 8 * j));
    }
  }
  return out;
}

inline Digest hmac_sha256(const std::string& key, const std::string& message) {
  std::string block = key.size() > 64 ? [&] {
    const Digest d = sha256(key);
    return std::string(d.begin(), d.end());
  }()
                                      : key;
  block.resize(64, '\0');
  std::string inner(64, '\0');
  std::string outer(64, '\0');
  for (int i = 0; i < 64; ++i) {
    inner[i] = static_cast<char>(block[i] ^ 0x36);
    outer[i] = static_cast<char>(block[i] ^ 0x5c);
  }
  const Digest first = sha256(inner + message);
  return sha256(outer + std::string(first.begin(), first.end()));
}

inline std::string hex(const Digest& digest) {
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (uint8_t byte : digest) {
    out.push_back(kHex[byte >> 4]);
    out.push_back(kHex[byte & 0xf]);
  }
  return out;
}

// ``body`` signed under ``key`` (a full job-store key): what the store holds.
inline std::string sign(const std::string& mac_key, const std::string& key, const std::string& body) {
  std::string message = key;
  message.push_back('\0');
  message += body;
  return body + "\n" + hex(hmac_sha256(mac_key, message));
}

// The body of ``value`` when it is signed under ``key``; false for anything else. The
// comparison takes the same time wherever the digests differ.
inline bool verify(const std::string& mac_key, const std::string& key, const std::string& value, std::string* body) {
  const size_t cut = value.rfind('\n');
  if (cut == std::string::npos || value.size() - cut - 1 != 64) {
    return false;
  }
  const std::string expected = sign(mac_key, key, value.substr(0, cut));  // as long as value: same body, 64 hex
  unsigned char differ = 0;
  for (size_t i = 0; i < value.size(); ++i) {
    differ |= static_cast<unsigned char>(expected[i] ^ value[i]);
  }
  if (differ != 0) {
    return false;
  }
  *body = value.substr(0, cut);
  return true;
}

}  // namespace replica::signing
