// GPU busy time for trace events: pooled CUDA events recorded on the current
// stream around an op and resolved later with cudaEventQuery — never a
// device-wide (or even a stream) synchronization on the training thread.
//
//   auto h = gpu_timer_begin();          // records a start event
//   ... launch the op's kernels ...
//   gpu_timer_end(h, event);             // records an end event; `event` keeps
//                                        // the CPU-side span and arguments
//   resolve_gpu_timers();                // e.g. once per iteration: every timer
//                                        // whose events completed is written
//                                        // to the tracer with busy_ns = GPU time
//
// Built only with CUDA; without it, gpu_timers_available() is false and the
// other calls throw StateError.
#pragma once

#include <cstdint>

#include "mapp/trace/tracer.h"

namespace mapp::torch_ext {

bool gpu_timers_available();
std::int64_t gpu_timer_begin();
void gpu_timer_end(std::int64_t handle, const trace::Event& event);
// Records the completed timers into the global tracer (if any) and recycles
// their events; returns how many are still in flight.
std::int64_t resolve_gpu_timers();

}  // namespace mapp::torch_ext
