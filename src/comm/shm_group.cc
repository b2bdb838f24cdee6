#include "mapp/comm/shm_group.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cstring>
#include <ctime>
#include <new>
#include <vector>

#include "mapp/common/check.h"
#include "shm_segment.h"

namespace mapp::comm {
namespace {

using shm::cpu_relax;

constexpr std::uint64_t kMagic = 0x4d41505053484d31ULL;  // "MAPPSHM1"
constexpr int kSpins = 256;                              // busy polls before yielding
constexpr int kYields = 16;  // sched_yield polls before sleeping on the futex

}  // namespace

struct ShmGroup::Header {
  std::atomic<std::uint64_t> magic;  // written last by the creator
  std::uint32_t world;
  std::uint64_t slot_bytes;
  alignas(64) std::atomic<std::uint32_t> count;     // members arrived at the barrier
  alignas(64) std::atomic<std::uint32_t> phase;     // barrier generation (futex word)
  alignas(64) std::atomic<std::uint32_t> sleepers;  // members asleep on `phase`
};

// What a member is about to run; members compare them after the first barrier
// of every collective (two sets, alternating like the data areas).
struct ShmGroup::Call {
  std::uint32_t op;    // 1 all_reduce, 2 all_gather, 3 reduce_scatter, 4 all_to_all,
                       // 5 all_to_all_v, 6 broadcast
  std::uint32_t elem;  // element size (broadcast: the root)
  std::uint64_t bytes;
};

namespace {

std::size_t header_bytes(int world) {
  return shm::round_to_page(sizeof(ShmGroup::Header) +
                            2 * static_cast<std::size_t>(world) * sizeof(ShmGroup::Call) +
                            static_cast<std::size_t>(world) * sizeof(shm::Member));
}

const char* op_name(std::uint32_t op) {
  switch (op) {
    case 1:
      return "all_reduce";
    case 2:
      return "all_gather";
    case 3:
      return "reduce_scatter";
    case 4:
      return "all_to_all";
    case 5:
      return "all_to_all_v";
    case 6:
      return "broadcast";
    default:
      return "?";
  }
}

}  // namespace

std::unique_ptr<ShmGroup> ShmGroup::create(const std::string& name, int rank, int world,
                                           std::size_t slot_bytes) {
  return std::unique_ptr<ShmGroup>(new ShmGroup(name, rank, world, slot_bytes, true));
}

std::unique_ptr<ShmGroup> ShmGroup::open(const std::string& name, int rank, int world,
                                         std::size_t slot_bytes) {
  return std::unique_ptr<ShmGroup>(new ShmGroup(name, rank, world, slot_bytes, false));
}

ShmGroup::ShmGroup(const std::string& name, int rank, int world, std::size_t slot_bytes,
                   bool create)
    : name_(name), rank_(rank), world_(world), slot_bytes_(slot_bytes) {
  MAPP_CHECK(world >= 1 && rank >= 0 && rank < world, "shared-memory group: rank ", rank,
             " is not in a group of ", world, " members");
  MAPP_CHECK(slot_bytes >= 64 * static_cast<std::size_t>(world) && slot_bytes % 64 == 0,
             "shared-memory group: slot size ", slot_bytes,
             " must be a multiple of 64 and at "
             "least 64 x the group size (",
             world, "); raise MAPP_SHM_SLOT_BYTES");
  header_bytes_ = header_bytes(world);
  segment_ = std::make_unique<shm::Segment>(
      name, header_bytes_ + 2 * static_cast<std::size_t>(world) * slot_bytes, create,
      "shared-memory group");
  base_ = segment_->base();
  if (create) {
    header_ = new (base_) Header();
    header_->world = static_cast<std::uint32_t>(world);
    header_->slot_bytes = slot_bytes;
    header_->magic.store(kMagic, std::memory_order_release);
  } else {
    header_ = static_cast<Header*>(base_);
    MAPP_CHECK(header_->magic.load(std::memory_order_acquire) == kMagic &&
                   header_->world == static_cast<std::uint32_t>(world) &&
                   header_->slot_bytes == slot_bytes,
               "shared memory '", name, "' was not made by a group of ", world, " with slots of ",
               slot_bytes, " bytes (found world ", header_->world, ", slot ", header_->slot_bytes,
               "): every member must use the same settings");
  }
  shm::register_member(members(), rank_);
}

shm::Member* ShmGroup::members() const {
  return reinterpret_cast<shm::Member*>(static_cast<std::uint8_t*>(base_) + sizeof(Header) +
                                        2 * static_cast<std::size_t>(world_) * sizeof(Call));
}

ShmGroup::~ShmGroup() = default;

void ShmGroup::unlink() { segment_->unlink(); }

std::uint8_t* ShmGroup::slot(int area, int member) const {
  return static_cast<std::uint8_t*>(base_) + header_bytes_ +
         (static_cast<std::size_t>(area) * world_ + member) * slot_bytes_;
}

void ShmGroup::barrier(const char* op, std::chrono::steady_clock::time_point deadline) {
  Header& h = *header_;
  const std::uint32_t phase = h.phase.load(std::memory_order_acquire);
  if (h.count.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<std::uint32_t>(world_)) {
    h.count.store(0, std::memory_order_relaxed);
    h.phase.store(phase + 1, std::memory_order_seq_cst);
    shm::wake_all(&h.phase, &h.sleepers);
    return;
  }
  for (int i = 0; i < kSpins + kYields; ++i) {
    if (h.phase.load(std::memory_order_acquire) != phase) return;
    if (i < kSpins) {
      cpu_relax();
    } else {
      sched_yield();
    }
  }
  for (;;) {
    if (h.phase.load(std::memory_order_acquire) != phase) return;
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline) {
      broken_ = true;
      MAPP_FAIL_BACKEND(op, " on shared-memory group '", name_, "' (member ", rank_, " of ", world_,
                        ") timed out waiting for the other members: one of them died, "
                        "is stuck, or issued a different collective (MAPP_COLLECTIVE_TIMEOUT_S)");
    }
    std::int32_t pid = 0;
    if (const int dead = shm::dead_member(members(), world_, rank_, &pid); dead >= 0) {
      broken_ = true;
      MAPP_FAIL_BACKEND(op, " on shared-memory group '", name_, "' (member ", rank_, " of ", world_,
                        "): member ", dead, " (pid ", pid,
                        ") has exited while the others wait for it; the job cannot continue "
                        "(see that rank's output for why it stopped)");
    }
    shm::sleep_while(&h.phase, &h.sleepers, phase, deadline);
  }
}

