// replica._C.Heartbeat: a role's liveness beat on a native thread.
//
// A beat sent from a Python thread needs the GIL for every step (wake up, sign,
// send): on a loaded machine a thread waiting for the GIL behind a main thread
// busy in Python (imports, FSDP's first step) was measured silent for 3.3 s,
// longer than a 2.5 s deadline. This thread beats without the GIL: it writes
// the signed value replica.jobstate.Heartbeat(member, beat) to the job store on
// a connection of its own (a TCPStore's, or an etcd member's HTTP gateway: Sink),
// exactly as JobStore.put would (the JSON body
// with sorted keys, a newline, the hex HMAC-SHA256 of "<full key>\0<body>" under
// the job's derived key), so the coordinator verifies it like any other value.
//
// It beats only while the interpreter shows signs of life: the Python side calls
// touch() from a thread of its own; once no touch came for `python_grace`, the
// beats stop and the role is declared dead at its deadline (a hung interpreter
// is a dead role, a slow one is not).
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cctype>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

namespace py = pybind11;
using Clock = std::chrono::steady_clock;

// --- SHA-256 (FIPS 180-4) and HMAC (RFC 2104) ---

constexpr std::array<uint32_t, 64> kRound = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

using Digest = std::array<uint8_t, 32>;

uint32_t rotr(uint32_t x, int n) {
  return (x >> n) | (x << (32 - n));
}

