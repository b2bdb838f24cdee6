// Event-driven simulation of a fixed schedule under the executor semantics.
#include <algorithm>
#include <iomanip>
#include <limits>
#include <map>
#include <sstream>
#include <tuple>

#include "internal.h"
#include "mapp/common/check.h"
#include "mapp/pipeline/schedule.h"

namespace mapp::pipeline {

using internal::kInf;

SimResult simulate(const Schedule& sched, const Costs& costs) {
  Schedule s = sched;
  add_communication(s);
  check_valid(s);
  costs.check(s.stages);
  const auto t = internal::Topo::of(s);
  const int p = s.stages;
  // Arrival time of each message, keyed (kind, microbatch, consuming vstage).
  std::map<std::tuple<int, int, int>, double> arrival;
  std::vector<double> link_free(2 * p, 0.0);
  std::vector<std::size_t> pc(p, 0);
  std::vector<double> free(p, 0.0);
  SimResult r;
  r.busy.assign(p, 0.0);
  // Start time of the next action of stage st, or kInf if it waits for a
  // message not yet sent.
  auto next_start = [&](int st) -> double {
    if (pc[st] >= s.actions[st].size()) return kInf;
    const Action& a = s.actions[st][pc[st]];
    const int vs = t.vstage(st, a.chunk);
    double at = free[st];
    if (p > 1 && a.type == ActionType::kForward && vs > 0) {
      auto it = arrival.find({0, a.microbatch, vs});
      if (it == arrival.end()) return kInf;
      at = std::max(at, it->second);
    } else if (p > 1 && (a.type == ActionType::kBackward || a.type == ActionType::kBackwardInput) &&
               vs < t.last()) {
      auto it = arrival.find({1, a.microbatch, vs});
      if (it == arrival.end()) return kInf;
      at = std::max(at, it->second);
    }
    return at;
  };
  const std::size_t total = s.num_actions();
  for (std::size_t step = 0; step < total; ++step) {
    const auto [st, when] = internal::earliest_stage(p, next_start);
    MAPP_CHECK(st >= 0, "simulate: internal error, no stage can progress");
    const Action& a = s.actions[st][pc[st]++];
    const int vs = t.vstage(st, a.chunk);
    double dur = 0;
    switch (a.type) {
      case ActionType::kForward:
        dur = costs.forward[st];
        break;
      case ActionType::kBackward:
        dur = costs.backward_input[st] + costs.backward_weight[st];
        break;
      case ActionType::kBackwardInput:
        dur = costs.backward_input[st];
        break;
      case ActionType::kBackwardWeight:
        dur = costs.backward_weight[st];
        break;
      case ActionType::kSendActivation:
      case ActionType::kSendGrad: {
        const bool fwd = a.type == ActionType::kSendActivation;
        const int slot = t.link_slot(st, a.peer, fwd);
        double& lf = link_free[slot];
        const double start = std::max(when, lf);
        lf = start + costs.p2p[slot / 2];
        arrival[{fwd ? 0 : 1, a.microbatch, fwd ? vs + 1 : vs - 1}] = lf;
        r.timeline.push_back({st, a, start, lf});
        continue;
      }
      default:
        continue;  // receives are posted, never waited on
    }
    free[st] = when + dur;
    r.busy[st] += dur;
    // A hand-off to this stage's other chunk arrives when its producer ends.
    if (a.type == ActionType::kForward && vs < t.last() && t.local(vs)) {
      arrival[{0, a.microbatch, vs + 1}] = free[st];
    } else if ((a.type == ActionType::kBackward || a.type == ActionType::kBackwardInput) &&
               vs > 0 && t.local(vs - 1)) {
      arrival[{1, a.microbatch, vs - 1}] = free[st];
    }
    r.timeline.push_back({st, a, when, when + dur});
  }
  for (int st = 0; st < p; ++st) {
    r.makespan = std::max(r.makespan, free[st]);
    r.peak_activations.push_back(s.peak_activations(st));
  }
  double busy = 0;
  for (double b : r.busy) busy += b;
  r.bubble_fraction = r.makespan > 0 ? 1.0 - busy / (p * r.makespan) : 0.0;
  return r;
}

std::string chrome_trace(const Schedule& s, const SimResult& r) {
  std::ostringstream os;
  os << std::setprecision(12);
  os << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
  bool first = true;
  auto sep = [&] {
    if (!first) os << ",";
    first = false;
  };
  for (int st = 0; st < s.stages; ++st) {
    sep();
    os << "{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":" << st << ",\"args\":{\"name\":\"stage "
       << st << "\"}}";
    const char* threads[] = {"compute", "send activations", "send gradients"};
    for (int tid = 0; tid < 3; ++tid) {
      sep();
      os << "{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":" << st << ",\"tid\":" << tid
         << ",\"args\":{\"name\":\"" << threads[tid] << "\"}}";
    }
  }
  for (const auto& e : r.timeline) {
    const Action& a = e.action;
    const int tid = a.is_compute() ? 0 : (a.type == ActionType::kSendActivation ? 1 : 2);
    sep();
    os << "{\"ph\":\"X\",\"pid\":" << e.stage << ",\"tid\":" << tid << ",\"name\":\""
       << type_name(a.type) << a.microbatch;
    if (s.chunks > 1) os << "." << a.chunk;
    os << "\",\"cat\":\"" << (a.is_compute() ? "compute" : "p2p") << "\",\"ts\":" << e.start * 1e6
       << ",\"dur\":" << (e.end - e.start) * 1e6 << ",\"args\":{\"microbatch\":" << a.microbatch
       << ",\"chunk\":" << a.chunk;
    if (!a.is_compute()) os << ",\"peer\":" << a.peer;
    os << "}}";
  }
  os << "]}";
  return os.str();
}

}  // namespace mapp::pipeline
