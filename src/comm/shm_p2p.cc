#include "mapp/comm/shm_p2p.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <new>

#include "mapp/common/check.h"
#include "shm_segment.h"

namespace mapp::comm {
namespace {

constexpr std::uint64_t kMagic = 0x4d41505050325031ULL;  // "MAPPP2P1"
constexpr int kSpins = 256;                              // busy polls before yielding
constexpr int kYields = 16;         // sched_yield polls before sleeping on the doorbell
constexpr std::size_t kLabel = 64;  // a slot's label, before its bytes

// A member's doorbell: peers bump `word` after they wrote to or freed a slot
// of a ring the member uses, and wake it when it sleeps.
struct alignas(64) Bell {
  std::atomic<std::uint32_t> word;
  std::atomic<std::uint32_t> sleepers;
};

std::uint64_t make_key(std::uint32_t tag, std::uint32_t nth) {
  return (static_cast<std::uint64_t>(nth) << 32) | tag;
}

}  // namespace

struct alignas(64) ShmP2P::Header {
  std::atomic<std::uint64_t> magic;  // written last by the creator
  std::uint32_t world;
  std::uint32_t slots;
  std::uint64_t slot_bytes;
};

struct ShmP2P::Slot {
  std::atomic<std::uint32_t> full;  // 0: the sender may write it; 1: the receiver may read it
  std::uint32_t bytes;              // of this piece
  std::uint64_t key;                // tag | nth message with that tag on this ring
  std::uint64_t offset;             // of this piece in the message
  std::uint64_t total;              // bytes of the whole message
  std::uint8_t* data() { return reinterpret_cast<std::uint8_t*>(this) + kLabel; }
};
static_assert(sizeof(ShmP2P::Slot) <= kLabel);

struct ShmP2P::Op {
  bool send;
  int peer;
  std::uint32_t tag;
  std::size_t bytes;
  bool done = false;
  std::string error;  // set at completion when the message did not fit the receive
};

namespace {

std::size_t header_bytes(int world) {
  return shm::round_to_page(sizeof(ShmP2P::Header) +
                            static_cast<std::size_t>(world) * sizeof(Bell) +
                            static_cast<std::size_t>(world) * sizeof(shm::Member));
}

}  // namespace

std::unique_ptr<ShmP2P> ShmP2P::create(const std::string& name, int rank, int world,
                                       std::size_t slot_bytes, int slots) {
  return std::unique_ptr<ShmP2P>(new ShmP2P(name, rank, world, slot_bytes, slots, true));
}

std::unique_ptr<ShmP2P> ShmP2P::open(const std::string& name, int rank, int world,
                                     std::size_t slot_bytes, int slots) {
  return std::unique_ptr<ShmP2P>(new ShmP2P(name, rank, world, slot_bytes, slots, false));
}

ShmP2P::ShmP2P(const std::string& name, int rank, int world, std::size_t slot_bytes, int slots,
               bool create)
    : name_(name), rank_(rank), world_(world), slot_bytes_(slot_bytes), slots_(slots) {
  MAPP_CHECK(world >= 1 && rank >= 0 && rank < world, "shared-memory p2p: rank ", rank,
             " is not in a group of ", world, " members");
  MAPP_CHECK(slot_bytes >= 64 && slot_bytes % 64 == 0 && slot_bytes <= (1ULL << 31),
             "shared-memory p2p: slot size ", slot_bytes,
             " must be a multiple of 64 between 64 and 2 GiB (MAPP_SHM_P2P_SLOT_BYTES)");
  MAPP_CHECK(slots >= 1 && slots <= 1024, "shared-memory p2p: ", slots,
             " slots per pair; use 1 to 1024 (MAPP_SHM_P2P_SLOTS)");
  stride_ = kLabel + slot_bytes;
  header_bytes_ = header_bytes(world);
  const std::size_t pairs = static_cast<std::size_t>(world) * (world - 1);
  segment_ = std::make_unique<shm::Segment>(
      name, header_bytes_ + pairs * static_cast<std::size_t>(slots) * stride_, create,
      "shared-memory p2p");
  base_ = segment_->base();
  if (create) {
    header_ = new (base_) Header();
    header_->world = static_cast<std::uint32_t>(world);
    header_->slots = static_cast<std::uint32_t>(slots);
    header_->slot_bytes = slot_bytes;
    for (int m = 0; m < world; ++m) new (static_cast<Bell*>(bells()) + m) Bell();
    for (std::size_t i = 0; i < pairs * static_cast<std::size_t>(slots); ++i)
      new (static_cast<std::uint8_t*>(base_) + header_bytes_ + i * stride_) Slot();
    header_->magic.store(kMagic, std::memory_order_release);
  } else {
    header_ = static_cast<Header*>(base_);
    MAPP_CHECK(header_->magic.load(std::memory_order_acquire) == kMagic &&
                   header_->world == static_cast<std::uint32_t>(world) &&
                   header_->slot_bytes == slot_bytes &&
                   header_->slots == static_cast<std::uint32_t>(slots),
               "shared memory '", name, "' was not made for p2p among ", world, " members with ",
               slots, " slots of ", slot_bytes, " bytes (found ", header_->world, " members, ",
               header_->slots, " slots of ", header_->slot_bytes,
               " bytes): every member must use the same settings");
  }
  peers_.resize(static_cast<std::size_t>(world));
  shm::register_member(members(), rank_);
}

ShmP2P::~ShmP2P() = default;

void ShmP2P::unlink() { segment_->unlink(); }

void* ShmP2P::bells() const { return static_cast<std::uint8_t*>(base_) + sizeof(Header); }

shm::Member* ShmP2P::members() const {
  return reinterpret_cast<shm::Member*>(static_cast<std::uint8_t*>(bells()) +
                                        static_cast<std::size_t>(world_) * sizeof(Bell));
}

ShmP2P::Slot* ShmP2P::slot(int src, int dst, int i) const {
  const std::size_t pair = static_cast<std::size_t>(src) * (world_ - 1) +
                           static_cast<std::size_t>(dst < src ? dst : dst - 1);
  return reinterpret_cast<Slot*>(static_cast<std::uint8_t*>(base_) + header_bytes_ +
                                 (pair * slots_ + i) * stride_);
}

void ShmP2P::ring(int member) {
  Bell& b = static_cast<Bell*>(bells())[member];
  b.word.fetch_add(1, std::memory_order_seq_cst);
  shm::wake_all(&b.word, &b.sleepers);
}

ShmP2P::Handle ShmP2P::isend(const void* data, std::size_t bytes, int dst, std::uint32_t tag) {
  MAPP_CHECK(dst >= 0 && dst < world_ && dst != rank_, "shared-memory p2p: member ", rank_,
             " cannot send to member ", dst, " of a group of ", world_);
  MAPP_CHECK(bytes == 0 || data != nullptr, "shared-memory p2p: send of ", bytes,
             " bytes from a null buffer");
  std::lock_guard<std::mutex> lock(mu_);
  Peer& p = peers_[dst];
  const Handle h = next_++;
  ops_.emplace(h, Op{true, dst, tag, bytes, false, {}});
  p.pending.push_back(Send{static_cast<const std::uint8_t*>(data), bytes, 0, false,
                           make_key(tag, p.sent_with_tag[tag]++), h});
  progress();
  return h;
}

ShmP2P::Handle ShmP2P::irecv(void* data, std::size_t bytes, int src, std::uint32_t tag) {
  MAPP_CHECK(src >= 0 && src < world_ && src != rank_, "shared-memory p2p: member ", rank_,
             " cannot receive from member ", src, " of a group of ", world_);
  MAPP_CHECK(bytes == 0 || data != nullptr, "shared-memory p2p: receive of ", bytes,
             " bytes into a null buffer");
  std::lock_guard<std::mutex> lock(mu_);
  Peer& p = peers_[src];
  const Handle h = next_++;
  ops_.emplace(h, Op{false, src, tag, bytes, false, {}});
  const std::uint64_t key = make_key(tag, p.posted_with_tag[tag]++);
  Recv r{static_cast<std::uint8_t*>(data), bytes, 0, 0, 0, h};
  if (auto it = p.early.find(key); it != p.early.end()) {
    // Pieces that came before this receive: take them over.
    Unexpected& u = it->second;
    r.total = u.total;
    r.received = u.received;
    r.pieces = u.pieces;
    if (u.total == bytes) std::memcpy(r.data, u.data.data(), bytes);
    p.early.erase(it);
  }
  if (!finish_if_complete(r)) p.posted.emplace(key, r);
  progress();
  return h;
}

bool ShmP2P::finish_if_complete(const Recv& r) {
  if (r.pieces == 0 || r.received != r.total) return false;
  Op& op = ops_.at(r.handle);
  op.done = true;
  if (r.total != r.bytes) {
    op.error = "shared-memory p2p: member " + std::to_string(rank_) + " posted a receive of " +
               std::to_string(r.bytes) + " bytes from member " + std::to_string(op.peer) +
               " (tag " + std::to_string(op.tag) + ") but the message has " +
               std::to_string(r.total) +
               " bytes; both sides must agree on the shape and dtype of what they exchange";
  }
  return true;
}

void ShmP2P::progress() {
  for (int m = 0; m < world_; ++m) {
    if (m == rank_) continue;
    Peer& p = peers_[m];
    bool touched = push(m, p);
    touched = drain(m, p) || touched;
    if (touched) ring(m);
  }
}

bool ShmP2P::push(int dst, Peer& p) {
  bool wrote = false;
  while (!p.pending.empty()) {
    Send& s = p.pending.front();
    for (int i = 0; i < slots_ && (s.sent < s.bytes || !s.started); ++i) {
      Slot* sl = slot(rank_, dst, i);
      if (sl->full.load(std::memory_order_acquire) != 0) continue;
      const std::size_t n = std::min(slot_bytes_, s.bytes - s.sent);
      if (n) std::memcpy(sl->data(), s.data + s.sent, n);
      sl->bytes = static_cast<std::uint32_t>(n);
      sl->key = s.key;
      sl->offset = s.sent;
      sl->total = s.bytes;
      sl->full.store(1, std::memory_order_release);
      s.sent += n;
      s.started = wrote = true;
    }
    if (s.sent < s.bytes || !s.started) break;  // the ring is full
    ops_.at(s.handle).done = true;
    p.pending.pop_front();
  }
  return wrote;
}

bool ShmP2P::drain(int src, Peer& p) {
  bool freed = false;
  int held = 0;  // full slots whose receive is not posted yet
  for (int i = 0; i < slots_; ++i) {
    Slot* sl = slot(src, rank_, i);
    if (sl->full.load(std::memory_order_acquire) != 1) continue;
    auto it = p.posted.find(sl->key);
    if (it == p.posted.end()) {
      ++held;
      continue;
    }
    Recv& r = it->second;
    r.total = sl->total;
    if (sl->total == r.bytes && sl->bytes) std::memcpy(r.data + sl->offset, sl->data(), sl->bytes);
    r.received += sl->bytes;
    ++r.pieces;
    sl->full.store(0, std::memory_order_release);
    freed = true;
    if (finish_if_complete(r)) p.posted.erase(it);
  }
  if (held == slots_) {
    // Every slot holds a piece nobody asked for yet: park them so the sender
    // can go on (it may be sending what we wait for behind them).
    for (int i = 0; i < slots_; ++i) {
      Slot* sl = slot(src, rank_, i);
      Unexpected& u = p.early[sl->key];
      if (u.pieces == 0) {
        u.total = sl->total;
        u.data.resize(sl->total);
      }
      if (sl->bytes) std::memcpy(u.data.data() + sl->offset, sl->data(), sl->bytes);
      u.received += sl->bytes;
      ++u.pieces;
      sl->full.store(0, std::memory_order_release);
    }
    freed = true;
  }
  return freed;
}

bool ShmP2P::take_if_done(Handle h) {
  auto it = ops_.find(h);
  MAPP_CHECK(it != ops_.end(), "shared-memory p2p: operation ", h,
             " is unknown or was already completed (wait or test it once)");
  if (!it->second.done) return false;
  std::string error = std::move(it->second.error);
  ops_.erase(it);
  MAPP_CHECK(error.empty(), error);
  return true;
}

bool ShmP2P::test(Handle h) {
  std::lock_guard<std::mutex> lock(mu_);
  progress();
  return take_if_done(h);
}

void ShmP2P::wait(Handle h, std::chrono::milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  Bell& bell = static_cast<Bell*>(bells())[rank_];
  for (int i = 0;; ++i) {
    const std::uint32_t seen = bell.word.load(std::memory_order_seq_cst);
    std::string what;
    int peer = -1;
    {
      std::lock_guard<std::mutex> lock(mu_);
      progress();
      if (take_if_done(h)) return;
      const Op& op = ops_.at(h);
      peer = op.peer;
      what = std::string(op.send ? "send of " : "receive of ") + std::to_string(op.bytes) +
             " bytes " + (op.send ? "to" : "from") + " member " + std::to_string(op.peer) +
             " (tag " + std::to_string(op.tag) + ")";
    }
    if (i < kSpins) {
      shm::cpu_relax();
      continue;
    }
    if (i < kSpins + kYields) {
      sched_yield();
      continue;
    }
    const auto now = std::chrono::steady_clock::now();
    if (now >= deadline)
      MAPP_FAIL_BACKEND(what, " on shared-memory p2p '", name_, "' (member ", rank_, " of ", world_,
                        ") timed out: the peer died, is stuck, or never posts the "
                        "matching operation (MAPP_COLLECTIVE_TIMEOUT_S)");
    // Only the peer matters: other members may have finished and exited.
    std::int32_t pid = 0;
    if (shm::exited(members(), peer, rank_, &pid))
      MAPP_FAIL_BACKEND(what, " on shared-memory p2p '", name_, "' (member ", rank_, " of ", world_,
                        "): member ", peer, " (pid ", pid,
                        ") has exited; the job cannot continue (see that rank's output for why "
                        "it stopped)");
    shm::sleep_while(&bell.word, &bell.sleepers, seen, deadline);
  }
}

std::size_t ShmP2P::in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ops_.size();
}

}  // namespace mapp::comm