Digest sha256(const std::string& message) {
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

Digest hmac_sha256(const std::string& key, const std::string& message) {
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

std::string hex(const Digest& digest) {
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (uint8_t byte : digest) {
    out.push_back(kHex[byte >> 4]);
    out.push_back(kHex[byte & 0xf]);
  }
  return out;
}

// --- where a beat goes ---

// A store the beat writes one key of. write() throws on failure; the next beat calls it again.
class Sink {
 public:
  virtual ~Sink() = default;
  virtual void write(const std::string& key, const std::string& value) = 0;
};

// The job's TCPStore, on a connection of its own (made again after a failure).
class TcpStoreSink : public Sink {
 public:
  TcpStoreSink(std::string host, int port, std::chrono::milliseconds timeout)
      : host_(std::move(host)), port_(port), timeout_(timeout) {
    TORCH_CHECK(port_ > 0 && port_ < 65536, "replica.Heartbeat: port ", port_, " is out of range");
  }

  void write(const std::string& key, const std::string& value) override {
    try {
      if (!store_) {
        c10d::TCPStoreOptions options;
        options.port = static_cast<uint16_t>(port_);
        options.isServer = false;
        options.waitWorkers = false;
        options.timeout = timeout_;
        store_ = std::make_unique<c10d::TCPStore>(host_, options);
      }
      store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
    } catch (...) {
      store_.reset();
      throw;
    }
  }

 private:
  const std::string host_;
  const int port_;
  const std::chrono::milliseconds timeout_;
  std::unique_ptr<c10d::TCPStore> store_;
};

std::string base64(const std::string& data) {
  static const char* kAlphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  size_t i = 0;
  for (; i + 2 < data.size(); i += 3) {
    const uint32_t n = (uint32_t(uint8_t(data[i])) << 16) | (uint32_t(uint8_t(data[i + 1])) << 8) | uint8_t(data[i + 2]);
    for (int shift : {18, 12, 6, 0}) {
      out.push_back(kAlphabet[(n >> shift) & 63]);
    }
  }
  if (i < data.size()) {
    uint32_t n = uint32_t(uint8_t(data[i])) << 16;
    if (i + 1 < data.size()) {
      n |= uint32_t(uint8_t(data[i + 1])) << 8;
    }
    out.push_back(kAlphabet[(n >> 18) & 63]);
    out.push_back(kAlphabet[(n >> 12) & 63]);
    out.push_back(i + 1 < data.size() ? kAlphabet[(n >> 6) & 63] : '=');
    out.push_back('=');
  }
  return out;
}

std::string json_string(const std::string& text) {
  std::string out = "\"";
  for (char c : text) {
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(c);
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buffer[8];
      std::snprintf(buffer, sizeof(buffer), "\\u%04x", c);
      out += buffer;
    } else {
      out.push_back(c);
    }
  }
  return out + "\"";
}

// An etcd cluster, through its v3 HTTP/JSON gateway (plain http; https goes through the Python
// beat): one kept-alive connection to one member at a time, the next member after any failure,
// every send and receive under the I/O deadline, authenticated per member (etcd's simple tokens
// are valid only on the member that issued them).
class EtcdSink : public Sink {
 public:
  EtcdSink(std::vector<std::pair<std::string, int>> endpoints, std::string user, std::string password,
           std::chrono::milliseconds timeout)
      : endpoints_(std::move(endpoints)), user_(std::move(user)), password_(std::move(password)), timeout_(timeout) {
    TORCH_CHECK(!endpoints_.empty(), "replica.Heartbeat: no etcd endpoint");
  }

  ~EtcdSink() override {
    disconnect();
  }

  void write(const std::string& key, const std::string& value) override {
    const std::string body = "{\"key\":\"" + base64(key) + "\",\"value\":\"" + base64(value) + "\"}";
    std::string error;
    for (size_t tried = 0; tried < endpoints_.size(); ++tried) {
      try {
        for (int attempt = 0; attempt < 2; ++attempt) {
          if (!user_.empty() && token_.empty()) {
            authenticate();
          }
          const auto [status, reply] = post("/v3/kv/put", body, token_);
          if (status == 200) {
            return;
          }
          if (status == 401 && !user_.empty() && attempt == 0) {
            token_.clear();  // expired, or issued by another member
            continue;
          }
          throw std::runtime_error("etcd answered " + std::to_string(status) + ": " + reply.substr(0, 200));
        }
      } catch (const std::exception& exc) {
        error = endpoint_name() + ": " + exc.what();
        disconnect();
        token_.clear();
        current_ = (current_ + 1) % endpoints_.size();
      }
    }
    throw std::runtime_error("no etcd member took the beat (last: " + error + ")");
  }

 private:
  std::string endpoint_name() const {
    return endpoints_[current_].first + ":" + std::to_string(endpoints_[current_].second);
  }

  void disconnect() {
    if (fd_ >= 0) {
      ::close(fd_);
      fd_ = -1;
    }
  }

  void connect_member() {
    const auto& [host, port] = endpoints_[current_];
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0 || found == nullptr) {
      throw std::runtime_error("cannot resolve " + host);
    }
    std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(found, &::freeaddrinfo);
    const int fd = ::socket(found->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) {
      throw std::runtime_error(std::string("socket: ") + std::strerror(errno));
    }
    timeval tv{};
    tv.tv_sec = static_cast<time_t>(timeout_.count() / 1000);
    tv.tv_usec = static_cast<suseconds_t>((timeout_.count() % 1000) * 1000);
    ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));  // bounds connect() too
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    if (::connect(fd, found->ai_addr, found->ai_addrlen) != 0) {
      const int err = errno;
      ::close(fd);
      throw std::runtime_error(std::string("connect: ") + std::strerror(err));
    }
    fd_ = fd;
  }

  void authenticate() {
    const auto [status, reply] =
        post("/v3/auth/authenticate", "{\"name\":" + json_string(user_) + ",\"password\":" + json_string(password_) + "}",
             "");
    const std::string field = "\"token\":\"";
    const size_t at = reply.find(field);
    if (status != 200 || at == std::string::npos) {
      throw std::runtime_error("etcd refused the beat's user (" + std::to_string(status) + ")");
    }
    const size_t end = reply.find('"', at + field.size());
    token_ = reply.substr(at + field.size(), end - at - field.size());
  }

  std::pair<int, std::string> post(const std::string& path, const std::string& body, const std::string& token) {
    if (fd_ < 0) {
      connect_member();
    }
    std::string request = "POST " + path + " HTTP/1.1\r\nHost: " + endpoint_name() +
        "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) + "\r\n";
    if (!token.empty()) {
      request += "Authorization: " + token + "\r\n";
    }
    request += "\r\n" + body;
    send_all(request);
    // The status line and headers, then Content-Length bytes (or chunks) of body.
    std::string head;
    size_t end;
    while ((end = buffer_.find("\r\n\r\n")) == std::string::npos) {
      receive();
    }
    head = buffer_.substr(0, end);
    buffer_.erase(0, end + 4);
    const size_t space = head.find(' ');
    const int status = space == std::string::npos ? 0 : std::atoi(head.c_str() + space + 1);
    std::string lower = head;
    for (char& c : lower) {
      c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    }
    std::string reply;
    if (lower.find("transfer-encoding: chunked") != std::string::npos) {
      while (true) {
        size_t line;
        while ((line = buffer_.find("\r\n")) == std::string::npos) {
          receive();
        }
        const size_t size = std::stoul(buffer_.substr(0, line), nullptr, 16);
        while (buffer_.size() < line + 2 + size + 2) {
          receive();
        }
        reply += buffer_.substr(line + 2, size);
        buffer_.erase(0, line + 2 + size + 2);
        if (size == 0) {
          break;
        }
      }
    } else {
      const size_t at = lower.find("content-length:");
      const size_t length = at == std::string::npos ? 0 : std::stoul(lower.substr(at + 15));
      while (buffer_.size() < length) {
        receive();
      }
      reply = buffer_.substr(0, length);
      buffer_.erase(0, length);
    }
    if (lower.find("connection: close") != std::string::npos) {
      disconnect();
      buffer_.clear();
    }
    return {status, reply};
  }

  void send_all(const std::string& data) {
    size_t sent = 0;
    while (sent < data.size()) {
      const ssize_t n = ::send(fd_, data.data() + sent, data.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) {
        throw std::runtime_error(std::string("send: ") + (n == 0 ? "closed" : std::strerror(errno)));
      }
      sent += static_cast<size_t>(n);
    }
  }

  void receive() {
    char chunk[4096];
    const ssize_t n = ::recv(fd_, chunk, sizeof(chunk), 0);
    if (n <= 0) {
      buffer_.clear();
      throw std::runtime_error(std::string("recv: ") + (n == 0 ? "the member closed the connection" : std::strerror(errno)));
    }
    buffer_.append(chunk, static_cast<size_t>(n));
  }

  const std::vector<std::pair<std::string, int>> endpoints_;
  const std::string user_;
  const std::string password_;
  const std::chrono::milliseconds timeout_;
  size_t current_ = 0;
  int fd_ = -1;
  std::string token_;
  std::string buffer_;
};

