// replica._C.LivenessServer: the coordinator's liveness endpoint.
//
// Every role beats every 100 ms. Written to the job store, 2,048 roles are 20,480
// signed writes a second (each one a Raft write on etcd, which carried ~1,100 a second
// on a 2-core machine), and the coordinator's read of all of them was a core at 1,024
// ranks (bench/control_scale.py). Here the beats come as UDP datagrams to one socket
// of the coordinator's: a native thread (no GIL) verifies each (the same signed value
// the store path writes), keeps each member's newest beat and when it rose on this
// machine's steady clock, and answers it with the job's generation number (liveness.h).
// The coordinator reads the table in memory (ages), with no request at all.
//
// A beat counts only when its number rose (a replayed or duplicated datagram moves
// nothing and gets no answer); anything unsigned, forged or malformed is counted in
// ``rejected`` and dropped. Only verified beats are answered, once each.
#include "liveness.h"

// pybind11 and c10's checks only, not torch/extension.h: the whole of torch's API is
// most of a translation unit's compile time (26 s against 6 s), and ops.cpp alone needs it.
#include <c10/util/Exception.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <netdb.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace {

namespace py = pybind11;
namespace signing = replica::signing;
namespace liveness = replica::liveness;
using Clock = std::chrono::steady_clock;

