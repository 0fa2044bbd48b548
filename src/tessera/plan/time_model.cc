// Step time, MFU and time to train (formulas and assumptions: time_model.h, docs/planner.md).
#include "tessera/plan/time_model.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "tessera/plan/comm_model.h"
#include "tessera/plan/memory.h"

namespace tessera::plan {
namespace {

struct Gemm {
  double rows, in, out, count;  // (rows x in) @ (in x out), `count` times
};

// The matmuls of layer `i` for `T` tokens on one device (forward shapes).
std::vector<Gemm> layer_gemms(const ModelSpec& m, int64_t i, double T, const Layout& l) {
  const double t = l.tp, h = static_cast<double>(m.hidden);
  std::vector<Gemm> g;
  if (m.mla) {
    if (m.q_lora_rank > 0) {
      g.push_back({T, h, static_cast<double>(m.q_lora_rank), 1});
      g.push_back({T, static_cast<double>(m.q_lora_rank), m.q_width() / t, 1});
    } else {
      g.push_back({T, h, m.q_width() / t, 1});
    }
    g.push_back({T, h, static_cast<double>(m.kv_lora_rank + m.rope_head_dim), 1});
    g.push_back({T, static_cast<double>(m.kv_lora_rank),
                 m.heads * static_cast<double>(m.nope_head_dim + m.v_head_dim) / t, 1});
  } else {
    g.push_back({T, h, (m.q_width() + m.k_width() + m.v_width()) / t, 1});
  }
  g.push_back({T, m.o_width() / t, h, 1});
  const double up = m.gated_mlp ? 2 : 1;
  if (m.layer_is_moe(i)) {
    g.push_back({T, h, static_cast<double>(m.experts), 1});  // router
    const double local = static_cast<double>(m.experts) / l.ep;
    const double rows = T * m.top_k / local;  // balanced routing: k T token-expert pairs
    g.push_back({rows, h, up * m.moe_ffn / t, local});
    g.push_back({rows, m.moe_ffn / t, h, local});
    if (m.shared_experts > 0) {
      const double f = static_cast<double>(m.shared_experts) * m.shared_ffn;
      g.push_back({T, h, up * f / t, 1});
      g.push_back({T, f / t, h, 1});
    }
  } else {
    g.push_back({T, h, up * m.ffn / t, 1});
    g.push_back({T, m.ffn / t, h, 1});
  }
  return g;
}

// Seconds of one GEMM at the hardware's achievable rate for its shape.
double gemm_seconds(const Hardware& hw, const std::string& dt, double e, double m, double n,
                    double k) {
  return 2 * m * n * k / hw.gemm_flops(dt, m, n, k, e);
}

double all_reduce_like(const Link& link, int p, double bytes, bool sp) {
  // Under SP each all-reduce becomes a reduce-scatter plus an all-gather (same volume).
  if (!sp) return collective_cost(Collective::kAllReduce, bytes, p, link).seconds;
  return collective_cost(Collective::kReduceScatter, bytes, p, link).seconds +
         collective_cost(Collective::kAllGather, bytes, p, link).seconds;
}

double exposed(double comm, double window, double overlap) {
  return std::max(comm - overlap * window, (1 - overlap) * comm);
}

}  // namespace

double layer_elementwise_bytes(const ModelSpec& m, int64_t layer, const TrainSetup& s,
                               const Layout& l, const Hardware& hw) {
  const StateBytes b = state_bytes(s, hw);
  Layout none = l;
  none.recompute = Recompute::kNone;
  double bytes = 5 * layer_activation_bytes(m, layer, s, none, b.activation);
  if (hw.store_16bit_as_f32 && s.precision != Precision::kFp32) {
    const double T = static_cast<double>(l.micro_batch) * s.seq / l.cp;
    for (const Gemm& g : layer_gemms(m, layer, T, l)) bytes += g.count * 8 * g.rows * (2 * g.in + 2 * g.out);
  }
  return bytes;
}

double optimizer_bytes_per_param(const StateBytes& b) {
  return 2 * (b.master + b.moments) + b.grad + b.weight * (b.master > 0 ? 1 : 2) + 4 * b.grad;
}

double model_flops_per_token(const ModelSpec& m, int64_t seq) {
  return 6.0 * m.active_matmul_params() +
         6.0 * m.layers * static_cast<double>(seq) * m.heads * (m.qk_dim() + m.v_dim());
}

StepTime estimate_step_time(const ModelSpec& m, const Hardware& hw, const TrainSetup& s,
                            const Layout& l) {
  StepTime st;
  const StateBytes b = state_bytes(s, hw);
  const std::string dt = compute_dtype(s.precision);
  const double e = b.activation;
  const double gemm_e = hw.store_16bit_as_f32 ? 2 : e;  // operands are rounded to 16 bits
  const bool rounds = hw.store_16bit_as_f32 && s.precision != Precision::kFp32;
  const double T = static_cast<double>(l.micro_batch) * s.seq / l.cp;
  const double h = static_cast<double>(m.hidden);
  const int64_t micro = l.micro_batches(s);
  st.micro_batches = micro;
  const double ebw = hw.effective_elementwise_bandwidth();
  const double obw = hw.effective_optimizer_bandwidth();
  const Link tp_link = group_link(hw, l.tp, 1);
  const Link cp_link = group_link(hw, l.cp, l.tp);
  const Link ep_link = group_link(hw, l.ep, l.tp * l.cp);
  const Link dp_link = group_link(hw, l.dp * l.cp, l.tp);
  const Link pp_link = group_link(hw, 2, l.tp * l.cp * l.dp);
  Layout none = l;
  none.recompute = Recompute::kNone;
  double flops_per_micro_all_stages = 0;  // hardware FLOPs of one micro-batch, one TP x CP rank

  for (int stage = 0; stage < l.pp; ++stage) {
    StageTime sg;
    const auto [begin, end] = stage_layers(m.layers, l.pp, stage);
    double stage_flops = 0;
    for (int64_t i = begin; i < end; ++i) {
      double fwd = 0, bwd = 0, gemm_fwd_flops = 0;
      for (const Gemm& g : layer_gemms(m, i, T, l)) {
        fwd += g.count * gemm_seconds(hw, dt, gemm_e, g.rows, g.out, g.in);
        bwd += g.count * (gemm_seconds(hw, dt, gemm_e, g.rows, g.in, g.out) +   // input grad
                          gemm_seconds(hw, dt, gemm_e, g.in, g.out, g.rows));  // weight grad
        gemm_fwd_flops += 2 * g.count * g.rows * g.in * g.out;
      }
      double flops = 3 * gemm_fwd_flops;
      // Causal attention: each local query meets s / 2 keys on average (kernels skip
      // the masked half); backward does 2.5x forward (FlashAttention-2's five matmuls to two).
      const double heads = static_cast<double>(m.heads) / l.tp;
      const double attn_flops = T * static_cast<double>(s.seq) * heads * (m.qk_dim() + m.v_dim());
      const double attn_rate =
          hw.attention_flops > 0 ? hw.attention_flops
                                 : hw.gemm_flops(dt, static_cast<double>(s.seq) / l.cp,
                                                 static_cast<double>(s.seq), m.qk_dim(), gemm_e);
      const double attn = attn_flops / attn_rate;
      const double act = layer_activation_bytes(m, i, s, none, e);
      const double elem = layer_elementwise_bytes(m, i, s, l, hw) / ebw;
      sg.gemm_fwd += fwd;
      sg.gemm_bwd += bwd;
      sg.attn_fwd += attn;
      sg.attn_bwd += 2.5 * attn;
      sg.elementwise += elem;
      flops += 3.5 * attn_flops;
      if (l.recompute == Recompute::kFull) {
        sg.recompute += fwd + attn + 2 * act / ebw;
        flops += gemm_fwd_flops + attn_flops;  // one more forward
      } else if (l.recompute == Recompute::kSelective) {
        sg.recompute += attn;
        flops += attn_flops;
      }
      // TP: two all-reduces forward, two backward, two more in a recomputed forward.
      const int tp_colls = 4 + (l.recompute == Recompute::kFull ? 2 : 0);
      sg.tp_comm += tp_colls * all_reduce_like(tp_link, l.tp, e * T * h, l.sp);
      // CP (ring attention): cp - 1 hand-offs of this rank's K and V forward, of K, V and
      // their gradients backward, hidden behind the attention they feed.
      if (l.cp > 1) {
        const double kv = e * T * (m.k_width() + m.v_width()) / l.tp;
        const double hop = collective_cost(Collective::kSendRecv, kv, 2, cp_link).seconds;
        const bool again = l.recompute != Recompute::kNone;  // attention runs again
        const double passes = 3 + (again ? 1 : 0);
        const double hidden_by = attn * (3.5 + (again ? 1 : 0));
        sg.cp_comm += std::max(0.0, passes * (l.cp - 1) * hop - hidden_by);
      }
      // EP: dispatch and combine all-to-alls forward and backward (and in a recompute).
      if (m.layer_is_moe(i) && l.ep > 1) {
        const int a2a = 4 + (l.recompute == Recompute::kFull ? 2 : 0);
        sg.ep_comm += a2a * collective_cost(Collective::kAllToAll, e * T * m.top_k * h, l.ep,
                                            ep_link).seconds;
      }
      stage_flops += flops;
    }
    if (stage == l.pp - 1) {  // lm_head and the loss over f32 logits
      const double V = static_cast<double>(m.vocab) / l.tp;
      sg.gemm_fwd += gemm_seconds(hw, dt, gemm_e, T, V, h);
      sg.gemm_bwd += gemm_seconds(hw, dt, gemm_e, T, h, V) + gemm_seconds(hw, dt, gemm_e, h, V, T);
      sg.elementwise += (4 * 4.0 * T * V + (rounds ? 8 * T * (2 * h + 2 * V) : 0)) / ebw;
      stage_flops += 6 * T * V * h;
    }
    flops_per_micro_all_stages += stage_flops;
    st.stages.push_back(sg);
    if (sg.total() > st.stages[st.slowest].total()) st.slowest = stage;
  }

  const StageTime& slow = st.stages[st.slowest];
  const double mb = static_cast<double>(micro);
  st.compute = mb * slow.compute();
  st.tp_comm = mb * slow.tp_comm;
  st.cp_comm = mb * slow.cp_comm;
  st.ep_comm = mb * slow.ep_comm;
  const double v = l.schedule == Schedule::kInterleaved ? l.vpp : 1;
  st.bubble = (l.pp - 1) * slow.total() / v;  // (pp-1)/(m+pp-1) of the pipeline's time
  if (l.pp > 1) {
    const double p2p = collective_cost(Collective::kSendRecv, e * T * h / (l.sp ? l.tp : 1), 2,
                                       pp_link).seconds;
    st.pp_comm = 2 * (v * mb + l.pp - 2) * p2p;
  }

  // Data parallelism over dp x cp replicas of the dense weights (experts: / ep).
  const MemoryEstimate mem = estimate_memory(m, hw, s, l);
  const StageMemory& ms = mem.stages[st.slowest];
  double expert_params = 0;
  {
    const auto [begin, end] = stage_layers(m.layers, l.pp, st.slowest);
    for (int64_t i = begin; i < end; ++i) expert_params += m.layer_routed_params(i) / (l.ep * l.tp);
  }
  const double dense_params = ms.params - expert_params;
  const int dense_group = l.dp * l.cp, expert_group = dense_group / l.ep;
  auto dp_cost = [&](Collective c, double bytes_per_param) {
    return collective_cost(c, bytes_per_param * dense_params, dense_group, dp_link).seconds +
           collective_cost(c, bytes_per_param * expert_params, expert_group, dp_link).seconds;
  };
  const double w_fwd = slow.gemm_fwd + slow.attn_fwd, w_bwd = slow.compute() - w_fwd;
  const double overlap = hw.comm_overlap;
  if (l.zero == 0) {
    st.dp_comm_total = dp_cost(Collective::kAllReduce, b.grad);
    st.dp_comm = exposed(st.dp_comm_total, w_bwd, overlap);
  } else if (l.zero <= 2) {
    // Reduce-scatter of gradients (every micro-batch under ZeRO-2), all-gather of the
    // updated weights overlapped with the next step's first forward.
    const double rs = dp_cost(Collective::kReduceScatter, b.grad) * (l.zero == 2 ? mb : 1);
    const double ag = dp_cost(Collective::kAllGather, b.weight);
    st.dp_comm_total = rs + ag;
    st.dp_comm = exposed(rs, w_bwd * (l.zero == 2 ? mb : 1), overlap) + exposed(ag, w_fwd, overlap);
  } else {
    // ZeRO-3: weights gathered for forward and again for backward, gradients
    // reduce-scattered, every micro-batch; prefetching hides them behind compute.
    const double per_micro = 2 * dp_cost(Collective::kAllGather, b.weight) +
                             dp_cost(Collective::kReduceScatter, b.grad);
    st.dp_comm_total = mb * per_micro;
    st.dp_comm = exposed(st.dp_comm_total, mb * slow.compute(), overlap);
  }

  // Optimizer step over this device's shard: read and write master weights and moments,
  // read the gradient, write the weight; clipping (norm, then scale in place) and
  // zeroing touch the gradients four times more.
  const double shard = l.zero >= 1 ? ms.params / dense_group : ms.params;
  const double grads_local = l.zero >= 2 ? shard : ms.params;
  const double state = optimizer_bytes_per_param(b) - 4 * b.grad;
  if (l.offload) {
    st.optimizer = shard * state / hw.host_memory_bandwidth +
                   shard * (b.grad + b.weight) / hw.host_bandwidth + 4 * b.grad * grads_local / obw;
  } else {
    st.optimizer = (shard * state + 4 * b.grad * grads_local) / obw;
  }
  if (s.optimizer == Optimizer::kMuon) {
    // Newton-Schulz, 5 iterations of X X^T, then B X (Jordan et al. 2024) on every matrix.
    const auto [begin, end] = stage_layers(m.layers, l.pp, st.slowest);
    auto ns = [&](double r, double c) {
      const double a = std::min(r, c), z = std::max(r, c);
      return 5 * (4 * a * a * z + 2 * a * a * a) / hw.gemm_flops(dt, a, a, z, gemm_e);
    };
    for (int64_t i = begin; i < end; ++i)
      for (const Gemm& g : layer_gemms(m, i, 1, l)) st.optimizer += g.count * ns(g.in, g.out);
  }

  st.total = st.compute + st.tp_comm + st.cp_comm + st.ep_comm + st.bubble + st.pp_comm +
             st.dp_comm + st.optimizer;
  const double tokens = static_cast<double>(s.global_batch) * s.seq;
  st.tokens_per_s = tokens / st.total;
  st.model_flops = tokens * model_flops_per_token(m, s.seq);
  // Every (dp, cp) replica runs every micro-batch through all stages; TP splits each.
  st.hardware_flops = flops_per_micro_all_stages * l.tp * l.cp * mb * l.dp;
  const double peak = hw.peak(dt) * static_cast<double>(s.devices);
  st.mfu = st.model_flops / (st.total * peak);
  st.hfu = st.hardware_flops / (st.total * peak);
  return st;
}

TrainingTime estimate_training_time(const TrainSetup& s, double tokens_per_s) {
  TrainingTime t;
  if (s.tokens <= 0 || tokens_per_s <= 0) return t;
  t.ideal_s = s.tokens / tokens_per_s;
  t.job_mtbf_s = s.device_mtbf_hours * 3600.0 / static_cast<double>(s.devices);
  const double delta = s.checkpoint_stall_s;
  t.checkpoint_interval_s =
      s.checkpoint_interval_s > 0 ? s.checkpoint_interval_s : std::sqrt(2 * delta * t.job_mtbf_s);
  const double tau = std::max(t.checkpoint_interval_s, 1e-9);
  const double lost = (tau / 2 + s.restart_s) / t.job_mtbf_s;
  t.wall_s = lost >= 1 ? std::numeric_limits<double>::infinity()
                       : t.ideal_s * (1 + delta / tau) / (1 - lost);
  t.expected_failures = std::isfinite(t.wall_s) ? t.wall_s / t.job_mtbf_s : 0;
  return t;
}

}  // namespace tessera::plan
