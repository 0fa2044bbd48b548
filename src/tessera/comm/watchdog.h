// The collective watchdog: an operation registers a scope while it is in flight; one
// background thread fires the scopes that outlive their timeout (log, then the timeout
// handler, std::abort() unless a test installed another).
#pragma once
#include <chrono>
#include <cstdint>
#include <map>
#include <string>

namespace tessera::comm {

class WatchdogScope {
 public:
  using Clock = std::chrono::steady_clock;
  // `what` names the operation and its group, e.g. "all_reduce #3 (ring, 1023 x f32) on
  // rank 1/4 (backend local)". timeout_seconds <= 0 disables the watchdog for this scope.
  WatchdogScope(std::string what, double timeout_seconds);
  ~WatchdogScope();
  WatchdogScope(const WatchdogScope&) = delete;
  WatchdogScope& operator=(const WatchdogScope&) = delete;

  bool enabled() const { return enabled_; }
  Clock::time_point deadline() const { return deadline_; }
  // Called by a wait that saw the deadline pass: fires the scope (log + handler) unless
  // the watchdog thread already did, then throws tessera::Error with the message.
  [[noreturn]] void expire();
  std::string message() const;

  // The innermost scope open on this thread (a wait inside a collective uses the
  // collective's deadline), or nullptr.
  static WatchdogScope* current();

 private:
  friend struct WatchdogRegistry;
  std::string what_;
  double timeout_seconds_;
  bool enabled_;
  Clock::time_point deadline_;
  WatchdogScope* previous_;
  bool registered_ = false;  // guarded by the registry's mutex
  bool fired_ = false;       // guarded by the registry's mutex
  std::multimap<Clock::time_point, WatchdogScope*>::iterator slot_;
};

// Logs `message` (error level) and runs the timeout handler (communicator.h).
void fire_timeout(const std::string& message);

}  // namespace tessera::comm
