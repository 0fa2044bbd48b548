// Logging sink.
#include "tessera/base/logging.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace tessera::base {

LogLevel log_level() {
  static const LogLevel level = [] {
    const char* v = std::getenv("TESSERA_LOG");
    if (!v) return LogLevel::kInfo;
    if (!std::strcmp(v, "debug")) return LogLevel::kDebug;
    if (!std::strcmp(v, "warn")) return LogLevel::kWarn;
    if (!std::strcmp(v, "error")) return LogLevel::kError;
    return LogLevel::kInfo;
  }();
  return level;
}

void log_message(LogLevel level, const std::string& msg) {
  static const char* names[] = {"debug", "info", "warn", "error"};
  std::fprintf(stderr, "[tessera %s] %s\n", names[static_cast<int>(level)], msg.c_str());
}

}  // namespace tessera::base
