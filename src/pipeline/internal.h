// Shared helpers of the schedule library (not installed).
#pragma once

#include <limits>
#include <string>
#include <utility>

#include "mapp/pipeline/schedule.h"

namespace mapp::pipeline::internal {

// Virtual-stage arithmetic: chunk c of stage s is virtual stage c * p + s.
struct Topo {
  int p, v;
  int vstage(int stage, int chunk) const { return chunk * p + stage; }
  int stage_of(int vs) const { return vs % p; }
  int chunk_of(int vs) const { return vs / p; }
  int last() const { return p * v - 1; }
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
Schedule empty(const std::string& name, int p, int m, int v);

// Largest number of live activations (microbatch x chunk units) that
// (interleaved) 1F1B keeps on `stage`.
inline int one_f_one_b_peak(int p, int m, int v, int stage) {
  const int warmup = v == 1 ? p - stage - 1 : (p - stage - 1) * 2 + (v - 1) * p;
  return warmup + 1 < m * v ? warmup + 1 : m * v;
}

}  // namespace mapp::pipeline::internal
