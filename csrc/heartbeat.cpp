// replica._C.NativeHeartbeatSender: a role's liveness beats sent from a native thread.
//
// A beat sent from a Python thread needs the GIL for every step (wake up, sign,
// send): on a loaded machine a thread waiting for the GIL behind a main thread
// busy in Python (imports, FSDP's first step) was measured silent for 3.3 s,
// longer than a 2.5 s deadline. This thread beats without the GIL: it writes
// the signed value replica.jobstore.Heartbeat(member, beat) to the job store on
// a connection of its own (a TCPStore's, or an etcd member's HTTP gateway: Sink),
// exactly as JobStore.put would (the JSON body
// with sorted keys, a newline, the hex HMAC-SHA256 of "<full key>\0<body>" under
// the job's derived key), so the coordinator verifies it like any other value.
//
// It beats only while the interpreter shows signs of life: the Python side calls
// touch() from a thread of its own; once no touch came for `python_grace`, the
// beats stop and the role is declared dead at its deadline (a hung interpreter
// is a dead role, a slow one is not).
#include "liveness.h"
#include "signing.h"

// pybind11 and c10's checks only, not torch/extension.h: the whole of torch's API is
// most of a translation unit's compile time (26 s against 6 s), and ops.cpp alone needs it.
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <linux/futex.h>
#include <pthread.h>
#include <signal.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
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
#include <climits>
#include <new>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <memory>
#include <limits>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace {

namespace py = pybind11;
using Clock = std::chrono::steady_clock;
namespace signing = replica::signing;
namespace liveness = replica::liveness;
using replica::signing::hex;
using replica::signing::hmac_sha256;

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
    TORCH_CHECK(port_ > 0 && port_ < 65536, "replica.NativeHeartbeatSender: port ", port_, " is out of range");
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
// are valid only on the member that issued them). It starts with the tokens the role's own store
// holds (kept valid by that store's use) and authenticates only where one is refused or missing.
class EtcdSink : public Sink {
 public:
  EtcdSink(std::vector<std::pair<std::string, int>> endpoints, std::string user, std::string password,
           std::chrono::milliseconds timeout, std::vector<std::string> tokens = {}, size_t first = 0)
      : endpoints_(std::move(endpoints)),
        user_(std::move(user)),
        password_(std::move(password)),
        timeout_(timeout),
        tokens_(std::move(tokens)) {
    TORCH_CHECK(!endpoints_.empty(), "replica.NativeHeartbeatSender: no etcd endpoint");
    TORCH_CHECK(tokens_.empty() || tokens_.size() == endpoints_.size(),
                "replica.NativeHeartbeatSender: one token per etcd endpoint ('' for none), got ", tokens_.size(),
                " for ", endpoints_.size());
    tokens_.resize(endpoints_.size());
    current_ = first % endpoints_.size();
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
          if (!user_.empty() && tokens_[current_].empty()) {
            authenticate();
          }
          const auto [status, reply] = post("/v3/kv/put", body, tokens_[current_]);
          if (status == 200) {
            return;
          }
          if (status == 401 && !user_.empty() && attempt == 0) {
            tokens_[current_].clear();  // expired, or issued by another member
            continue;
          }
          throw std::runtime_error("etcd answered " + std::to_string(status) + ": " + reply.substr(0, 200));
        }
      } catch (const std::exception& exc) {
        error = endpoint_name() + ": " + exc.what();
        disconnect();
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
    tokens_[current_] = reply.substr(at + field.size(), end - at - field.size());
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
  std::vector<std::string> tokens_;  // per endpoint ('' : none yet)
  size_t current_ = 0;
  int fd_ = -1;
  std::string buffer_;
};

