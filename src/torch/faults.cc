// MAPP_INJECT_SLOWDOWN and MAPP_INJECT_LINK_DELAY (include/mapp/torch/faults.h),
// as python/megatronapp/resilience/faults.py parses the others.
#include "mapp/torch/faults.h"

#include <algorithm>
#include <atomic>
#include <ctime>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <type_traits>

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

namespace {
// `var`'s comma-separated key=value pairs (empty when unset), each key one of
// `keys`; ValueError naming the variable otherwise.
std::map<std::string, std::string> pairs(const char* var, const std::set<std::string>& keys) {
  const std::string text = tunable_string(var);
  std::map<std::string, std::string> out;
  if (text.empty()) return out;
  std::string names;
  for (const auto& k : keys) names += (names.empty() ? "" : ", ") + k;
  for (std::size_t pos = 0; pos <= text.size();) {
    const std::size_t end = std::min(text.find(',', pos), text.size());
    const std::string part = text.substr(pos, end - pos);
    const std::size_t eq = part.find('=');
    MAPP_CHECK(eq != std::string::npos, var, "='", text,
               "': expected comma-separated key=value pairs with keys ", names);
    const std::string k = part.substr(0, eq);
    MAPP_CHECK(keys.count(k), var, ": unknown key '", k, "' (expected ", names, ")");
    out[k] = part.substr(eq + 1);
    pos = end + 1;
  }
  return out;
}

// A whole-string number (`1`, `0.5`); ValueError naming the variable and key.
template <typename T>
T number(const char* var, const std::string& key, const std::string& v) {
  std::size_t used = 0;
  T out{};
  try {
    if constexpr (std::is_integral_v<T>)
      out = std::stoi(v, &used);
    else
      out = std::stod(v, &used);
  } catch (const std::logic_error&) {
    used = std::string::npos;
  }
  MAPP_CHECK(used == v.size(), var, ": '", v, "' is not a number for ", key);
  return out;
}
}  // namespace

std::optional<Slowdown> injected_slowdown() {
  constexpr const char* kVar = "MAPP_INJECT_SLOWDOWN";
  const auto kv = pairs(kVar, {"factor", "phase", "rank", "start"});
  if (kv.empty()) return std::nullopt;
  MAPP_CHECK(kv.count("rank") && kv.count("factor"), kVar, "='", tunable_string(kVar),
             "': rank and factor are required");
  Slowdown s;
  const std::string& ranks = kv.at("rank");  // "1" or "0+2"
  for (std::size_t at = 0; at <= ranks.size();) {
    const std::size_t plus = std::min(ranks.find('+', at), ranks.size());
    s.ranks.push_back(number<int>(kVar, "rank", ranks.substr(at, plus - at)));
    at = plus + 1;
  }
  s.factor = number<double>(kVar, "factor", kv.at("factor"));
  if (kv.count("start")) s.start = number<int>(kVar, "start", kv.at("start"));
  const std::string phase = kv.count("phase") ? kv.at("phase") : "all";
  MAPP_CHECK(phase == "forward" || phase == "backward" || phase == "all",
             "MAPP_INJECT_SLOWDOWN: phase must be one of forward, backward, all; got '", phase,
             "'");
  MAPP_CHECK(s.factor >= 1.0, "MAPP_INJECT_SLOWDOWN: factor must be >= 1, got ", s.factor);
  s.forward = phase != "backward";
  s.backward = phase != "forward";
  return s;
}

std::optional<LinkDelay> injected_link_delay() {
  constexpr const char* kVar = "MAPP_INJECT_LINK_DELAY";
  const auto kv = pairs(kVar, {"ms", "peer", "rank"});
  if (kv.empty()) return std::nullopt;
  MAPP_CHECK(kv.size() == 3, kVar, "='", tunable_string(kVar), "': rank, peer and ms are required");
  LinkDelay d{number<int>(kVar, "rank", kv.at("rank")), number<int>(kVar, "peer", kv.at("peer")),
              number<double>(kVar, "ms", kv.at("ms"))};
  MAPP_CHECK(d.ms >= 0, "MAPP_INJECT_LINK_DELAY: ms must be >= 0");
  return d;
}

}  // namespace mapp::faults
