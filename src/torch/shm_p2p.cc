#include "mapp/torch/shm_p2p.h"

#include <map>
#include <mutex>
#include <utility>
#include <vector>

#include "c10d_util.h"
#include "mapp/comm/shm_p2p.h"
#include "mapp/common/check.h"
#include "mapp/common/tunables.h"

namespace mapp::torch_ext {
namespace {

struct Attached {
  std::shared_ptr<comm::ShmP2P> p2p;
  // Works dropped before completion: (handle, the tensor it reads or writes).
  std::vector<std::pair<std::uint64_t, at::Tensor>> orphans;
};

std::mutex& mu() {
  static std::mutex m;
  return m;
}
std::map<std::string, Attached>& attached() {
  static auto* groups = new std::map<std::string, Attached>();
  return *groups;  // leaked: outlives static destruction order at exit
}

// Releases the tensors of dropped works that have completed since.
void sweep(Attached& a) {
  auto& o = a.orphans;
  for (std::size_t i = 0; i < o.size();) {
    bool done = true;
    try {
      done = a.p2p->test(o[i].first);
    } catch (const std::exception&) {  // completed with an error nobody waits for
    }
    if (done) {
      o[i] = std::move(o.back());
      o.pop_back();
    } else {
      ++i;
    }
  }
}

std::shared_ptr<comm::ShmP2P> lookup(const std::string& group_name, const at::Tensor& t,
                                     const char* op) {
  MAPP_CHECK(t.device().is_cpu(), op, ": shared-memory p2p moves CPU tensors; got one on ",
             t.device().str(), " (send device tensors through the group's backend)");
  MAPP_CHECK(t.is_contiguous(), op, ": the tensor must be contiguous");
  std::lock_guard<std::mutex> lock(mu());
  auto it = attached().find(group_name);
  MAPP_CHECK_STATE(it != attached().end(), op, ": group '", group_name,
                   "' has no shared-memory p2p transport; call "
                   "megatronapp.parallel_state.enable_shared_memory(group, p2p=True) first");
  sweep(it->second);
  return it->second.p2p;
}

std::uint32_t checked_tag(std::int64_t tag, const char* op) {
  MAPP_CHECK(tag >= 0 && tag <= 0xffffffffLL, op, ": tag ", tag, " is outside [0, 2^32)");
  return static_cast<std::uint32_t>(tag);
}

}  // namespace

ShmWork::ShmWork(std::shared_ptr<comm::ShmP2P> p2p, std::uint64_t handle, at::Tensor tensor,
                 std::string group_name)
    : p2p_(std::move(p2p)),
      handle_(handle),
      tensor_(std::move(tensor)),
      group_name_(std::move(group_name)) {}

ShmWork::~ShmWork() {
  if (done_) return;
  std::lock_guard<std::mutex> lock(mu());
  auto it = attached().find(group_name_);
  if (it != attached().end() && it->second.p2p == p2p_)
    it->second.orphans.emplace_back(handle_, std::move(tensor_));
  // else the transport was detached: our reference keeps the mapping alive
  // and the tensor dies with us; nobody drives that transport any more.
}

void ShmWork::wait(std::int64_t timeout_ms) {
  if (done_) return;
  const auto timeout =
      timeout_ms < 0 ? internal::collective_timeout() : std::chrono::milliseconds(timeout_ms);
  try {
    p2p_->wait(handle_, timeout);
  } catch (...) {
    done_ = true;  // the transport forgot it (or the job is over): nothing to keep alive
    throw;
  }
  done_ = true;
}

bool ShmWork::is_completed() {
  if (!done_) {
    try {
      done_ = p2p_->test(handle_);
    } catch (...) {
      done_ = true;
      throw;
    }
  }
  return done_;
}

c10::intrusive_ptr<ShmWork> shm_isend(const at::Tensor& tensor, const std::string& group_name,
                                      std::int64_t dst, std::int64_t tag) {
  auto p2p = lookup(group_name, tensor, "shm_isend");
  const auto h = p2p->isend(tensor.data_ptr(), tensor.nbytes(), static_cast<int>(dst),
                            checked_tag(tag, "shm_isend"));
  return c10::make_intrusive<ShmWork>(std::move(p2p), h, tensor, group_name);
}

c10::intrusive_ptr<ShmWork> shm_irecv(const at::Tensor& tensor, const std::string& group_name,
                                      std::int64_t src, std::int64_t tag) {
  auto p2p = lookup(group_name, tensor, "shm_irecv");
  const auto h = p2p->irecv(tensor.data_ptr(), tensor.nbytes(), static_cast<int>(src),
                            checked_tag(tag, "shm_irecv"));
  return c10::make_intrusive<ShmWork>(std::move(p2p), h, tensor, group_name);
}

bool shm_p2p_attach(const std::string& group_name, const std::string& shm_name, bool create) {
  auto pg = internal::resolve(group_name);
  const int rank = static_cast<int>(pg->getRank());
  const int world = static_cast<int>(pg->getSize());
  const auto slot = static_cast<std::size_t>(tunable_int("MAPP_SHM_P2P_SLOT_BYTES"));
  const auto slots = static_cast<int>(tunable_int("MAPP_SHM_P2P_SLOTS"));
  std::shared_ptr<comm::ShmP2P> p = create
                                        ? comm::ShmP2P::create(shm_name, rank, world, slot, slots)
                                        : comm::ShmP2P::open(shm_name, rank, world, slot, slots);
  std::lock_guard<std::mutex> lock(mu());
  attached()[group_name] = Attached{std::move(p), {}};
  return true;
}

void shm_p2p_unlink(const std::string& group_name) {
  std::lock_guard<std::mutex> lock(mu());
  auto it = attached().find(group_name);
  if (it != attached().end()) it->second.p2p->unlink();
}

void shm_p2p_detach(const std::string& group_name) {
  std::lock_guard<std::mutex> lock(mu());
  attached().erase(group_name);
}

std::int64_t shm_p2p_ring_bytes(const std::string& group_name) {
  std::lock_guard<std::mutex> lock(mu());
  auto it = attached().find(group_name);
  return it == attached().end() ? 0 : static_cast<std::int64_t>(it->second.p2p->ring_bytes());
}

bool shm_p2p_attached(const std::string& group_name) {
  std::lock_guard<std::mutex> lock(mu());
  return attached().count(group_name) != 0;
}

}  // namespace mapp::torch_ext