// --- the sender's memory: what a fork of this process neither copies nor holds back ---
//
// While the kernel copies a process's page tables for fork() it holds the process's memory map
// and write-protects its private pages (to share them copy-on-write): a thread of the process
// that faults meanwhile waits for the whole copy: 100 ms a fork of a 4 GiB process, 340 ms at
// 12 GiB (bench/fork_silence.py), and a loader's workers fork at every epoch. Signing a beat
// allocates, so a beat thread that signs faults at its first beat in a fork. So a beat is made
// by two threads:
// * the sender wakes every period and sends the next datagram, signed ahead of time, with one
//   send(2). It does not fault: its stack, its thread descriptor, its counters and the signed
//   datagrams live in one mapping that is populated, locked where the limit allows, and marked
//   MADV_WIPEONFORK (a fork neither copies nor write-protects it); it allocates nothing, takes
//   no lock and blocks every signal (a handler would write the interpreter's memory). Beyond
//   that mapping it only reads memory that is present (the beat's settings, the last touch).
// * the control thread (run()) signs the beats to come into the ring, reads the endpoint's
//   answers, changes the socket over (aim) and writes the store while the endpoint does not
//   answer. It may wait out a fork: the ring holds kRing periods of beats.

constexpr int64_t kRing = 64;
constexpr size_t kSenderStack = size_t{1} << 20;  // glibc puts the thread's descriptor and static TLS in it

struct Slot {
  std::atomic<int64_t> beat{0};  // which beat the bytes are (0: none yet)
  uint32_t length = 0;
  char data[liveness::kMaxDatagram];
};

struct Outbox {
  std::atomic<uint32_t> stopping{0};  // a futex word: stop() wakes the sender's sleep
  std::atomic<int> fd{-1};            // the endpoint's socket (-1: none; the store takes the beats)
  std::atomic<int64_t> beat{0};       // the last beat made: sent, or left for the store
  std::atomic<int64_t> sent{0};       // the last beat whose datagram went out
  std::atomic<int64_t> loops{0};      // the sender's periods so far
  std::atomic<int> send_errno{0};     // the last datagram's error (0: it went out)
  std::atomic<int64_t> unsigned_beats{0};  // beats due with no signed datagram ready (the signer late)
  std::atomic<bool> paused{false};
  Slot slots[kRing];
};

// One anonymous mapping for the sender, populated at once; fork_proof() when a fork leaves it alone.
class SenderMemory {
 public:
  SenderMemory() {
    const size_t page = static_cast<size_t>(::sysconf(_SC_PAGESIZE));
    outbox_bytes_ = (sizeof(Outbox) + page - 1) / page * page;
    size_ = outbox_bytes_ + kSenderStack;
    void* at = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    TORCH_CHECK(at != MAP_FAILED, "replica.NativeHeartbeatSender: mmap of the sender's memory: ", std::strerror(errno));
    base_ = static_cast<char*>(at);
    fork_proof_ = ::madvise(base_, size_, MADV_WIPEONFORK) == 0;  // Linux >= 4.14
    locked_ = ::mlock(base_, size_) == 0;  // RLIMIT_MEMLOCK may refuse: then only swapping could page it out
    outbox_ = new (base_) Outbox();
  }
  ~SenderMemory() {
    outbox_->~Outbox();
    ::munmap(base_, size_);
  }
  SenderMemory(const SenderMemory&) = delete;
  SenderMemory& operator=(const SenderMemory&) = delete;

  Outbox& outbox() const { return *outbox_; }
  char* stack() const { return base_ + outbox_bytes_; }
  size_t stack_size() const { return kSenderStack; }
  bool fork_proof() const { return fork_proof_; }
  bool locked() const { return locked_; }

 private:
  char* base_ = nullptr;
  size_t size_ = 0;
  size_t outbox_bytes_ = 0;
  bool fork_proof_ = false;
  bool locked_ = false;
  Outbox* outbox_ = nullptr;
};

// --- the beat ---

