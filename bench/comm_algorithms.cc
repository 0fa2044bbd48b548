// Collective algorithms over the local backend (ranks = threads of this process): time
// per call of every algorithm of ours and the backend's own, by message size and group
// size, and the check behind Algorithm::kAuto's table: at each point, how much slower the
// algorithm auto picks is than the best one measured (the bar: within 10%).
// Also binomial tree vs pipelined broadcast / reduce, and the ring's segment size.
// Usage: comm_algorithms [passes=3] [rounds=3] [min_seconds_per_round=0.02] [max_mb=16]
//            [ranks=2,3,4,6,8] [parts=all_reduce,reduce_scatter,all_gather,broadcast,reduce]
// ("segments" in parts adds the ring's segment-size sweep at the largest size)
// Every pass visits every point (so the samples of one point are minutes apart on a shared
// machine); within a point the candidates are timed interleaved, round by round. A figure
// is the median over passes of each pass's median round.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "tessera/base/timer.h"
#include "tessera/comm/algorithms.h"
#include "tessera/comm/communicator.h"
#include "tessera/comm/local_backend.h"

namespace {

using namespace tessera;
using namespace tessera::comm;

// Collective: seconds per call of each candidate (median over rounds), the same on every
// rank (rank 0's clock, broadcast).
std::vector<double> time_candidates(Communicator& c, const std::vector<std::function<void()>>& fns,
                                    double min_s, int rounds) {
  std::vector<int64_t> reps(fns.size());
  for (size_t i = 0; i < fns.size(); ++i) {
    fns[i]();  // warm-up
    c.barrier();
    base::Timer t;
    fns[i]();
    c.barrier();
    Tensor k = Tensor::from_vector<int64_t>(
        {std::clamp<int64_t>(static_cast<int64_t>(min_s / std::max(t.seconds(), 1e-7)), 1, 20000)},
        {1});
    c.broadcast(k, 0);
    reps[i] = k.data<int64_t>()[0];
  }
  std::vector<std::vector<double>> secs(fns.size());
  for (int r = 0; r < rounds; ++r)
    for (size_t i = 0; i < fns.size(); ++i) {
      c.barrier();
      base::Timer t;
      for (int64_t k = 0; k < reps[i]; ++k) fns[i]();
      c.barrier();
      secs[i].push_back(t.seconds() / reps[i]);
    }
  std::vector<double> out;
  for (auto& s : secs) {
    Tensor ns = Tensor::from_vector<int64_t>({static_cast<int64_t>(base::median(s) * 1e12)}, {1});
    c.broadcast(ns, 0);
    out.push_back(ns.data<int64_t>()[0] * 1e-12);
  }
  return out;
}

std::string human(int64_t b) {
  char s[32];
  std::snprintf(s, sizeof s, "%lld%s", static_cast<long long>(b >= (1 << 20) ? b >> 20 : b >> 10),
                b >= (1 << 20) ? "M" : "K");
  return s;
}

struct Point {
  std::string op;
  int ranks;
  int64_t bytes;
  bool operator<(const Point& o) const {
    return std::tie(op, ranks, bytes) < std::tie(o.op, o.ranks, o.bytes);
  }
};

const std::vector<std::pair<const char*, Algorithm>> kAlgos = {{"backend", Algorithm::kBackend},
                                                               {"ring", Algorithm::kRing},
                                                               {"hd", Algorithm::kHalvingDoubling}};

// One pass over one point: seconds per call of each candidate.
std::vector<double> measure(const Point& p, double min_s, int rounds) {
  const int N = p.ranks;
  const int64_t n = p.bytes / 4;
  std::vector<double> secs;
  if (p.op.rfind("segment ", 0) == 0) {  // "segment <bytes>": ring all_reduce, that segment size
    const int64_t keep = algo::segment_bytes();
    algo::set_segment_bytes(std::stoll(p.op.substr(8)));
    run_local(N, [&](Communicator& c) {
      Tensor full = Tensor::zeros({n}, DType::kF32);
      const auto t = time_candidates(
          c, {[&] { c.all_reduce(full, ReduceOp::kSum, Algorithm::kRing); }}, min_s, rounds);
      if (c.rank() == 0) secs = t;
    });
    algo::set_segment_bytes(keep);
    return secs;
  }
  run_local(N, [&](Communicator& c) {
    Tensor full = Tensor::zeros({n}, DType::kF32);
    Tensor part = Tensor::zeros({chunk_range(n, N, c.rank()).size()}, DType::kF32);
    std::vector<std::function<void()>> fns;
    const int tag = 1 << 29;  // direct algorithm calls: outside the collectives' tags
    if (p.op == "broadcast") {
      fns.push_back([&] { algo::broadcast_tree(c, tag, full.raw_data(), p.bytes, 0); });
      fns.push_back([&] { algo::broadcast_chain(c, tag, full.raw_data(), p.bytes, 0); });
    } else if (p.op == "reduce") {
      fns.push_back(
          [&] { algo::reduce_tree(c, tag, full.raw_data(), n, DType::kF32, ReduceOp::kSum, 0); });
      fns.push_back([&] {
        algo::reduce_ring_gather(c, tag, full.raw_data(), n, DType::kF32, ReduceOp::kSum, 0);
      });
    } else {
      for (const auto& [name, a] : kAlgos)
        fns.push_back([&, a = a] {
          if (p.op == "all_reduce")
            c.all_reduce(full, ReduceOp::kSum, a);
          else if (p.op == "reduce_scatter")
            c.reduce_scatter(full, part, ReduceOp::kSum, a);
          else
            c.all_gather(part, full, a);
        });
    }
    const auto t = time_candidates(c, fns, min_s, rounds);
    if (c.rank() == 0) secs = t;
  });
  return secs;
}

// Index (in the point's candidate list) of what the library picks.
size_t picked(const Point& p) {
  if (p.op == "broadcast") return p.bytes <= algo::broadcast_tree_max_bytes() ? 0 : 1;
  if (p.op == "reduce") return p.bytes <= algo::reduce_tree_max_bytes() ? 0 : 1;
  const Algorithm a = p.op == "all_reduce"       ? algo::auto_all_reduce(p.bytes, p.ranks, false)
                      : p.op == "reduce_scatter" ? algo::auto_reduce_scatter(p.bytes, p.ranks)
                                                 : algo::auto_all_gather(p.bytes, p.ranks);
  for (size_t i = 0; i < kAlgos.size(); ++i)
    if (kAlgos[i].second == a) return i;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const int passes = argc > 1 ? std::atoi(argv[1]) : 3;
  const int rounds = argc > 2 ? std::atoi(argv[2]) : 3;
  const double min_s = argc > 3 ? std::atof(argv[3]) : 0.02;
  const int64_t max_bytes = (argc > 4 ? std::atoll(argv[4]) : 16) << 20;
  std::vector<int> group_sizes = {2, 3, 4, 6, 8};
  if (argc > 5) {
    group_sizes.clear();
    std::stringstream ss(argv[5]);
    for (std::string x; std::getline(ss, x, ',');) group_sizes.push_back(std::stoi(x));
  }
  std::vector<std::string> ops;
  {
    std::stringstream ss(argc > 6 ? argv[6]
                                  : "all_reduce,reduce_scatter,all_gather,broadcast,reduce");
    for (std::string x; std::getline(ss, x, ',');) ops.push_back(x);
  }
  std::vector<Point> points, segment_points;
  const std::vector<int64_t> segments = {16 << 10,  32 << 10,  64 << 10,
                                         128 << 10, 256 << 10, 1 << 20};
  for (const auto& op : ops)
    for (int N : group_sizes) {
      if (op == "segments") {
        for (int64_t seg : segments)
          segment_points.push_back({"segment " + std::to_string(seg), N, max_bytes});
        continue;
      }
      for (int64_t b = 1 << 10; b <= max_bytes; b *= 4) points.push_back({op, N, b});
    }

  std::map<Point, std::vector<std::vector<double>>> samples;  // point -> pass -> candidate
  for (int pass = 0; pass < passes; ++pass) {
    for (const Point& p : points) samples[p].push_back(measure(p, min_s, rounds));
    for (const Point& p : segment_points) samples[p].push_back(measure(p, min_s, rounds));
    std::fprintf(stderr, "pass %d/%d done\n", pass + 1, passes);
  }

  std::printf(
      "local backend, f32 messages, microseconds per call: median over %d passes of the\n"
      "median of %d rounds; segment %lld KiB; tree up to %lld KiB (broadcast), %lld KiB (reduce)\n",
      passes, rounds, static_cast<long long>(algo::segment_bytes() >> 10),
      static_cast<long long>(algo::broadcast_tree_max_bytes() >> 10),
      static_cast<long long>(algo::reduce_tree_max_bytes() >> 10));
  double worst = 0;
  int over = 0;
  std::string last_op;
  for (const Point& p : points) {
    const bool tree = p.op == "broadcast" || p.op == "reduce";
    if (p.op != last_op) {
      last_op = p.op;
      if (tree)
        std::printf("\n%-14s %5s %7s %10s %10s  %-9s %-9s %s\n", p.op.c_str(), "ranks", "bytes",
                    "tree", "pipelined", "best", "picked", "picked/best");
      else
        std::printf("\n%-14s %5s %7s %10s %10s %10s  %-9s %-9s %s\n", p.op.c_str(), "ranks",
                    "bytes", "backend", "ring", "hd", "best", "auto", "auto/best");
    }
    const auto& s = samples[p];
    std::vector<double> med(s[0].size());
    for (size_t i = 0; i < med.size(); ++i) {
      std::vector<double> v;
      for (const auto& pass : s) v.push_back(pass[i]);
      med[i] = base::median(v);
    }
    const size_t best = std::min_element(med.begin(), med.end()) - med.begin();
    const size_t pick = picked(p);
    const double ratio = med[pick] / med[best];
    worst = std::max(worst, ratio);
    over += ratio > 1.10;
    auto name = [&](size_t i) { return tree ? (i ? "pipelined" : "tree") : kAlgos[i].first; };
    std::printf("%-14s %5d %7s", "", p.ranks, human(p.bytes).c_str());
    for (double m : med) std::printf(" %10.1f", m * 1e6);
    std::printf("  %-9s %-9s %.2f%s\n", name(best), name(pick), ratio, ratio > 1.10 ? "  <--" : "");
  }
  if (!segment_points.empty()) {
    std::printf("\nring all_reduce of %s by segment size (us per call; default %lld KiB)\n%5s",
                human(max_bytes).c_str(), static_cast<long long>(algo::segment_bytes() >> 10),
                "ranks");
    for (int64_t seg : segments) std::printf(" %9s", human(seg).c_str());
    for (size_t i = 0; i < segment_points.size(); ++i) {
      if (i % segments.size() == 0) std::printf("\n%5d", segment_points[i].ranks);
      std::vector<double> v;
      for (const auto& pass : samples[segment_points[i]]) v.push_back(pass[0]);
      std::printf(" %9.0f", base::median(v) * 1e6);
    }
    std::printf("\n");
  }
  std::printf(
      "\nauto (or the tree/pipelined switch) vs the best measured: worst %.2f, %d of %zu "
      "points over 1.10\n",
      worst, over, points.size());
  return 0;
}