ShmGroup::Call* ShmGroup::calls(int set) const {
  auto* first = reinterpret_cast<Call*>(static_cast<std::uint8_t*>(base_) + sizeof(Header));
  return first + static_cast<std::size_t>(set) * world_;
}

int ShmGroup::announce(std::uint32_t op, std::size_t bytes, std::size_t elem) {
  const int set = static_cast<int>(ops_++ & 1);
  calls(set)[rank_] = Call{op, static_cast<std::uint32_t>(elem), bytes};
  return set;
}

void ShmGroup::verify(int set) {
  const Call* c = calls(set);
  bool same = true;
  for (int m = 0; m < world_; ++m) {
    same = same && c[m].op == c[rank_].op && c[m].elem == c[rank_].elem &&
           c[m].bytes == c[rank_].bytes;
  }
  if (same) return;
  broken_ = true;
  std::string all;
  for (int m = 0; m < world_; ++m) {
    all += (m ? ", " : "") + std::string("member ") + std::to_string(m) + ": " + op_name(c[m].op) +
           " of " + std::to_string(c[m].bytes) + " bytes (" + std::to_string(c[m].elem) +
           "-byte elements)";
  }
  MAPP_CHECK_STATE(false, "shared-memory group '", name_,
                   "': the members issued different collectives (", all,
                   "); every member must issue the same collectives in the same order");
}

namespace {

void check_usable(bool broken, const std::string& name, const char* op) {
  MAPP_CHECK_STATE(!broken, op, " on shared-memory group '", name,
                   "': an earlier collective on this group timed out, so the members are out "
                   "of step; the group cannot be used again (restart the job)");
}

}  // namespace

