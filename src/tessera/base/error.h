// The one exception type Tessera's library code throws for bad input or failed I/O.
// The CLI catches it and prints its message as one line with a non-zero exit.
#pragma once
#include <stdexcept>
#include <string>
#include <utility>
#include <sstream>

namespace tessera {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

// An Error about one named field of a request or config (an API parameter such as
// "top_p"), so a server can report the field apart from the message.
class FieldError : public Error {
 public:
  FieldError(std::string field, const std::string& msg) : Error(msg), field_(std::move(field)) {}
  const std::string& field() const { return field_; }

 private:
  std::string field_;
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

// Throws tessera::FieldError naming `field`, with the streamed arguments as message.
template <typename... Args>
[[noreturn]] void fail_field(const std::string& field, Args&&... args) {
  throw FieldError(field, detail::concat(std::forward<Args>(args)...));
}

}  // namespace tessera

// Checks a condition on input or state; on failure throws tessera::Error with the message.
#define TESSERA_CHECK(cond, ...)                   \
  do {                                             \
    if (!(cond)) ::tessera::fail(__VA_ARGS__);     \
  } while (0)
