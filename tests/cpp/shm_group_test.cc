// The shared-memory group among real processes (fork): sums, gathers and
// reduce-scatters against closed forms, in pieces smaller than the data, and
// the failure paths (a member that never arrives, mismatched settings).
#include "mapp/comm/shm_group.h"

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "fork_members.h"
#include "mapp/common/check.h"

namespace mapp::comm {
namespace {

using std::chrono::milliseconds;

const ShmGroup::Reduce kAddFloat = [](void* dst, const void* src, std::size_t bytes) {
  auto* d = static_cast<float*>(dst);
  const auto* s = static_cast<const float*>(src);
  for (std::size_t i = 0; i < bytes / sizeof(float); ++i) d[i] += s[i];
};

std::string unique_name(const char* what) {
  return "/mapp-test-" + std::string(what) + "-" + std::to_string(::getpid());
}

// Runs body(member) in `world` processes (member 0 creates the segment before
// the others start) and expects every one of them to exit 0.
void run_members(int world, std::size_t slot, const std::string& name,
                 const std::function<int(ShmGroup&)>& body) {
  auto creator = ShmGroup::create(name, 0, world, slot);
  testing::run_forked<ShmGroup>(
      world, *creator, [&](int m) { return ShmGroup::open(name, m, world, slot); }, body);
}

TEST(ShmGroup, AllReduceMatchesClosedFormAcrossPieces) {
  for (int world : {2, 3, 4}) {
    // 256-byte slots: 1000 floats move in 16 pieces, the last one short.
    run_members(world, 256, unique_name("ar"), [world](ShmGroup& g) {
      for (std::size_t n : {1UL, 7UL, 64UL, 1000UL}) {
        std::vector<float> x(n);
        for (std::size_t i = 0; i < n; ++i) x[i] = static_cast<float>(g.rank() * 1000 + i);
        g.all_reduce(x.data(), n * sizeof(float), sizeof(float), kAddFloat, milliseconds(20000));
        const float base = 1000.0F * static_cast<float>(world * (world - 1) / 2);
        for (std::size_t i = 0; i < n; ++i) {
          if (x[i] != base + static_cast<float>(world * i)) return 1;
        }
      }
      return 0;
    });
  }
}

TEST(ShmGroup, AllGatherAllToAllAndReduceScatterMatchClosedForm) {
  run_members(3, 192, unique_name("ag"), [](ShmGroup& g) {
    const int w = g.world();
    const std::size_t n = 100;  // floats per member: 400 bytes, pieces of 192
    std::vector<float> in(n), out(n * w);
    for (std::size_t i = 0; i < n; ++i) in[i] = static_cast<float>(g.rank() * 10000 + i);
    g.all_gather(in.data(), n * sizeof(float), out.data(), milliseconds(20000));
    for (int m = 0; m < w; ++m) {
      for (std::size_t i = 0; i < n; ++i) {
        if (out[m * n + i] != static_cast<float>(m * 10000 + i)) return 1;
      }
    }
    // reduce_scatter: chunk c of member m holds m + c*1000 + i.
    std::vector<float> full(n * w), mine(n);
    for (int c = 0; c < w; ++c) {
      for (std::size_t i = 0; i < n; ++i)
        full[c * n + i] = static_cast<float>(g.rank() + c * 1000 + i);
    }
    g.reduce_scatter(full.data(), n * sizeof(float), mine.data(), sizeof(float), kAddFloat,
                     milliseconds(20000));
    for (std::size_t i = 0; i < n; ++i) {
      const float want = static_cast<float>(w * (w - 1) / 2 + w * (g.rank() * 1000 + i));
      if (mine[i] != want) return 2;
    }
    // all_to_all: chunk c of member m holds m * 100 + c * 10000 + i.
    std::vector<float> sent(n * w), got(n * w);
    for (int c = 0; c < w; ++c) {
      for (std::size_t i = 0; i < n; ++i)
        sent[c * n + i] = static_cast<float>(g.rank() * 100 + c * 10000 + i);
    }
    g.all_to_all(sent.data(), n * sizeof(float), got.data(), milliseconds(20000));
    for (int m = 0; m < w; ++m) {
      for (std::size_t i = 0; i < n; ++i) {
        if (got[m * n + i] != static_cast<float>(m * 100 + g.rank() * 10000 + i)) return 4;
      }
    }
    return 0;
  });
}

// Broadcast from every root, in pieces (400 bytes through 192-byte slots),
// interleaved with an all-reduce so the areas alternate across operations.
TEST(ShmGroup, BroadcastFromEveryRootAcrossPieces) {
  run_members(3, 192, unique_name("bc"), [](ShmGroup& g) {
    const std::size_t n = 100;
    for (int root = 0; root < g.world(); ++root) {
      std::vector<float> x(n, -1.0F);
      if (g.rank() == root)
        for (std::size_t i = 0; i < n; ++i) x[i] = static_cast<float>(root * 1000 + i);
      g.broadcast(x.data(), n * sizeof(float), root, milliseconds(20000));
      for (std::size_t i = 0; i < n; ++i)
        if (x[i] != static_cast<float>(root * 1000 + i)) return 1;
      float one = 1.0F;
      g.all_reduce(&one, sizeof(float), sizeof(float), kAddFloat, milliseconds(20000));
      if (one != static_cast<float>(g.world())) return 2;
    }
    return 0;
  });
}

// Uneven all-to-all: member i sends (i + 2 * j) * 37 % 101 floats to member j
// (some zero), across pieces of a small slot; then a member with nothing to
// send or receive at all.
TEST(ShmGroup, UnevenAllToAllMatchesClosedForm) {
  run_members(3, 192, unique_name("a2av"), [](ShmGroup& g) {
    const int w = g.world(), me = g.rank();
    const auto count = [](int i, int j) {
      return static_cast<std::size_t>((i + 2 * j) * 37 % 101 % 50);
    };
    std::vector<std::size_t> send(w), recv(w);
    std::vector<float> in, out;
    for (int j = 0; j < w; ++j) {
      send[j] = count(me, j) * sizeof(float);
      recv[j] = count(j, me) * sizeof(float);
      for (std::size_t i = 0; i < count(me, j); ++i)
        in.push_back(static_cast<float>(me * 10000 + j * 100 + i));
    }
    std::size_t total = 0;
    for (int j = 0; j < w; ++j) total += count(j, me);
    out.assign(total, -1.0F);
    g.all_to_all_v(in.data(), send.data(), out.data(), recv.data(), milliseconds(20000));
    std::size_t k = 0;
    for (int j = 0; j < w; ++j) {
      for (std::size_t i = 0; i < count(j, me); ++i, ++k) {
        if (out[k] != static_cast<float>(j * 10000 + me * 100 + i)) return 1;
      }
    }
    // Member 1 neither sends nor receives; 0 and 2 swap one float.
    const std::vector<std::size_t> s1 =
        me == 1 ? std::vector<std::size_t>{0, 0, 0}
                : std::vector<std::size_t>{me == 2 ? 4U : 0U, 0, me == 0 ? 4U : 0U};
    float x = static_cast<float>(me), y = -1.0F;
    g.all_to_all_v(&x, s1.data(), &y, s1.data(), milliseconds(20000));
    if (me != 1 && y != static_cast<float>(2 - me)) return 2;
    return 0;
  });
}

TEST(ShmGroup, MissingMemberTimesOutThenRefusesFurtherUse) {
  auto g = ShmGroup::create(unique_name("to"), 0, 2, 256);
  float x = 1.0F;
  try {
    g->all_reduce(&x, sizeof x, sizeof x, kAddFloat, milliseconds(200));
    FAIL() << "expected a timeout";
  } catch (const BackendError& e) {
    EXPECT_NE(std::string(e.what()).find("timed out"), std::string::npos) << e.what();
  }
  EXPECT_THROW(g->all_reduce(&x, sizeof x, sizeof x, kAddFloat, milliseconds(200)), StateError);
}

TEST(ShmGroup, AMemberThatExitedIsNamedLongBeforeTheTimeout) {
  const std::string name = unique_name("dead");
  auto g = ShmGroup::create(name, 0, 2, 256);
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    auto member = ShmGroup::open(name, 1, 2, 256);  // joins, then dies without a collective
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);  // reaped: the pid no longer exists
  float x = 1.0F;
  const auto t0 = std::chrono::steady_clock::now();
  try {
    g->all_reduce(&x, sizeof x, sizeof x, kAddFloat, milliseconds(60000));
    FAIL() << "expected the dead member to be noticed";
  } catch (const BackendError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("member 1 (pid " + std::to_string(pid) + ") has exited"), std::string::npos)
        << what;
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_THROW(g->all_reduce(&x, sizeof x, sizeof x, kAddFloat, milliseconds(200)), StateError);
  g->unlink();
}

TEST(ShmGroup, DifferentCollectivesAreAnErrorOnEveryMember) {
  run_members(2, 256, unique_name("mix"), [](ShmGroup& g) {
    std::vector<float> x(4, 1.0F), out(8);
    try {
      if (g.rank() == 0) {
        g.all_reduce(x.data(), 16, sizeof(float), kAddFloat, milliseconds(5000));
      } else {
        g.all_gather(x.data(), 16, out.data(), milliseconds(5000));
      }
    } catch (const StateError& e) {
      const std::string what = e.what();
      return what.find("member 0: all_reduce of 16 bytes") != std::string::npos &&
                     what.find("member 1: all_gather of 16 bytes") != std::string::npos
                 ? 0
                 : 5;
    }
    return 6;
  });
}

TEST(ShmGroup, BadSettingsAreClearErrors) {
  const std::string name = unique_name("bad");
  auto g = ShmGroup::create(name, 0, 2, 256);
  EXPECT_THROW(ShmGroup::open(name, 1, 3, 256), BackendError);  // size differs
  EXPECT_THROW(ShmGroup::open(unique_name("absent"), 1, 2, 256), BackendError);
  EXPECT_THROW(ShmGroup::create("no-slash", 0, 2, 256), ValueError);
  EXPECT_THROW(ShmGroup::create(unique_name("r"), 2, 2, 256), ValueError);
  EXPECT_THROW(ShmGroup::create(unique_name("s"), 0, 4, 100), ValueError);
  float x = 0.0F;
  EXPECT_THROW(g->all_reduce(&x, 3, sizeof x, kAddFloat, milliseconds(100)), ValueError);
}

}  // namespace
}  // namespace mapp::comm
