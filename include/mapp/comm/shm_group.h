// Collectives among the processes of one node through one shared-memory
// segment: the intra-node transport for CPU tensors (what NCCL's SHM/P2P
// transports are to GPUs). Gloo moves every byte through TCP loopback sockets
// and its own threads; here a member writes its data once into its slot and
// the members reduce disjoint sub-chunks in place, so a 512 KiB all-reduce is
// two memory passes and two barriers.
//
// Layout of the segment: a header (magic, world, slot size, the barrier) and
// two areas of `world` slots of `slot_bytes` each. Consecutive pieces use
// alternate areas, so a member may overwrite an area once it has passed the
// first barrier of the *next* piece, which every member reaches only after it
// finished reading this one: two barriers per all-reduce piece, one per
// all-gather, all-to-all or reduce-scatter piece. Tensors larger than a slot move in
// pieces.
//
// Members announce each collective (operation, bytes, element size) and
// compare after its first barrier: members that issue different collectives
// get an error naming each member's call, not a silent wrong answer.
//
// Every member computes the same result bit for bit: each element is reduced
// by exactly one member, in member order, and everyone copies that value.
//
// The barrier spins briefly, then sleeps on a futex in the shared mapping (so
// oversubscribed cores are not burnt), and fails with BackendError after the
// timeout: a dead or diverged member becomes an error naming the operation,
// never a hang. A member whose process has exited (its pid, recorded at open,
// no longer exists in our pid namespace) is named within ~100 ms instead of
// at the timeout.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

namespace mapp::comm {
namespace shm {
class Segment;
struct Member;
}  // namespace shm

class ShmGroup {
 public:
  struct Header;  // in the segment; defined in shm_group.cc
  struct Call;    // a member's announced collective, checked against the others
  // `add(dst, src, bytes)` adds the elements at `src` into those at `dst`.
  using Reduce = std::function<void(void* dst, const void* src, std::size_t bytes)>;

  // Member 0 creates the segment `name` (a POSIX shm name, "/..."); the others
  // open it after the creator returned (order them with a collective). Open
  // checks that world and slot size agree with the creator's.
  static std::unique_ptr<ShmGroup> create(const std::string& name, int rank, int world,
                                          std::size_t slot_bytes);
  static std::unique_ptr<ShmGroup> open(const std::string& name, int rank, int world,
                                        std::size_t slot_bytes);
  ~ShmGroup();
  ShmGroup(const ShmGroup&) = delete;
  ShmGroup& operator=(const ShmGroup&) = delete;

  // Removes the name (the mappings stay valid); call once every member opened.
  void unlink();

  int rank() const { return rank_; }
  int world() const { return world_; }
  std::size_t slot_bytes() const { return slot_bytes_; }

  // In-place sum of `bytes` at `data` (elements of `elem_size` bytes).
  void all_reduce(void* data, std::size_t bytes, std::size_t elem_size, const Reduce& add,
                  std::chrono::milliseconds timeout);
  // `out` (world * bytes) receives every member's `in` (bytes), member-major.
  void all_gather(const void* in, std::size_t bytes, void* out, std::chrono::milliseconds timeout);
  // `in` and `out` hold world chunks of `bytes` each: chunk j of member i's
  // `in` lands in chunk i of member j's `out`.
  void all_to_all(const void* in, std::size_t bytes, void* out, std::chrono::milliseconds timeout);
  // Uneven all-to-all: member i's `send[j]` bytes (at `in` + send[0] + ... +
  // send[j-1]) land at member j's `out` + recv[0] + ... + recv[i-1], where
  // member j's recv[i] must equal member i's send[j]. Every member calls it,
  // also with nothing to send or receive (the MoE dispatcher's exchange).
  void all_to_all_v(const void* in, const std::size_t* send, void* out, const std::size_t* recv,
                    std::chrono::milliseconds timeout);
  // Member `root`'s `bytes` at `data` land at every member's `data`.
  void broadcast(void* data, std::size_t bytes, int root, std::chrono::milliseconds timeout);
  // `in` holds world chunks of `bytes` each; `out` (bytes) receives the sum of
  // every member's chunk `rank`.
  void reduce_scatter(const void* in, std::size_t bytes, void* out, std::size_t elem_size,
                      const Reduce& add, std::chrono::milliseconds timeout);

 private:
  ShmGroup(const std::string& name, int rank, int world, std::size_t slot_bytes, bool create);
  std::uint8_t* slot(int area, int member) const;
  void barrier(const char* op, std::chrono::steady_clock::time_point deadline);
  Call* calls(int set) const;
  shm::Member* members() const;
  int announce(std::uint32_t op, std::size_t bytes, std::size_t elem);  // returns its set
  void verify(int set);  // throws StateError when the members' calls differ

  std::string name_;
  int rank_;
  int world_;
  std::size_t slot_bytes_;
  std::size_t header_bytes_ = 0;
  std::unique_ptr<shm::Segment> segment_;
  void* base_ = nullptr;
  Header* header_ = nullptr;
  std::uint64_t piece_ = 0;  // pieces moved so far; picks the area
  std::uint64_t ops_ = 0;    // collectives announced so far; picks the call set
  bool broken_ = false;      // a barrier timed out: members are out of step
  std::mutex mu_;            // one collective at a time per process
};

}  // namespace mapp::comm
