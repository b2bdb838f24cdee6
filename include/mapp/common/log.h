// Logging facade. spdlog (and its fmt 9) stays inside src/common/log.cc so that
// translation units which include torch headers (which ship fmt 12) never see
// a second fmt. Callers format their own message.
#pragma once

#include <string_view>

namespace mapp {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3, kOff = 4 };

// Writes one line "[megatronapp] [level] message" to stderr if `level` is at
// or above the threshold (MAPP_LOG_LEVEL, default info). Thread-safe.
void log(LogLevel level, std::string_view message);

// Threshold currently in effect; set_log_level overrides MAPP_LOG_LEVEL.
LogLevel log_level();
void set_log_level(LogLevel level);

// Parses "debug" / "info" / "warn" / "error" / "off"; throws ValueError.
LogLevel parse_log_level(std::string_view name);

}  // namespace mapp
