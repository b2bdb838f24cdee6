// "mapp": a torch.distributed backend for CPU tensors. Any torch code can use
// it (Megatron-Core, DeepSpeed, torch's own DDP/FSDP):
//
//   import megatronapp                      # registers the backend
//   torch.distributed.init_process_group("mapp")            # CPU tensors
//   torch.distributed.init_process_group("cpu:mapp,cuda:nccl")
//
// Each process group gets a Gloo backend (what crosses nodes, and the
// operations shared memory does not carry) and, when every member runs on
// this node, one shared-memory segment (mapp::comm::ShmGroup) that carries
// broadcast, all_reduce (sum, avg, product, min, max; every dtype including
// bfloat16, which Gloo cannot reduce), all_gather, reduce_scatter and
// all_to_all, in their list, tensor and coalesced forms. Send/recv, gather,
// scatter, reduce and barrier go to Gloo. MAPP_SHM_COLLECTIVES=0 keeps every
// operation on Gloo (the backend is then Gloo under another name).
//
// Operations through shared memory complete before they return (their Work is
// already complete); members must issue them in the same order, as for any
// backend, and a mismatch is an error naming each member's call.
#pragma once

#include <chrono>
#include <string>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace mapp::dist {

// The backend of one process group: `rank` of `size` members meeting at
// `store` (the group's prefixed store, as torch passes it to a backend's
// creator). Throws BackendError when Gloo cannot connect within `timeout`.
c10::intrusive_ptr<c10d::Backend> create_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                 int rank, int size,
                                                 std::chrono::milliseconds timeout,
                                                 const std::string& group_name);

// Whether `backend` (from create_backend) moves this node's collectives
// through shared memory.
bool backend_uses_shared_memory(const c10::intrusive_ptr<c10d::Backend>& backend);

}  // namespace mapp::dist