class NativeHeartbeatSender {
 public:
  // ``key`` is what the value is signed under (the job store's full key); ``store_key`` is where
  // it is written (the same, or with an etcd namespace before it).
  NativeHeartbeatSender(std::unique_ptr<Sink> sink, std::string key, std::string store_key, std::string mac_key,
                        int64_t member, double period_s, double python_grace_s, double store_after_s,
                        const std::string& liveness_host = "", int liveness_port = 0, double store_period_s = 0.0)
      : sink_(std::move(sink)),
        key_(std::move(key)),
        store_key_(std::move(store_key)),
        mac_key_(std::move(mac_key)),
        member_(member),
        period_(to_duration(period_s, "period")),
        python_grace_(to_duration(python_grace_s, "python_grace")),
        store_after_(to_duration(store_after_s, "store_after")),
        store_period_(store_period_s == 0.0 ? period_ : to_duration(store_period_s, "store_period")),
        touched_(Clock::now().time_since_epoch().count()) {
    TORCH_CHECK(mac_key_.size() == 32, "replica.NativeHeartbeatSender: the key must be the job's 32-byte derived key");
    wake_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    TORCH_CHECK(wake_ >= 0, "replica.NativeHeartbeatSender: eventfd: ", std::strerror(errno));
    if (liveness_port != 0) {  // aimed from the first beat: the store sees none while it is answered
      aimed_ = resolve(liveness_host, liveness_port);
      aim_changed_ = true;
      change_over();
    }
    refill();
    start_sender();
    thread_ = std::thread([this] { run(); });
  }

