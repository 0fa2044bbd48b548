// Layout evaluation and the exhaustive search over parallel layouts.
#include "tessera/plan/search.h"

#include <algorithm>

namespace tessera::plan {

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> d;
  for (int64_t i = 1; i * i <= n; ++i) {
    if (n % i) continue;
    d.push_back(i);
    if (i != n / i) d.push_back(n / i);
  }
  std::sort(d.begin(), d.end());
  return d;
}

Evaluation evaluate_layout(const ModelSpec& m, const Hardware& hw, const TrainSetup& s,
                           const Layout& l) {
  Evaluation ev;
  ev.layout = l;
  ev.memory = estimate_memory(m, hw, s, l);
  ev.time = estimate_step_time(m, hw, s, l);
  ev.training = estimate_training_time(s, ev.time.tokens_per_s);
  return ev;
}

namespace {

bool faster(const Evaluation& a, const Evaluation& b) {
  if (a.time.tokens_per_s != b.time.tokens_per_s) return a.time.tokens_per_s > b.time.tokens_per_s;
  return a.memory.peak().total() < b.memory.peak().total();
}

bool nearer(const Evaluation& a, const Evaluation& b) {
  return a.memory.over_bytes() < b.memory.over_bytes();
}

// Keeps the best `keep` of a stream under `better` without storing the rest.
void keep_best(std::vector<Evaluation>& v, Evaluation ev, size_t keep,
               bool (*better)(const Evaluation&, const Evaluation&)) {
  if (v.size() >= keep && !better(ev, v.back())) return;
  v.insert(std::upper_bound(v.begin(), v.end(), ev, better), std::move(ev));
  if (v.size() > keep) v.pop_back();
}

}  // namespace

namespace {

SearchResult search_pass(const ModelSpec& m, const Hardware& hw, const TrainSetup& s,
                         const SearchOptions& o, bool offload) {
  SearchResult r;
  r.offload = offload;
  const int64_t n = s.devices;
  const int max_tp = o.max_tp > 0 ? o.max_tp : hw.devices_per_node;
  const size_t keep = static_cast<size_t>(std::max(o.keep, 1));
  for (int64_t tp : divisors(n)) {
    if (tp > max_tp) continue;
    for (int64_t pp : divisors(n / tp)) {
      for (int64_t cp : divisors(n / (tp * pp))) {
        const int64_t dp = n / (tp * pp * cp);
        if (s.global_batch % dp != 0) continue;
        const std::vector<int64_t> eps = m.is_moe() ? divisors(dp * cp) : std::vector<int64_t>{1};
        for (int64_t ep : eps) {
          for (int zero = offload ? 1 : 0; zero <= 3; ++zero) {
            if (zero > 0 && dp * cp == 1 && !offload) continue;  // nothing to shard over
            for (int64_t mb : divisors(s.global_batch / dp)) {
              if (mb > o.max_micro_batch) break;
              for (Recompute rc : {Recompute::kNone, Recompute::kSelective, Recompute::kFull}) {
                for (bool sp : {false, true}) {
                  Layout l;
                  l.dp = static_cast<int>(dp), l.tp = static_cast<int>(tp);
                  l.pp = static_cast<int>(pp), l.cp = static_cast<int>(cp);
                  l.ep = static_cast<int>(ep), l.zero = zero, l.micro_batch = mb;
                  l.recompute = rc, l.sp = sp, l.offload = offload;
                  if (!layout_problem(m, hw, s, l).empty()) continue;
                  ++r.valid;
                  // Memory first: most layouts of a big model fail it, and it is cheap.
                  Evaluation ev;
                  ev.layout = l;
                  ev.memory = estimate_memory(m, hw, s, l);
                  if (!ev.memory.fits()) {
                    ++r.too_big;
                    keep_best(r.nearest_misses, std::move(ev), 3, nearer);
                    continue;
                  }
                  ++r.fitting;
                  ev.time = estimate_step_time(m, hw, s, l);
                  ev.training = estimate_training_time(s, ev.time.tokens_per_s);
                  keep_best(r.ranked, std::move(ev), keep, faster);
                }
              }
            }
          }
        }
      }
    }
  }
  for (auto& ev : r.nearest_misses) {
    ev.time = estimate_step_time(m, hw, s, ev.layout);
    ev.training = estimate_training_time(s, ev.time.tokens_per_s);
  }
  return r;
}

}  // namespace

SearchResult search_layouts(const ModelSpec& m, const Hardware& hw, const TrainSetup& s,
                            const SearchOptions& o) {
  SearchResult r = search_pass(m, hw, s, o, false);
  if (!r.ranked.empty() || r.valid == 0) return r;
  SearchResult off = search_pass(m, hw, s, o, true);
  off.offload_tried = r.offload_tried = true;
  if (off.ranked.empty()) return r;  // report the misses without offload
  return off;
}

}  // namespace tessera::plan
