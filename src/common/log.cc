#include "mapp/common/log.h"

#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <memory>
#include <mutex>
#include <string>

#include "mapp/common/check.h"
#include "mapp/common/tunables.h"

namespace mapp {
namespace {

std::shared_ptr<spdlog::logger> make_logger() {
  // stderr, unbuffered lines; the rank prefix is added by callers that know it.
  auto logger = spdlog::stderr_logger_mt("megatronapp");
  logger->set_pattern("[megatronapp] [%l] %v");
  logger->set_level(spdlog::level::trace);  // filtering happens in log()
  return logger;
}

spdlog::logger& logger() {
  static std::shared_ptr<spdlog::logger> instance = [] {
    auto existing = spdlog::get("megatronapp");
    return existing ? existing : make_logger();
  }();
  return *instance;
}

std::atomic<int>& level_slot() {
  static std::atomic<int> slot{
      static_cast<int>(parse_log_level(tunable_string("MAPP_LOG_LEVEL")))};
  return slot;
}

spdlog::level::level_enum to_spdlog(LogLevel level) {
  switch (level) {
    case LogLevel::kDebug: return spdlog::level::debug;
    case LogLevel::kInfo: return spdlog::level::info;
    case LogLevel::kWarn: return spdlog::level::warn;
    case LogLevel::kError: return spdlog::level::err;
    case LogLevel::kOff: return spdlog::level::off;
  }
  return spdlog::level::info;
}

}  // namespace

LogLevel parse_log_level(std::string_view name) {
  if (name == "debug") return LogLevel::kDebug;
  if (name == "info") return LogLevel::kInfo;
  if (name == "warn" || name == "warning") return LogLevel::kWarn;
  if (name == "error") return LogLevel::kError;
  if (name == "off") return LogLevel::kOff;
  MAPP_CHECK(false, "unknown log level '", std::string(name),
             "'; use one of debug, info, warn, error, off");
}

LogLevel log_level() { return static_cast<LogLevel>(level_slot().load()); }

void set_log_level(LogLevel level) { level_slot().store(static_cast<int>(level)); }

void log(LogLevel level, std::string_view message) {
  if (level == LogLevel::kOff || static_cast<int>(level) < level_slot().load()) {
    return;
  }
  logger().log(to_spdlog(level), "{}", message);
}

}  // namespace mapp