  static std::chrono::milliseconds io_timeout(double seconds) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(to_duration(seconds, "io_timeout"));
  }

  ~NativeHeartbeatSender() {
    stop();
    ::close(wake_);
  }

  NativeHeartbeatSender(const NativeHeartbeatSender&) = delete;
  NativeHeartbeatSender& operator=(const NativeHeartbeatSender&) = delete;

  // The interpreter is alive (called from a Python thread every so often).
  void touch() {
    touched_.store(Clock::now().time_since_epoch().count());
  }

  void stop() {
    Outbox& out = memory_.outbox();
    if (sender_started_) {
      out.stopping.store(1, std::memory_order_release);
      ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&out.stopping), FUTEX_WAKE | FUTEX_PRIVATE_FLAG, INT_MAX,
                nullptr, nullptr, 0);
      ::pthread_join(sender_, nullptr);
      sender_started_ = false;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    signal();
    if (thread_.joinable()) {
      thread_.join();
    }
    for (const auto& [fd, loops] : retired_) {
      ::close(fd);
    }
    retired_.clear();
    if (udp_ >= 0) {
      ::close(udp_);
      udp_ = -1;
      out.fd.store(-1);
    }
  }

  // Beat to the coordinator's liveness endpoint at host:port (UDP) from now on; the store
  // only while no answer came for ``store_after`` (an endpoint out of reach: a firewall, a
  // coordinator that moved). Resolved here; the control thread changes over at once.
  void aim(const std::string& host, int port) {
    const Target target = resolve(host, port);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      aimed_ = target;
      aim_changed_ = true;
    }
    signal();
  }

  // The newest beat that went out: as a datagram, or written to the store.
  int64_t beats() const {
    return std::max(memory_.outbox().sent.load(), stored_.load());
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
    return memory_.outbox().paused.load();
  }

  // Whether a fork of this process leaves the sender alone (MADV_WIPEONFORK took).
  bool fork_proof() const {
    return memory_.fork_proof();
  }

  // Beats that were due when no signed datagram was ready (the control thread held up that long).
  int64_t unsigned_beats() const {
    return memory_.outbox().unsigned_beats.load();
  }

  // The newest generation number a verified answer of the endpoint carried (-1: none yet).
  int64_t generation() const {
    return generation_.load();
  }

  // Seconds since the last verified answer (infinity: none yet).
  double reply_age() const {
    const int64_t at = replied_at_.load();
    if (at == 0) {
      return std::numeric_limits<double>::infinity();
    }
    return std::chrono::duration<double>(Clock::now().time_since_epoch() - Clock::duration(at)).count();
  }

  int64_t replies() const {
    return replies_.load();
  }

 private:
  struct Target {
    sockaddr_storage address{};
    socklen_t length = 0;
  };

  static Target resolve(const std::string& host, int port) {
    TORCH_CHECK(port > 0 && port < 65536, "replica.NativeHeartbeatSender: port ", port, " is out of range");
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_DGRAM;
    addrinfo* found = nullptr;
    const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
    TORCH_CHECK(rc == 0 && found != nullptr, "replica.NativeHeartbeatSender: cannot resolve ", host, ": ",
                gai_strerror(rc));
    Target target;
    std::memcpy(&target.address, found->ai_addr, found->ai_addrlen);
    target.length = found->ai_addrlen;
    ::freeaddrinfo(found);
    return target;
  }

  static Clock::duration to_duration(double seconds, const char* name) {
    TORCH_CHECK(seconds > 0, "replica.NativeHeartbeatSender: ", name, " must be > 0 s, got ", seconds);
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  }

  void signal() {
    const uint64_t one = 1;
    [[maybe_unused]] const ssize_t n = ::write(wake_, &one, sizeof(one));
  }

  bool alive() const {
    return Clock::now() - Clock::time_point(Clock::duration(touched_.load())) < python_grace_;
  }

  // --- the sender's thread: nothing below allocates, locks, or writes outside memory_ ---

  void start_sender() {
    pthread_attr_t attr;
    ::pthread_attr_init(&attr);
    int rc = ::pthread_attr_setstack(&attr, memory_.stack(), memory_.stack_size());
    sigset_t all, old;
    ::sigfillset(&all);
    ::pthread_sigmask(SIG_SETMASK, &all, &old);  // the new thread starts with every signal blocked
    if (rc == 0) {
      rc = ::pthread_create(&sender_, &attr, &NativeHeartbeatSender::sender_main, this);
    }
    ::pthread_sigmask(SIG_SETMASK, &old, nullptr);
    ::pthread_attr_destroy(&attr);
    TORCH_CHECK(rc == 0, "replica.NativeHeartbeatSender: cannot start the sender thread: ", std::strerror(rc));
    sender_started_ = true;
  }

  static void* sender_main(void* self) {
    static_cast<NativeHeartbeatSender*>(self)->send_beats();
    return nullptr;
  }

  void send_beats() noexcept {
    Outbox& out = memory_.outbox();
    const int64_t period_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(period_).count();
    timespec next{};
    ::clock_gettime(CLOCK_MONOTONIC, &next);
    while (out.stopping.load(std::memory_order_acquire) == 0) {
      const bool live = alive();
      out.paused.store(!live);
      if (live) {
        beat_once(out);
      }
      out.loops.fetch_add(1);
      // The next period, woken early by stop(); one that passed meanwhile is not made up for.
      timespec now{};
      ::clock_gettime(CLOCK_MONOTONIC, &now);
      const int64_t now_ns = now.tv_sec * 1'000'000'000 + now.tv_nsec;
      int64_t next_ns = next.tv_sec * 1'000'000'000 + next.tv_nsec + period_ns;
      next_ns = std::max(next_ns, now_ns);
      next.tv_sec = next_ns / 1'000'000'000;
      next.tv_nsec = next_ns % 1'000'000'000;
      // FUTEX_WAIT_BITSET: an absolute CLOCK_MONOTONIC deadline
      ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&out.stopping), FUTEX_WAIT_BITSET | FUTEX_PRIVATE_FLAG, 0,
                &next, nullptr, FUTEX_BITSET_MATCH_ANY);
    }
  }

  static void beat_once(Outbox& out) {
    const int64_t beat = out.beat.load() + 1;
    const int fd = out.fd.load();
    if (fd < 0) {
      out.beat.store(beat);  // no endpoint: the control thread writes it to the store
      return;
    }
    const Slot& slot = out.slots[beat % kRing];
    if (slot.beat.load(std::memory_order_acquire) != beat) {
      out.unsigned_beats.fetch_add(1);
      return;
    }
    const ssize_t n = ::send(fd, slot.data, slot.length, MSG_DONTWAIT);
    out.send_errno.store(n >= 0 ? 0 : errno);
    if (n >= 0) {
      out.sent.store(beat);
    }
    out.beat.store(beat);
  }

  // --- the control thread ---

  // Sign the beats to come: every one up to kRing past the last one made.
  void refill() {
    Outbox& out = memory_.outbox();
    const int64_t made = out.beat.load();
    while (signed_upto_ < made + kRing) {
      const int64_t beat = std::max(signed_upto_, made) + 1;
      const std::string value = signing::sign(mac_key_, key_, liveness::beat_body(beat, member_));
      TORCH_CHECK(value.size() <= liveness::kMaxDatagram, "replica.NativeHeartbeatSender: a signed beat of ",
                  value.size(), " bytes");
      Slot& slot = out.slots[beat % kRing];
      std::memcpy(slot.data, value.data(), value.size());
      slot.length = static_cast<uint32_t>(value.size());
      slot.beat.store(beat, std::memory_order_release);
      signed_upto_ = beat;
    }
  }

  // A socket connected to the newest target; the sender takes it at its next beat, and the old
  // one is closed once the sender has gone round twice since (it may be sending on it).
  void change_over() {
    std::optional<Target> target;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!aim_changed_) {
        return;
      }
      aim_changed_ = false;
      target = aimed_;
    }
    const int fd = ::socket(target->address.ss_family, SOCK_DGRAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0 || ::connect(fd, reinterpret_cast<const sockaddr*>(&target->address), target->length) != 0) {
      const std::string error = std::string("liveness endpoint: ") + std::strerror(errno);
      if (fd >= 0) {
        ::close(fd);
      }
      std::lock_guard<std::mutex> guard(mutex_);
      last_error_ = error;
      return;
    }
    Outbox& out = memory_.outbox();
    const int old = out.fd.exchange(fd);
    if (old >= 0) {
      retired_.emplace_back(old, out.loops.load());
    }
    udp_ = fd;
    aimed_at_ = Clock::now();
  }

  void close_retired() {
    const int64_t loops = memory_.outbox().loops.load();
    // C++17: torch 2.11 builds extensions with -std=c++17 (no std::erase_if).
    retired_.erase(std::remove_if(retired_.begin(), retired_.end(),
                                  [loops](const std::pair<int, int64_t>& fd) {
                                    if (loops < fd.second + 2) {
                                      return false;
                                    }
                                    ::close(fd.first);
                                    return true;
                                  }),
                   retired_.end());
  }

  // Whether the store should take the beats too: not aimed, or no answer for store_after.
  bool to_store() const {
    if (udp_ < 0) {
      return true;
    }
    const int64_t at = replied_at_.load();
    const Clock::time_point last = at == 0 ? aimed_at_ : std::max(aimed_at_, Clock::time_point(Clock::duration(at)));
    return Clock::now() - last > store_after_;
  }

  void read_replies() {
    char data[liveness::kMaxDatagram + 1];
    for (;;) {
      const ssize_t n = ::recv(udp_, data, sizeof(data), 0);
      if (n < 0) {
        return;  // EAGAIN, or ECONNREFUSED from an endpoint not listening: the store path covers it
      }
      std::string body;
      int64_t fields[3];  // beat, generation, member
      if (static_cast<size_t>(n) > liveness::kMaxDatagram ||
          !signing::verify(mac_key_, liveness::reply_key(key_), std::string(data, static_cast<size_t>(n)), &body) ||
          !liveness::parse(body, {"beat", "generation", "member"}, fields) || fields[2] != member_) {
        continue;
      }
      int64_t held = generation_.load();
      while (fields[1] > held && !generation_.compare_exchange_weak(held, fields[1])) {
      }
      replied_at_.store(Clock::now().time_since_epoch().count());
      replies_.fetch_add(1);
    }
  }

  void failed(const std::string& error) {
    int64_t expected = 0;
    failing_since_.compare_exchange_strong(expected, Clock::now().time_since_epoch().count());
    std::lock_guard<std::mutex> guard(mutex_);
    last_error_ = error;
  }

  // Once a period: the sender's datagrams are the beat while the endpoint answers. Otherwise the
  // store takes the newest beat made, once a store_period while aimed (a coordinator's death
  // sent every role's beats to the store at once: 2,048 roles at 10 a second are 20,000 writes a
  // second, more than a 3-member etcd takes, and its successor found the store too slow to read
  // them), every beat when not aimed.
  void check() {
    if (!to_store()) {
      const int error = memory_.outbox().send_errno.load();
      if (error == 0) {
        failing_since_.store(0);
      } else {
        failed(std::string("liveness endpoint: ") + std::strerror(error));
      }
      return;
    }
    const int64_t beat = memory_.outbox().beat.load();
    if (beat <= stored_.load() || (udp_ >= 0 && Clock::now() < store_next_)) {
      return;
    }
    try {
      sink_->write(store_key_, signing::sign(mac_key_, key_, liveness::beat_body(beat, member_)));
      stored_.store(beat);
      store_next_ = Clock::now() + store_period_;
      failing_since_.store(0);
    } catch (const std::exception& exc) {
      failed(exc.what());
    }
  }

  void run() {
    auto next = Clock::now();
    for (;;) {
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (stopping_) {
          break;
        }
      }
      change_over();
      close_retired();
      refill();
      if (Clock::now() >= next) {
        next = Clock::now() + period_;
        if (alive()) {
          check();
        }
      }
      // Wait for the next period, reading answers meanwhile; stop() and aim() wake it.
      pollfd fds[2] = {{wake_, POLLIN, 0}, {udp_, POLLIN, 0}};
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(next - Clock::now()).count();
      ::poll(fds, udp_ >= 0 ? 2 : 1, static_cast<int>(std::max<int64_t>(left, 0)) + 1);
      if (fds[0].revents & POLLIN) {
        uint64_t count = 0;
        [[maybe_unused]] const ssize_t n = ::read(wake_, &count, sizeof(count));
      }
      if (udp_ >= 0) {
        read_replies();
      }
    }
  }

  std::unique_ptr<Sink> sink_;  // used by the control thread only
  const std::string key_;
  const std::string store_key_;
  const std::string mac_key_;
  const int64_t member_;
  const Clock::duration period_;
  const Clock::duration python_grace_;
  const Clock::duration store_after_;
  const Clock::duration store_period_;
  std::atomic<int64_t> touched_;
  std::atomic<int64_t> failing_since_{0};
  std::atomic<int64_t> generation_{-1};
  std::atomic<int64_t> replied_at_{0};
  std::atomic<int64_t> replies_{0};
  SenderMemory memory_;
  pthread_t sender_{};
  bool sender_started_ = false;
  mutable std::mutex mutex_;
  bool stopping_ = false;
  bool aim_changed_ = false;
  std::optional<Target> aimed_;
  std::string last_error_;
  int wake_ = -1;
  int udp_ = -1;                  // the control thread's: the newest socket (the sender's too)
  std::vector<std::pair<int, int64_t>> retired_;  // sockets replaced, with the sender's loops then
  int64_t signed_upto_ = 0;       // the control thread's: the newest beat signed into the ring
  std::atomic<int64_t> stored_{0};  // the newest beat the store took (written by the control thread)
  Clock::time_point aimed_at_;    // the control thread's
  Clock::time_point store_next_;  // the control thread's: the store's next fallback beat, not before
  std::thread thread_;
};

}  // namespace

