// Schedule IR: names, bookkeeping, communication insertion and validation.
#include "mapp/pipeline/schedule.h"

#include <algorithm>
#include <map>
#include <sstream>
#include <tuple>

#include "internal.h"
#include "mapp/common/check.h"

namespace mapp::pipeline {

namespace {
constexpr const char* kTypeNames[] = {"F",        "B",        "BI",        "W",
                                      "SEND_ACT", "RECV_ACT", "SEND_GRAD", "RECV_GRAD"};
}  // namespace

const char* type_name(ActionType t) { return kTypeNames[static_cast<int>(t)]; }

ActionType parse_type(const std::string& name) {
  for (int i = 0; i < 8; ++i) {
    if (name == kTypeNames[i]) return static_cast<ActionType>(i);
  }
  MAPP_CHECK(false, "unknown pipeline action type '", name,
             "' (expected one of F, B, BI, W, SEND_ACT, RECV_ACT, SEND_GRAD, RECV_GRAD)");
  return ActionType::kForward;
}

const char* placement_name(Placement p) { return p == Placement::kWave ? "wave" : "loop"; }

Placement parse_placement(const std::string& name) {
  if (name == "loop") return Placement::kLoop;
  if (name == "wave") return Placement::kWave;
  MAPP_CHECK(false, "unknown chunk placement '", name, "' (expected loop or wave)");
  return Placement::kLoop;
}

int Schedule::vstage(int stage, int chunk) const { return internal::Topo::of(*this).vstage(stage, chunk); }
int Schedule::stage_of(int vs) const { return internal::Topo::of(*this).stage_of(vs); }

std::string to_string(const Action& a) {
  std::ostringstream os;
  os << type_name(a.type) << "(mb=" << a.microbatch << ", chunk=" << a.chunk;
  if (!a.is_compute()) os << ", peer=" << a.peer;
  os << ")";
  return os.str();
}

bool Schedule::has_communication() const {
  for (const auto& stage : actions) {
    for (const auto& a : stage) {
      if (!a.is_compute()) return true;
    }
  }
  return false;
}

int Schedule::peak_activations(int stage) const {
  int live = 0, peak = 0;
  for (const auto& a : actions.at(stage)) {
    if (a.type == ActionType::kForward) {
      peak = std::max(peak, ++live);
    } else if (a.type == ActionType::kBackward || a.type == ActionType::kBackwardWeight) {
      --live;
    }
  }
  return peak;
}

std::size_t Schedule::num_actions() const {
  std::size_t n = 0;
  for (const auto& stage : actions) n += stage.size();
  return n;
}

namespace internal {

void check_shape(int p, int m, int v, const char* what) {
  MAPP_CHECK(p >= 1, what, ": the number of pipeline stages must be >= 1, got ", p);
  MAPP_CHECK(m >= 1, what, ": the number of microbatches must be >= 1, got ", m);
  MAPP_CHECK(v >= 1, what, ": the number of model chunks per stage must be >= 1, got ", v);
  MAPP_CHECK(v == 1 || p > 1, what, ": ", v,
             " model chunks per stage (virtual pipeline) need more than one pipeline stage");
}

Schedule empty(const std::string& name, int p, int m, int v, Placement placement) {
  Schedule s;
  s.name = name;
  s.stages = p;
  s.microbatches = m;
  s.chunks = v;
  s.placement = placement;
  s.actions.resize(p);
  return s;
}

}  // namespace internal

// ---- communication -------------------------------------------------------------

void add_communication(Schedule& s) {
  const auto t = internal::Topo::of(s);
  if (s.stages == 1 || s.has_communication()) return;
  for (int st = 0; st < s.stages; ++st) {
    const auto& in = s.actions[st];
    std::vector<Action> out;
    out.reserve(in.size() * 2);
    // The receive for compute action i is posted before compute action i-1.
    std::vector<std::vector<Action>> recv_before(in.size() + 1);
    for (std::size_t i = 0; i < in.size(); ++i) {
      const Action& a = in[i];
      const int vs = t.vstage(st, a.chunk);
      const std::size_t at = i == 0 ? 0 : i - 1;
      if (a.type == ActionType::kForward && vs > 0 && !t.local(vs - 1)) {
        recv_before[at].push_back(
            {ActionType::kRecvActivation, a.microbatch, a.chunk, t.stage_of(vs - 1)});
      } else if ((a.type == ActionType::kBackward || a.type == ActionType::kBackwardInput) &&
                 vs < t.last() && !t.local(vs)) {
        recv_before[at].push_back(
            {ActionType::kRecvGrad, a.microbatch, a.chunk, t.stage_of(vs + 1)});
      }
    }
    for (std::size_t i = 0; i < in.size(); ++i) {
      const Action& a = in[i];
      for (const auto& r : recv_before[i]) out.push_back(r);
      out.push_back(a);
      const int vs = t.vstage(st, a.chunk);
      if (a.type == ActionType::kForward && vs < t.last() && !t.local(vs)) {
        out.push_back({ActionType::kSendActivation, a.microbatch, a.chunk, t.stage_of(vs + 1)});
      } else if ((a.type == ActionType::kBackward || a.type == ActionType::kBackwardInput) &&
                 vs > 0 && !t.local(vs - 1)) {
        out.push_back({ActionType::kSendGrad, a.microbatch, a.chunk, t.stage_of(vs - 1)});
      }
    }
    s.actions[st] = std::move(out);
  }
}

// ---- validation -------------------------------------------------------------------

namespace {

std::string where(int stage, std::size_t pos, const Action& a) {
  std::ostringstream os;
  os << "stage " << stage << ", action #" << pos << " " << to_string(a);
  return os.str();
}

// A message is identified by kind (0 activation, 1 gradient), microbatch and
// the virtual stage that consumes it.
using MsgKey = std::tuple<int, int, int>;

struct Expect {
  bool needs = false;
  int peer = -1;
  MsgKey key{};
  bool local = false;  // a hand-off between two chunks of this stage
};

// What a transfer action (or a compute action's input) corresponds to.
Expect message_of(const internal::Topo& t, int stage, const Action& a) {
  const int vs = t.vstage(stage, a.chunk);
  switch (a.type) {
    case ActionType::kSendActivation:
      if (vs < t.last()) return {true, t.stage_of(vs + 1), {0, a.microbatch, vs + 1}, t.local(vs)};
      break;
    case ActionType::kRecvActivation:
    case ActionType::kForward:
      if (vs > 0) return {true, t.stage_of(vs - 1), {0, a.microbatch, vs}, t.local(vs - 1)};
      break;
    case ActionType::kSendGrad:
      if (vs > 0) return {true, t.stage_of(vs - 1), {1, a.microbatch, vs - 1}, t.local(vs - 1)};
      break;
    case ActionType::kRecvGrad:
    case ActionType::kBackward:
    case ActionType::kBackwardInput:
      if (vs < t.last()) return {true, t.stage_of(vs + 1), {1, a.microbatch, vs}, t.local(vs)};
      break;
    default:
      break;
  }
  return {};
}

std::string validate_impl(const Schedule& s) {
  std::ostringstream err;
  if (s.stages < 1 || s.microbatches < 1 || s.chunks < 1) {
    err << "schedule '" << s.name << "' has stages=" << s.stages
        << ", microbatches=" << s.microbatches << ", chunks=" << s.chunks << "; all must be >= 1";
    return err.str();
  }
  if (static_cast<int>(s.actions.size()) != s.stages) {
    err << "schedule '" << s.name << "' declares " << s.stages << " stages but lists actions for "
        << s.actions.size();
    return err.str();
  }
  if (s.chunks > 1 && s.stages == 1) return "a schedule with several chunks needs stages > 1";
  if (s.placement == Placement::kWave && s.chunks < 2) {
    return "the wave placement needs at least two chunks per stage";
  }
  const auto t = internal::Topo::of(s);
  const int m = s.microbatches, v = s.chunks;
  const bool comm = s.has_communication() || s.stages == 1;
  if (!comm) return "schedule has no send/recv actions (call add_communication first)";

  // Per stage: ranges, completeness, local order, receives before use.
  // sent[key] = (stage, position) of the send; recv[key] likewise.
  std::map<MsgKey, std::pair<int, std::size_t>> sends, recvs;
  for (int st = 0; st < s.stages; ++st) {
    // state per (mb, chunk): bit 0 F, 1 B, 2 BI, 3 W
    std::vector<int> done(static_cast<std::size_t>(m) * v, 0);
    std::map<MsgKey, std::size_t> posted;
    std::map<MsgKey, bool> handed;  // hand-offs between this stage's chunks, once produced
    const auto& list = s.actions[st];
    for (std::size_t i = 0; i < list.size(); ++i) {
      const Action& a = list[i];
      if (a.microbatch < 0 || a.microbatch >= m || a.chunk < 0 || a.chunk >= v) {
        err << where(st, i, a) << ": microbatch must lie in [0, " << m << ") and chunk in [0, " << v
            << ")";
        return err.str();
      }
      int& d = done[static_cast<std::size_t>(a.microbatch) * v + a.chunk];
      const Expect e = message_of(t, st, a);
      switch (a.type) {
        case ActionType::kForward:
          if (d & 1) return where(st, i, a) + ": duplicate forward";
          d |= 1;
          break;
        case ActionType::kBackward:
        case ActionType::kBackwardInput:
          if (!(d & 1)) return where(st, i, a) + ": backward before the forward of this microbatch";
          if (d & 6) return where(st, i, a) + ": duplicate backward";
          d |= a.type == ActionType::kBackward ? 2 : 4;
          break;
        case ActionType::kBackwardWeight:
          if (!(d & 4)) {
            return where(st, i, a) +
                   ": weight gradient before the input gradient (BI) of this microbatch";
          }
          if (d & 8) return where(st, i, a) + ": duplicate weight gradient";
          d |= 8;
          break;
        default: {
          if (e.needs && e.local) {
            return where(st, i, a) +
                   ": no such transfer (the neighbouring virtual stage sits on this stage too; "
                   "two chunks of one stage hand off without a send or receive)";
          }
          if (!e.needs) {
            return where(st, i, a) + ": no such transfer (the " +
                   (a.type == ActionType::kSendActivation || a.type == ActionType::kRecvGrad
                        ? std::string("last")
                        : std::string("first")) +
                   " virtual stage has no peer in this direction)";
          }
          if (a.peer != e.peer) {
            err << where(st, i, a) << ": peer must be stage " << e.peer;
            return err.str();
          }
          const bool is_send =
              a.type == ActionType::kSendActivation || a.type == ActionType::kSendGrad;
          auto& table = is_send ? sends : recvs;
          if (!table.emplace(e.key, std::make_pair(st, i)).second) {
            return where(st, i, a) + ": duplicate transfer";
          }
          if (is_send) {
            const bool produced = a.type == ActionType::kSendActivation ? (d & 1) : (d & 6);
            if (!produced) {
              return where(st, i, a) + ": sent before the action that produces it";
            }
          } else {
            posted.emplace(e.key, i);
          }
        }
      }
      if (a.is_compute()) {  // record the hand-offs this action produces for a later chunk
        const int vs = t.vstage(st, a.chunk);
        if (a.type == ActionType::kForward && vs < t.last() && t.local(vs)) {
          handed[{0, a.microbatch, vs + 1}] = true;
        } else if ((a.type == ActionType::kBackward || a.type == ActionType::kBackwardInput) &&
                   vs > 0 && t.local(vs - 1)) {
          handed[{1, a.microbatch, vs - 1}] = true;
        }
      }
      if (a.is_compute() && e.needs && e.local && !handed.count(e.key)) {
        return where(st, i, a) + ": its input comes from this stage's own chunk (virtual stage " +
               std::to_string(a.type == ActionType::kForward ? std::get<2>(e.key) - 1
                                                             : std::get<2>(e.key) + 1) +
               "), which must run first";
      }
      if (a.is_compute() && e.needs && !e.local && s.stages > 1 && !posted.count(e.key)) {
        return where(st, i, a) + ": its input is never received before it (add a " +
               (a.type == ActionType::kForward ? "RECV_ACT" : "RECV_GRAD") +
               " earlier on this stage)";
      }
    }
    for (int mb = 0; mb < m; ++mb) {
      for (int c = 0; c < v; ++c) {
        const int d = done[static_cast<std::size_t>(mb) * v + c];
        std::string missing;
        if (!(d & 1)) {
          missing = "F";
        } else if (!(d & 6)) {
          missing = "B (or BI and W)";
        } else if ((d & 4) && !(d & 8)) {
          missing = "W";
        }
        if (!missing.empty()) {
          err << "stage " << st << " never runs " << missing << " of microbatch " << mb
              << ", chunk " << c;
          return err.str();
        }
      }
    }
  }
  for (const auto& [key, at] : sends) {
    if (!recvs.count(key)) {
      const auto& a = s.actions[at.first][at.second];
      return where(at.first, at.second, a) + ": no matching receive on stage " +
             std::to_string(a.peer);
    }
  }
  for (const auto& [key, at] : recvs) {
    if (!sends.count(key)) {
      const auto& a = s.actions[at.first][at.second];
      return where(at.first, at.second, a) + ": no matching send on stage " +
             std::to_string(a.peer);
    }
  }

  // Deadlock: run the executor semantics with instantaneous actions.
  std::vector<std::size_t> pc(s.stages, 0);
  std::map<MsgKey, bool> sent;
  bool progress = true;
  while (progress) {
    progress = false;
    for (int st = 0; st < s.stages; ++st) {
      const auto& list = s.actions[st];
      while (pc[st] < list.size()) {
        const Action& a = list[pc[st]];
        const Expect e = message_of(t, st, a);
        if (a.is_compute() && e.needs && !e.local && s.stages > 1 && !sent.count(e.key)) break;
        if (a.type == ActionType::kSendActivation || a.type == ActionType::kSendGrad) {
          sent[e.key] = true;
        }
        ++pc[st];
        progress = true;
      }
    }
  }
  for (int st = 0; st < s.stages; ++st) {
    if (pc[st] < s.actions[st].size()) {
      err << "deadlock: ";
      bool first = true;
      for (int q = 0; q < s.stages; ++q) {
        if (pc[q] >= s.actions[q].size()) continue;
        const Action& a = s.actions[q][pc[q]];
        err << (first ? "" : "; ") << where(q, pc[q], a) << " waits for "
            << (a.type == ActionType::kForward ? "an activation" : "a gradient") << " from stage "
            << message_of(t, q, a).peer;
        first = false;
      }
      return err.str();
    }
  }
  return {};
}

}  // namespace

std::string validate(const Schedule& s) { return validate_impl(s); }

void check_valid(const Schedule& s) {
  const std::string e = validate(s);
  MAPP_CHECK(e.empty(), "invalid pipeline schedule '", s.name, "': ", e);
}

}  // namespace mapp::pipeline
