// Text tables, summaries and JSON for training plans (explain_train: report_explain.cc;
// serving: report_infer.cc).
#include "tessera/plan/report.h"

#include <cmath>
#include <cstdio>
#include <string>
#include <sstream>

#include "tessera/base/strings.h"

namespace tessera::plan {

std::string format_bytes(double b) {
  const double a = std::abs(b), k = 1024.0;
  if (a >= k * k * k * k) return base::strprintf("%.2f TiB", b / (k * k * k * k));
  if (a >= k * k * k) return base::strprintf("%.2f GiB", b / (k * k * k));
  if (a >= k * k) return base::strprintf("%.1f MiB", b / (k * k));
  if (a >= k) return base::strprintf("%.1f KiB", b / k);
  return base::strprintf("%.0f B", b);
}

std::string format_seconds(double s) {
  if (!std::isfinite(s)) return "never (failures outpace checkpoints)";
  if (s >= 86400 * 2) return base::strprintf("%.1f days", s / 86400);
  if (s >= 3600) return base::strprintf("%.1f h", s / 3600);
  if (s >= 120) return base::strprintf("%.1f min", s / 60);
  if (s >= 1) return base::strprintf("%.2f s", s);
  if (s >= 1e-3) return base::strprintf("%.1f ms", s * 1e3);
  return base::strprintf("%.1f us", s * 1e6);
}

namespace {

std::string count(double n) {
  if (n >= 1e12) return base::strprintf("%.2fT", n / 1e12);
  if (n >= 1e9) return base::strprintf("%.2fB", n / 1e9);
  if (n >= 1e6) return base::strprintf("%.2fM", n / 1e6);
  if (n >= 1e3) return base::strprintf("%.1fk", n / 1e3);
  return base::strprintf("%.0f", n);
}

double gib(double b) { return b / (1024.0 * 1024 * 1024); }

}  // namespace

std::string describe_train_setup(const ModelSpec& m, const Hardware& hw, const TrainSetup& s) {
  std::ostringstream os;
  os << "model: " << m.describe() << "\n";
  os << "hardware: " << s.devices << " x " << hw.name << " (" << format_bytes(hw.memory_bytes)
     << ", " << hw.peak(compute_dtype(s.precision)) / 1e12 << " TFLOP/s " << compute_dtype(s.precision)
     << ", " << hw.devices_per_node << " per node";
  if (hw.source != "preset") os << "; from " << hw.source;
  os << ")\n";
  os << "run: seq " << s.seq << ", global batch " << s.global_batch << " sequences ("
     << count(static_cast<double>(s.global_batch) * s.seq) << " tokens), " << precision_name(s.precision)
     << ", " << optimizer_name(s.optimizer);
  if (s.tokens > 0) os << ", D = " << count(s.tokens) << " tokens";
  os << "\n";
  return os.str();
}

std::string format_train_table(const std::vector<Evaluation>& evs) {
  std::ostringstream os;
  os << base::strprintf(
      "%3s  %-4s %-3s %-3s %-3s %-3s %-4s %-4s %-9s %-3s | %7s %7s %7s %7s %7s %7s | "
      "%8s %8s %8s %8s %8s | %10s %5s\n",
      "#", "dp", "tp", "pp", "cp", "ep", "zero", "mb", "recompute", "sp", "mem GiB", "weights",
      "grads", "optim", "activ", "other", "step s", "compute", "comm", "bubble", "optim",
      "tokens/s", "MFU");
  int rank = 0;
  for (const auto& ev : evs) {
    const Layout& l = ev.layout;
    const StageMemory& p = ev.memory.peak();
    const StepTime& t = ev.time;
    os << base::strprintf(
        "%3d  %-4d %-3d %-3d %-3d %-3d %-4s %-4lld %-9s %-3s | %7.2f %7.2f %7.2f %7.2f "
        "%7.2f %7.2f | %8.3f %8.3f %8.3f %8.3f %8.3f | %10.0f %5.3f\n",
        ++rank, l.dp, l.tp, l.pp, l.cp, l.ep,
        (std::to_string(l.zero) + (l.offload ? "+o" : "")).c_str(),
        static_cast<long long>(l.micro_batch), recompute_name(l.recompute), l.sp ? "on" : "off",
        gib(p.total()), gib(p.weights), gib(p.grads), gib(p.optimizer()), gib(p.activations),
        gib(p.temporary + p.reserved + p.fragmentation), t.total, t.compute, t.comm_exposed(),
        t.bubble, t.optimizer, t.tokens_per_s, t.mfu);
  }
  return os.str();
}

std::string format_train_summary(const Evaluation& ev, const TrainSetup& s) {
  std::ostringstream os;
  const StageMemory& p = ev.memory.peak();
  const StepTime& t = ev.time;
  os << "layout " << ev.layout.str() << " (" << t.micro_batches << " micro-batches per step)\n";
  os << "memory per device (pipeline stage " << p.stage << ", layers " << p.first_layer << "-"
     << p.first_layer + p.layers - 1 << "): " << format_bytes(p.total()) << " of "
     << format_bytes(ev.memory.capacity)
     << (ev.fits() ? " - fits" : " - DOES NOT FIT") << "\n";
  // One line of a breakdown: name, the formatted value, its share of the total.
  auto share = [&](int name_w, const char* name, int value_w, const std::string& value, double v,
                   double total) {
    os << base::strprintf("  %-*s %*s  %5.1f%%\n", name_w, name, value_w, value.c_str(),
                          total > 0 ? 100 * v / total : 0.0);
  };
  auto part = [&](const char* name, double v) {
    share(15, name, 12, format_bytes(v), v, p.total());
  };
  part("weights", p.weights);
  part("gradients", p.grads);
  part("master weights", p.master);
  part("optimizer", p.moments);
  part("activations", p.activations);
  part("temporary", p.temporary);
  part("reserved", p.reserved);
  part("fragmentation", p.fragmentation);
  if (p.host > 0) os << "  (offloaded to host: " << format_bytes(p.host) << ")\n";
  os << "time per step: " << format_seconds(t.total) << "\n";
  auto tpart = [&](const char* name, double v) {
    share(22, name, 10, format_seconds(v), v, t.total);
  };
  tpart("compute", t.compute);
  tpart("TP comm", t.tp_comm);
  tpart("CP comm (exposed)", t.cp_comm);
  tpart("EP all-to-all", t.ep_comm);
  tpart("PP send/recv (exposed)", t.pp_comm);
  tpart("DP comm (exposed)", t.dp_comm);
  tpart("pipeline bubble", t.bubble);
  tpart("optimizer step", t.optimizer);
  os << base::strprintf("throughput: %.0f tokens/s, MFU %.1f%% (HFU %.1f%%)\n", t.tokens_per_s,
                        100 * t.mfu, 100 * t.hfu);
  if (s.tokens > 0) {
    const TrainingTime& tt = ev.training;
    os << "time to train on " << count(s.tokens) << " tokens: " << format_seconds(tt.ideal_s)
       << " without failures, " << format_seconds(tt.wall_s) << " with them (job MTBF "
       << format_seconds(tt.job_mtbf_s) << ", checkpoint every "
       << format_seconds(tt.checkpoint_interval_s) << ", ~" << std::llround(tt.expected_failures)
       << " failures)\n";
  }
  return os.str();
}

std::string format_search_summary(const SearchResult& r) {
  std::ostringstream os;
  if (r.offload)
    os << "nothing fits in device memory without ZeRO-Offload; searched again with the fp32 "
          "master weights, moments and a gradient copy in host memory (zero column: +o)\n";
  os << r.valid << " valid layouts, " << r.fitting << " fit in memory, " << r.too_big
     << " do not";
  if (!r.nearest_misses.empty()) {
    const Evaluation& n = r.nearest_misses.front();
    os << " (nearest miss " << n.layout.str() << " needs "
       << format_bytes(n.memory.peak().total()) << ", over by " << format_bytes(n.memory.over_bytes())
       << ")";
  }
  os << "\n";
  return os.str();
}

nlohmann::json train_setup_json(const ModelSpec& m, const Hardware& hw, const TrainSetup& s) {
  nlohmann::json j;
  j["model"] = {{"name", m.name},
                {"params", m.total_params()},
                {"active_params", m.active_params()},
                {"layers", m.layers},
                {"hidden", m.hidden},
                {"heads", m.heads},
                {"kv_heads", m.kv_heads},
                {"experts", m.experts},
                {"top_k", m.top_k},
                {"vocab", m.vocab}};
  j["hardware"] = {{"name", hw.name},
                   {"source", hw.source},
                   {"memory_bytes", hw.memory_bytes},
                   {"peak_flops", hw.peak(compute_dtype(s.precision))},
                   {"devices_per_node", hw.devices_per_node}};
  j["run"] = {{"devices", s.devices},
              {"seq", s.seq},
              {"global_batch", s.global_batch},
              {"tokens", s.tokens},
              {"precision", precision_name(s.precision)},
              {"optimizer", optimizer_name(s.optimizer)}};
  return j;
}

nlohmann::json evaluation_json(const Evaluation& ev) {
  const Layout& l = ev.layout;
  const StageMemory& p = ev.memory.peak();
  const StepTime& t = ev.time;
  nlohmann::json j;
  j["layout"] = {{"dp", l.dp},
                 {"tp", l.tp},
                 {"pp", l.pp},
                 {"cp", l.cp},
                 {"ep", l.ep},
                 {"zero", l.zero},
                 {"micro_batch", l.micro_batch},
                 {"recompute", recompute_name(l.recompute)},
                 {"sp", l.sp},
                 {"schedule", schedule_name(l.schedule)},
                 {"vpp", l.vpp},
                 {"offload", l.offload},
                 {"text", l.str()}};
  j["fits"] = ev.fits();
  j["memory_bytes"] = {{"weights", p.weights},         {"gradients", p.grads},
                       {"master_weights", p.master},   {"optimizer", p.moments},
                       {"activations", p.activations}, {"temporary", p.temporary},
                       {"reserved", p.reserved},       {"fragmentation", p.fragmentation},
                       {"total", p.total()},           {"capacity", ev.memory.capacity},
                       {"offloaded_to_host", p.host},  {"stage", p.stage}};
  j["time_s"] = {{"compute", t.compute},       {"tp_comm", t.tp_comm},
                 {"cp_comm", t.cp_comm},       {"ep_comm", t.ep_comm},
                 {"pp_comm", t.pp_comm},       {"dp_comm", t.dp_comm},
                 {"dp_comm_before_overlap", t.dp_comm_total},
                 {"bubble", t.bubble},         {"optimizer", t.optimizer},
                 {"total", t.total}};
  j["micro_batches"] = t.micro_batches;
  j["tokens_per_s"] = t.tokens_per_s;
  j["mfu"] = t.mfu;
  j["hfu"] = t.hfu;
  if (ev.training.ideal_s > 0) {
    j["time_to_train_s"] = ev.training.ideal_s;
    j["time_to_train_with_failures_s"] =
        std::isfinite(ev.training.wall_s) ? nlohmann::json(ev.training.wall_s) : nlohmann::json();
    j["job_mtbf_s"] = ev.training.job_mtbf_s;
    j["checkpoint_interval_s"] = ev.training.checkpoint_interval_s;
  }
  return j;
}

}  // namespace tessera::plan
