// Fault injection, the variables megatronapp.resilience.faults reads
// (docs/tracing.md), so a C++ run can be checked by the slow-rank detector:
//
//   MAPP_INJECT_SLOWDOWN="rank=1,factor=1.5,phase=forward|backward|all[,start=K]"
//
// emulates a down-clocked device on global rank 1 (`rank=0+2`: on several): mapp::forward_backward
// keeps the thread busy, after each forward (F) and/or backward (B, BI, W)
// action of that rank, for (factor - 1) x the thread CPU time the action
// took, so its busy time grows like a slower device's.
//
//   MAPP_INJECT_LINK_DELAY="rank=2,peer=3,ms=5"
//
// delays every pipeline message from global rank 2 to global rank 3 by 5 ms
// without blocking the sender (mapp::forward_backward issues it from a timer
// thread): a slow link. Python's trainers read it here too.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

namespace mapp::faults {

struct Slowdown {
  std::vector<int> ranks;  // `rank=1` or `rank=0+2` (e.g. the forward ranks of MegaFBD)
  double factor = 1.0;
  bool forward = false, backward = false;
  int start = 0;  // first iteration slowed (`start=K`; see set_iteration)
  bool applies_to(int global_rank) const;
};

// The training loop's current iteration (train_gpt calls it at the start of
// every iteration): a slowdown with `start=K` applies once it reaches K.
void set_iteration(int iteration);
int iteration();

// The parsed MAPP_INJECT_SLOWDOWN (nullopt when unset); ValueError naming
// the variable for a malformed value.
std::optional<Slowdown> injected_slowdown();

struct LinkDelay {
  int rank = -1, peer = -1;  // global ranks: sender, receiver
  double ms = 0;
};

// The parsed MAPP_INJECT_LINK_DELAY (nullopt when unset); ValueError naming
// the variable for a malformed value.
std::optional<LinkDelay> injected_link_delay();

// CPU time of the calling thread, and a busy wait for `extra` x the thread
// time since `t0`.
std::int64_t thread_time_ns();
void stall_since(std::int64_t t0, double extra);

}  // namespace mapp::faults
