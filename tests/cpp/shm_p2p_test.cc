// Shared-memory point-to-point among real processes (fork): messages larger
// than the ring in pieces, tags repeated and matched in order, receives posted
// before and after their sends, both directions at once with rings far smaller
// than the traffic (no deadlock), size mismatches and dead peers as errors.
#include "mapp/comm/shm_p2p.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "fork_members.h"
#include "mapp/common/check.h"

namespace mapp::comm {
namespace {

using std::chrono::milliseconds;
constexpr milliseconds kLong(20000);

std::string unique_name(const char* what) {
  return "/mapp-p2p-test-" + std::string(what) + "-" + std::to_string(::getpid());
}

// Runs body(member) in `world` processes (member 0 creates the segment before
// the others start) and expects every one of them to exit 0.
void run_members(int world, std::size_t slot, int slots, const std::string& name,
                 const std::function<int(ShmP2P&)>& body) {
  auto creator = ShmP2P::create(name, 0, world, slot, slots);
  testing::run_forked<ShmP2P>(
      world, *creator, [&](int m) { return ShmP2P::open(name, m, world, slot, slots); }, body);
}

std::vector<float> pattern(int from, int to, int tag, std::size_t n) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i)
    v[i] = static_cast<float>(from * 1000003 + to * 10007 + tag * 101) + static_cast<float>(i);
  return v;
}

TEST(ShmP2P, RingOfStagesExchangesMessagesLargerThanTheRingBothWays) {
  // Every member sends to both neighbours and receives from both, 6 messages
  // each way with 3 distinct tags (each tag used twice), 1000 floats per
  // message through 2 slots of 256 bytes: 16 pieces per message, the ring
  // holds 1/8 of one. Every receive is posted after every send (worst order).
  for (int world : {2, 3, 4}) {
    run_members(world, 256, 2, unique_name("ring"), [world](ShmP2P& g) {
      const int me = g.rank(), next = (me + 1) % world, prev = (me + world - 1) % world;
      const std::size_t n = 1000;
      std::vector<std::vector<float>> out, in;
      std::vector<ShmP2P::Handle> handles;
      for (int k = 0; k < 6; ++k) {
        for (int to : {next, prev}) {
          out.push_back(pattern(me, to, k, n));
          handles.push_back(g.isend(out.back().data(), n * sizeof(float), to, k % 3));
          if (world == 2) break;
        }
      }
      std::vector<std::pair<int, int>> expect;  // (from, k)
      for (int k = 0; k < 6; ++k) {
        for (int from : {prev, next}) {
          in.emplace_back(n);
          handles.push_back(g.irecv(in.back().data(), n * sizeof(float), from, k % 3));
          expect.emplace_back(from, k);
          if (world == 2) break;
        }
      }
      for (auto h : handles) g.wait(h, kLong);
      for (std::size_t j = 0; j < in.size(); ++j) {
        if (in[j] != pattern(expect[j].first, me, expect[j].second, n)) return 1;
      }
      return g.in_flight() == 0 ? 0 : 2;
    });
  }
}

TEST(ShmP2P, ReceivePostedFirstAndZeroByteMessages) {
  run_members(2, 128, 1, unique_name("order"), [](ShmP2P& g) {
    const int peer = 1 - g.rank();
    if (g.rank() == 1) {
      std::vector<double> a(100), b(3);
      auto h0 = g.irecv(nullptr, 0, peer, 7);
      auto h1 = g.irecv(a.data(), a.size() * sizeof(double), peer, 9);
      auto h2 = g.irecv(b.data(), b.size() * sizeof(double), peer, 8);
      g.wait(h2, kLong);  // out of posting order: tag 8 was sent last
      g.wait(h1, kLong);
      g.wait(h0, kLong);
      for (int i = 0; i < 100; ++i)
        if (a[i] != i * 0.5) return 1;
      return b == std::vector<double>{1, 2, 3} ? 0 : 1;
    }
    std::vector<double> a(100), b{1, 2, 3};
    for (int i = 0; i < 100; ++i) a[i] = i * 0.5;
    auto h0 = g.isend(nullptr, 0, peer, 7);
    auto h1 = g.isend(a.data(), a.size() * sizeof(double), peer, 9);
    auto h2 = g.isend(b.data(), b.size() * sizeof(double), peer, 8);
    while (!g.test(h0)) {
    }
    g.wait(h1, kLong);
    g.wait(h2, kLong);
    return 0;
  });
}

TEST(ShmP2P, SizeMismatchIsAnErrorNamingBothSizes) {
  run_members(2, 256, 2, unique_name("size"), [](ShmP2P& g) {
    std::vector<float> buf(16);
    if (g.rank() == 0) {
      g.wait(g.isend(buf.data(), 16 * sizeof(float), 1, 3), kLong);
      return 0;
    }
    try {
      g.wait(g.irecv(buf.data(), 8 * sizeof(float), 0, 3), kLong);
    } catch (const ValueError& e) {
      const std::string msg = e.what();
      return msg.find("32 bytes") != std::string::npos && msg.find("64 bytes") != std::string::npos
                 ? 0
                 : 1;
    }
    return 1;
  });
}

TEST(ShmP2P, ADeadPeerIsNamedLongBeforeTheTimeout) {
  const std::string name = unique_name("dead");
  auto g = ShmP2P::create(name, 0, 2, 256, 2);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    auto member = ShmP2P::open(name, 1, 2, 256, 2);  // joins, then dies without sending
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);  // reaped: the pid no longer exists
  float x = 0;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    g->wait(g->irecv(&x, sizeof(x), 1, 0), milliseconds(60000));
    FAIL() << "expected the dead member to be noticed";
  } catch (const BackendError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("member 1 (pid " + std::to_string(pid) + ") has exited"), std::string::npos)
        << what;
    EXPECT_NE(what.find("receive of 4 bytes from member 1 (tag 0)"), std::string::npos) << what;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  g->unlink();
}

TEST(ShmP2P, TimeoutAndBadArgumentsAreClearErrors) {
  const std::string name = unique_name("bad");
  auto g = ShmP2P::create(name, 0, 2, 256, 2);
  float x = 0;
  auto h = g->irecv(&x, sizeof(x), 1, 0);
  try {
    g->wait(h, milliseconds(50));
    ADD_FAILURE() << "expected a timeout";
  } catch (const BackendError& e) {
    EXPECT_NE(std::string(e.what()).find("timed out"), std::string::npos) << e.what();
  }
  EXPECT_THROW(g->isend(&x, sizeof(x), 0, 0), ValueError);         // to itself
  EXPECT_THROW(g->irecv(&x, sizeof(x), 2, 0), ValueError);         // no such member
  EXPECT_THROW(ShmP2P::open(name, 1, 2, 512, 2), std::exception);  // other slot size
  EXPECT_THROW(ShmP2P::create(unique_name("bad2"), 0, 2, 100, 2), ValueError);
  g->unlink();
}

}  // namespace
}  // namespace mapp::comm
