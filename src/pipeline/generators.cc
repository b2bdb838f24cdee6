// Schedule generators: small pure functions from (p, m, v) to per-stage orders,
// and the dynamic planner (an event-driven list scheduler over a time model).
#include <algorithm>
#include <deque>
#include <limits>
#include <map>
#include <tuple>

#include "internal.h"
#include "mapp/common/check.h"
#include "mapp/pipeline/schedule.h"

namespace mapp::pipeline {

using internal::Topo;

namespace {
Action F(int mb, int c = 0) { return {ActionType::kForward, mb, c, -1}; }
Action B(int mb, int c = 0) { return {ActionType::kBackward, mb, c, -1}; }
using internal::kInf;
}  // namespace

Schedule gpipe(int p, int m) {
  internal::check_shape(p, m, 1, "gpipe");
  Schedule s = internal::empty("gpipe", p, m, 1);
  for (int st = 0; st < p; ++st) {
    for (int mb = 0; mb < m; ++mb) s.actions[st].push_back(F(mb));
    for (int mb = 0; mb < m; ++mb) s.actions[st].push_back(B(mb));
  }
  add_communication(s);
  return s;
}

Schedule one_f_one_b(int p, int m) {
  internal::check_shape(p, m, 1, "1f1b");
  Schedule s = internal::empty("1f1b", p, m, 1);
  for (int st = 0; st < p; ++st) {
    auto& out = s.actions[st];
    const int warmup = std::min(p - st - 1, m);
    for (int mb = 0; mb < warmup; ++mb) out.push_back(F(mb));
    for (int i = 0; i < m - warmup; ++i) {
      out.push_back(F(warmup + i));
      out.push_back(B(i));
    }
    for (int mb = m - warmup; mb < m; ++mb) out.push_back(B(mb));
  }
  add_communication(s);
  return s;
}

Schedule interleaved(int p, int m, int v) {
  internal::check_shape(p, m, v, "interleaved");
  MAPP_CHECK(m % p == 0, "interleaved: the number of microbatches (", m,
             ") must be a multiple of the pipeline size (", p,
             "): microbatches go through the chunks in groups of p; use a multiple of ", p,
             " or another schedule");
  Schedule s = internal::empty(v == 1 ? "1f1b" : "interleaved", p, m, v);
  const int total = m * v;
  // Megatron's order: the k-th forward of a stage is microbatch
  // (k / (p v)) p + k % p of chunk (k % (p v)) / p; backwards mirror the chunks.
  auto mb_of = [&](int k) { return (k / (p * v)) * p + k % p; };
  auto chunk_of = [&](int k, bool forward) {
    const int c = (k % (p * v)) / p;
    return forward ? c : v - 1 - c;
  };
  for (int st = 0; st < p; ++st) {
    auto& out = s.actions[st];
    const int warmup = std::min(internal::one_f_one_b_peak(p, m, v, st) - 1, total);
    const int steady = total - warmup;
    for (int k = 0; k < warmup; ++k) out.push_back(F(mb_of(k), chunk_of(k, true)));
    for (int k = 0; k < steady; ++k) {
      out.push_back(F(mb_of(warmup + k), chunk_of(warmup + k, true)));
      out.push_back(B(mb_of(k), chunk_of(k, false)));
    }
    for (int k = steady; k < total; ++k) out.push_back(B(mb_of(k), chunk_of(k, false)));
  }
  add_communication(s);
  return s;
}

// ---- time model ----------------------------------------------------------------------

Costs Costs::uniform(int p, double f, double bi, double bw, double p2p) {
  Costs c;
  c.forward.assign(p, f);
  c.backward_input.assign(p, bi);
  c.backward_weight.assign(p, bw);
  c.p2p.assign(p, p2p);
  return c;
}

void Costs::check(int p) const {
  auto one = [&](const std::vector<double>& x, const char* name) {
    MAPP_CHECK(static_cast<int>(x.size()) == p, "pipeline costs: '", name, "' has ", x.size(),
               " entries, expected one per stage (", p, ")");
    for (double t : x) {
      MAPP_CHECK(t >= 0 && t < kInf, "pipeline costs: '", name, "' must be finite and >= 0, got ",
                 t);
    }
  };
  one(forward, "forward");
  one(backward_input, "backward_input");
  one(backward_weight, "backward_weight");
  one(p2p, "p2p");
}

// ---- dynamic planner -------------------------------------------------------------------

Policy parse_policy(const std::string& name) {
  if (name == "dfc") return Policy::kDepthFirst;
  if (name == "bfc") return Policy::kBreadthFirst;
  if (name == "auto") return Policy::kAuto;
  if (name == "adaptive") return Policy::kAdaptive;
  MAPP_CHECK(false, "unknown dynamic pipeline policy '", name,
             "' (expected dfc, bfc, auto or adaptive)");
  return Policy::kAuto;
}

const char* policy_name(Policy p) {
  switch (p) {
    case Policy::kDepthFirst:
      return "dfc";
    case Policy::kBreadthFirst:
      return "bfc";
    case Policy::kAuto:
      return "auto";
    case Policy::kAdaptive:
      return "adaptive";
  }
  return "?";
}

namespace {

// Limits of one planning run, per stage, in activation units (one microbatch
// through one chunk). memory: live activations (from F to the end of B or W);
// window: forwards whose input-gradient backward has not run yet.
// lag: weight gradients a stage keeps in reserve before they take priority over
// forwards (ZB-H1 keeps s on stage s, to fill the drain).
struct Caps {
  std::vector<int> memory, window, lag;
};

// One list-scheduling run. backward_first: prefer ready backwards over
// forwards (depth-first). A microbatch enters a stage (its first-chunk F) only
// when the memory cap has room for all v of its chunks, so it can always
// finish its forwards and the plan never deadlocks on memory.
Schedule plan(const std::string& name, int p, int m, int v, bool backward_first, const Caps& caps,
              const Costs& costs, Placement placement = Placement::kLoop,
              double* makespan = nullptr) {
  for (int st = 0; st < p; ++st) {
    MAPP_CHECK(caps.memory[st] >= v, "pipeline planner '", name, "': a memory limit of ",
               caps.memory[st], " activations on stage ", st, " is below the ", v,
               " chunks one microbatch needs; raise memory_limit to at least ", v);
  }
  const Topo t{p, v, placement == Placement::kWave};
  Schedule out = internal::empty(name, p, m, v, placement);
  // Arrival times of messages: act[vs][mb] (input of virtual stage vs),
  // grad[vs][mb] (output gradient of virtual stage vs). kInf = not yet sent.
  std::vector<std::vector<double>> act(p * v, std::vector<double>(m, kInf));
  std::vector<std::vector<double>> grad(p * v, std::vector<double>(m, kInf));
  for (int mb = 0; mb < m; ++mb) act[0][mb] = 0;
  std::vector<double> link_free(2 * p, 0.0);  // [link * 2 + direction]
  struct Stage {
    double free = 0;
    std::vector<int> next_f, next_b;            // per chunk: next microbatch
    std::vector<std::vector<double>> f_end;     // [chunk][mb]
    std::deque<std::pair<int, int>> pending_w;  // (mb, chunk)
    int live = 0, done = 0;
    int reserved = 0;  // forwards still owed to microbatches that entered
    int window = 0;    // forwards without their input-gradient backward
  };
  std::vector<Stage> stages(p);
  for (auto& S : stages) {
    S.next_f.assign(v, 0);
    S.next_b.assign(v, 0);
    S.f_end.assign(v, std::vector<double>(m, kInf));
  }
  const int per_stage = 3 * m * v;
  auto send = [&](int from, int to, double at, bool forward_dir) {
    if (from == to) return at;  // a hand-off between two chunks of one stage
    const int slot = t.link_slot(from, to, forward_dir);
    double& lf = link_free[slot];
    const double start = std::max(at, lf);
    lf = start + costs.p2p[slot / 2];
    return lf;
  };
  // Candidate availability on a stage: returns (time, kind, mb, chunk).
  struct Pick {
    double at = kInf;
    ActionType type = ActionType::kForward;
    int mb = -1, chunk = -1;
  };
  auto ready_f = [&](int st, int c) {
    const Stage& S = stages[st];
    const int mb = S.next_f[c];
    if (mb >= m) return kInf;
    return act[t.vstage(st, c)][mb];
  };
  auto ready_b = [&](int st, int c) {
    const Stage& S = stages[st];
    const int mb = S.next_b[c];
    if (mb >= m || mb >= S.next_f[c]) return kInf;
    const int vs = t.vstage(st, c);
    return vs == t.last() ? S.f_end[c][mb] : grad[vs][mb];
  };
  auto may_forward = [&](int st, int c) {
    const Stage& S = stages[st];
    if (c != 0) return true;  // reserved when the microbatch entered
    return S.live + S.reserved + v <= caps.memory[st] &&
           S.window + S.reserved + v <= caps.window[st];
  };
  // The policy's choice among the candidates ready at time `now`.
  auto choose = [&](int st, double now) {
    const Stage& S = stages[st];
    Pick pick;
    auto best_b = [&]() -> Pick {
      Pick b;
      for (int c = v - 1; c >= 0; --c) {  // earlier microbatch first, then deeper chunk
        if (ready_b(st, c) <= now && (b.mb < 0 || S.next_b[c] < b.mb)) {
          b = {now, ActionType::kBackwardInput, S.next_b[c], c};
        }
      }
      return b;
    };
    auto best_f = [&]() -> Pick {
      Pick f;
      for (int c = 0; c < v; ++c) {
        if (ready_f(st, c) > now || !may_forward(st, c)) continue;
        const bool better = f.mb < 0 || (backward_first ? c > f.chunk  // depth-first: deepest chunk
                                                        : false);  // breadth-first: lowest chunk
        if (better) f = {now, ActionType::kForward, S.next_f[c], c};
      }
      return f;
    };
    Pick first = backward_first ? best_b() : best_f();
    if (first.mb >= 0) return first;
    if (static_cast<int>(S.pending_w.size()) > caps.lag[st]) {
      return Pick{now, ActionType::kBackwardWeight, S.pending_w.front().first,
                  S.pending_w.front().second};
    }
    Pick second = backward_first ? best_f() : best_b();
    if (second.mb >= 0) return second;
    if (!S.pending_w.empty()) {
      return Pick{now, ActionType::kBackwardWeight, S.pending_w.front().first,
                  S.pending_w.front().second};
    }
    return pick;
  };
  // Earliest time at which stage st has something it may run.
  auto decision_time = [&](int st) {
    const Stage& S = stages[st];
    if (S.done == per_stage) return kInf;
    if (!S.pending_w.empty()) return S.free;
    double at = kInf;
    for (int c = 0; c < v; ++c) {
      if (may_forward(st, c)) at = std::min(at, ready_f(st, c));
      at = std::min(at, ready_b(st, c));
    }
    return std::max(at, S.free);
  };

  const int total = per_stage * p;
  for (int step = 0; step < total; ++step) {
    const auto [st, when] = internal::earliest_stage(p, decision_time);
    MAPP_CHECK(st >= 0, "pipeline planner '", name,
               "': no stage can make progress (memory limit too small?)");
    Pick pk = choose(st, when);
    MAPP_CHECK(pk.mb >= 0, "pipeline planner: internal error (no candidate at decision time)");
    Stage& S = stages[st];
    const int vs = t.vstage(st, pk.chunk);
    const double start = std::max(when, S.free);
    out.actions[st].push_back({pk.type, pk.mb, pk.chunk, -1});
    ++S.done;
    if (pk.type == ActionType::kForward) {
      S.free = start + costs.forward[st];
      S.f_end[pk.chunk][pk.mb] = S.free;
      ++S.next_f[pk.chunk];
      ++S.live;
      ++S.window;
      S.reserved += pk.chunk == 0 ? v - 1 : -1;
      if (vs < t.last()) act[vs + 1][pk.mb] = send(st, t.stage_of(vs + 1), S.free, true);
    } else if (pk.type == ActionType::kBackwardInput) {
      S.free = start + costs.backward_input[st];
      ++S.next_b[pk.chunk];
      --S.window;
      S.pending_w.emplace_back(pk.mb, pk.chunk);
      if (vs > 0) grad[vs - 1][pk.mb] = send(st, t.stage_of(vs - 1), S.free, false);
    } else {
      S.free = start + costs.backward_weight[st];
      S.pending_w.pop_front();
      --S.live;
    }
  }
  if (makespan != nullptr) {
    *makespan = 0;
    for (const auto& S : stages) *makespan = std::max(*makespan, S.free);
  }
  add_communication(out);
  return out;
}

// (Interleaved) 1F1B's limits: each stage's forward window, and the memory
// of its fullest stage (stage 0) everywhere, which lets the later stages defer
// weight gradients (ZB-H1) without raising the peak of the pipeline.
Caps one_f_one_b_caps(int p, int m, int v) {
  Caps c;
  for (int st = 0; st < p; ++st) c.window.push_back(internal::one_f_one_b_peak(p, m, v, st));
  c.memory.assign(p, c.window[0]);
  for (int st = 0; st < p; ++st) c.lag.push_back(st);
  return c;
}

Caps uniform_caps(int p, int memory) {
  Caps c{std::vector<int>(p, memory), std::vector<int>(p, memory), {}};
  for (int st = 0; st < p; ++st) c.lag.push_back(st);
  return c;
}

}  // namespace

Schedule zero_bubble(int p, int m) {
  internal::check_shape(p, m, 1, "zero_bubble");
  // ZB-H1: 1F1B's order of forwards and input-gradient backwards; stage s
  // runs the weight gradient of microbatch j right after the input gradient of
  // j + s, so s weight gradients are in reserve to fill the drain (the stage
  // finishes its last BI s+1 units before the end). Live activations: 1F1B's
  // window p - s plus s deferred = p on every stage, 1F1B's peak.
  Schedule s = internal::empty("zero-bubble", p, m, 1);
  const Schedule base = one_f_one_b(p, m);
  for (int st = 0; st < p; ++st) {
    auto& out = s.actions[st];
    int next_w = 0;
    for (const auto& a : base.actions[st]) {
      if (a.type == ActionType::kForward) {
        out.push_back(a);
      } else if (a.type == ActionType::kBackward) {
        out.push_back({ActionType::kBackwardInput, a.microbatch, 0, -1});
        if (a.microbatch - st >= 0) out.push_back({ActionType::kBackwardWeight, next_w++, 0, -1});
      }
    }
    while (next_w < m) out.push_back({ActionType::kBackwardWeight, next_w++, 0, -1});
  }
  add_communication(s);
  return s;
}

Schedule zb_v(int p, int m, const std::optional<Costs>& costs) {
  internal::check_shape(p, m, 2, "zb-v");
  MAPP_CHECK(p > 1, "zb-v: needs more than one pipeline stage");
  const Costs c = costs ? *costs : Costs::uniform(p);
  c.check(p);
  // 1F1B's activation memory: p microbatches through a whole stage, i.e. 2p
  // through one of its two chunks, on every stage (or all m if fewer). The
  // planner runs depth-first (backwards first, then the deepest chunk's
  // forwards); the weight gradients kept in reserve before they take
  // priority over forwards fill the bubbles: the reserve with the shortest
  // predicted step wins (ties: the smaller reserve).
  const int memory = std::min(2 * p, 2 * m);
  Schedule best;
  double best_t = kInf;
  // The search: forwards without their input gradient (the window) from
  // p to the whole memory, and reserves up to p + 2 (wider ones never won
  // for p <= 8); backwards first always won. Scored by the planner's own
  // time model, so a plan of p = 16, m = 64 takes well under a second.
  for (int window = std::min(p, memory); window <= memory; ++window) {
    for (int lag = 0; lag <= std::min(memory, p + 2); ++lag) {
      Caps caps{std::vector<int>(p, memory), std::vector<int>(p, window), std::vector<int>(p, lag)};
      double mk = 0;
      Schedule s = plan("zb-v", p, m, 2, true, caps, c, Placement::kWave, &mk);
      if (mk < best_t * (1 - 1e-9)) {
        best_t = mk;
        best = std::move(s);
      }
    }
  }
  return best;
}

Schedule dynamic(int p, int m, int v, Policy policy, std::optional<int> memory_limit,
                 const std::optional<Costs>& costs) {
  internal::check_shape(p, m, v, "dynamic");
  const Costs c = costs ? *costs : Costs::uniform(p);
  c.check(p);
  if (memory_limit) {
    MAPP_CHECK(*memory_limit >= v, "dynamic: memory_limit must be at least ", v,
               " activations (one microbatch through each of the ", v, " chunks), got ",
               *memory_limit);
  }
  const Caps base = one_f_one_b_caps(p, m, v);
  const int peak_1f1b = base.memory[0];
  const std::string prefix = std::string("dynamic-") + policy_name(policy);
  switch (policy) {
    case Policy::kDepthFirst: {
      Caps caps = base;
      if (memory_limit) {
        for (auto& x : caps.memory) x = std::min(x, *memory_limit);
      }
      return plan(prefix, p, m, v, true, caps, c);
    }
    case Policy::kBreadthFirst:
      return plan(prefix, p, m, v, false, uniform_caps(p, memory_limit.value_or(m * v)), c);
    case Policy::kAuto:
      return plan(prefix, p, m, v, false, uniform_caps(p, memory_limit.value_or(peak_1f1b)), c);
    case Policy::kAdaptive:
      break;
  }
  // Adaptive: the candidates below under the given costs; shortest predicted
  // makespan within the memory limit wins (ties: the earlier candidate).
  const int limit = memory_limit.value_or(peak_1f1b);
  std::vector<Schedule> cands;
  if (v == 1 || m % p == 0) cands.push_back(v == 1 ? one_f_one_b(p, m) : interleaved(p, m, v));
  cands.push_back(dynamic(p, m, v, Policy::kDepthFirst, memory_limit, c));
  cands.push_back(dynamic(p, m, v, Policy::kAuto, limit, c));
  {  // depth-first keeping as many weight gradients in reserve as memory allows
    Caps caps = base;
    for (auto& x : caps.memory) x = std::min(x, limit);
    caps.lag.assign(p, limit);
    cands.push_back(plan("dynamic-dfc-deferred", p, m, v, true, caps, c));
  }
  if (v == 1) cands.push_back(zero_bubble(p, m));
  const Schedule* best = nullptr;
  double best_t = kInf;
  for (const auto& s : cands) {
    int peak = 0;
    for (int st = 0; st < p; ++st) peak = std::max(peak, s.peak_activations(st));
    if (peak > limit) continue;
    const double mk = simulate(s, c).makespan;
    if (mk < best_t * (1 - 1e-9)) {
      best_t = mk;
      best = &s;
    }
  }
  MAPP_CHECK(best != nullptr, "dynamic(adaptive): no candidate schedule fits memory_limit=", limit);
  Schedule out = *best;
  out.name = prefix + "(" + best->name + ")";
  return out;
}

const char* schedule_names() { return "gpipe, 1f1b, interleaved, zero-bubble, zb-v, dynamic"; }

Schedule by_name(const std::string& name, int p, int m, int v, const std::string& policy,
                 std::optional<int> memory_limit, const std::optional<Costs>& costs) {
  if ((name == "interleaved" || name == "1f1b") && v > 1) return interleaved(p, m, v);
  if (name == "zb-v") {
    MAPP_CHECK(v == 2, "schedule 'zb-v' runs two model chunks per stage (the V), not ", v,
               ": leave virtual_pipeline_model_parallel_size unset or set it to 2");
    return zb_v(p, m, costs);
  }
  if (name == "dynamic") return dynamic(p, m, v, parse_policy(policy), memory_limit, costs);
  const bool known = name == "gpipe" || name == "1f1b" || name == "interleaved" ||
                     name == "zero-bubble";
  MAPP_CHECK(known, "unknown pipeline schedule '", name, "' (expected one of ", schedule_names(),
             ")");
  MAPP_CHECK(v == 1, "schedule '", name, "' runs one model chunk per stage; with "
             "virtual_pipeline_model_parallel_size=", v, " use 'interleaved' or 'dynamic'");
  if (name == "gpipe") return gpipe(p, m);
  if (name == "zero-bubble") return zero_bubble(p, m);
  return one_f_one_b(p, m);
}

}  // namespace mapp::pipeline
