// `tessera plan train --explain`: the arithmetic behind one layout, line by line, with
// the same functions the estimates use so the lines and the table cannot disagree.
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <sstream>

#include "tessera/base/strings.h"
#include "tessera/plan/comm_model.h"
#include "tessera/plan/report.h"

namespace tessera::plan {
namespace {

using base::strprintf;

std::string b(double x) { return format_bytes(x); }
std::string sec(double x) { return format_seconds(x); }
double M(double x) { return x / 1e6; }

}  // namespace

std::string explain_train(const ModelSpec& m, const Hardware& hw, const TrainSetup& s,
                          const Evaluation& ev) {
  std::ostringstream os;
  const Layout& l = ev.layout;
  const StateBytes sb = state_bytes(s, hw);
  const StageMemory& p = ev.memory.peak();
  const StepTime& t = ev.time;
  const double e = sb.activation;
  const double T = static_cast<double>(l.micro_batch) * s.seq / l.cp;
  const int64_t micro = l.micro_batches(s);

  os << "== model ==\n";
  os << strprintf("N = %.4gB parameters (%.4gB active per token); per layer: attention %.2fM, %s %.2fM, norms %.0f\n",
            m.total_params() / 1e9, m.active_params() / 1e9, M(m.attention_params()),
            m.is_moe() ? "experts" : "MLP",
            M(m.is_moe() ? m.experts * m.expert_params() + m.shared_expert_params()
                         : m.dense_mlp_params()),
            static_cast<double>(m.norm_params()));
  os << strprintf("embeddings %.2fM, lm_head %.2fM%s\n", M(m.embedding_params()), M(m.lm_head_params()),
            m.tied ? " (tied)" : "");

  os << "\n== layout " << l.str() << " ==\n";
  os << strprintf("devices = dp x tp x pp x cp = %d x %d x %d x %d = %lld\n", l.dp, l.tp, l.pp, l.cp,
            static_cast<long long>(l.devices()));
  os << strprintf("micro-batches m = global batch / (dp x mb) = %lld / (%d x %lld) = %lld\n",
            static_cast<long long>(s.global_batch), l.dp, static_cast<long long>(l.micro_batch),
            static_cast<long long>(micro));
  os << strprintf("tokens per micro-batch per device T = mb x seq / cp = %lld x %lld / %d = %.0f\n",
            static_cast<long long>(l.micro_batch), static_cast<long long>(s.seq), l.cp, T);

  os << "\n== memory per device (worst stage: " << p.stage << ", layers " << p.first_layer << "-"
     << p.first_layer + p.layers - 1 << ") ==\n";
  const double shards = static_cast<double>(l.dp) * l.cp;
  os << strprintf("parameters held P = %.4gM (layers / tp, experts / (ep x tp), embeddings and lm_head / tp)\n",
            M(p.params));
  os << strprintf("bytes per element: weight %.0f, gradient %.0f, master %.0f, optimizer moments %.0f%s\n",
            sb.weight, sb.grad, sb.master, sb.moments,
            hw.store_16bit_as_f32 ? " (this hardware stores 16-bit values as f32)" : "");
  auto z = [&](int stage) { return l.zero >= stage ? strprintf(" / (dp x cp = %.0f)", shards) : std::string(); };
  os << strprintf("weights     = %.0f x P%s = %s\n", sb.weight, z(3).c_str(), b(p.weights).c_str());
  os << strprintf("gradients   = %.0f x P%s = %s\n", sb.grad, z(2).c_str(), b(p.grads).c_str());
  os << strprintf("master      = %.0f x P%s = %s%s\n", sb.master, z(1).c_str(), b(p.master).c_str(),
            l.offload ? " (offloaded)" : "");
  os << strprintf("moments     = %.0f x P%s = %s%s\n", sb.moments, z(1).c_str(), b(p.moments).c_str(),
            s.optimizer == Optimizer::kMuon ? " (Muon: 4 bytes for hidden matrices)" : "");
  const ActivationTerms a = layer_activation_terms(m, p.first_layer, s, l, e, sb.matmul_activation);
  const double sp = l.sp ? l.tp : 1;
  os << strprintf("activations of one layer, one micro-batch (Korthikanti et al. 2022 sec. 4.1, e = %.0f bytes):\n", e);
  os << strprintf("  norm inputs + QKV input + MLP input  4 e T h / sp = 4 x %.0f x %.0f x %lld / %.0f = %s\n",
            e, T, static_cast<long long>(m.hidden), sp, b(a.layer_io).c_str());
  if (a.dropout_masks > 0) os << strprintf("  dropout masks  2 T h / sp = %s\n", b(a.dropout_masks).c_str());
  os << strprintf("  norm statistics (f32)  = %s\n", b(a.norm_stats).c_str());
  os << strprintf("  Q, K, V  e T (q + k + v) / tp = %s\n", b(a.qkv).c_str());
  os << strprintf("  attention core  %s = %s\n",
            s.flash_attention ? "4 (heads / tp) T (flash log-sum-exp)" : "5 (heads / tp) T s (scores)",
            b(a.attention_core).c_str());
  os << strprintf("  attention output  e T heads d_v / tp = %s\n", b(a.attention_out).c_str());
  os << strprintf("  MLP  e T %s / tp = %s\n", m.gated_mlp ? "3 f" : "2 f", b(a.mlp).c_str());
  if (a.moe_routing > 0) os << strprintf("  MoE routing (router logits, dispatched copies) = %s\n", b(a.moe_routing).c_str());
  const double kept = layer_activation_bytes(m, p.first_layer, s, l, e, sb.matmul_activation);
  os << strprintf("  sum %s; with recompute=%s each layer keeps %s\n", b(a.total()).c_str(),
            recompute_name(l.recompute), b(kept).c_str());
  os << strprintf("activations = in-flight micro-batches %.3g (%s) x %lld layers x per-layer + embedding/final-norm tensors = %s\n",
            p.in_flight, schedule_name(l.schedule), static_cast<long long>(p.layers),
            b(p.activations).c_str());
  os << strprintf("temporary   = backward working set, logits, SP/ZeRO buffers = %s\n", b(p.temporary).c_str());
  os << strprintf("reserved    = %s; fragmentation = %.0f%% of allocated = %s\n", b(p.reserved).c_str(),
            100 * hw.fragmentation, b(p.fragmentation).c_str());
  os << strprintf("total       = %s of %s: %s by %s\n", b(p.total()).c_str(), b(ev.memory.capacity).c_str(),
            ev.fits() ? "fits with headroom" : "OVER", b(std::abs(ev.memory.over_bytes())).c_str());

  os << "\n== time per step ==\n";
  const std::string dt = compute_dtype(s.precision);
  const StageTime& st = t.stages[t.slowest];
  if (hw.gemm.count(dt))
    os << strprintf("GEMM rates from this machine's calibrated %s curve (peak %.1f GFLOP/s)\n", dt.c_str(),
              hw.peak(dt) / 1e9);
  else
    os << strprintf("GEMM rate = min(peak %.0f TFLOP/s x efficiency %.2f, intensity x %.0f GB/s x %.2f)\n",
              hw.peak(dt) / 1e12, hw.compute_efficiency, hw.memory_bandwidth / 1e9,
              hw.memory_efficiency);
  os << strprintf("slowest stage %d, per micro-batch: GEMM forward %s, backward %s (2x: input and weight gradients)\n",
            t.slowest, sec(st.gemm_fwd).c_str(), sec(st.gemm_bwd).c_str());
  os << strprintf("  attention core forward %s = T x s x heads/tp x (d_qk + d_v) FLOPs (causal half), backward 2.5x = %s\n",
            sec(st.attn_fwd).c_str(), sec(st.attn_bwd).c_str());
  os << strprintf("  memory-bound work 5 x activation bytes / (%.0f GB/s x %.2f) = %s\n",
            hw.memory_bandwidth / 1e9, hw.memory_efficiency, sec(st.elementwise).c_str());
  if (st.recompute > 0) os << strprintf("  recomputation %s\n", sec(st.recompute).c_str());
  const Link tp_link = group_link(hw, l.tp, 1);
  if (l.tp > 1)
    os << strprintf("  TP: %d x %s of e T h = %s per layer on %s (alpha %.1f us, beta %.0f GB/s), all layers: %s\n",
              4 + (l.recompute == Recompute::kFull ? 2 : 0), l.sp ? "(reduce-scatter + all-gather)" : "all-reduce",
              b(e * T * m.hidden).c_str(), tp_link.inter_node ? "inter-node links" : "intra-node links",
              tp_link.latency * 1e6, tp_link.bandwidth / 1e9, sec(st.tp_comm).c_str());
  if (st.cp_comm > 0) os << strprintf("  CP ring attention, exposed: %s\n", sec(st.cp_comm).c_str());
  if (st.ep_comm > 0) os << strprintf("  EP all-to-all (dispatch + combine, fwd + bwd): %s\n", sec(st.ep_comm).c_str());
  os << strprintf("  stage time per micro-batch t_mb = %s\n", sec(st.total()).c_str());
  os << strprintf("compute + TP/CP/EP = m x t_mb = %lld x %s = %s\n", static_cast<long long>(micro),
            sec(st.total()).c_str(), sec(t.compute + t.tp_comm + t.cp_comm + t.ep_comm).c_str());
  if (l.pp > 1) {
    const double v = l.schedule == Schedule::kInterleaved ? l.vpp : 1;
    os << strprintf("bubble = (pp - 1) x t_mb / v = %d x %s / %.0f = %s, i.e. (pp-1)/(v m + pp-1) = %.4f of the pipeline\n",
              l.pp - 1, sec(st.total()).c_str(), v, sec(t.bubble).c_str(),
              (l.pp - 1) / (v * micro + l.pp - 1));
    os << strprintf("pipeline send/recv on the critical path: %s\n", sec(t.pp_comm).c_str());
  }
  if (l.dp * l.cp > 1) {
    const Link dp_link = group_link(hw, l.dp * l.cp, l.tp);
    os << strprintf("DP over %d ranks (%s, alpha %.1f us, beta %.1f GB/s): %s of traffic (%s), %.0f%% overlappable -> exposed %s\n",
              l.dp * l.cp, dp_link.inter_node ? "inter-node" : "intra-node", dp_link.latency * 1e6,
              dp_link.bandwidth / 1e9, sec(t.dp_comm_total).c_str(),
              l.zero == 0 ? "all-reduce of gradients" : l.zero < 3 ? "reduce-scatter of gradients + all-gather of weights"
                                                                 : "2 all-gathers + reduce-scatter per micro-batch",
              100 * hw.comm_overlap, sec(t.dp_comm).c_str());
  }
  os << strprintf("optimizer step: state bytes / memory bandwidth = %s\n", sec(t.optimizer).c_str());
  os << strprintf("step = %s; tokens/s = B x s / step = %lld x %lld / %s = %.0f\n", sec(t.total).c_str(),
            static_cast<long long>(s.global_batch), static_cast<long long>(s.seq), sec(t.total).c_str(),
            t.tokens_per_s);
  os << strprintf("MFU = (6 N_active + 6 L s heads (d_qk + d_v)) x tokens / (step x devices x peak) = %.3g FLOP / (%s x %lld x %.4g TFLOP/s) = %.1f%%\n",
            t.model_flops, sec(t.total).c_str(), static_cast<long long>(s.devices),
            hw.peak(dt) / 1e12, 100 * t.mfu);
  if (s.tokens > 0) {
    const TrainingTime& tt = ev.training;
    os << strprintf("time to train = D / tokens/s = %.4g / %.0f = %s  (= 6 N D / (devices x peak x MFU) up to the attention term)\n",
              s.tokens, t.tokens_per_s, sec(tt.ideal_s).c_str());
    os << strprintf("failures: job MTBF = %.0f h per device / %lld devices = %s; checkpoint every tau = %s (stall %s); restart %s\n",
              s.device_mtbf_hours, static_cast<long long>(s.devices), sec(tt.job_mtbf_s).c_str(),
              sec(tt.checkpoint_interval_s).c_str(), sec(s.checkpoint_stall_s).c_str(),
              sec(s.restart_s).c_str());
    os << strprintf("wall = ideal x (1 + stall/tau) / (1 - (tau/2 + restart) / MTBF) = %s (+%.1f%%, ~%.0f failures)\n",
              sec(tt.wall_s).c_str(), 100 * tt.overhead(), tt.expected_failures);
  }
  return os.str();
}

}  // namespace tessera::plan