class LivenessServer {
 public:
  LivenessServer(const std::string& host, int port, std::string prefix, std::string mac_key)
      : prefix_(std::move(prefix)), mac_key_(std::move(mac_key)) {
    TORCH_CHECK(mac_key_.size() == 32, "replica.LivenessServer: the key must be the job's 32-byte derived key");
    TORCH_CHECK(port >= 0 && port < 65536, "replica.LivenessServer: port ", port, " is out of range");
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_DGRAM;
    hints.ai_flags = AI_PASSIVE;
    addrinfo* found = nullptr;
    const int rc = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
    TORCH_CHECK(rc == 0 && found != nullptr, "replica.LivenessServer: cannot resolve ", host, ": ", gai_strerror(rc));
    std::string error;
    for (addrinfo* a = found; a != nullptr && fd_ < 0; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol);
      if (fd >= 0 && ::bind(fd, a->ai_addr, a->ai_addrlen) == 0) {
        fd_ = fd;
        break;
      }
      error = std::strerror(errno);
      if (fd >= 0) {
        ::close(fd);
      }
    }
    ::freeaddrinfo(found);
    TORCH_CHECK(fd_ >= 0, "replica.LivenessServer: cannot bind UDP ", host, ":", port, ": ", error);
    // Room for a burst: 2,048 roles beating in the same millisecond fit.
    const int buffer = 4 << 20;
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVBUF, &buffer, sizeof(buffer));
    sockaddr_storage bound{};
    socklen_t length = sizeof(bound);
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&bound), &length);
    port_ = ntohs(bound.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&bound)->sin6_port
                                              : reinterpret_cast<sockaddr_in*>(&bound)->sin_port);
    wake_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    TORCH_CHECK(wake_ >= 0, "replica.LivenessServer: eventfd: ", std::strerror(errno));
    thread_ = std::thread([this] { run(); });
  }

  ~LivenessServer() {
    stop();
    ::close(fd_);
    ::close(wake_);
  }

  LivenessServer(const LivenessServer&) = delete;
  LivenessServer& operator=(const LivenessServer&) = delete;

  int port() const {
    return port_;
  }

  void stop() {
    if (!stopping_.exchange(true)) {
      const uint64_t one = 1;
      [[maybe_unused]] const ssize_t n = ::write(wake_, &one, sizeof(one));
    }
    if (thread_.joinable()) {
      thread_.join();
    }
  }

  // The generation number every answer carries from now on (never lowered).
  void set_generation(int64_t generation) {
    int64_t held = generation_.load();
    while (generation > held && !generation_.compare_exchange_weak(held, generation)) {
    }
  }

  int64_t generation() const {
    return generation_.load();
  }

  // Seconds since each member's beat last rose (-1: never heard here).
  std::vector<double> ages(const std::vector<int64_t>& members) const {
    const auto now = Clock::now();
    std::vector<double> out;
    out.reserve(members.size());
    std::lock_guard<std::mutex> lock(mutex_);
    for (int64_t m : members) {
      const auto it = table_.find(m);
      out.push_back(it == table_.end() ? -1.0 : std::chrono::duration<double>(now - it->second.at).count());
    }
    return out;
  }

  // Each member's newest beat number heard here (0: none).
  std::vector<int64_t> beats(const std::vector<int64_t>& members) const {
    std::vector<int64_t> out;
    out.reserve(members.size());
    std::lock_guard<std::mutex> lock(mutex_);
    for (int64_t m : members) {
      const auto it = table_.find(m);
      out.push_back(it == table_.end() ? 0 : it->second.beat);
    }
    return out;
  }

  void forget(int64_t member) {
    std::lock_guard<std::mutex> lock(mutex_);
    table_.erase(member);
  }

  int64_t received() const {
    return received_.load();
  }

  int64_t rejected() const {
    return rejected_.load();
  }

 private:
  struct Entry {
    int64_t beat = 0;
    Clock::time_point at;
  };

  void run() {
    pollfd fds[2] = {{fd_, POLLIN, 0}, {wake_, POLLIN, 0}};
    char data[liveness::kMaxDatagram + 1];
    while (!stopping_.load()) {
      if (::poll(fds, 2, -1) < 0 && errno != EINTR) {
        return;  // cannot happen with valid descriptors; the coordinator then sees no beats and says so
      }
      for (int drained = 0; drained < 4096 && !stopping_.load(); ++drained) {
        sockaddr_storage from{};
        socklen_t length = sizeof(from);
        const ssize_t n = ::recvfrom(fd_, data, sizeof(data), 0, reinterpret_cast<sockaddr*>(&from), &length);
        if (n < 0) {
          break;  // EAGAIN: drained
        }
        received_.fetch_add(1);
        if (!handle(std::string(data, static_cast<size_t>(n)), from, length)) {
          rejected_.fetch_add(1);
        }
      }
    }
  }

  // True for a verified beat (answered when it rose).
  bool handle(const std::string& value, const sockaddr_storage& from, socklen_t length) {
    if (value.size() > liveness::kMaxDatagram) {
      return false;
    }
    // The member comes from the unverified body first, to name the key it must be signed under.
    const size_t cut = value.rfind('\n');
    int64_t fields[2] = {0, 0};  // beat, member
    if (cut == std::string::npos || !liveness::parse(value.substr(0, cut), {"beat", "member"}, fields)) {
      return false;
    }
    const std::string key = liveness::beat_key(prefix_, fields[1]);
    std::string body;
    if (!signing::verify(mac_key_, key, value, &body)) {
      return false;
    }
    const int64_t beat = fields[0];
    const int64_t member = fields[1];
    {
      std::lock_guard<std::mutex> lock(mutex_);
      Entry& entry = table_[member];
      if (beat <= entry.beat) {
        return true;  // a duplicate or a replay: verified, but it moves nothing and is not answered
      }
      entry.beat = beat;
      entry.at = Clock::now();
    }
    const std::string reply =
        signing::sign(mac_key_, liveness::reply_key(key), liveness::reply_body(beat, generation_.load(), member));
    // A lost answer is the next beat's to carry: never wait for the socket here.
    ::sendto(fd_, reply.data(), reply.size(), MSG_DONTWAIT, reinterpret_cast<const sockaddr*>(&from), length);
    return true;
  }

  const std::string prefix_;
  const std::string mac_key_;
  int fd_ = -1;
  int wake_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::atomic<int64_t> generation_{-1};
  std::atomic<int64_t> received_{0};
  std::atomic<int64_t> rejected_{0};
  mutable std::mutex mutex_;
  std::unordered_map<int64_t, Entry> table_;
  std::thread thread_;
};

}  // namespace

namespace replica {

void bind_liveness(py::module& m) {
  py::class_<LivenessServer>(m, "LivenessServer",
                             "The coordinator's UDP liveness endpoint (a native thread): see "
                             "replica.jobstore.JobStore.liveness_server")
      .def(py::init<const std::string&, int, std::string, std::string>(), py::arg("host"), py::arg("port"),
           py::arg("prefix"), py::arg("mac_key"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("port", &LivenessServer::port)
      .def("stop", &LivenessServer::stop, py::call_guard<py::gil_scoped_release>())
      .def("set_generation", &LivenessServer::set_generation, py::arg("generation"))
      .def_property_readonly("generation", &LivenessServer::generation)
      .def("ages", &LivenessServer::ages, py::arg("members"), py::call_guard<py::gil_scoped_release>())
      .def("beats", &LivenessServer::beats, py::arg("members"), py::call_guard<py::gil_scoped_release>())
      .def("forget", &LivenessServer::forget, py::arg("member"))
      .def_property_readonly("received", &LivenessServer::received)
      .def_property_readonly("rejected", &LivenessServer::rejected);
}

}  // namespace replica
