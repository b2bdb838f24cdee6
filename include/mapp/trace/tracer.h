// Always-on, low-overhead tracing: a per-process ring of fixed-size events and
// a background writer that appends them to a Chrome Trace Event file.
//
// record() copies one 128-byte event into the ring under a short lock (no
// allocation, no formatting, no I/O); the writer thread wakes every
// flush_interval_ms (or when the ring is half full), formats the pending
// events and appends them to the file with one write + flush. The file is the
// JSON-array flavour of the Trace Event Format ("[" then one event per line,
// each followed by ","), which trace viewers accept without the closing "]"
// (written by close()), so a process that dies mid-run leaves a loadable file
// missing only its last flush interval. A full ring drops events and counts
// them (dropped()) rather than blocking the training thread.
//
// Times are nanoseconds of a Clock: SteadyClock (CLOCK_MONOTONIC, the clock of
// Python's time.monotonic_ns) by default, a FakeClock in tests. Collective
// events carry the c10d group name and a per-group sequence number, so an
// aggregator can match the instances of one collective across ranks.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace mapp::trace {

enum class Category : std::uint8_t {
  kCompute,     // forward / backward work of a microbatch
  kCollective,  // TP collectives, DP bucket reductions
  kP2P,         // pipeline sends and receive waits
  kOptimizer,   // optimizer step, gradient finalization
  kData,        // data loading
  kIteration,   // one whole training step
  kUser,        // megatronapp.trace.scope / mapp::trace::Scope
};
const char* category_name(Category c);
Category parse_category(const std::string& name);

// Lanes (Chrome "tid") so that nothing on one lane overlaps.
enum Lane : std::uint8_t { kMainLane = 0, kCommLane = 1, kP2PLane = 2, kUserLane = 3 };

struct Event {
  char name[32] = {};   // truncated to 31 characters
  char group[32] = {};  // c10d group name of a collective ("" otherwise)
  std::int64_t start_ns = 0, end_ns = 0;
  std::int64_t bytes = -1;  // payload of a transfer / collective, -1 if unknown
  std::int64_t seq = -1;    // per-group collective sequence number
  // Time the device was busy with this op (CPU: the thread's CPU time; GPU:
  // CUDA events), -1 if unknown. Excludes waiting for inputs or a core.
  std::int64_t busy_ns = -1;
  std::int32_t microbatch = -1, chunk = -1, peer = -1, iteration = -1;
  Category category = Category::kUser;
  std::uint8_t lane = kMainLane;
  std::uint8_t reserved[6] = {};

  void set_name(const std::string& s);
  void set_group(const std::string& s);
};
static_assert(sizeof(Event) == 128, "trace events are fixed-size");

class Clock {
 public:
  virtual ~Clock() = default;
  virtual std::int64_t now_ns() const = 0;
};

class SteadyClock : public Clock {
 public:
  std::int64_t now_ns() const override;
};

class FakeClock : public Clock {
 public:
  std::int64_t now_ns() const override { return t_.load(); }
  void set(std::int64_t t) { t_.store(t); }
  void advance(std::int64_t dt) { t_.fetch_add(dt); }

 private:
  std::atomic<std::int64_t> t_{0};
};

struct TracerOptions {
  std::size_t capacity = 1 << 16;  // events in the ring
  int flush_interval_ms = 200;
  bool enabled = true;  // sampling: the caller toggles set_enabled per iteration
};

class Tracer {
 public:
  // Opens (truncates) `path` and writes the header and metadata events.
  Tracer(int rank, const std::string& path, TracerOptions options = {},
         std::shared_ptr<Clock> clock = nullptr);
  ~Tracer();  // close()
  Tracer(const Tracer&) = delete;
  Tracer& operator=(const Tracer&) = delete;

  void record(const Event& e);  // thread-safe; no-op while disabled
  std::int64_t now_ns() const { return clock_->now_ns(); }
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  void set_enabled(bool on) { enabled_.store(on, std::memory_order_relaxed); }
  void set_iteration(std::int32_t it) { iteration_.store(it, std::memory_order_relaxed); }
  std::int32_t iteration() const { return iteration_.load(std::memory_order_relaxed); }

  void flush();  // writes every pending event now (synchronously)
  void close();  // flush, write the closing "]", stop the writer; idempotent

  int rank() const { return rank_; }
  const std::string& path() const { return path_; }
  std::uint64_t recorded() const { return recorded_.load(); }
  std::uint64_t dropped() const { return dropped_.load(); }
  std::uint64_t bytes_written() const { return bytes_written_.load(); }

  // Formats one event as a Trace Event JSON object (no trailing comma).
  static std::string to_json(const Event& e, int rank);

 private:
  void writer_loop();
  void drain_locked(std::vector<Event>& out);
  void write_events(const std::vector<Event>& events);

  int rank_;
  std::string path_;
  TracerOptions options_;
  std::shared_ptr<Clock> clock_;
  std::FILE* file_ = nullptr;
  std::mutex mu_;  // ring
  std::condition_variable cv_;
  std::vector<Event> ring_;
  std::size_t head_ = 0, size_ = 0;
  std::mutex file_mu_;
  std::atomic<bool> enabled_;
  std::atomic<std::int32_t> iteration_{-1};
  std::atomic<bool> stop_{false};
  std::atomic<std::uint64_t> recorded_{0}, dropped_{0}, bytes_written_{0};
  std::thread writer_;
  bool closed_ = false;
};

// The process-wide tracer (nullptr when tracing is off). install() replaces
// (and closes) the previous one.
Tracer* global();
void install(std::unique_ptr<Tracer> tracer);
void uninstall();

// Next sequence number of a collective on `group` (always counted, traced or
// not, so numbers agree across ranks whatever the sampling).
std::int64_t next_seq(const std::string& group);
void reset_seqs();

// The collective currently in flight on this process ("" if none), e.g.
// "all_reduce on group '3' (seq 57)": named by the dead-rank watchdog.
void set_in_flight(const std::string& what);
std::string in_flight();

// The lane of the calling thread (communication threads set kCommLane).
void set_thread_lane(Lane lane);
Lane thread_lane();

// RAII scope on the global tracer: records [construction, destruction).
class Scope {
 public:
  Scope(const char* name, Category category);
  ~Scope();
  Event& event() { return e_; }  // fill in arguments before the scope ends
  Scope(const Scope&) = delete;
  Scope& operator=(const Scope&) = delete;

 private:
  Tracer* t_;
  Event e_;
};

}  // namespace mapp::trace