// --- the beat ---

class Heartbeat {
 public:
  // ``key`` is what the value is signed under (the job store's full key); ``store_key`` is where
  // it is written (the same, or with an etcd namespace before it).
  Heartbeat(std::unique_ptr<Sink> sink, std::string key, std::string store_key, std::string mac_key, int64_t member,
            double period_s, double python_grace_s)
      : sink_(std::move(sink)),
        key_(std::move(key)),
        store_key_(std::move(store_key)),
        mac_key_(std::move(mac_key)),
        member_(member),
        period_(to_duration(period_s, "period")),
        python_grace_(to_duration(python_grace_s, "python_grace")),
        touched_(Clock::now().time_since_epoch().count()) {
    TORCH_CHECK(mac_key_.size() == 32, "replica.Heartbeat: the key must be the job's 32-byte derived key");
    thread_ = std::thread([this] { run(); });
  }

  static std::chrono::milliseconds io_timeout(double seconds) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(to_duration(seconds, "io_timeout"));
  }

  ~Heartbeat() {
    stop();
  }

  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  // The interpreter is alive (called from a Python thread every so often).
  void touch() {
    touched_.store(Clock::now().time_since_epoch().count());
  }

  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    if (thread_.joinable()) {
      thread_.join();
    }
  }

  int64_t beats() const {
    return beats_.load();
  }

  // Seconds since the first of the failures in a row (0 while beats get through).
  double failing_for() const {
    const int64_t since = failing_since_.load();
    if (since == 0) {
      return 0.0;
    }
    return std::chrono::duration<double>(Clock::now().time_since_epoch() - Clock::duration(since)).count();
  }

  std::string last_error() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return last_error_;
  }

  bool paused() const {
    return paused_.load();
  }

 private:
  static Clock::duration to_duration(double seconds, const char* name) {
    TORCH_CHECK(seconds > 0, "replica.Heartbeat: ", name, " must be > 0 s, got ", seconds);
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  }

  void run() {
    int64_t beat = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    while (!stopping_) {
      lock.unlock();
      const bool alive = Clock::now() - Clock::time_point(Clock::duration(touched_.load())) < python_grace_;
      paused_.store(!alive);
      if (alive) {
        try {
          const std::string body =
              "{\"beat\":" + std::to_string(beat + 1) + ",\"member\":" + std::to_string(member_) + "}";
          std::string message = key_;
          message.push_back('\0');
          message += body;
          const std::string value = body + "\n" + hex(hmac_sha256(mac_key_, message));
          sink_->write(store_key_, value);
          beats_.store(++beat);
          failing_since_.store(0);
        } catch (const std::exception& exc) {
          int64_t expected = 0;
          failing_since_.compare_exchange_strong(expected, Clock::now().time_since_epoch().count());
          std::lock_guard<std::mutex> guard(mutex_);
          last_error_ = exc.what();
        }
      }
      lock.lock();
      wake_.wait_for(lock, period_, [this] { return stopping_; });
    }
  }

  std::unique_ptr<Sink> sink_;  // used by the beat's thread only
  const std::string key_;
  const std::string store_key_;
  const std::string mac_key_;
  const int64_t member_;
  const Clock::duration period_;
  const Clock::duration python_grace_;
  std::atomic<int64_t> touched_;
  std::atomic<int64_t> beats_{0};
  std::atomic<int64_t> failing_since_{0};
  std::atomic<bool> paused_{false};
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::string last_error_;
  std::thread thread_;
};

}  // namespace

