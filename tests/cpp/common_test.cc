#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "mapp/common/check.h"
#include "mapp/common/log.h"
#include "mapp/common/tunables.h"

namespace mapp {
namespace {

TEST(Check, CarriesMessageAndLocation) {
  try {
    MAPP_CHECK(1 + 1 == 3, "expected ", 3, " got ", 2);
    FAIL() << "MAPP_CHECK did not throw";
  } catch (const ValueError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("expected 3 got 2"), std::string::npos) << what;
    EXPECT_NE(what.find("common_test.cc"), std::string::npos) << what;
  }
}

TEST(Check, StateErrorIsRuntimeError) {
  EXPECT_THROW(MAPP_CHECK_STATE(false, "not initialized"), StateError);
}

TEST(Tunables, DefaultsEnvironmentAndTypos) {
  ::unsetenv("MAPP_COLLECTIVE_TIMEOUT_S");
  EXPECT_EQ(tunable_int("MAPP_COLLECTIVE_TIMEOUT_S"), 300);
  ::setenv("MAPP_COLLECTIVE_TIMEOUT_S", "12", 1);
  EXPECT_EQ(tunable_int("MAPP_COLLECTIVE_TIMEOUT_S"), 12);
  ::setenv("MAPP_COLLECTIVE_TIMEOUT_S", "12s", 1);
  EXPECT_THROW(tunable_int("MAPP_COLLECTIVE_TIMEOUT_S"), ValueError);
  ::unsetenv("MAPP_COLLECTIVE_TIMEOUT_S");
  EXPECT_THROW(tunable_string("MAPP_NO_SUCH_THING"), ValueError);
  EXPECT_NE(describe_tunables().find("MAPP_LOG_LEVEL=info"), std::string::npos);
}

TEST(Log, LevelsParseAndFilter) {
  EXPECT_EQ(parse_log_level("warn"), LogLevel::kWarn);
  EXPECT_THROW(parse_log_level("loud"), ValueError);
  set_log_level(LogLevel::kError);
  EXPECT_EQ(log_level(), LogLevel::kError);
  log(LogLevel::kInfo, "filtered out");
  set_log_level(LogLevel::kInfo);
}

}  // namespace
}  // namespace mapp
