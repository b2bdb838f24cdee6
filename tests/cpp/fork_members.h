// Runs a shared-memory group's members as real processes for the tests of
// src/comm (ShmGroup, ShmP2P).
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <vector>

namespace mapp::comm::testing {

// Runs body(member) in `world` forked processes: member 0 uses `creator`
// (made before the fork, so the segment exists), member m > 0 what open(m)
// returns. Expects every member to exit 0 (an exception is printed and fails
// it), then unlinks the segment.
template <typename Group>
void run_forked(int world, Group& creator, const std::function<std::unique_ptr<Group>(int)>& open,
                const std::function<int(Group&)>& body) {
  std::vector<pid_t> pids;
  for (int m = 0; m < world; ++m) {
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      int rc = 0;
      try {
        if (m == 0) {
          rc = body(creator);
        } else {
          rc = body(*open(m));
        }
      } catch (const std::exception& e) {
        std::fprintf(stderr, "member %d: %s\n", m, e.what());
        rc = 3;
      }
      std::fflush(stderr);
      ::_exit(rc);
    }
    pids.push_back(pid);
  }
  for (int m = 0; m < world; ++m) {
    int status = 0;
    ASSERT_EQ(::waitpid(pids[m], &status, 0), pids[m]);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "member " << m << " failed";
  }
  creator.unlink();
}

}  // namespace mapp::comm::testing
