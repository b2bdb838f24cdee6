// Tracer: fixed-size events through the ring and the background writer into a
// well-formed Chrome trace, with a fake clock; the file is loadable mid-run.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "mapp/common/check.h"
#include "mapp/trace/tracer.h"

namespace tr = mapp::trace;

namespace {

std::string read(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// What a viewer does with a file whose writer died: drop the trailing comma,
// close the array.
nlohmann::json load_possibly_unterminated(std::string text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == ',')) text.pop_back();
  if (text.back() != ']') text += "]";
  return nlohmann::json::parse(text);
}

std::string tmp(const char* name) {
  return (std::filesystem::temp_directory_path() / name).string();
}

}  // namespace

TEST(Tracer, WritesWellFormedChromeTraceWithFakeClock) {
  auto clock = std::make_shared<tr::FakeClock>();
  const std::string path = tmp("mapp_trace_test.json");
  tr::install(std::make_unique<tr::Tracer>(3, path, tr::TracerOptions{}, clock));
  tr::global()->set_iteration(7);
  for (int mb = 0; mb < 5; ++mb) {
    tr::Scope s("forward", tr::Category::kCompute);
    s.event().microbatch = mb;
    s.event().chunk = 0;
    clock->advance(1500);  // 1.5 us
  }
  {
    tr::set_thread_lane(tr::kCommLane);
    tr::Scope c("all_reduce", tr::Category::kCollective);
    c.event().set_group("dp\"group");  // escaped in the output
    c.event().seq = tr::next_seq("dp\"group");
    c.event().bytes = 4096;
    clock->advance(2000);
    tr::set_thread_lane(tr::kMainLane);
  }
  // Mid-run (before close) the file loads once flushed.
  tr::global()->flush();
  const auto mid = load_possibly_unterminated(read(path));
  EXPECT_GE(mid.size(), 6u);
  tr::uninstall();
  const auto j = nlohmann::json::parse(read(path));  // closed: a strict JSON array
  ASSERT_TRUE(j.is_array());
  int x = 0;
  double prev_end = -1;
  for (const auto& e : j) {
    ASSERT_TRUE(e.contains("ph") && e.contains("pid") && e.contains("name"));
    EXPECT_EQ(e["pid"], 3);
    if (e["ph"] != "X") continue;
    ++x;
    for (const char* k : {"tid", "ts", "dur", "cat", "args"}) EXPECT_TRUE(e.contains(k)) << k;
    EXPECT_EQ(e["args"]["iter"], 7);
    if (e["tid"] == 0) {  // one lane: no overlaps, in order
      EXPECT_GE(e["ts"].get<double>(), prev_end);
      prev_end = e["ts"].get<double>() + e["dur"].get<double>();
      EXPECT_DOUBLE_EQ(e["dur"].get<double>(), 1.5);
    } else {
      EXPECT_EQ(e["name"], "all_reduce");
      EXPECT_EQ(e["args"]["group"], "dp\"group");
      EXPECT_EQ(e["args"]["seq"], 0);
      EXPECT_EQ(e["args"]["bytes"], 4096);
      EXPECT_DOUBLE_EQ(e["ts"].get<double>(), 7.5);
    }
  }
  EXPECT_EQ(x, 6);
  std::filesystem::remove(path);
}

TEST(Tracer, FullRingDropsAndCountsInsteadOfBlocking) {
  auto clock = std::make_shared<tr::FakeClock>();
  const std::string path = tmp("mapp_trace_drop.json");
  tr::TracerOptions o;
  o.capacity = 16;
  o.flush_interval_ms = 100000;  // the writer only wakes at half-full
  tr::Tracer t(0, path, o, clock);
  tr::Event e;
  e.set_name("x");
  for (int i = 0; i < 10000; ++i) t.record(e);
  EXPECT_EQ(t.recorded() + t.dropped(), 10000u);
  t.close();
  const auto j = nlohmann::json::parse(read(path));
  std::size_t events = 0;
  for (const auto& ev : j) events += ev["ph"] == "X";
  EXPECT_EQ(events, t.recorded());
  std::filesystem::remove(path);
}

TEST(Tracer, DisabledRecordsNothingAndSequencesStillCount) {
  const std::string path = tmp("mapp_trace_off.json");
  tr::TracerOptions o;
  o.enabled = false;
  tr::install(std::make_unique<tr::Tracer>(1, path, o));
  tr::reset_seqs();
  for (int i = 0; i < 3; ++i) {
    tr::Scope s("all_reduce", tr::Category::kCollective);
    s.event().seq = tr::next_seq("g");
  }
  EXPECT_EQ(tr::next_seq("g"), 3);
  EXPECT_EQ(tr::global()->recorded(), 0u);
  tr::uninstall();
  std::filesystem::remove(path);
}

TEST(Tracer, BadPathIsAClearError) {
  try {
    tr::Tracer t(0, "/nonexistent/dir/trace.json");
    FAIL();
  } catch (const mapp::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("cannot open trace file"), std::string::npos);
  }
}
