// Pipeline schedule simulation and the --svg drawing (schedule above, memory bars below).
#include "tessera/plan/svg.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "tessera/base/error.h"
#include "tessera/base/strings.h"
#include "tessera/io/json_file.h"
#include "tessera/plan/report.h"

namespace tessera::plan {
namespace {

struct OpRef {
  bool forward;
  int micro, chunk;
};

// The op order of device `i` (Megatron-LM's schedules).
std::vector<OpRef> device_order(const Layout& l, int64_t m, int i) {
  std::vector<OpRef> ops;
  const int pp = l.pp;
  const int mm = static_cast<int>(m);
  if (l.schedule == Schedule::kGPipe) {
    for (int j = 0; j < mm; ++j) ops.push_back({true, j, 0});
    for (int j = 0; j < mm; ++j) ops.push_back({false, j, 0});
    return ops;
  }
  const int v = l.schedule == Schedule::kInterleaved ? l.vpp : 1;
  const int total = mm * v;
  auto fwd = [&](int k) {
    return OpRef{true, (k / (pp * v)) * pp + k % pp, (k / pp) % v};
  };
  auto bwd = [&](int k) {
    return OpRef{false, (k / (pp * v)) * pp + k % pp, v - 1 - (k / pp) % v};
  };
  const int warm = v == 1 ? std::min(pp - i - 1, total)
                          : std::min((pp - i - 1) * 2 + (v - 1) * pp, total);
  if (v == 1) {
    for (int k = 0; k < warm; ++k) ops.push_back({true, k, 0});
    for (int k = 0; k < total - warm; ++k) {
      ops.push_back({true, warm + k, 0});
      ops.push_back({false, k, 0});
    }
    for (int k = total - warm; k < total; ++k) ops.push_back({false, k, 0});
    return ops;
  }
  for (int k = 0; k < warm; ++k) ops.push_back(fwd(k));
  for (int k = 0; k < total - warm; ++k) {
    ops.push_back(fwd(warm + k));
    ops.push_back(bwd(k));
  }
  for (int k = total - warm; k < total; ++k) ops.push_back(bwd(k));
  return ops;
}

}  // namespace

std::vector<PipelineOp> simulate_pipeline(const Layout& l, int64_t micro_batches,
                                          const std::vector<double>& fwd,
                                          const std::vector<double>& bwd) {
  const int pp = l.pp;
  Layout lay = l;
  // Megatron's interleaved order assumes m divisible by pp; otherwise draw plain 1F1B.
  if (lay.schedule == Schedule::kInterleaved && micro_batches % pp != 0) {
    lay.schedule = Schedule::k1F1B;
    lay.vpp = 1;
  }
  const int v = lay.schedule == Schedule::kInterleaved ? lay.vpp : 1;
  const int V = pp * v;  // virtual stages
  const int m = static_cast<int>(micro_batches);
  std::vector<std::vector<double>> fdone(V, std::vector<double>(m, -1)), bdone = fdone;
  std::vector<std::vector<OpRef>> order(pp);
  for (int i = 0; i < pp; ++i) order[i] = device_order(lay, micro_batches, i);
  std::vector<size_t> next(pp, 0);
  std::vector<double> free_at(pp, 0);
  std::vector<PipelineOp> out;
  for (bool progress = true; progress;) {
    progress = false;
    for (int i = 0; i < pp; ++i) {
      while (next[i] < order[i].size()) {
        const OpRef& op = order[i][next[i]];
        const int vs = op.chunk * pp + i;
        double ready = 0;
        if (op.forward) {
          if (vs > 0) ready = fdone[vs - 1][op.micro];
        } else {
          ready = vs + 1 < V ? bdone[vs + 1][op.micro] : fdone[vs][op.micro];
        }
        if (ready < 0) break;  // input not produced yet
        PipelineOp p;
        p.device = i, p.micro = op.micro, p.chunk = op.chunk, p.forward = op.forward;
        p.start = std::max(free_at[i], ready);
        p.end = p.start + (op.forward ? fwd[i] : bwd[i]) / v;
        free_at[i] = p.end;
        (op.forward ? fdone : bdone)[vs][op.micro] = p.end;
        out.push_back(p);
        ++next[i];
        progress = true;
      }
    }
  }
  return out;
}

namespace {

std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    if (c == '<') o += "&lt;";
    else if (c == '>') o += "&gt;";
    else if (c == '&') o += "&amp;";
    else o += c;
  }
  return o;
}

}  // namespace

