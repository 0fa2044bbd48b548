// ProgressBar drawing.
#include "tessera/base/timer.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>

namespace tessera::base {

double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + v.size() / 2, v.end());
  return v[v.size() / 2];
}

double median_call_seconds(const std::function<void(int64_t)>& fn, double min_seconds,
                           int min_calls) {
  fn(0);
  std::vector<double> secs;
  double total = 0;
  for (int64_t i = 1; total < min_seconds || static_cast<int>(secs.size()) < min_calls; ++i) {
    Timer t;
    fn(i);
    secs.push_back(t.seconds());
    total += secs.back();
  }
  return median(std::move(secs));
}

ProgressBar::ProgressBar(std::string label, int64_t total, int64_t start)
    : label_(std::move(label)), total_(total), start_(start), tty_(isatty(2)) {}

std::string format_duration(double s) {
  char buf[32];
  const long long t = static_cast<long long>(s + 0.5);
  if (t >= 3600) std::snprintf(buf, sizeof buf, "%lldh%02lldm", t / 3600, t / 60 % 60);
  else if (t >= 60) std::snprintf(buf, sizeof buf, "%lldm%02llds", t / 60, t % 60);
  else std::snprintf(buf, sizeof buf, "%llds", t);
  return buf;
}

void ProgressBar::update(int64_t done, const std::string& suffix, bool force) {
  const double t = timer_.seconds();
  const double min_gap = tty_ ? 0.1 : 5.0;
  if (!force && done < total_ && last_print_ >= 0 && t - last_print_ < min_gap) return;
  last_print_ = t;
  constexpr int kWidth = 30;
  const int filled = total_ > 0 ? static_cast<int>(kWidth * done / total_) : 0;
  std::string bar(kWidth, ' ');
  for (int i = 0; i < filled && i < kWidth; ++i) bar[i] = '=';
  if (filled < kWidth) bar[filled] = '>';
  const double rate = t > 0 ? static_cast<double>(done - start_) / t : 0.0;
  const std::string eta = done < total_ && rate > 0
                              ? "ETA " + format_duration(static_cast<double>(total_ - done) / rate) + " "
                              : done >= total_ ? "in " + format_duration(t) + " " : "";
  std::fprintf(stderr, "%s%s [%s] %lld/%lld %.1f it/s %s%s%s", tty_ ? "\r" : "", label_.c_str(),
               bar.c_str(), static_cast<long long>(done), static_cast<long long>(total_), rate,
               eta.c_str(), suffix.c_str(), tty_ ? "\033[K" : "\n");
  std::fflush(stderr);
}

void ProgressBar::finish(const std::string& suffix) {
  last_print_ = -1.0;
  update(total_, suffix);
  if (tty_) std::fputc('\n', stderr);
}

}  // namespace tessera::base
