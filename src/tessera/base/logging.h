// Minimal leveled logging to stderr. TESSERA_LOG=debug|info|warn|error sets the level.
#pragma once
#include <string>

#include "tessera/base/error.h"

namespace tessera::base {

enum class LogLevel { kDebug = 0, kInfo = 1, kWarn = 2, kError = 3 };
LogLevel log_level();
void log_message(LogLevel level, const std::string& msg);

}  // namespace tessera::base

#define TESSERA_LOG(level, ...)                                                     \
  do {                                                                              \
    if (::tessera::base::LogLevel::level >= ::tessera::base::log_level())           \
      ::tessera::base::log_message(::tessera::base::LogLevel::level,                \
                                   ::tessera::detail::concat(__VA_ARGS__));         \
  } while (0)
