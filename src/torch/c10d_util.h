// Shared by the collectives of src/torch: group lookup by name and a bounded
// wait that turns c10d failures and timeouts into errors naming the operation.
#pragma once

#include <chrono>
#include <exception>
#include <string>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "mapp/comm/shm_group.h"
#include "mapp/common/check.h"
#include "mapp/common/tunables.h"
#include "mapp/trace/tracer.h"

namespace mapp::torch_ext::internal {

inline c10::intrusive_ptr<c10d::ProcessGroup> resolve(const std::string& group_name) {
  try {
    return c10d::resolve_process_group(group_name);
  } catch (const c10::Error&) {
    MAPP_CHECK_STATE(false, "no process group is registered under the name '", group_name,
                     "'; call torch.distributed.init_process_group (and "
                     "megatronapp.initialize_model_parallel) first and pass group.group_name");
  }
}

inline std::chrono::milliseconds collective_timeout() {
  return std::chrono::milliseconds(1000 * tunable_int("MAPP_COLLECTIVE_TIMEOUT_S"));
}

// Runs `body` (a blocking collective) as a trace event carrying its group and
// per-group sequence number (counted even when tracing is off, so numbers
// agree across ranks); a failure becomes an error naming the operation.
template <typename Body>
void traced(const char* op, const std::string& group_name, std::int64_t bytes, Body&& body) {
  trace::Scope scope(op, trace::Category::kCollective);
  scope.event().set_group(group_name);
  scope.event().seq = trace::next_seq(group_name);
  scope.event().bytes = bytes;
  trace::set_in_flight(std::string(op) + " on group '" + group_name + "' (seq " +
                       std::to_string(scope.event().seq) + ")");
  try {
    body();
    trace::set_in_flight("");
  } catch (const std::exception& e) {
    MAPP_FAIL_BACKEND(op, " on group '", group_name, "' failed: ", e.what());
  }
}

// Issues a c10d collective (`issue` returns the Work) and waits for it at most
// MAPP_COLLECTIVE_TIMEOUT_S: a hang must become an error.
template <typename Issue>
void run(const char* op, const std::string& group_name, Issue&& issue, std::int64_t bytes = -1) {
  const auto timeout = collective_timeout();
  traced(op, group_name, bytes, [&] {
    c10::intrusive_ptr<c10d::Work> work = issue();
    work->wait(timeout);
  });
}

// ---- the group's transport (src/torch/collectives.cc) ----------------------------
// The shared-memory group registered for `group_name` (Python:
// parallel_state.enable_shared_memory) when `t` is a CPU tensor, else null.
std::shared_ptr<comm::ShmGroup> shm_for(const at::Tensor& t, const std::string& group_name);
bool has_shm(const at::Tensor& t, const std::string& group_name);
// Elementwise dst += src of `dtype` (ATen), the reduction of the shared-memory group.
comm::ShmGroup::Reduce aten_add(at::ScalarType dtype);

// Blocking collectives on contiguous tensors, through the group's shared
// memory when it has one, else through c10d `pg`; traced as `op`.
// all_reduce_base: in-place sum. all_gather_base: out = [world x in].
// reduce_scatter_base: in = [world x out], out = sum of chunk `rank`.
// all_to_all_base: equal chunks, chunk j of member i -> chunk i of member j.
void all_reduce_base(at::Tensor& buf, const std::string& group_name, c10d::ProcessGroup& pg,
                     const char* op);
void all_gather_base(at::Tensor& out, const at::Tensor& in, const std::string& group_name,
                     c10d::ProcessGroup& pg, const char* op);
void reduce_scatter_base(at::Tensor& out, const at::Tensor& in, const std::string& group_name,
                         c10d::ProcessGroup& pg, const char* op);
void all_to_all_base(at::Tensor& out, const at::Tensor& in, const std::string& group_name,
                     c10d::ProcessGroup& pg, const char* op);

// What members must share to share memory: the host (name and boot), the
// /dev/shm mount and the network namespace (parallel_state.node_identity).
std::string node_identity();

// One shared-memory segment for the `size` members of a group meeting at
// `store` under `key` (this process is member `me`): member 0 creates it and
// publishes its name, the others open it, and once all have reported, member
// 0 unlinks the name. Null for a group of one, a group spanning nodes, or when
// any member could not map it (member 0 then prints why, naming `label`);
// every member gets the same answer.
std::shared_ptr<comm::ShmGroup> rendezvous_shm(c10d::Store& store, const std::string& key, int me,
                                               int size, const std::string& label);
// Routes the collectives of the registered group `group_name` through `group`.
void shm_register(const std::string& group_name, std::shared_ptr<comm::ShmGroup> group);

}  // namespace mapp::torch_ext::internal