std::string render_plan_svg(const ModelSpec& m, const Hardware& hw, const TrainSetup& s,
                            const Evaluation& ev) {
  const Layout& l = ev.layout;
  const StepTime& t = ev.time;
  // Draw at most 32 micro-batches: enough to show fill, steady state and drain.
  const int64_t drawn = std::min<int64_t>(t.micro_batches, 32);
  std::vector<double> fwd, bwd;
  for (const StageTime& st : t.stages) {
    const double f = st.gemm_fwd + st.attn_fwd + 0.4 * st.elementwise +
                     (st.tp_comm + st.cp_comm + st.ep_comm) / 3;
    fwd.push_back(f);
    bwd.push_back(st.total() - f);
  }
  const auto ops = simulate_pipeline(l, drawn, fwd, bwd);
  double span = 0;
  for (const auto& op : ops) span = std::max(span, op.end);
  const int rows = std::min(l.pp, 64);
  const double W = 1000, left = 90, right = 20, row_h = rows > 16 ? 12 : 24;
  const double sched_top = 70, sched_h = rows * row_h;
  const double chart_top = sched_top + sched_h + 80, chart_h = 220;
  const double H = chart_top + chart_h + 70;
  std::ostringstream os;
  os << base::strprintf(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
      "font-family=\"sans-serif\" font-size=\"11\">\n<rect width=\"100%%\" height=\"100%%\" "
      "fill=\"white\"/>\n",
      W, H);
  os << "<text x=\"10\" y=\"20\" font-size=\"15\">" << esc(m.name) << " on " << s.devices << " x "
     << esc(hw.name) << ": " << esc(l.str()) << "</text>\n";
  os << base::strprintf(
      "<text x=\"10\" y=\"40\">pipeline schedule (%s, %lld of %lld micro-batches drawn): "
      "step %s, %.0f tokens/s, MFU %.1f%%; blue forward, green backward, gaps are bubble</text>\n",
      schedule_name(l.schedule), static_cast<long long>(drawn),
      static_cast<long long>(t.micro_batches), format_seconds(t.total).c_str(), t.tokens_per_s,
      100 * t.mfu);
  const double plot_w = W - left - right;
  for (int i = 0; i < rows; ++i) {
    os << base::strprintf("<text x=\"10\" y=\"%.1f\">stage %d</text>\n",
                          sched_top + i * row_h + row_h * 0.7, i);
  }
  for (const auto& op : ops) {
    if (op.device >= rows || span <= 0) continue;
    const double x = left + plot_w * op.start / span, w = plot_w * (op.end - op.start) / span;
    const double y = sched_top + op.device * row_h;
    const char* fill = op.forward ? (op.chunk % 2 ? "#6fa8dc" : "#3d85c6")
                                  : (op.chunk % 2 ? "#93c47d" : "#6aa84f");
    os << base::strprintf(
        "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" fill=\"%s\" "
        "stroke=\"white\" stroke-width=\"0.5\"><title>%s micro-batch %d chunk %d: "
        "%s</title></rect>\n",
        x, y + 1, std::max(w, 0.5), row_h - 2, fill, op.forward ? "forward" : "backward", op.micro,
        op.chunk, format_seconds(op.end - op.start).c_str());
    if (w > 14 && row_h >= 20) {
      os << base::strprintf(
          "<text x=\"%.2f\" y=\"%.1f\" fill=\"white\" text-anchor=\"middle\">%d</text>\n",
          x + w / 2, y + row_h * 0.68, op.micro);
    }
  }
  os << base::strprintf(
      "<text x=\"%.0f\" y=\"%.1f\">0</text><text x=\"%.0f\" y=\"%.1f\" "
      "text-anchor=\"end\">%s</text>\n",
      left, sched_top + sched_h + 14, W - right, sched_top + sched_h + 14,
      format_seconds(span).c_str());

  // Memory per stage: stacked parts against the device's capacity.
  const auto& stages = ev.memory.stages;
  double top = ev.memory.capacity;
  for (const auto& st : stages) top = std::max(top, st.total());
  top *= 1.08;
  os << base::strprintf(
      "<text x=\"10\" y=\"%.1f\" font-size=\"13\">memory per device by pipeline stage "
      "(dashed: capacity %s)</text>\n",
      chart_top - 25, format_bytes(ev.memory.capacity).c_str());
  const char* names[] = {"weights", "gradients", "master", "optimizer", "activations",
                         "temporary", "reserved+frag"};
  const char* colors[] = {"#3d85c6", "#e69138", "#8e7cc3", "#c27ba0", "#6aa84f", "#f1c232", "#999999"};
  const int nbars = static_cast<int>(std::min<size_t>(stages.size(), 64));
  const double slot = plot_w / nbars, bar_w = std::min(60.0, slot * 0.7);
  for (int i = 0; i < nbars; ++i) {
    const StageMemory& st = stages[i];
    const double parts[] = {st.weights,     st.grads,     st.master,
                            st.moments,     st.activations, st.temporary,
                            st.reserved + st.fragmentation};
    double acc = 0;
    const double x = left + slot * i + (slot - bar_w) / 2;
    for (int k = 0; k < 7; ++k) {
      const double h0 = chart_h * acc / top, h1 = chart_h * parts[k] / top;
      acc += parts[k];
      if (h1 <= 0) continue;
      os << base::strprintf(
          "<rect x=\"%.1f\" y=\"%.2f\" width=\"%.1f\" height=\"%.2f\" fill=\"%s\"><title>stage %d "
          "%s: %s</title></rect>\n",
          x, chart_top + chart_h - h0 - h1, bar_w, h1, colors[k], i, names[k],
          format_bytes(parts[k]).c_str());
    }
    if (nbars <= 16) {
      os << base::strprintf("<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%d</text>\n",
                            x + bar_w / 2, chart_top + chart_h + 14, i);
    }
  }
  for (double f : {0.0, 0.5, 1.0}) {  // y labels at 0, half and full capacity
    const double y = chart_top + chart_h - chart_h * f * ev.memory.capacity / top;
    os << base::strprintf("<text x=\"%.0f\" y=\"%.1f\" text-anchor=\"end\">%s</text>\n", left - 6,
                          y + 4, format_bytes(f * ev.memory.capacity).c_str());
  }
  const double cap_y = chart_top + chart_h - chart_h * ev.memory.capacity / top;
  os << base::strprintf(
      "<line x1=\"%.0f\" x2=\"%.0f\" y1=\"%.2f\" y2=\"%.2f\" stroke=\"#cc0000\" "
      "stroke-dasharray=\"6,4\"/>\n"
      "<line x1=\"%.0f\" x2=\"%.0f\" y1=\"%.1f\" y2=\"%.1f\" stroke=\"black\"/>\n",
      left, W - right, cap_y, cap_y, left, W - right, chart_top + chart_h, chart_top + chart_h);
  for (int k = 0; k < 7; ++k) {
    const double x = left + k * 125;
    os << base::strprintf(
        "<rect x=\"%.0f\" y=\"%.1f\" width=\"10\" height=\"10\" fill=\"%s\"/>"
        "<text x=\"%.0f\" y=\"%.1f\">%s</text>\n",
        x, chart_top + chart_h + 30, colors[k], x + 14, chart_top + chart_h + 39, names[k]);
  }
  os << "</svg>\n";
  return os.str();
}

