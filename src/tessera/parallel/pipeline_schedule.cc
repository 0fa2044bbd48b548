// Pipeline schedules and their replay (pipeline_schedule.h).
#include "tessera/parallel/pipeline_schedule.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <tuple>

#include "tessera/base/error.h"

namespace tessera::parallel {

PipeSchedule parse_pipe_schedule(const std::string& name) {
  if (name == "gpipe") return PipeSchedule::kGpipe;
  if (name == "1f1b") return PipeSchedule::k1F1B;
  if (name == "interleaved") return PipeSchedule::kInterleaved;
  fail("pipeline schedule '", name, "' is not one of gpipe, 1f1b, interleaved");
}

const char* pipe_schedule_name(PipeSchedule s) {
  switch (s) {
    case PipeSchedule::kGpipe: return "gpipe";
    case PipeSchedule::k1F1B: return "1f1b";
    default: return "interleaved";
  }
}

void check_pipe_shape(PipeSchedule s, const PipeShape& sh) {
  TESSERA_CHECK(sh.pp >= 1, "pp = ", sh.pp, " must be >= 1");
  TESSERA_CHECK(sh.micro_batches >= 1, "pipeline: ", sh.micro_batches,
                " micro-batches per step (grad_accum) must be >= 1");
  if (s == PipeSchedule::kInterleaved) {
    TESSERA_CHECK(sh.virtual_stages >= 2, "pipeline schedule interleaved needs pp_virtual_stages >= 2, got ",
                  sh.virtual_stages, " (use 1f1b for one chunk per rank)");
    TESSERA_CHECK(sh.micro_batches % sh.pp == 0, "pipeline schedule interleaved needs the ",
                  sh.micro_batches, " micro-batches per step (grad_accum) to be a multiple of pp = ",
                  sh.pp);
  } else {
    TESSERA_CHECK(sh.virtual_stages == 1, "pipeline schedule ", pipe_schedule_name(s),
                  " runs one chunk per rank: pp_virtual_stages = ", sh.virtual_stages,
                  " needs schedule = \"interleaved\"");
  }
}

std::vector<std::vector<PipeAction>> pipe_schedule(PipeSchedule s, const PipeShape& sh) {
  check_pipe_shape(s, sh);
  const int P = sh.pp, M = sh.micro_batches, V = sh.virtual_stages;
  std::vector<std::vector<PipeAction>> out(P);
  using K = PipeAction::Kind;
  for (int r = 0; r < P; ++r) {
    auto& a = out[r];
    if (s == PipeSchedule::kGpipe) {
      for (int m = 0; m < M; ++m) a.push_back({K::kForward, m, 0});
      for (int m = 0; m < M; ++m) a.push_back({K::kBackward, m, 0});
    } else if (s == PipeSchedule::k1F1B) {
      const int warmup = std::min(P - r - 1, M);
      for (int m = 0; m < warmup; ++m) a.push_back({K::kForward, m, 0});
      for (int k = 0; k < M - warmup; ++k) {
        a.push_back({K::kForward, warmup + k, 0});
        a.push_back({K::kBackward, k, 0});
      }
      for (int m = M - warmup; m < M; ++m) a.push_back({K::kBackward, m, 0});
    } else {
      // Megatron-LM forward_backward_pipelining_with_interleaving: the k-th forward runs
      // chunk (k mod pp V) / pp of micro-batch (k / pp V) pp + k mod pp; backwards walk the
      // chunks in reverse.
      const int total = M * V;
      const int warmup = M == P ? total : std::min(total, (P - r - 1) * 2 + (V - 1) * P);
      auto action = [&](int k, bool forward) {
        const int in_group = k % (P * V);
        int chunk = in_group / P;
        if (!forward) chunk = V - 1 - chunk;
        const int micro = (k / (P * V)) * P + k % P;
        return PipeAction{forward ? K::kForward : K::kBackward, micro, chunk};
      };
      for (int k = 0; k < warmup; ++k) a.push_back(action(k, true));
      for (int k = 0; k < total - warmup; ++k) {
        a.push_back(action(warmup + k, true));
        a.push_back(action(k, false));
      }
      for (int k = total - warmup; k < total; ++k) a.push_back(action(k, false));
    }
  }
  return out;
}

std::string format_pipe_schedule(const std::vector<std::vector<PipeAction>>& actions,
                                 const PipeShape& sh) {
  std::string s;
  for (size_t r = 0; r < actions.size(); ++r) {
    s += "rank " + std::to_string(r) + ":";
    for (const PipeAction& a : actions[r]) {
      s += a.kind == PipeAction::kForward ? " F" : " B";
      s += std::to_string(a.micro);
      if (sh.virtual_stages > 1) s += "." + std::to_string(a.chunk);
    }
    s += "\n";
  }
  return s;
}

PipeTimeline simulate_schedule(const std::vector<std::vector<PipeAction>>& actions,
                               const PipeShape& sh, double forward, double backward) {
  const int P = sh.pp, V = sh.virtual_stages, VS = P * V;
  TESSERA_CHECK(static_cast<int>(actions.size()) == P, "schedule has ", actions.size(),
                " ranks, pp = ", P);
  // End time of each pass, by (kind, micro, virtual stage).
  std::map<std::tuple<int, int, int>, double> done;
  PipeTimeline t;
  t.spans.resize(P);
  std::vector<size_t> next(P, 0);
  std::vector<double> free(P, 0.0);
  std::vector<int> in_flight(P, 0);
  size_t remaining = 0;
  for (const auto& a : actions) remaining += a.size();
  while (remaining > 0) {
    bool progressed = false;
    for (int r = 0; r < P; ++r) {
      while (next[r] < actions[r].size()) {
        const PipeAction& a = actions[r][next[r]];
        const int vs = a.chunk * P + r;
        // What the pass waits for: the previous stage's forward, the next stage's backward
        // (at the last stage its own forward).
        std::tuple<int, int, int> dep;
        bool has_dep = true;
        if (a.kind == PipeAction::kForward) {
          has_dep = vs > 0;
          dep = {0, a.micro, vs - 1};
        } else {
          dep = vs + 1 < VS ? std::tuple<int, int, int>{1, a.micro, vs + 1}
                            : std::tuple<int, int, int>{0, a.micro, vs};
        }
        double ready = 0;
        if (has_dep) {
          const auto it = done.find(dep);
          if (it == done.end()) break;
          ready = it->second;
        }
        if (a.kind == PipeAction::kBackward)
          TESSERA_CHECK(done.count({0, a.micro, vs}), "pipeline schedule: rank ", r, " runs B",
                        a.micro, " of chunk ", a.chunk, " before its forward");
        const double start = std::max(free[r], ready);
        const double end = start + (a.kind == PipeAction::kForward ? forward : backward);
        TESSERA_CHECK(done.emplace(std::tuple<int, int, int>{a.kind == PipeAction::kForward ? 0 : 1,
                                                             a.micro, vs},
                                   end)
                          .second,
                      "pipeline schedule: rank ", r, " runs ",
                      a.kind == PipeAction::kForward ? "F" : "B", a.micro, " of chunk ", a.chunk,
                      " twice");
        free[r] = end;
        t.spans[r].push_back({start, end});
        in_flight[r] += a.kind == PipeAction::kForward ? 1 : -1;
        t.max_in_flight = std::max(t.max_in_flight, in_flight[r]);
        ++next[r];
        --remaining;
        progressed = true;
      }
    }
    if (!progressed) {
      for (int r = 0; r < P; ++r)
        if (next[r] < actions[r].size()) {
          const PipeAction& a = actions[r][next[r]];
          fail("pipeline schedule deadlocks: rank ", r, " waits forever at ",
               a.kind == PipeAction::kForward ? "F" : "B", a.micro, " of chunk ", a.chunk);
        }
    }
  }
  const int M = sh.micro_batches;
  TESSERA_CHECK(static_cast<int>(done.size()) == 2 * M * VS, "pipeline schedule runs ",
                done.size(), " passes, expected ", 2 * M * VS);
  t.bubble = measured_bubble(t.spans);
  for (const auto& r : t.spans)
    if (!r.empty()) t.makespan = std::max(t.makespan, r.back().end);
  return t;
}

namespace {

// The pipeline's span (first start to last end over every rank) and each rank's busy time.
struct SpanBusy {
  double span = 0;
  std::vector<double> busy;  // per rank
};
SpanBusy span_and_busy(const std::vector<std::vector<PipeSpan>>& spans) {
  double t0 = INFINITY, t1 = -INFINITY;
  SpanBusy r;
  for (const auto& rank : spans) {
    double b = 0;
    for (const PipeSpan& s : rank) {
      t0 = std::min(t0, s.start);
      t1 = std::max(t1, s.end);
      b += s.end - s.start;
    }
    r.busy.push_back(b);
  }
  r.span = t1 > t0 ? t1 - t0 : 0.0;
  return r;
}

}  // namespace

double measured_bubble(const std::vector<std::vector<PipeSpan>>& spans) {
  const SpanBusy sb = span_and_busy(spans);
  if (sb.span <= 0 || spans.empty()) return 0.0;
  double busy = 0;
  for (double b : sb.busy) busy += b;
  return 1.0 - busy / (static_cast<double>(spans.size()) * sb.span);
}

double critical_bubble(const std::vector<std::vector<PipeSpan>>& spans) {
  const SpanBusy sb = span_and_busy(spans);
  if (sb.span <= 0 || spans.empty()) return 0.0;
  return 1.0 - *std::max_element(sb.busy.begin(), sb.busy.end()) / sb.span;
}

double ideal_bubble(const PipeShape& sh) {
  const double p = sh.pp, m = sh.micro_batches, v = sh.virtual_stages;
  return (p - 1) / (v * m + p - 1);
}

std::string pipe_timeline_svg(const std::vector<std::vector<PipeAction>>& actions,
                              const std::vector<std::vector<PipeSpan>>& spans,
                              const PipeShape& sh, const std::string& title) {
  double t0 = INFINITY, t1 = -INFINITY;
  for (const auto& r : spans)
    for (const PipeSpan& s : r) {
      t0 = std::min(t0, s.start);
      t1 = std::max(t1, s.end);
    }
  if (!(t1 > t0)) t0 = 0, t1 = 1;
  const double left = 70, width = 900, row = 34, top = 40;
  const int P = static_cast<int>(spans.size());
  const double height = top + row * P + 40;
  const auto x = [&](double t) { return left + (t - t0) / (t1 - t0) * width; };
  char buf[512];
  std::string s;
  std::snprintf(buf, sizeof buf,
                "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
                "font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%%\" height=\"100%%\" "
                "fill=\"white\"/>\n",
                left + width + 20, height);
  s += buf;
  std::string esc;
  for (char ch : title) esc += ch == '<' ? std::string("&lt;") : ch == '&' ? std::string("&amp;") : std::string(1, ch);
  std::snprintf(buf, sizeof buf,
                "<text x=\"%.0f\" y=\"20\" font-size=\"14\">%s: measured bubble %.1f%%, formula "
                "(pp-1)/(v m+pp-1) %.1f%%</text>\n",
                left, esc.c_str(), 100 * measured_bubble(spans), 100 * ideal_bubble(sh));
  s += buf;
  for (int r = 0; r < P; ++r) {
    const double y = top + r * row;
    std::snprintf(buf, sizeof buf, "<text x=\"8\" y=\"%.0f\">rank %d</text>\n", y + row / 2 + 4, r);
    s += buf;
    for (size_t i = 0; i < spans[r].size() && i < actions[r].size(); ++i) {
      const PipeAction& a = actions[r][i];
      const bool f = a.kind == PipeAction::kForward;
      // Chunks of an interleaved schedule in different hues.
      const char* fill = f ? (a.chunk % 2 ? "#c7e9c0" : "#9ecae1") : (a.chunk % 2 ? "#31a354" : "#3182bd");
      const double x0 = x(spans[r][i].start), x1 = x(spans[r][i].end);
      std::snprintf(buf, sizeof buf,
                    "<rect x=\"%.2f\" y=\"%.0f\" width=\"%.2f\" height=\"%.0f\" fill=\"%s\" "
                    "stroke=\"#333\" stroke-width=\"0.5\"><title>%s%d chunk %d: %.3f-%.3f ms</title></rect>\n",
                    x0, y + 3, std::max(0.5, x1 - x0), row - 6, fill, f ? "F" : "B", a.micro, a.chunk,
                    1e3 * (spans[r][i].start - t0), 1e3 * (spans[r][i].end - t0));
      s += buf;
      if (x1 - x0 > 14) {
        std::snprintf(buf, sizeof buf, "<text x=\"%.2f\" y=\"%.0f\" text-anchor=\"middle\" fill=\"%s\">%s%d</text>\n",
                      (x0 + x1) / 2, y + row / 2 + 4, f ? "#000" : "#fff", f ? "F" : "B", a.micro);
        s += buf;
      }
    }
  }
  const double axis = top + row * P + 6;
  for (int i = 0; i <= 5; ++i) {
    const double t = t0 + (t1 - t0) * i / 5;
    std::snprintf(buf, sizeof buf,
                  "<line x1=\"%.1f\" y1=\"%.0f\" x2=\"%.1f\" y2=\"%.0f\" stroke=\"#999\"/>"
                  "<text x=\"%.1f\" y=\"%.0f\" text-anchor=\"middle\">%.1f ms</text>\n",
                  x(t), axis, x(t), axis + 5, x(t), axis + 18, 1e3 * (t - t0));
    s += buf;
  }
  s += "</svg>\n";
  return s;
}

}  // namespace tessera::parallel
