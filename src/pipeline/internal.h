// Shared helpers of the schedule library (not installed).
#pragma once

#include <limits>
#include <string>
#include <utility>

#include "mapp/pipeline/schedule.h"

namespace mapp::pipeline::internal {

// Virtual-stage arithmetic of a placement (see Placement): loop, chunk c of
// stage s is virtual stage c*p + s; wave, odd chunks run from stage p-1 down.
struct Topo {
  int p, v;
  bool wave = false;
  static Topo of(const Schedule& s) { return {s.stages, s.chunks, s.placement == Placement::kWave}; }
  int vstage(int stage, int chunk) const {
    return chunk * p + (wave && chunk % 2 == 1 ? p - 1 - stage : stage);
  }
  int stage_of(int vs) const {
    const int c = vs / p, r = vs % p;
    return wave && c % 2 == 1 ? p - 1 - r : r;
  }
  int chunk_of(int vs) const { return vs / p; }
  int last() const { return p * v - 1; }
  // Whether the message between virtual stages vs and vs + 1 stays on one stage.
  bool local(int vs) const { return stage_of(vs) == stage_of(vs + 1); }
  // Index into a [link * 2 + direction] table of the link a transfer from
  // stage `from` to stage `to` uses. Loop placement: link `from` for
  // activations, link `to` for gradients (direction 0 / 1), as the ring
  // p-1 -> 0 is a link of its own. Wave: the physical link between the two
  // neighbours, direction 0 upwards (s -> s+1) and 1 downwards.
  int link_slot(int from, int to, bool activation) const {
    if (!wave) return activation ? from * 2 : to * 2 + 1;
    return to > from ? from * 2 : to * 2 + 1;
  }
};

constexpr double kInf = std::numeric_limits<double>::infinity();

// The stage whose next event comes first: (stage, time), stage -1 when every
// time is infinite. Ties go to the lower stage, so runs are deterministic.
template <typename F>
std::pair<int, double> earliest_stage(int p, F&& time_of) {
  int best = -1;
  double when = kInf;
  for (int q = 0; q < p; ++q) {
    const double d = time_of(q);
    if (d < when) {
      when = d;
      best = q;
    }
  }
  return {best, when};
}

void check_shape(int p, int m, int v, const char* what);
Schedule empty(const std::string& name, int p, int m, int v,
               Placement placement = Placement::kLoop);

// Largest number of live activations (microbatch x chunk units) that
// (interleaved) 1F1B keeps on `stage`.
inline int one_f_one_b_peak(int p, int m, int v, int stage) {
  const int warmup = v == 1 ? p - stage - 1 : (p - stage - 1) * 2 + (v - 1) * p;
  return warmup + 1 < m * v ? warmup + 1 : m * v;
}

}  // namespace mapp::pipeline::internal
