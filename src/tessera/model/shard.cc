// Per-rank sizes under tensor parallelism (shard.h).
#include "tessera/model/shard.h"

#include <algorithm>
#include <limits>

#include "tessera/base/error.h"

namespace tessera::model {

LocalDims local_dims(const ModelConfig& c, TpShard s) {
  TESSERA_CHECK(s.size >= 1 && s.rank >= 0 && s.rank < s.size, "tensor-parallel rank ", s.rank,
                " is outside a group of ", s.size);
  const int64_t tp = s.size;
  // Mixture of experts under tp: the attention splits as usual; the router and routed
  // experts are replicated over the tp group (each rank runs them on the same rows); a
  // shared expert (qwen2_moe's gated one, deepseek's) splits as a dense MLP does.
  if (c.is_deepseek())  // its dense MLPs and shared experts split over tp
    for (int64_t l = 0; l < c.num_layers + c.mtp_layers; ++l)
      TESSERA_CHECK(c.mlp_size(l) % tp == 0, "tp = ", tp, " does not divide layer ", l, "'s MLP size ", c.mlp_size(l));
  const bool dense_mlp = !c.is_moe() || c.shared_expert;
  auto split = [&](int64_t n, const char* what) {
    TESSERA_CHECK(n % tp == 0, "tp = ", tp, " does not divide ", what, " = ", n);
    return n / tp;
  };
  LocalDims d;
  d.heads = split(c.num_heads, "num_attention_heads");
  if (tp > c.num_kv_heads && c.num_kv_heads > 0 && tp % c.num_kv_heads == 0) {
    d.kv_heads = 1;
    d.kv_replicas = tp / c.num_kv_heads;
    d.kv_index = s.rank / d.kv_replicas;
  } else {
    TESSERA_CHECK(c.num_kv_heads % tp == 0, "tp = ", tp, " and num_key_value_heads = ",
                  c.num_kv_heads, ": one must divide the other");
    d.kv_heads = c.num_kv_heads / tp;
    d.kv_index = s.rank;
  }
  d.head_dim = c.head_dim;
  d.q = d.heads * d.head_dim;
  d.kv = d.kv_heads * d.head_dim;
  d.qkv = d.q + 2 * d.kv;
  d.ffn = dense_mlp ? split(c.intermediate_size, "intermediate_size") : c.intermediate_size;
  TESSERA_CHECK(c.vocab_size >= tp, "tp = ", tp, " exceeds vocab_size = ", c.vocab_size);
  const int64_t per = (c.vocab_size + tp - 1) / tp;
  d.vocab_begin = std::min<int64_t>(c.vocab_size, per * s.rank);
  d.vocab = std::min<int64_t>(c.vocab_size, d.vocab_begin + per) - d.vocab_begin;
  TESSERA_CHECK(d.vocab > 0, "tp = ", tp, " leaves rank ", s.rank, " no vocabulary rows of ",
                c.vocab_size);
  TESSERA_CHECK(s.ep_size >= 1 && s.ep_rank >= 0 && s.ep_rank < s.ep_size, "expert-parallel rank ", s.ep_rank,
                " is outside a group of ", s.ep_size);
  TESSERA_CHECK(s.ep_size == 1 || c.is_moe(), "ep = ", s.ep_size, ": expert parallelism needs a ",
                "mixture-of-experts model (", c.model_type, " has no experts)");
  TESSERA_CHECK(c.num_experts % s.ep_size == 0, "ep = ", s.ep_size, " does not divide the model's ",
                c.num_experts, " experts");
  d.experts = c.num_experts / s.ep_size;
  d.expert_begin = d.experts * s.ep_rank;
  return d;
}

std::pair<int64_t, int64_t> PpStage::layers(int chunk, int64_t num_layers) const {
  if (whole()) return {0, num_layers};
  const int v = virtual_stage(chunk);
  return {bounds[v], bounds[v + 1]};
}

bool PpStage::holds_layer(int64_t layer) const { return whole() || chunk_of_layer(layer) >= 0; }

int PpStage::chunk_of_layer(int64_t layer) const {
  if (whole()) return 0;
  for (int c = 0; c < num_chunks(); ++c) {
    const int v = virtual_stage(c);
    if (layer >= bounds[v] && layer < bounds[v + 1]) return c;
  }
  return -1;
}

std::string PpStage::describe() const {
  if (whole()) return "every layer";
  std::string s = "layers ";
  for (int c = 0; c < num_chunks(); ++c) {
    const int v = virtual_stage(c);
    s += (c ? ", " : "") + std::to_string(bounds[v]);
    if (bounds[v + 1] - bounds[v] > 1) s += "-" + std::to_string(bounds[v + 1] - 1);
  }
  if (holds_embed()) s += " + embeddings";
  if (holds_head()) s += " + head";
  return s;
}

PpStage pipeline_stage(const ModelConfig& c, int rank, int size, int virtual_stages,
                       const std::vector<int64_t>& given) {
  TESSERA_CHECK(size >= 1 && rank >= 0 && rank < size, "pipeline rank ", rank,
                " is outside ", size, " stages");
  TESSERA_CHECK(virtual_stages >= 1, "pp_virtual_stages = ", virtual_stages, " must be >= 1");
  PpStage st;
  st.rank = rank;
  st.size = size;
  st.virtual_stages = virtual_stages;
  if (size == 1 && virtual_stages == 1) return st;
  const int V = size * virtual_stages;
  const int64_t L = c.num_layers;
  TESSERA_CHECK(V <= L, "pp = ", size, " x ", virtual_stages, " virtual stages = ", V,
                " exceeds the model's ", L, " layers (each stage needs one)");
  st.bounds.assign(V + 1, 0);
  if (!given.empty()) {
    TESSERA_CHECK(static_cast<int>(given.size()) == V, "pp_layers lists ", given.size(),
                  " stages, the layout has pp x virtual stages = ", V);
    for (int v = 0; v < V; ++v) {
      TESSERA_CHECK(given[v] >= 1, "pp_layers: stage ", v, " gets ", given[v],
                    " layers (each needs at least one)");
      st.bounds[v + 1] = st.bounds[v] + given[v];
    }
    TESSERA_CHECK(st.bounds[V] == L, "pp_layers sums to ", st.bounds[V], " layers, the model has ", L);
    return st;
  }
  // Parameters per layer, and what the first and last virtual stages carry besides.
  const int64_t H = c.hidden_size, norms = c.uses_layernorm() ? 2 : 1;
  const int64_t per_layer = H * (c.q_dim() + 2 * c.kv_dim()) + c.q_dim() * H +
                            (c.gated_mlp() ? 3 : 2) * H * c.intermediate_size + 2 * norms * H;
  int64_t embed = c.vocab_size * H, head = norms * H;
  if (c.arch == Arch::kGpt2) embed += c.max_position_embeddings * H;
  if (!c.tie_word_embeddings) head += c.vocab_size * H;
  // best[v][b]: the smallest largest stage when virtual stages 0..v-1 hold layers [0, b).
  constexpr int64_t kInf = std::numeric_limits<int64_t>::max();
  std::vector<std::vector<int64_t>> best(V + 1, std::vector<int64_t>(L + 1, kInf));
  std::vector<std::vector<int64_t>> cut(V + 1, std::vector<int64_t>(L + 1, 0));
  best[0][0] = 0;
  for (int v = 1; v <= V; ++v)
    for (int64_t b = v; b <= L - (V - v); ++b)
      for (int64_t a = v - 1; a < b; ++a) {
        if (best[v - 1][a] == kInf) continue;
        const int64_t cost = (b - a) * per_layer + (v == 1 ? embed : 0) + (v == V ? head : 0);
        const int64_t m = std::max(best[v - 1][a], cost);
        if (m < best[v][b]) {
          best[v][b] = m;
          cut[v][b] = a;
        }
      }
  int64_t b = L;
  for (int v = V; v >= 1; --v) {
    st.bounds[v] = b;
    b = cut[v][b];
  }
  st.bounds[0] = 0;
  return st;
}

}  // namespace tessera::model
