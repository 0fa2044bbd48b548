// The one exception type Tessera's library code throws for bad input or failed I/O.
// The CLI catches it and prints its message as one line with a non-zero exit.
#pragma once
#include <stdexcept>
#include <string>
#include <sstream>

namespace tessera {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

namespace detail {
template <typename... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace detail

// Throws tessera::Error with the streamed arguments as message.
template <typename... Args>
[[noreturn]] void fail(Args&&... args) {
  throw Error(detail::concat(std::forward<Args>(args)...));
}

}  // namespace tessera

// Checks a condition on input or state; on failure throws tessera::Error with the message.
#define TESSERA_CHECK(cond, ...)                   \
  do {                                             \
    if (!(cond)) ::tessera::fail(__VA_ARGS__);     \
  } while (0)
