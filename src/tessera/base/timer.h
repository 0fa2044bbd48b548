// Wall-clock timing and a terminal progress line for long work.
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace tessera::base {

class Timer {
 public:
  Timer() : start_(std::chrono::steady_clock::now()) {}
  void reset() { start_ = std::chrono::steady_clock::now(); }
  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  std::chrono::steady_clock::time_point start_;
};

double median(std::vector<double> values);  // of a non-empty list

// The median seconds of one call, the rule every benchmark here uses: fn(0) is an
// untimed warm-up, then fn(1), fn(2), ... are timed one by one until min_seconds have
// passed and at least min_calls were timed. The median is robust on shared machines.
double median_call_seconds(const std::function<void(int64_t)>& fn, double min_seconds,
                           int min_calls = 5);

// "42s", "3m05s", "2h07m": a duration for people.
std::string format_duration(double seconds);

// Prints "label [=====>    ] 37/100 12.3 it/s ETA 5s" on stderr, redrawn in place when
// stderr is a terminal and at most every few seconds otherwise. `start`: work already done
// when the bar starts (a resumed run), left out of the rate and so of the ETA.
class ProgressBar {
 public:
  ProgressBar(std::string label, int64_t total, int64_t start = 0);
  // force: print now whatever the time since the last line (a line worth seeing).
  void update(int64_t done, const std::string& suffix = "", bool force = false);
  void finish(const std::string& suffix = "");

 private:
  std::string label_;
  int64_t total_;
  int64_t start_ = 0;
  Timer timer_;
  double last_print_ = -1.0;
  bool tty_;
};

}  // namespace tessera::base
