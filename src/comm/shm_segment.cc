#include "shm_segment.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>

#include "mapp/common/check.h"

namespace mapp::comm::shm {

long futex(std::atomic<std::uint32_t>* addr, int op, std::uint32_t val, const timespec* ts) {
  return syscall(SYS_futex, reinterpret_cast<std::uint32_t*>(addr), op, val, ts, nullptr, 0);
}

void sleep_while(std::atomic<std::uint32_t>* word, std::atomic<std::uint32_t>* sleepers,
                 std::uint32_t seen, std::chrono::steady_clock::time_point deadline) {
  const auto now = std::chrono::steady_clock::now();
  if (now >= deadline) return;
  const auto left =
      std::min<std::chrono::nanoseconds>(deadline - now, std::chrono::milliseconds(100));
  timespec ts{static_cast<time_t>(left.count() / 1000000000),
              static_cast<long>(left.count() % 1000000000)};
  sleepers->fetch_add(1, std::memory_order_seq_cst);
  if (word->load(std::memory_order_seq_cst) == seen) futex(word, FUTEX_WAIT, seen, &ts);
  sleepers->fetch_sub(1, std::memory_order_seq_cst);
}

void wake_all(std::atomic<std::uint32_t>* word, const std::atomic<std::uint32_t>* sleepers) {
  if (sleepers->load(std::memory_order_seq_cst) > 0) futex(word, FUTEX_WAKE, INT_MAX, nullptr);
}

namespace {
std::string errno_text() { return std::strerror(errno); }
}  // namespace

Segment::Segment(const std::string& name, std::size_t bytes, bool create, const char* what)
    : name_(name), bytes_(bytes), unlinked_(!create) {
  MAPP_CHECK(!name.empty() && name[0] == '/' && name.find('/', 1) == std::string::npos, what, ": '",
             name, "' is not a POSIX shm name ('/' then no '/')");
  const int fd = ::shm_open(name.c_str(), create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR, 0600);
  if (fd < 0)
    MAPP_FAIL_BACKEND(what, ": shm_open('", name, "') failed: ", errno_text(),
                      create ? "" : "; the creating member must create it before others open it");
  // Reserve the pages now: on a size-limited tmpfs (a container's 64 MiB
  // /dev/shm) a sparse segment would fail later with SIGBUS, not an error.
  if (create) {
    const int rc = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes));
    if (rc != 0) {
      ::close(fd);
      ::shm_unlink(name.c_str());
      MAPP_FAIL_BACKEND(what, ": reserving ", bytes, " bytes of shared memory '", name,
                        "' failed: ", std::strerror(rc),
                        " (is /dev/shm large enough? lower MAPP_SHM_SLOT_BYTES or set "
                        "MAPP_SHM_COLLECTIVES=0)");
    }
  }
  struct stat st {};
  if (!create && (::fstat(fd, &st) != 0 || static_cast<std::size_t>(st.st_size) != bytes)) {
    ::close(fd);
    MAPP_FAIL_BACKEND(what, ": shared memory '", name, "' has ", st.st_size, " bytes, expected ",
                      bytes, ": members disagree on the group size or MAPP_SHM_SLOT_BYTES");
  }
  base_ = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (base_ == MAP_FAILED) {
    base_ = nullptr;
    if (create) ::shm_unlink(name.c_str());
    MAPP_FAIL_BACKEND(what, ": mmap of shared memory '", name, "' (", bytes,
                      " bytes) failed: ", errno_text());
  }
}

Segment::~Segment() {
  if (base_ != nullptr) ::munmap(base_, bytes_);
  unlink();
}

void Segment::unlink() {
  if (!unlinked_) ::shm_unlink(name_.c_str());
  unlinked_ = true;
}

void register_member(Member* table, int rank) {
  struct stat st {};
  table[rank].pid_ns =
      ::stat("/proc/self/ns/pid", &st) == 0 ? static_cast<std::uint64_t>(st.st_ino) : 0;
  table[rank].pid.store(static_cast<std::int32_t>(::getpid()), std::memory_order_release);
}

bool exited(const Member* table, int member, int self, std::int32_t* pid) {
  const std::uint64_t ns = table[self].pid_ns;
  const std::int32_t p = table[member].pid.load(std::memory_order_acquire);
  // Only a member in our pid namespace: a pid means the same process there.
  if (member == self || ns == 0 || p <= 0 || table[member].pid_ns != ns) return false;
  if (::kill(p, 0) != 0 && errno == ESRCH) {
    *pid = p;
    return true;
  }
  return false;
}

int dead_member(const Member* table, int world, int self, std::int32_t* pid) {
  for (int i = 0; i < world; ++i) {
    if (exited(table, i, self, pid)) return i;
  }
  return -1;
}

}  // namespace mapp::comm::shm
