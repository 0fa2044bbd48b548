// The running render's Limits and counters. One render runs on one thread; Template::render
// installs its Budget in a thread-local slot (BudgetScope), so the value helpers and builtins far
// below the evaluator check sizes before they allocate without a budget argument on every call.
#pragma once
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>

#include "tessera/serve/jinja.h"

namespace tessera::serve::jinja {

// Estimated heap bytes (nodes, strings, keys) and nesting depth of a value, computed without
// recursion; stops early once either passes the given bounds.
struct ValueSize {
  size_t bytes = 0;
  int depth = 0;
};
ValueSize measure_value(const Value& v, size_t max_bytes, int max_depth);

class Budget {
 public:
  explicit Budget(const Limits& limits, bool timed = true);

  const Limits& limits() const { return limits_; }
  // The template line errors from helpers without a node name (the evaluator keeps it current).
  void set_line(int line) { line_ = line; }
  int line() const { return line_; }

  // Work done, in units of about one node evaluated or 64 bytes copied; the wall clock is read
  // once per kClockEvery units, so time is checked every few microseconds of work.
  void charge(int64_t units) {
    fuel_ += units;
    if (fuel_ >= next_clock_) check_clock();
  }
  void charge_bytes(size_t bytes) { charge(static_cast<int64_t>(bytes >> 6) + 1); }

  // Each throws "chat template line L: <limit> exceeded (--chat-template-limits key=...)".
  void count_iteration(int line);
  void check_string(int line, size_t bytes);  // before building a string of `bytes`
  void check_list(int line, size_t items);    // before building a list of `items`
  void check_output(int line, size_t bytes);  // before an output buffer grows to `bytes`
  // Nesting depth (plus extra_depth, for a value about to be wrapped) and estimated bytes of a
  // list or dict the template built: the string limit bounds its bytes too, the depth limit its
  // nesting (so repr, tojson and nlohmann's own recursive copy stay within the stack).
  void check_value(int line, const Value& v, int extra_depth = 0);
  void check_size(int line, size_t bytes, int depth);
  ValueSize size_of(const Value& v);  // measure_value within the limits, charged as work
  void enter(int line);               // one nesting level deeper (use DepthGuard)
  void leave() { --depth_; }

  // a * b for size checks, SIZE_MAX where it overflows (b <= 0 gives 0).
  static size_t saturating_mul(size_t a, int64_t b);

 private:
  static constexpr int64_t kClockEvery = 1024;
  void check_clock();

  Limits limits_;
  bool timed_;
  std::chrono::steady_clock::time_point deadline_;
  int64_t fuel_ = 0, next_clock_ = kClockEvery;
  int64_t iterations_ = 0;
  int depth_ = 0;
  int line_ = 0;
};

// The budget of the render running on this thread, else one with default limits and no clock.
Budget& current_budget();

// Installs a budget for the current thread for its lifetime (restores the previous one).
class BudgetScope {
 public:
  explicit BudgetScope(Budget& b);
  ~BudgetScope();
  BudgetScope(const BudgetScope&) = delete;
  BudgetScope& operator=(const BudgetScope&) = delete;

 private:
  Budget* saved_;
};

class DepthGuard {
 public:
  DepthGuard(Budget& b, int line) : b_(b) { b_.enter(line); }
  ~DepthGuard() { b_.leave(); }
  DepthGuard(const DepthGuard&) = delete;
  DepthGuard& operator=(const DepthGuard&) = delete;

 private:
  Budget& b_;
};

}  // namespace tessera::serve::jinja