void ShmGroup::all_reduce(void* data, std::size_t bytes, std::size_t elem_size, const Reduce& add,
                          std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable(broken_, name_, "all_reduce");
  MAPP_CHECK(elem_size > 0 && bytes % elem_size == 0, "all_reduce: ", bytes,
             " bytes is not a whole number of ", elem_size, "-byte elements");
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto* p = static_cast<std::uint8_t*>(data);
  const std::size_t n = bytes / elem_size;
  const std::size_t piece_elems = slot_bytes_ / elem_size;
  const int set = n ? announce(1, bytes, elem_size) : 0;
  for (std::size_t off = 0; off < n; off += piece_elems) {
    const std::size_t cnt = std::min(piece_elems, n - off);
    const int area = static_cast<int>(piece_++ & 1);
    std::memcpy(slot(area, rank_), p + off * elem_size, cnt * elem_size);
    barrier("all_reduce", deadline);
    if (off == 0) verify(set);
    // Member r reduces sub-chunk r into its own slot, adding the others in member order.
    const std::size_t per = (cnt + world_ - 1) / world_;
    const auto range = [&](int m) {
      const std::size_t lo = std::min(cnt, per * m);
      return std::pair<std::size_t, std::size_t>(lo, std::min(cnt, lo + per));
    };
    const auto [lo, hi] = range(rank_);
    if (hi > lo) {
      for (int m = 0; m < world_; ++m) {
        if (m != rank_)
          add(slot(area, rank_) + lo * elem_size, slot(area, m) + lo * elem_size,
              (hi - lo) * elem_size);
      }
    }
    barrier("all_reduce", deadline);
    for (int m = 0; m < world_; ++m) {
      const auto [mlo, mhi] = range(m);
      if (mhi > mlo)
        std::memcpy(p + (off + mlo) * elem_size, slot(area, m) + mlo * elem_size,
                    (mhi - mlo) * elem_size);
    }
  }
}

void ShmGroup::all_gather(const void* in, std::size_t bytes, void* out,
                          std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable(broken_, name_, "all_gather");
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const auto* src = static_cast<const std::uint8_t*>(in);
  auto* dst = static_cast<std::uint8_t*>(out);
  const int set = bytes ? announce(2, bytes, 1) : 0;
  for (std::size_t off = 0; off < bytes; off += slot_bytes_) {
    const std::size_t cnt = std::min(slot_bytes_, bytes - off);
    const int area = static_cast<int>(piece_++ & 1);
    std::memcpy(slot(area, rank_), src + off, cnt);
    barrier("all_gather", deadline);
    if (off == 0) verify(set);
    for (int m = 0; m < world_; ++m) std::memcpy(dst + m * bytes + off, slot(area, m), cnt);
  }
}

void ShmGroup::broadcast(void* data, std::size_t bytes, int root,
                         std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable(broken_, name_, "broadcast");
  MAPP_CHECK(root >= 0 && root < world_, "broadcast: root ", root, " is outside the group of ",
             world_, " members");
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto* p = static_cast<std::uint8_t*>(data);
  // One barrier per piece, as all_gather: the root writes its slot of this
  // piece's area, the others read it.
  const int set = bytes ? announce(6, bytes, static_cast<std::size_t>(root)) : 0;
  for (std::size_t off = 0; off < bytes; off += slot_bytes_) {
    const std::size_t cnt = std::min(slot_bytes_, bytes - off);
    const int area = static_cast<int>(piece_++ & 1);
    if (rank_ == root) std::memcpy(slot(area, root), p + off, cnt);
    barrier("broadcast", deadline);
    if (off == 0) verify(set);
    if (rank_ != root) std::memcpy(p + off, slot(area, root), cnt);
  }
}

