// Pipeline send/recv through shared memory (mapp::comm::ShmP2P) for a process
// group whose members share one node; Python:
// megatronapp.parallel_state.enable_shared_memory(group, p2p=True) attaches
// it, and the pipeline executor sends through torch.ops.mapp.shm_isend /
// shm_irecv, which return a ShmWork (torch.classes.mapp.ShmWork).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <cstdint>
#include <memory>
#include <string>

namespace mapp::comm {
class ShmP2P;
}

namespace mapp::torch_ext {

// A posted send or receive. wait() completes it (idempotent); a work dropped
// before completion keeps its tensor alive until a later operation on the
// group finds it complete, so an abandoned receive never writes freed memory.
class ShmWork : public torch::CustomClassHolder {
 public:
  ShmWork(std::shared_ptr<comm::ShmP2P> p2p, std::uint64_t handle, at::Tensor tensor,
          std::string group_name);
  ~ShmWork() override;
  void wait(std::int64_t timeout_ms);  // < 0: MAPP_COLLECTIVE_TIMEOUT_S
  bool is_completed();

 private:
  std::shared_ptr<comm::ShmP2P> p2p_;
  std::uint64_t handle_;
  at::Tensor tensor_;
  std::string group_name_;
  bool done_ = false;
};

c10::intrusive_ptr<ShmWork> shm_isend(const at::Tensor& tensor, const std::string& group_name,
                                      std::int64_t dst, std::int64_t tag);
c10::intrusive_ptr<ShmWork> shm_irecv(const at::Tensor& tensor, const std::string& group_name,
                                      std::int64_t src, std::int64_t tag);

bool shm_p2p_attach(const std::string& group_name, const std::string& shm_name, bool create);
void shm_p2p_unlink(const std::string& group_name);
void shm_p2p_detach(const std::string& group_name);
bool shm_p2p_attached(const std::string& group_name);
// Bytes one ring of the group's transport holds (0 when not attached).
std::int64_t shm_p2p_ring_bytes(const std::string& group_name);

}  // namespace mapp::torch_ext
