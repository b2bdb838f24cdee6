#include "mapp/memory/trace.h"

#include <chrono>
#include <cstring>
#include <fstream>
#include <sstream>

#include "mapp/common/check.h"

namespace mapp {
namespace {

constexpr char kMagic[8] = {'M', 'A', 'P', 'P', 'T', 'R', 'C', '1'};

void put_varint(std::string& out, std::uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

class Reader {
 public:
  explicit Reader(const std::string& b) : b_(b) {}
  std::size_t offset() const { return pos_; }
  bool done() const { return pos_ == b_.size(); }
  std::uint8_t byte(const char* what) {
    MAPP_CHECK(pos_ < b_.size(), "allocation trace truncated at byte ", pos_, " (reading ",
               what, ")");
    return static_cast<std::uint8_t>(b_[pos_++]);
  }
  std::uint64_t varint(const char* what) {
    std::uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
      MAPP_CHECK(shift < 64, "allocation trace: varint for ", what, " at byte ", pos_,
                 " is longer than 10 bytes");
      const std::uint8_t c = byte(what);
      v |= static_cast<std::uint64_t>(c & 0x7f) << shift;
      if (!(c & 0x80)) return v;
    }
  }

 private:
  const std::string& b_;
  std::size_t pos_ = 0;
};

}  // namespace

std::string AllocTrace::encode() const {
  std::string out(kMagic, sizeof(kMagic));
  const std::uint64_t n = events.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  for (const TraceEvent& e : events) {
    out.push_back(static_cast<char>(e.op));
    switch (e.op) {
      case TraceOp::kAlloc:
        put_varint(out, e.id);
        put_varint(out, e.size);
        put_varint(out, e.stream);
        break;
      case TraceOp::kFree: put_varint(out, e.id); break;
      case TraceOp::kRecordStream:
        put_varint(out, e.id);
        put_varint(out, e.stream);
        break;
      case TraceOp::kReleaseCached: break;
    }
  }
  return out;
}

AllocTrace AllocTrace::decode(const std::string& bytes) {
  MAPP_CHECK(bytes.size() >= 16 && std::memcmp(bytes.data(), kMagic, 8) == 0,
             "not an allocation trace: the file must start with \"MAPPTRC1\" and a count");
  std::uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= static_cast<std::uint64_t>(static_cast<std::uint8_t>(bytes[8 + i])) << (8 * i);
  // Each event takes at least one byte: a count beyond that is corrupt.
  MAPP_CHECK(n <= bytes.size() - 16, "allocation trace claims ", n, " events but has only ",
             bytes.size() - 16, " bytes of events");
  AllocTrace t;
  t.events.reserve(n);
  Reader r(bytes);
  for (int i = 0; i < 16; ++i) r.byte("header");
  std::unordered_map<std::uint64_t, bool> live;  // id -> still allocated
  for (std::uint64_t i = 0; i < n; ++i) {
    const std::size_t at = r.offset();
    TraceEvent e;
    const std::uint8_t op = r.byte("op");
    switch (op) {
      case 1:
        e.op = TraceOp::kAlloc;
        e.id = r.varint("id");
        e.size = r.varint("size");
        e.stream = r.varint("stream");
        MAPP_CHECK(live.find(e.id) == live.end(), "allocation trace: id ", e.id,
                   " allocated twice (event ", i, ", byte ", at, ")");
        live[e.id] = true;
        break;
      case 2:
      case 3: {
        e.op = op == 2 ? TraceOp::kFree : TraceOp::kRecordStream;
        e.id = r.varint("id");
        if (op == 3) e.stream = r.varint("stream");
        auto it = live.find(e.id);
        MAPP_CHECK(it != live.end() && it->second, "allocation trace: ",
                   op == 2 ? "free" : "record_stream", " of id ", e.id,
                   " which is not allocated (event ", i, ", byte ", at, ")");
        if (op == 2) it->second = false;
        break;
      }
      case 4: e.op = TraceOp::kReleaseCached; break;
      default:
        MAPP_CHECK(false, "allocation trace: unknown op ", int(op), " at byte ", at,
                   " (event ", i, "); valid ops are 1 alloc, 2 free, 3 record_stream, 4 "
                   "release_cached");
    }
    t.events.push_back(e);
  }
  MAPP_CHECK(r.done(), "allocation trace: ", bytes.size() - r.offset(),
             " unexpected bytes after the last of ", n, " events");
  return t;
}

void AllocTrace::save(const std::string& path) const {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  MAPP_CHECK(f.good(), "cannot open '", path, "' for writing");
  const std::string bytes = encode();
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  MAPP_CHECK(f.good(), "writing the allocation trace '", path, "' failed");
}

AllocTrace AllocTrace::load(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  MAPP_CHECK(f.good(), "cannot open allocation trace '", path, "'");
  std::ostringstream ss;
  ss << f.rdbuf();
  try {
    return decode(ss.str());
  } catch (const ValueError& e) {
    throw ValueError(std::string("'") + path + "': " + e.what());
  }
}

void AllocTraceRecorder::on_alloc(const void* ptr, std::size_t bytes, StreamId stream) {
  const std::uint64_t id = next_id_++;
  ids_[ptr] = id;
  trace_.events.push_back({TraceOp::kAlloc, id, bytes, stream});
}

void AllocTraceRecorder::on_free(const void* ptr) {
  auto it = ids_.find(ptr);
  if (it == ids_.end()) return;  // allocated before recording began
  trace_.events.push_back({TraceOp::kFree, it->second, 0, 0});
  ids_.erase(it);
}

void AllocTraceRecorder::on_record_stream(const void* ptr, StreamId stream) {
  auto it = ids_.find(ptr);
  if (it == ids_.end()) return;
  trace_.events.push_back({TraceOp::kRecordStream, it->second, 0, stream});
}

void AllocTraceRecorder::on_release_cached() {
  trace_.events.push_back({TraceOp::kReleaseCached, 0, 0, 0});
}

ReplayResult replay(const AllocTrace& trace, DeviceBackend& device, const PoolOptions& options) {
  CachingPool pool(device, options);
  std::unordered_map<std::uint64_t, void*> ptrs;
  ptrs.reserve(trace.events.size() / 2 + 1);
  ReplayResult out;
  using Clock = std::chrono::steady_clock;
  Clock::duration busy{};
  for (const TraceEvent& e : trace.events) {
    switch (e.op) {
      case TraceOp::kAlloc: {
        const auto t0 = Clock::now();
        void* p = pool.allocate(e.size, e.stream);
        busy += Clock::now() - t0;
        ptrs[e.id] = p;
        break;
      }
      case TraceOp::kFree: {
        auto it = ptrs.find(e.id);
        MAPP_CHECK(it != ptrs.end(), "replay: free of unknown id ", e.id);
        const auto t0 = Clock::now();
        pool.deallocate(it->second);
        busy += Clock::now() - t0;
        ptrs.erase(it);
        break;
      }
      case TraceOp::kRecordStream: {
        auto it = ptrs.find(e.id);
        MAPP_CHECK(it != ptrs.end(), "replay: record_stream of unknown id ", e.id);
        pool.record_stream(it->second, e.stream);
        break;
      }
      case TraceOp::kReleaseCached: pool.release_cached(); break;
    }
    ++out.operations;
  }
  out.stats = pool.stats();
  out.seconds = std::chrono::duration<double>(busy).count();
  for (auto& [id, p] : ptrs) pool.deallocate(p);
  return out;
}

}  // namespace mapp
