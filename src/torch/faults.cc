// MAPP_INJECT_SLOWDOWN and MAPP_INJECT_LINK_DELAY (include/mapp/torch/faults.h),
// as python/megatronapp/resilience/faults.py parses the others.
#include "mapp/torch/faults.h"

#include <algorithm>
#include <atomic>
#include <ctime>
#include <stdexcept>
#include <string>

#include "mapp/common/check.h"
#include "mapp/common/tunables.h"

namespace mapp::faults {

std::int64_t thread_time_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

void stall_since(std::int64_t t0, double extra) {
  const std::int64_t now = thread_time_ns();
  const std::int64_t until = now + static_cast<std::int64_t>(extra * static_cast<double>(now - t0));
  while (thread_time_ns() < until) {  // busy: the device is working
  }
}

namespace {
std::atomic<int> current_iteration{0};
}  // namespace

void set_iteration(int it) { current_iteration.store(it, std::memory_order_relaxed); }
int iteration() { return current_iteration.load(std::memory_order_relaxed); }

bool Slowdown::applies_to(int global_rank) const {
  return std::find(ranks.begin(), ranks.end(), global_rank) != ranks.end();
}

std::optional<Slowdown> injected_slowdown() {
  const std::string text = tunable_string("MAPP_INJECT_SLOWDOWN");
  if (text.empty()) return std::nullopt;
  Slowdown s;
  std::string phase = "all";
  bool has_rank = false, has_factor = false;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    const std::size_t end = std::min(text.find(',', pos), text.size());
    const std::string part = text.substr(pos, end - pos);
    const std::size_t eq = part.find('=');
    MAPP_CHECK(eq != std::string::npos, "MAPP_INJECT_SLOWDOWN='", text,
               "': expected comma-separated key=value pairs with keys factor, phase, rank, start");
    const std::string k = part.substr(0, eq), v = part.substr(eq + 1);
    MAPP_CHECK(k == "rank" || k == "factor" || k == "phase" || k == "start",
               "MAPP_INJECT_SLOWDOWN: unknown key '", k, "' (expected factor, phase, rank, start)");
    try {
      if (k == "rank") {  // "1" or "0+2"
        std::size_t at = 0;
        while (at <= v.size()) {
          const std::size_t plus = std::min(v.find('+', at), v.size());
          std::size_t used = 0;
          const std::string one = v.substr(at, plus - at);
          s.ranks.push_back(std::stoi(one, &used));
          MAPP_CHECK(used == one.size(), "MAPP_INJECT_SLOWDOWN: bad value '", v, "' for 'rank'");
          at = plus + 1;
        }
        s.rank = s.ranks.front();
        has_rank = true;
      } else if (k == "start") {
        s.start = std::stoi(v);
      } else if (k == "factor") {
        s.factor = std::stod(v);
        has_factor = true;
      } else {
        phase = v;
      }
    } catch (const std::logic_error&) {
      MAPP_CHECK(false, "MAPP_INJECT_SLOWDOWN: '", v, "' is not a number for ", k);
    }
    pos = end + 1;
  }
  MAPP_CHECK(has_rank && has_factor, "MAPP_INJECT_SLOWDOWN='", text,
             "': rank and factor are required");
  MAPP_CHECK(phase == "forward" || phase == "backward" || phase == "all",
             "MAPP_INJECT_SLOWDOWN: phase must be one of forward, backward, all; got '", phase,
             "'");
  MAPP_CHECK(s.factor >= 1.0, "MAPP_INJECT_SLOWDOWN: factor must be >= 1, got ", s.factor);
  s.forward = phase != "backward";
  s.backward = phase != "forward";
  return s;
}

std::optional<LinkDelay> injected_link_delay() {
  const std::string text = tunable_string("MAPP_INJECT_LINK_DELAY");
  if (text.empty()) return std::nullopt;
  LinkDelay d;
  bool has_rank = false, has_peer = false, has_ms = false;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    const std::size_t end = std::min(text.find(',', pos), text.size());
    const std::string part = text.substr(pos, end - pos);
    const std::size_t eq = part.find('=');
    MAPP_CHECK(eq != std::string::npos, "MAPP_INJECT_LINK_DELAY='", text,
               "': expected comma-separated key=value pairs with keys ms, peer, rank");
    const std::string k = part.substr(0, eq), v = part.substr(eq + 1);
    MAPP_CHECK(k == "rank" || k == "peer" || k == "ms", "MAPP_INJECT_LINK_DELAY: unknown key '", k,
               "' (expected ms, peer, rank)");
    try {
      std::size_t used = 0;
      if (k == "ms") {
        d.ms = std::stod(v, &used);
        has_ms = true;
      } else {
        (k == "rank" ? d.rank : d.peer) = std::stoi(v, &used);
        (k == "rank" ? has_rank : has_peer) = true;
      }
      MAPP_CHECK(used == v.size(), "MAPP_INJECT_LINK_DELAY: bad value '", v, "' for '", k, "'");
    } catch (const std::logic_error&) {
      MAPP_CHECK(false, "MAPP_INJECT_LINK_DELAY: bad value '", v, "' for '", k, "'");
    }
    pos = end + 1;
  }
  MAPP_CHECK(has_rank && has_peer && has_ms, "MAPP_INJECT_LINK_DELAY='", text,
             "': rank, peer and ms are required");
  MAPP_CHECK(d.ms >= 0, "MAPP_INJECT_LINK_DELAY: ms must be >= 0");
  return d;
}

}  // namespace mapp::faults