namespace replica {

void bind_heartbeat(py::module& m) {
  py::class_<Heartbeat>(m, "Heartbeat",
                        "A liveness beat written by a native thread (no GIL): see replica.jobstate.JobStore.heartbeat")
      .def(py::init([](std::string host, int port, std::string key, std::string mac_key, int64_t member,
                       double period_s, double io_timeout_s, double python_grace_s) {
             auto sink = std::make_unique<TcpStoreSink>(std::move(host), port, Heartbeat::io_timeout(io_timeout_s));
             std::string store_key = key;
             return std::make_unique<Heartbeat>(std::move(sink), std::move(key), std::move(store_key),
                                                std::move(mac_key), member, period_s, python_grace_s);
           }),
           py::arg("host"), py::arg("port"), py::arg("key"), py::arg("mac_key"), py::arg("member"),
           py::arg("period_s"), py::arg("io_timeout_s"), py::arg("python_grace_s"),
           py::call_guard<py::gil_scoped_release>())
      .def_static(
          "on_etcd",
          [](std::vector<std::pair<std::string, int>> endpoints, std::string user, std::string password,
             std::string key, std::string store_key, std::string mac_key, int64_t member, double period_s,
             double io_timeout_s, double python_grace_s) {
            auto sink = std::make_unique<EtcdSink>(std::move(endpoints), std::move(user), std::move(password),
                                                   Heartbeat::io_timeout(io_timeout_s));
            return std::make_unique<Heartbeat>(std::move(sink), std::move(key), std::move(store_key),
                                               std::move(mac_key), member, period_s, python_grace_s);
          },
          py::arg("endpoints"), py::arg("user"), py::arg("password"), py::arg("key"), py::arg("store_key"),
          py::arg("mac_key"), py::arg("member"), py::arg("period_s"), py::arg("io_timeout_s"),
          py::arg("python_grace_s"), py::call_guard<py::gil_scoped_release>(),
          "The beat written to an etcd cluster through its HTTP gateway (plain http)")
      .def("touch", &Heartbeat::touch)
      .def("stop", &Heartbeat::stop, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("beats", &Heartbeat::beats)
      .def_property_readonly("failing_for", &Heartbeat::failing_for)
      .def_property_readonly("paused", &Heartbeat::paused)
      .def_property_readonly("last_error", &Heartbeat::last_error);
  m.def(
      "hmac_sha256_hex",
      [](const std::string& key, const std::string& message) { return hex(hmac_sha256(key, message)); },
      py::arg("key"), py::arg("message"), "HMAC-SHA256 as the heartbeat computes it (for tests)");
}

}  // namespace replica