void write_plan_svg(const std::string& path, const ModelSpec& m, const Hardware& hw,
                    const TrainSetup& s, const Evaluation& ev) {
  io::write_file_atomic(path, render_plan_svg(m, hw, s, ev));
}

std::string render_infer_svg(const ModelSpec& m, const Hardware& hw, const InferSetup& s,
                             const std::vector<InferEvaluation>& configs) {
  TESSERA_CHECK(!configs.empty(), "plan infer --svg: no configuration to draw");
  const double left = 150, width = 560, row = 30, top = 50;
  const double height = top + row * static_cast<double>(configs.size()) + 50;
  const double total = hw.memory_bytes;
  std::string out;
  base::appendf(out,
                "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%.0f\" height=\"%.0f\" "
                "font-family=\"sans-serif\" font-size=\"12\">\n"
                "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n"
                "<text x=\"10\" y=\"20\" font-size=\"14\">%s on %s: memory per device, %lld-token "
                "requests at full concurrency</text>\n",
                left + width + 170, height, m.name.c_str(), hw.name.c_str(), static_cast<long long>(s.context));
  struct Part {
    const char* name;
    const char* color;
  };
  const Part parts[] = {{"weights", "#1f77b4"}, {"workspace", "#7f7f7f"}, {"KV cache", "#ff7f0e"}, {"free", "#e5e5e5"}};
  for (size_t i = 0; i < configs.size(); ++i) {
    const InferEvaluation& e = configs[i];
    const double y = top + row * static_cast<double>(i);
    const double kv = e.kv_bytes_per_request * static_cast<double>(e.max_concurrency);
    const double used[] = {e.weight_bytes, e.workspace_bytes, kv,
                           std::max(0.0, total - e.weight_bytes - e.workspace_bytes - kv)};
    base::appendf(out, "<text x=\"10\" y=\"%.0f\">tp=%d %s / %s KV</text>\n", y + 16, e.tp,
                  e.weights.c_str(), e.kv.c_str());
    double x = left;
    for (int k = 0; k < 4; ++k) {
      const double w = width * std::clamp(used[k] / total, 0.0, 1.0);
      base::appendf(out,
                    "<rect x=\"%.1f\" y=\"%.0f\" width=\"%.1f\" height=\"%.0f\" fill=\"%s\">"
                    "<title>%s: %s</title></rect>\n",
                    x, y + 4, w, row - 8, parts[k].color, parts[k].name, format_bytes(used[k]).c_str());
      x += w;
    }
    base::appendf(out, "<text x=\"%.0f\" y=\"%.0f\">%lld requests, %.0f tok/s</text>\n", left + width + 8,
                  y + 16, static_cast<long long>(e.max_concurrency), e.decode_tokens_per_s_full);
  }
  const double ly = top + row * static_cast<double>(configs.size()) + 20;
  for (int k = 0; k < 4; ++k)
    base::appendf(out,
                  "<rect x=\"%.0f\" y=\"%.0f\" width=\"12\" height=\"12\" fill=\"%s\"/>"
                  "<text x=\"%.0f\" y=\"%.0f\">%s</text>\n",
                  left + 110.0 * k, ly, parts[k].color, left + 110.0 * k + 16, ly + 11, parts[k].name);
  out += "</svg>\n";
  return out;
}

}  // namespace tessera::plan
