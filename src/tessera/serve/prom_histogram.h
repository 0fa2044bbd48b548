// A minimal thread-safe Prometheus histogram rendered as text (seconds), for the KV transfer
// metrics of disaggregated serving (workers and router).
#pragma once
#include <cstdint>
#include <cstdio>
#include <iterator>
#include <mutex>
#include <string>

namespace tessera::serve {

struct PromHistogram {
  static constexpr double kBounds[] = {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10};
  void observe(double s) {
    std::lock_guard<std::mutex> lock(m_);
    for (size_t i = 0; i < std::size(kBounds); ++i)
      if (s <= kBounds[i]) ++counts_[i];
    ++count_;
    sum_ += s;
  }
  std::string render(const std::string& name, const std::string& help, const std::string& labels) const {
    std::lock_guard<std::mutex> lock(m_);
    std::string o = "# HELP " + name + " " + help + "\n# TYPE " + name + " histogram\n";
    char buf[64];
    const std::string sep = labels.empty() ? "" : ",";
    for (size_t i = 0; i < std::size(kBounds); ++i) {
      std::snprintf(buf, sizeof buf, "%g", kBounds[i]);
      o += name + "_bucket{" + labels + sep + "le=\"" + buf + "\"} " + std::to_string(counts_[i]) + "\n";
    }
    o += name + "_bucket{" + labels + sep + "le=\"+Inf\"} " + std::to_string(count_) + "\n";
    std::snprintf(buf, sizeof buf, "%.9g", sum_);
    o += name + "_sum{" + labels + "} " + buf + "\n" + name + "_count{" + labels + "} " + std::to_string(count_) + "\n";
    return o;
  }

 private:
  mutable std::mutex m_;
  int64_t counts_[std::size(kBounds)] = {};
  int64_t count_ = 0;
  double sum_ = 0;
};

}  // namespace tessera::serve
