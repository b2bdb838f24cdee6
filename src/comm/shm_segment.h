// What the shared-memory transports (ShmGroup's collectives, ShmP2P's
// send/recv) share: a mapped POSIX segment, the futex, and the table of
// member pids through which a waiter notices that a peer's process exited.
// Internal to src/comm.
#pragma once

#include <time.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

namespace mapp::comm::shm {

static_assert(std::atomic<std::uint32_t>::is_always_lock_free,
              "shared-memory transports need address-free 32-bit atomics");

constexpr std::size_t kPage = 4096;

inline std::size_t round_to_page(std::size_t n) { return (n + kPage - 1) / kPage * kPage; }

// FUTEX_WAIT (until `*addr != val` or `ts`) / FUTEX_WAKE on a word in a
// mapping shared between processes (so never FUTEX_PRIVATE).
long futex(std::atomic<std::uint32_t>* addr, int op, std::uint32_t val, const timespec* ts);

// The waiters' sleep, shared by the barrier and the p2p doorbells: sleeps on
// `word` while it still reads `seen` (counted in `sleepers`, so a waker only
// makes the syscall when someone sleeps), at most until `deadline` and at
// most 100 ms, the slice after which a waiter re-checks its deadline and
// whether a peer has exited.
void sleep_while(std::atomic<std::uint32_t>* word, std::atomic<std::uint32_t>* sleepers,
                 std::uint32_t seen, std::chrono::steady_clock::time_point deadline);

// Wakes every sleeper of `word` (call after changing it).
void wake_all(std::atomic<std::uint32_t>* word, const std::atomic<std::uint32_t>* sleepers);

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// A POSIX shared-memory segment mapped read-write. The creator makes it
// (O_EXCL) and reserves its pages; an opener checks that the size matches.
// `what` names the user in errors ("shared-memory group", ...).
class Segment {
 public:
  Segment(const std::string& name, std::size_t bytes, bool create, const char* what);
  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  void* base() const { return base_; }
  std::size_t bytes() const { return bytes_; }
  const std::string& name() const { return name_; }
  // Removes the name (mappings stay valid); idempotent.
  void unlink();

 private:
  std::string name_;
  std::size_t bytes_;
  void* base_ = nullptr;
  bool unlinked_ = false;
};

// A member's identity, recorded when it opens the segment.
struct Member {
  std::atomic<std::int32_t> pid;  // 0 until the member has opened the segment
  std::uint64_t pid_ns;           // inode of its /proc/self/ns/pid (0: unknown)
};

// Records this process as member `rank` of `table`.
void register_member(Member* table, int rank);

// Whether `member`'s process (recorded when it opened) no longer exists in our
// pid namespace (its pid in *pid); false when that cannot be told.
bool exited(const Member* table, int member, int self, std::int32_t* pid);

// A member of `table[0..world)` other than `self` that exited(), or -1.
int dead_member(const Member* table, int world, int self, std::int32_t* pid);

}  // namespace mapp::comm::shm
