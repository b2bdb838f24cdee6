// Ring-buffered tracer with a background Chrome-trace writer.
#include "mapp/trace/tracer.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <unordered_map>

#include "mapp/common/check.h"

namespace mapp::trace {

namespace {
constexpr const char* kCategoryNames[] = {"compute", "collective", "p2p",  "optimizer",
                                          "data",    "iteration",  "user"};

void copy_truncated(char* dst, std::size_t cap, const std::string& s) {
  const std::size_t n = std::min(s.size(), cap - 1);
  std::memcpy(dst, s.data(), n);
  dst[n] = '\0';
}

// JSON string escaping for names we did not choose (user scopes, group names).
void append_escaped(std::string& out, const char* s) {
  for (; *s; ++s) {
    const char c = *s;
    if (c == '"' || c == '\\') {
      out += '\\';
      out += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out += c;
    }
  }
}

std::mutex g_mu;
std::unique_ptr<Tracer> g_tracer;
// Replaced tracers are closed but kept: a scope open on another thread may
// still record into one (a no-op once closed, never a dangling pointer).
std::vector<std::unique_ptr<Tracer>> g_retired;
std::atomic<Tracer*> g_ptr{nullptr};
std::mutex g_seq_mu;
std::unordered_map<std::string, std::int64_t> g_seq;
thread_local Lane t_lane = kMainLane;
std::mutex g_flight_mu;
std::string g_flight;
}  // namespace

void set_in_flight(const std::string& what) {
  std::lock_guard<std::mutex> lock(g_flight_mu);
  g_flight = what;
}

std::string in_flight() {
  std::lock_guard<std::mutex> lock(g_flight_mu);
  return g_flight;
}

const char* category_name(Category c) { return kCategoryNames[static_cast<int>(c)]; }

Category parse_category(const std::string& name) {
  for (int i = 0; i < 7; ++i) {
    if (name == kCategoryNames[i]) return static_cast<Category>(i);
  }
  MAPP_CHECK(false, "unknown trace category '", name,
             "' (expected compute, collective, p2p, optimizer, data, iteration or user)");
  return Category::kUser;
}

void Event::set_name(const std::string& s) { copy_truncated(name, sizeof name, s); }
void Event::set_group(const std::string& s) { copy_truncated(group, sizeof group, s); }

std::int64_t SteadyClock::now_ns() const {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

Tracer::Tracer(int rank, const std::string& path, TracerOptions options,
               std::shared_ptr<Clock> clock)
    : rank_(rank),
      path_(path),
      options_(options),
      clock_(clock ? std::move(clock) : std::make_shared<SteadyClock>()),
      enabled_(options.enabled) {
  MAPP_CHECK(options_.capacity >= 16, "trace ring capacity must be >= 16 events, got ",
             options_.capacity);
  MAPP_CHECK(options_.flush_interval_ms >= 1, "trace flush interval must be >= 1 ms");
  file_ = std::fopen(path.c_str(), "w");
  MAPP_CHECK(file_ != nullptr, "cannot open trace file '", path, "' for writing: ",
             std::strerror(errno), " (does --trace-dir exist and is it writable?)");
  ring_.resize(options_.capacity);
  std::string head = "[\n";
  head += "{\"ph\":\"M\",\"pid\":" + std::to_string(rank) +
          ",\"name\":\"process_name\",\"args\":{\"name\":\"rank " + std::to_string(rank) +
          "\"}},\n";
  const char* lanes[] = {"main", "communication", "p2p", "user"};
  for (int i = 0; i < 4; ++i) {
    head += "{\"ph\":\"M\",\"pid\":" + std::to_string(rank) + ",\"tid\":" + std::to_string(i) +
            ",\"name\":\"thread_name\",\"args\":{\"name\":\"" + lanes[i] + "\"}},\n";
  }
  // The clock this file's timestamps come from, for the aggregator.
  head += "{\"ph\":\"M\",\"pid\":" + std::to_string(rank) +
          ",\"name\":\"megatronapp\",\"args\":{\"rank\":" + std::to_string(rank) +
          ",\"clock\":\"monotonic\"}},\n";
  std::fwrite(head.data(), 1, head.size(), file_);
  std::fflush(file_);
  bytes_written_ += head.size();
  writer_ = std::thread([this] { writer_loop(); });
}

Tracer::~Tracer() { close(); }

void Tracer::record(const Event& e) {
  if (!enabled() || stop_.load(std::memory_order_relaxed)) return;
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (size_ == ring_.size()) {
      ++dropped_;
      return;
    }
    Event& slot = ring_[(head_ + size_) % ring_.size()];
    slot = e;
    if (slot.iteration < 0) slot.iteration = iteration();
    ++size_;
    wake = size_ * 2 == ring_.size();
  }
  ++recorded_;
  if (wake) cv_.notify_one();
}

void Tracer::drain_locked(std::vector<Event>& out) {
  out.clear();
  out.reserve(size_);
  for (std::size_t i = 0; i < size_; ++i) out.push_back(ring_[(head_ + i) % ring_.size()]);
  head_ = (head_ + size_) % ring_.size();
  size_ = 0;
}

std::string Tracer::to_json(const Event& e, int rank) {
  std::string s;
  s.reserve(256);
  char num[64];
  s += "{\"ph\":\"X\",\"pid\":";
  s += std::to_string(rank);
  s += ",\"tid\":";
  s += std::to_string(static_cast<int>(e.lane));
  s += ",\"name\":\"";
  append_escaped(s, e.name);
  s += "\",\"cat\":\"";
  s += category_name(e.category);
  // Microseconds with nanosecond resolution.
  std::snprintf(num, sizeof num, "\",\"ts\":%lld.%03lld,\"dur\":%lld.%03lld",
                static_cast<long long>(e.start_ns / 1000),
                static_cast<long long>(e.start_ns % 1000),
                static_cast<long long>(std::max<std::int64_t>(0, e.end_ns - e.start_ns) / 1000),
                static_cast<long long>(std::max<std::int64_t>(0, e.end_ns - e.start_ns) % 1000));
  s += num;
  s += ",\"args\":{\"iter\":";
  s += std::to_string(e.iteration);
  if (e.microbatch >= 0) s += ",\"mb\":" + std::to_string(e.microbatch);
  if (e.chunk >= 0) s += ",\"chunk\":" + std::to_string(e.chunk);
  if (e.peer >= 0) s += ",\"peer\":" + std::to_string(e.peer);
  if (e.bytes >= 0) s += ",\"bytes\":" + std::to_string(e.bytes);
  if (e.group[0] != '\0') {
    s += ",\"group\":\"";
    append_escaped(s, e.group);
    s += "\"";
  }
  if (e.seq >= 0) s += ",\"seq\":" + std::to_string(e.seq);
  if (e.busy_ns >= 0) {
    std::snprintf(num, sizeof num, ",\"busy_us\":%lld.%03lld",
                  static_cast<long long>(e.busy_ns / 1000), static_cast<long long>(e.busy_ns % 1000));
    s += num;
  }
  s += "}}";
  return s;
}

void Tracer::write_events(const std::vector<Event>& events) {
  if (events.empty()) return;
  std::string buf;
  buf.reserve(events.size() * 200);
  for (const Event& e : events) {
    buf += to_json(e, rank_);
    buf += ",\n";
  }
  std::lock_guard<std::mutex> lock(file_mu_);
  if (file_ == nullptr) return;
  std::fwrite(buf.data(), 1, buf.size(), file_);
  std::fflush(file_);
  bytes_written_ += buf.size();
}

void Tracer::writer_loop() {
  std::vector<Event> batch;
  while (!stop_.load()) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::milliseconds(options_.flush_interval_ms),
                   [this] { return stop_.load() || size_ * 2 >= ring_.size(); });
      drain_locked(batch);
    }
    write_events(batch);
  }
}