void ShmGroup::all_to_all(const void* in, std::size_t bytes, void* out,
                          std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable(broken_, name_, "all_to_all");
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const auto* src = static_cast<const std::uint8_t*>(in);
  auto* dst = static_cast<std::uint8_t*>(out);
  const std::size_t step = slot_bytes_ / world_;  // bytes of each chunk per piece
  const int set = bytes ? announce(4, bytes, 1) : 0;
  for (std::size_t off = 0; off < bytes; off += step) {
    const std::size_t cnt = std::min(step, bytes - off);
    const int area = static_cast<int>(piece_++ & 1);
    for (int m = 0; m < world_; ++m)
      std::memcpy(slot(area, rank_) + m * cnt, src + m * bytes + off, cnt);
    barrier("all_to_all", deadline);
    if (off == 0) verify(set);
    for (int m = 0; m < world_; ++m)
      std::memcpy(dst + m * bytes + off, slot(area, m) + rank_ * cnt, cnt);
  }
}

void ShmGroup::all_to_all_v(const void* in, const std::size_t* send, void* out,
                            const std::size_t* recv, std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable(broken_, name_, "all_to_all_v");
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::vector<std::size_t> send_off(world_ + 1, 0), recv_off(world_ + 1, 0);
  std::size_t mine = 0;  // the largest chunk this member moves
  for (int m = 0; m < world_; ++m) {
    send_off[m + 1] = send_off[m] + send[m];
    recv_off[m + 1] = recv_off[m] + recv[m];
    mine = std::max({mine, send[m], recv[m]});
  }
  // The members' largest chunks decide how many pieces everyone moves: each
  // announces its own, and after one barrier all read the maximum.
  const int set = announce(5, mine, 1);
  barrier("all_to_all_v", deadline);
  const Call* c = calls(set);
  std::size_t most = 0;
  for (int m = 0; m < world_; ++m) {
    if (c[m].op != 5) verify(set);  // throws, naming every member's call
    most = std::max<std::size_t>(most, c[m].bytes);
  }
  const auto* src = static_cast<const std::uint8_t*>(in);
  auto* dst = static_cast<std::uint8_t*>(out);
  const std::size_t step = slot_bytes_ / world_;
  const auto part = [step](std::size_t total, std::size_t off) {
    return off >= total ? std::size_t{0} : std::min(step, total - off);
  };
  for (std::size_t off = 0; off < most; off += step) {
    const int area = static_cast<int>(piece_++ & 1);
    for (int m = 0; m < world_; ++m) {
      if (const std::size_t n = part(send[m], off))
        std::memcpy(slot(area, rank_) + m * step, src + send_off[m] + off, n);
    }
    barrier("all_to_all_v", deadline);
    for (int m = 0; m < world_; ++m) {
      if (const std::size_t n = part(recv[m], off))
        std::memcpy(dst + recv_off[m] + off, slot(area, m) + rank_ * step, n);
    }
  }
}

void ShmGroup::reduce_scatter(const void* in, std::size_t bytes, void* out, std::size_t elem_size,
                              const Reduce& add, std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mu_);
  check_usable(broken_, name_, "reduce_scatter");
  MAPP_CHECK(elem_size > 0 && bytes % elem_size == 0, "reduce_scatter: ", bytes,
             " bytes is not a whole number of ", elem_size, "-byte elements");
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  const auto* src = static_cast<const std::uint8_t*>(in);
  auto* dst = static_cast<std::uint8_t*>(out);
  // A piece carries `step` bytes of each of the world chunks.
  const std::size_t step = slot_bytes_ / world_ / elem_size * elem_size;
  const int set = bytes ? announce(3, bytes, elem_size) : 0;
  for (std::size_t off = 0; off < bytes; off += step) {
    const std::size_t cnt = std::min(step, bytes - off);
    const int area = static_cast<int>(piece_++ & 1);
    for (int m = 0; m < world_; ++m)
      std::memcpy(slot(area, rank_) + m * cnt, src + m * bytes + off, cnt);
    barrier("reduce_scatter", deadline);
    if (off == 0) verify(set);
    std::memcpy(dst + off, slot(area, 0) + rank_ * cnt, cnt);
    for (int m = 1; m < world_; ++m) add(dst + off, slot(area, m) + rank_ * cnt, cnt);
  }
}

}  // namespace mapp::comm
