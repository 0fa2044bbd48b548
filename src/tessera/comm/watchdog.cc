// The collective watchdog (watchdog.h) and Communicator::set_timeout_handler.
#include "tessera/comm/watchdog.h"

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

#include "tessera/base/error.h"
#include "tessera/base/logging.h"
#include "tessera/comm/communicator.h"

namespace tessera::comm {

namespace {
thread_local WatchdogScope* t_current = nullptr;
}  // namespace

// Process-wide: the open scopes by deadline and the thread that fires overdue ones. It is
// leaked on purpose so that it outlives every communicator, even static ones (mpi_world).
struct WatchdogRegistry {
  std::mutex mu;
  std::condition_variable cv;
  std::multimap<WatchdogScope::Clock::time_point, WatchdogScope*> open;
  bool thread_started = false;
  Communicator::TimeoutHandler handler;  // empty: std::abort()
  int firing = 0;  // timeouts the watchdog thread is reporting right now (fire_timeout)
  std::condition_variable fired_cv;

  static WatchdogRegistry& get() {
    static WatchdogRegistry* r = new WatchdogRegistry;
    return *r;
  }

  void add(WatchdogScope* s) {
    std::lock_guard<std::mutex> lk(mu);
    s->slot_ = open.emplace(s->deadline_, s);
    s->registered_ = true;
    if (!thread_started) {
      thread_started = true;
      std::thread([this] { run(); }).detach();
    } else if (s->slot_ == open.begin()) {
      cv.notify_one();  // a new earliest deadline
    }
  }

  void remove(WatchdogScope* s) {
    std::lock_guard<std::mutex> lk(mu);
    if (s->registered_) open.erase(s->slot_);
    s->registered_ = false;
  }

  // Blocks while the watchdog thread is reporting a timeout (its handler may abort the
  // process: a waiter that saw the same deadline must not race past it and throw first).
  // Bounded, so a handler that never returns cannot hang the waiter forever.
  void wait_for_firing() {
    std::unique_lock<std::mutex> lk(mu);
    fired_cv.wait_for(lk, std::chrono::seconds(10), [this] { return firing == 0; });
  }

  // True when the caller is the one that fires `s` (it was not fired yet).
  bool claim(WatchdogScope* s) {
    std::lock_guard<std::mutex> lk(mu);
    if (s->fired_) return false;
    s->fired_ = true;
    if (s->registered_) open.erase(s->slot_);
    s->registered_ = false;
    return true;
  }

  void run() {
    std::unique_lock<std::mutex> lk(mu);
    for (;;) {
      if (open.empty()) {
        cv.wait(lk);
        continue;
      }
      auto first = open.begin();
      const WatchdogScope::Clock::time_point when = first->first;  // the node may go while waiting
      if (WatchdogScope::Clock::now() < when) {
        cv.wait_until(lk, when);
        continue;
      }
      WatchdogScope* s = first->second;
      open.erase(first);
      s->registered_ = false;
      s->fired_ = true;
      // The scope may close once the lock is released: report from a copy.
      const std::string msg = s->message();
      ++firing;
      lk.unlock();
      fire_timeout(msg);
      lk.lock();
      --firing;
      fired_cv.notify_all();
    }
  }
};

WatchdogScope::WatchdogScope(std::string what, double timeout_seconds)
    : what_(std::move(what)),
      timeout_seconds_(timeout_seconds),
      enabled_(timeout_seconds > 0),
      previous_(t_current) {
  // Clamped so that "never" (1e30) cannot overflow the clock.
  const double secs = enabled_ ? std::min(timeout_seconds, 1e9) : 1e9;
  deadline_ = Clock::now() +
              std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(secs));
  t_current = this;
  if (enabled_) WatchdogRegistry::get().add(this);
}

WatchdogScope::~WatchdogScope() {
  if (enabled_) WatchdogRegistry::get().remove(this);
  t_current = previous_;
}

WatchdogScope* WatchdogScope::current() { return t_current; }

std::string WatchdogScope::message() const {
  char secs[32];
  std::snprintf(secs, sizeof secs, "%g", timeout_seconds_);
  return "comm watchdog: " + what_ + " did not finish within " + secs +
         " s (set_timeout); aborting the job";
}

void WatchdogScope::expire() {
  const std::string msg = message();
  WatchdogRegistry& r = WatchdogRegistry::get();
  if (r.claim(this))
    fire_timeout(msg);
  else
    r.wait_for_firing();  // the watchdog thread reports it: let its handler act first
  throw Error(msg);
}

void fire_timeout(const std::string& message) {
  base::log_message(base::LogLevel::kError, message);
  Communicator::TimeoutHandler handler;
  {
    WatchdogRegistry& r = WatchdogRegistry::get();
    std::lock_guard<std::mutex> lk(r.mu);
    handler = r.handler;
  }
  if (!handler) {
    std::fflush(stderr);
    std::abort();
  }
  handler(message);
}

void Communicator::set_timeout_handler(TimeoutHandler handler) {
  WatchdogRegistry& r = WatchdogRegistry::get();
  std::lock_guard<std::mutex> lk(r.mu);
  r.handler = std::move(handler);
}

}  // namespace tessera::comm