void Tracer::flush() {
  std::vector<Event> batch;
  {
    std::lock_guard<std::mutex> lock(mu_);
    drain_locked(batch);
  }
  write_events(batch);
}

void Tracer::close() {
  if (closed_) return;
  closed_ = true;
  stop_.store(true);
  cv_.notify_one();
  if (writer_.joinable()) writer_.join();
  flush();
  std::lock_guard<std::mutex> lock(file_mu_);
  if (file_ != nullptr) {
    // A metadata event keeps the array valid after the last "," .
    const std::string tail = "{\"ph\":\"M\",\"pid\":" + std::to_string(rank_) +
                             ",\"name\":\"trace_end\",\"args\":{\"dropped\":" +
                             std::to_string(dropped_.load()) + "}}\n]\n";
    std::fwrite(tail.data(), 1, tail.size(), file_);
    bytes_written_ += tail.size();
    std::fclose(file_);
    file_ = nullptr;
  }
}

Tracer* global() { return g_ptr.load(std::memory_order_acquire); }

void install(std::unique_ptr<Tracer> tracer) {
  std::lock_guard<std::mutex> lock(g_mu);
  g_ptr.store(tracer.get(), std::memory_order_release);
  if (g_tracer) {
    g_tracer->close();
    g_retired.push_back(std::move(g_tracer));
  }
  g_tracer = std::move(tracer);
}

void uninstall() {
  std::lock_guard<std::mutex> lock(g_mu);
  g_ptr.store(nullptr, std::memory_order_release);
  if (g_tracer) {
    g_tracer->close();
    g_retired.push_back(std::move(g_tracer));
  }
}

std::int64_t next_seq(const std::string& group) {
  std::lock_guard<std::mutex> lock(g_seq_mu);
  return g_seq[group]++;
}

void reset_seqs() {
  std::lock_guard<std::mutex> lock(g_seq_mu);
  g_seq.clear();
}

void set_thread_lane(Lane lane) { t_lane = lane; }
Lane thread_lane() { return t_lane; }

Scope::Scope(const char* name, Category category) : t_(global()) {
  if (t_ == nullptr || !t_->enabled()) {
    t_ = nullptr;
    return;
  }
  e_.set_name(name);
  e_.category = category;
  e_.lane = thread_lane();
  e_.start_ns = t_->now_ns();
}

Scope::~Scope() {
  if (t_ == nullptr) return;
  e_.end_ns = t_->now_ns();
  t_->record(e_);
}

}  // namespace mapp::trace
