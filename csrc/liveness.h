// The liveness datagrams between a role's native beat (heartbeat.cpp) and the
// coordinator's liveness endpoint (liveness.cpp), one format for both sides.
//
// A beat is the signed value replica.jobstore.Heartbeat(member, beat) that the store
// path writes to "<prefix>/hb/<member>" (the same bytes, signed under that key), sent
// as one UDP datagram. The endpoint answers each beat that rose with the signed value
// {"beat","generation","member"} under "<prefix>/hb/<member>/reply": the role learns
// that it is heard and the job's current generation number, so its per-step and
// per-period checks of the generation need no store request while nothing moves.
#pragma once

#include "signing.h"

#include <cctype>
#include <cstdint>
#include <initializer_list>
#include <string>

namespace replica::liveness {

// A datagram larger than this is not a beat or a reply (a signed beat is ~100 bytes).
inline constexpr size_t kMaxDatagram = 512;

inline std::string beat_body(int64_t beat, int64_t member) {
  return "{\"beat\":" + std::to_string(beat) + ",\"member\":" + std::to_string(member) + "}";
}

inline std::string reply_body(int64_t beat, int64_t generation, int64_t member) {
  return "{\"beat\":" + std::to_string(beat) + ",\"generation\":" + std::to_string(generation) +
         ",\"member\":" + std::to_string(member) + "}";
}

inline std::string beat_key(const std::string& prefix, int64_t member) {
  return prefix + "/hb/" + std::to_string(member);
}

inline std::string reply_key(const std::string& beat_key) {
  return beat_key + "/reply";
}

// Reads exactly {"<names[0]>":<int>,"<names[1]>":<int>,...} (the bodies above: sorted
// keys, no spaces, integers of at most 18 digits) into ``out``; false for anything else.
inline bool parse(const std::string& body, std::initializer_list<const char*> names, int64_t* out) {
  size_t at = 0;
  auto take = [&](const std::string& text) {
    if (body.compare(at, text.size(), text) != 0) {
      return false;
    }
    at += text.size();
    return true;
  };
  size_t index = 0;
  for (const char* name : names) {
    if (!take(index == 0 ? "{\"" : ",\"") || !take(name) || !take("\":")) {
      return false;
    }
    const bool negative = at < body.size() && body[at] == '-';
    at += negative ? 1 : 0;
    const size_t first = at;
    int64_t value = 0;
    while (at < body.size() && std::isdigit(static_cast<unsigned char>(body[at])) && at - first < 18) {
      value = value * 10 + (body[at] - '0');
      ++at;
    }
    if (at == first) {
      return false;
    }
    out[index++] = negative ? -value : value;
  }
  return take("}") && at == body.size();
}

}  // namespace replica::liveness
