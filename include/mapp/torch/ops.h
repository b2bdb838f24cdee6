// megatronapp::torch — the only C++ that includes torch. Collectives run on a
// c10d process group looked up by name (Python passes `group.group_name`), so
// a C++ trainer and a Python script reach the same groups and the same code.
// Each function is also registered as a torch operator in the `mapp`
// namespace (torch.ops.mapp.<name>); see src/torch/ops.cc for the schemas.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace mapp::torch_ext {

// Sums `tensor` over the group in place and returns it. CPU bfloat16 travels
// as float32 (Gloo has no bfloat16) and is cast back.
at::Tensor& all_reduce_sum_(at::Tensor& tensor, const std::string& group_name);

// Sums `tensors` over the group in place (then multiplies them by `scale`),
// packing same-dtype tensors into flat buffers of at most kCoalesceBucketBytes
// so that many small tensors cost few collectives. Element-wise, so the same
// sums as one call per tensor.
constexpr std::int64_t kCoalesceBucketBytes = 25LL << 20;
void coalesced_all_reduce_(const std::vector<at::Tensor>& tensors, const std::string& group_name,
                           std::optional<double> scale = std::nullopt);

// Concatenation along `dim` of every group member's `tensor`, in group-rank
// order. All members must pass the same shape.
at::Tensor all_gather(const at::Tensor& tensor, std::int64_t dim,
                      const std::string& group_name);

// Sum over the group, then this member's slice of `dim` (size / group size).
// Throws ValueError if the size of `dim` is not divisible by the group size.
at::Tensor reduce_scatter_sum(const at::Tensor& tensor, std::int64_t dim,
                              const std::string& group_name);

class CommWork;  // comm_engine.h

// all_gather along dim 0 into `out` ([group size * in.size(0), ...]) and
// reduce_scatter_sum along dim 0 of `in` into `out` ([in.size(0) / group size,
// ...]), asynchronously on the group's communication thread (comm_engine.h),
// for overlapping tensor-parallel communication with GEMMs. Both tensors must
// be contiguous and must not be touched until the work is waited for. Jobs of
// one group run in submission order; a caller that also issues blocking
// collectives on the group must wait for its works first.
c10::intrusive_ptr<CommWork> all_gather_async(at::Tensor out, at::Tensor in,
                                              const std::string& group_name);
c10::intrusive_ptr<CommWork> reduce_scatter_async(at::Tensor out, at::Tensor in,
                                                  const std::string& group_name);

// Shared-memory transport for a group whose members share one node: member 0
// creates the segment `shm_name` (create=true), then the others open it; from
// then on CPU tensors of all_reduce_sum_ / all_gather / reduce_scatter_sum on
// this group move through it instead of the group's backend. shm_unlink
// removes the name once every member opened it; shm_detach goes back to the
// backend. Python: megatronapp.parallel_state.enable_shared_memory does all this.
bool shm_attach(const std::string& group_name, const std::string& shm_name, bool create);
void shm_unlink(const std::string& group_name);
void shm_detach(const std::string& group_name);
bool shm_attached(const std::string& group_name);

// Size of and this process's rank in the named group.
std::int64_t group_size(const std::string& group_name);
std::int64_t group_rank(const std::string& group_name);

// Per-row (max, sum exp(x - max), target logit or 0) of a vocabulary shard
// starting at global id `vocab_start`: logits [..., V_local] -> float32 [..., 3].
// CPU: mapp::vocab_ce_local_stats; CUDA: kernels/cross_entropy.cu.
at::Tensor vocab_ce_local_stats(const at::Tensor& logits, const at::Tensor& target,
                                std::int64_t vocab_start);

// Names of the torch operators this library registered (for diagnostics;
// calling it also guarantees the library is linked and its ops registered).
std::vector<std::string> registered_ops();

// Whether this build compiled the CUDA kernels in.
bool built_with_cuda();

}  // namespace mapp::torch_ext