namespace replica {

void bind_heartbeat(py::module& m) {
  py::class_<NativeHeartbeatSender>(
      m, "NativeHeartbeatSender",
      "A role's liveness beats sent by a native thread (no GIL): see replica.jobstore.JobStore.heartbeat_sender")
      .def(py::init([](std::string host, int port, std::string key, std::string mac_key, int64_t member,
                       double period_s, double io_timeout_s, double python_grace_s, double store_after_s,
                       std::string liveness_host, int liveness_port, double store_period_s) {
             auto sink = std::make_unique<TcpStoreSink>(std::move(host), port,
                                                        NativeHeartbeatSender::io_timeout(io_timeout_s));
             std::string store_key = key;
             return std::make_unique<NativeHeartbeatSender>(std::move(sink), std::move(key), std::move(store_key),
                                                            std::move(mac_key), member, period_s, python_grace_s,
                                                            store_after_s, liveness_host, liveness_port,
                                                            store_period_s);
           }),
           py::arg("host"), py::arg("port"), py::arg("key"), py::arg("mac_key"), py::arg("member"),
           py::arg("period_s"), py::arg("io_timeout_s"), py::arg("python_grace_s"), py::arg("store_after_s") = 1.0,
           py::arg("liveness_host") = "", py::arg("liveness_port") = 0, py::arg("store_period_s") = 0.0,
           py::call_guard<py::gil_scoped_release>())
      .def_static(
          "on_etcd",
          [](std::vector<std::pair<std::string, int>> endpoints, std::string user, std::string password,
             std::string key, std::string store_key, std::string mac_key, int64_t member, double period_s,
             double io_timeout_s, double python_grace_s, double store_after_s, std::string liveness_host,
             int liveness_port, double store_period_s, std::vector<std::string> tokens, size_t first) {
            auto sink = std::make_unique<EtcdSink>(std::move(endpoints), std::move(user), std::move(password),
                                                   NativeHeartbeatSender::io_timeout(io_timeout_s), std::move(tokens),
                                                   first);
            return std::make_unique<NativeHeartbeatSender>(std::move(sink), std::move(key), std::move(store_key),
                                                           std::move(mac_key), member, period_s, python_grace_s,
                                                           store_after_s, liveness_host, liveness_port,
                                                           store_period_s);
          },
          py::arg("endpoints"), py::arg("user"), py::arg("password"), py::arg("key"), py::arg("store_key"),
          py::arg("mac_key"), py::arg("member"), py::arg("period_s"), py::arg("io_timeout_s"),
          py::arg("python_grace_s"), py::arg("store_after_s") = 1.0, py::arg("liveness_host") = "",
          py::arg("liveness_port") = 0, py::arg("store_period_s") = 0.0,
          py::arg("tokens") = std::vector<std::string>{}, py::arg("first") = 0, py::call_guard<py::gil_scoped_release>(),
          "The beat written to an etcd cluster through its HTTP gateway (plain http)")
      .def("touch", &NativeHeartbeatSender::touch)
      .def("stop", &NativeHeartbeatSender::stop, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("beats", &NativeHeartbeatSender::beats)
      .def_property_readonly("failing_for", &NativeHeartbeatSender::failing_for)
      .def_property_readonly("paused", &NativeHeartbeatSender::paused)
      .def_property_readonly("fork_proof", &NativeHeartbeatSender::fork_proof,
                             "Whether a fork of this process leaves the beat's sender alone (MADV_WIPEONFORK)")
      .def_property_readonly("unsigned_beats", &NativeHeartbeatSender::unsigned_beats)
      .def_property_readonly("last_error", &NativeHeartbeatSender::last_error)
      .def("aim", &NativeHeartbeatSender::aim, py::arg("host"), py::arg("port"),
           py::call_guard<py::gil_scoped_release>(),
           "Beat to the coordinator's liveness endpoint (UDP) from now on; the store only while it does not answer")
      .def_property_readonly("generation", &NativeHeartbeatSender::generation)
      .def_property_readonly("reply_age", &NativeHeartbeatSender::reply_age)
      .def_property_readonly("replies", &NativeHeartbeatSender::replies);
  m.def(
      "hmac_sha256_hex",
      [](const std::string& key, const std::string& message) { return hex(hmac_sha256(key, message)); },
      py::arg("key"), py::arg("message"), "HMAC-SHA256 as the heartbeat computes it (for tests)");
  m.def(
      "sign_value",
      [](const std::string& mac_key, const std::string& key, const std::string& body) {
        return py::bytes(signing::sign(mac_key, key, body));
      },
      py::arg("mac_key"), py::arg("key"), py::arg("body"),
      "``body`` signed under the full store key ``key`` as the native threads sign (for tests: "
      "JobStore.sign must give the same bytes)");
  m.def(
      "verify_value",
      [](const std::string& mac_key, const std::string& key, const std::string& value) -> py::object {
        std::string body;
        if (!signing::verify(mac_key, key, value, &body)) {
          return py::none();
        }
        return py::bytes(body);
      },
      py::arg("mac_key"), py::arg("key"), py::arg("value"),
      "The body of ``value`` when it is signed under ``key``, else None, as the native threads verify (for tests)");
}

}  // namespace replica
