// Memory per device: model states by ZeRO stage and sharding, Korthikanti activations,
// pipeline in-flight micro-batches, temporaries, allowances (docs/planner.md).
#include "tessera/plan/memory.h"

#include <algorithm>

namespace tessera::plan {

ActivationTerms layer_activation_terms(const ModelSpec& m, int64_t layer, const TrainSetup& s,
                                       const Layout& l, double e, double em) {
  if (em < 0) em = e;
  ActivationTerms a;
  const double T = static_cast<double>(l.micro_batch) * s.seq / l.cp;  // tokens on this device
  const double t = l.tp, sp = l.sp ? l.tp : 1;
  const double h = static_cast<double>(m.hidden);
  // Korthikanti 4.1: two norm inputs, the QKV input and the MLP input (the norm outputs).
  a.layer_io = (2 * e + 2 * em) * T * h / sp;
  if (s.dropout) a.dropout_masks = 2 * T * h / sp;
  a.norm_stats = 2 * (m.layernorm ? 8.0 : 4.0) * T / sp;  // mean + rstd, or rstd (f32)
  if (m.mla) {
    // Latents are computed by unsplit down-projections on every TP rank; the up-projected
    // Q, K, V are split by heads.
    const double latents = (m.q_lora_rank > 0 ? 2.0 * m.q_lora_rank : 0) +
                           (m.kv_lora_rank + m.rope_head_dim) + m.kv_lora_rank;
    a.qkv = e * T * latents / sp + e * T * (m.q_width() + m.k_width() + m.v_width()) / t;
  } else {
    a.qkv = e * T * (m.q_width() + m.k_width() + m.v_width()) / t;
  }
  const double heads = static_cast<double>(m.heads) / t;
  if (s.flash_attention) {
    a.attention_core = 4.0 * heads * T;  // f32 log-sum-exp per head and query
  } else {
    // Scores of the local queries against all s keys: softmax output, dropout mask and
    // dropout output (2 + 1 + 2 bytes per score in the paper's 16-bit accounting).
    const double scores = heads * T * static_cast<double>(s.seq);
    a.attention_core = e * scores + (s.dropout ? scores * (1 + e) : 0);
  }
  a.attention_out = e * T * m.o_width() / t;
  const double mlp_mats = m.gated_mlp ? 3.0 : 2.0;  // gate|up + product, or fc1 out + act out
  if (m.layer_is_moe(layer)) {
    const double k = static_cast<double>(m.top_k);
    // Balanced routing: each device processes k x its tokens, whatever the EP degree.
    a.mlp = e * T * k * mlp_mats * m.moe_ffn / t +
            e * T * mlp_mats * m.shared_experts * m.shared_ffn / t;
    a.moe_routing = 4.0 * T * m.experts / sp + e * T * k * h;  // logits, dispatched copies
  } else {  // the last of the MLP's matrices (the product or activation output) feeds only down
    a.mlp = (e * (mlp_mats - 1) + em) * T * m.ffn / t;
  }
  return a;
}

double layer_activation_bytes(const ModelSpec& m, int64_t layer, const TrainSetup& s,
                              const Layout& l, double e, double em) {
  const double T = static_cast<double>(l.micro_batch) * s.seq / l.cp;
  switch (l.recompute) {
    case Recompute::kFull:
      return e * T * m.hidden / (l.sp ? l.tp : 1);  // only the layer input is kept
    case Recompute::kSelective: {
      const ActivationTerms a = layer_activation_terms(m, layer, s, l, e, em);
      return a.total() - a.attention_core -
             (s.selective_keeps_attention_output ? 0 : a.attention_out);
    }
    case Recompute::kNone: break;
  }
  return layer_activation_terms(m, layer, s, l, e, em).total();
}

std::pair<int64_t, int64_t> stage_layers(int64_t layers, int pp, int stage) {
  const int64_t base = layers / pp, rem = layers % pp;
  const int64_t light = pp - rem;  // stages [0, light) get `base`, the rest base + 1
  const int64_t begin = stage < light ? stage * base : light * base + (stage - light) * (base + 1);
  return {begin, begin + base + (stage < light ? 0 : 1)};
}

double in_flight_micro_batches(const Layout& l, int64_t m, int stage) {
  const double mb = static_cast<double>(m);
  switch (l.schedule) {
    case Schedule::kGPipe: return mb;
    case Schedule::k1F1B: return std::min<double>(l.pp - stage, mb);
    case Schedule::kInterleaved: {
      const double v = l.vpp;
      const double chunks = 2.0 * (l.pp - stage - 1) + (v - 1) * l.pp + 1;
      return std::min(v * mb, chunks) / v;
    }
  }
  return mb;
}

double zero_bytes_per_param(int stage, int n, const StateBytes& b) {
  const double opt = b.master + b.moments;
  const double w = stage >= 3 ? b.weight / n : b.weight;
  const double g = stage >= 2 ? b.grad / n : b.grad;
  const double o = stage >= 1 ? opt / n : opt;
  return w + g + o;
}

double MemoryEstimate::host_peak() const {
  double h = 0;
  for (const auto& s : stages) h = std::max(h, s.host);
  return h;
}

MemoryEstimate estimate_memory(const ModelSpec& m, const Hardware& hw, const TrainSetup& s,
                               const Layout& l) {
  MemoryEstimate est;
  est.capacity = hw.memory_bytes;
  est.host_capacity = hw.host_memory_bytes;
  const StateBytes b = state_bytes(s, hw);
  const double e = b.activation;
  const double t = l.tp;
  const double dense_shards = static_cast<double>(l.dp) * l.cp;  // replicas of dense weights
  const double expert_shards = dense_shards / l.ep;               // replicas of an expert
  const int64_t micro = l.micro_batches(s);
  const double T = static_cast<double>(l.micro_batch) * s.seq / l.cp;
  const double h = static_cast<double>(m.hidden);
  const double sp = l.sp ? l.tp : 1;
  for (int st = 0; st < l.pp; ++st) {
    StageMemory sm;
    sm.stage = st;
    const auto [begin, end] = stage_layers(m.layers, l.pp, st);
    sm.first_layer = begin;
    sm.layers = end - begin;
    const bool first = st == 0, last = st == l.pp - 1;
    // Parameters: dense ones split by TP (norms and routers replicated), experts by EP x TP.
    double dense = 0, experts = 0, matrices = 0, layer_max = 0, act_layers = 0, act_max = 0;
    for (int64_t i = begin; i < end; ++i) {
      double d = m.attention_params() / t + m.norm_params();
      double mats = m.attention_params() / t;
      if (m.layer_is_moe(i)) {
        d += m.shared_expert_params() / t + m.router_params();
        mats += m.shared_expert_params() / t + m.layer_routed_params(i) / (l.ep * t);
      } else {
        d += m.dense_mlp_params() / t;
        mats += m.dense_mlp_params() / t;
      }
      const double x = m.layer_routed_params(i) / (l.ep * t);
      dense += d;
      experts += x;
      matrices += mats;
      layer_max = std::max(layer_max, d + x);
      act_layers += layer_activation_bytes(m, i, s, l, e, b.matmul_activation);
      Layout none = l;
      none.recompute = Recompute::kNone;
      act_max = std::max(act_max, layer_activation_bytes(m, i, s, none, e, b.matmul_activation));
    }
    if (first) dense += m.embedding_params() / t;
    if (last) dense += m.final_norm_params() + (m.tied && l.pp == 1 ? 0 : m.vocab * h / t);
    sm.params = dense + experts;
    auto shard = [&](double d, double x, bool sharded) {
      return sharded ? d / dense_shards + x / expert_shards : d + x;
    };
    sm.weights = b.weight * shard(dense, experts, l.zero >= 3);
    sm.grads = b.grad * shard(dense, experts, l.zero >= 2);
    const double master = b.master * shard(dense, experts, l.zero >= 1);
    double moments = b.moments * shard(dense, experts, l.zero >= 1);
    if (s.optimizer == Optimizer::kMuon)  // momentum only for hidden matrices
      moments -= (b.moments - b.muon_moments) *
                 (l.zero >= 1 ? matrices / dense_shards : matrices);
    if (l.offload) {
      sm.host = master + moments + sm.grads;  // ZeRO-Offload keeps a host gradient copy too
    } else {
      sm.master = master;
      sm.moments = moments;
    }
    // Activations of the in-flight micro-batches, plus what lies outside the layers:
    // token ids and positions (int32) on the first stage, the final norm on the last.
    sm.in_flight = in_flight_micro_batches(l, micro, st);
    double per_micro = act_layers;
    if (first) per_micro += 8.0 * T + (s.dropout ? T * h / sp : 0);
    if (last) per_micro += ((e + b.matmul_activation) * h + (m.layernorm ? 8.0 : 4.0)) * T / sp;
    sm.activations = sm.in_flight * per_micro;
    // Temporaries: gradients of one layer's activations in backward (and the recomputed
    // layer under full recomputation), f32 logits on the last stage, an all-gathered
    // sequence under SP, two gathered layers + one layer's gradients under ZeRO-3, two
    // gradient buckets under ZeRO-2.
    sm.temporary = act_max * (l.recompute == Recompute::kFull ? 2 : 1);
    if (last) sm.temporary += 4.0 * T * m.vocab / t;
    if (l.sp) sm.temporary += e * T * h;
    if (l.zero >= 3) sm.temporary += layer_max * (2 * b.weight + b.grad);
    else if (l.zero == 2) sm.temporary += 2 * s.zero_bucket_bytes;
    sm.reserved = hw.reserved_bytes;
    const double allocated = sm.weights + sm.grads + sm.master + sm.moments + sm.activations +
                             sm.temporary;
    sm.fragmentation = hw.fragmentation * allocated;
    est.stages.push_back(sm);
  }
  for (int i = 1; i < l.pp; ++i)
    if (est.stages[i].total() > est.stages[est.worst].total()) est.worst = i;
  return est;
}

}  // namespace tessera::plan
