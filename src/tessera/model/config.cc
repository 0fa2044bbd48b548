// Parsing and validation of Hugging Face config.json files.
#include "tessera/model/config.h"

#include <charconv>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <initializer_list>
#include <utility>

#include <nlohmann/json.hpp>

#include "tessera/base/checked.h"
#include "tessera/base/error.h"
#include "tessera/io/gguf.h"
#include "tessera/io/json_file.h"
#include "tessera/model/gguf_model.h"

namespace tessera::model {

using nlohmann::json;

const char* arch_name(Arch a) {
  switch (a) {
    case Arch::kLlama: return "llama";
    case Arch::kQwen2: return "qwen2";
    case Arch::kGpt2: return "gpt2";
  }
  return "?";
}

namespace {

using namespace limits;  // kMaxVocab, kMaxHidden, ...

// An integer key in [lo, hi]; the error names the key and, for a value outside int64
// (a 20-digit literal), says so instead of wrapping.
int64_t get_int(const json& j, const std::string& source, const char* key, int64_t lo, int64_t hi,
                int64_t dflt = -1, bool required = true) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    TESSERA_CHECK(!required, source, ": missing key '", key, "'");
    return dflt;
  }
  TESSERA_CHECK(it->is_number_integer(), source, ": key '", key, "' must be an integer, got ",
                io::json_brief(*it));
  TESSERA_CHECK(io::json_int_in(*it, lo, hi), source, ": key '", key, "' must be in [", lo, ", ", hi, "], got ",
                io::json_brief(*it));
  return it->get<int64_t>();
}

double get_float(const json& j, const std::string& source, const char* key, double dflt) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  TESSERA_CHECK(it->is_number(), source, ": key '", key, "' must be a number, got ",
                io::json_brief(*it));
  return it->get<double>();
}

// A mixture-of-experts model's "topk_method": "greedy" (plain top-k, the default) or
// "noaux_tc" (a per-expert selection bias, DeepSeek-V3's auxiliary-loss-free balancing).
// group_limited_greedy (DeepSeek-V2) only where groups are read (DeepSeek models).
std::string read_topk_method(const json& j, const std::string& source, bool groups = false) {
  auto it = j.find("topk_method");
  if (it == j.end() || it->is_null()) return "greedy";
  const std::string m = it->is_string() ? it->get<std::string>() : "";
  TESSERA_CHECK(m == "greedy" || m == "noaux_tc" || (groups && m == "group_limited_greedy"), source,
                ": 'topk_method' ", io::json_brief(*it), " is not supported (greedy",
                groups ? ", group_limited_greedy" : "", " or noaux_tc)");
  return m;
}

bool get_bool(const json& j, const std::string& source, const char* key, bool dflt) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  TESSERA_CHECK(it->is_boolean(), source, ": key '", key, "' must be true or false, got ",
                io::json_brief(*it));
  return it->get<bool>();
}

// eos_token_id may be an int or a list of ints (Llama 3); keep the first. An id outside the
// vocabulary is an error naming the key.
int64_t get_token_id(const json& j, const std::string& source, const char* key, int64_t vocab) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return -1;
  const json* v = &*it;
  if (it->is_array() && !it->empty()) v = &(*it)[0];
  if (!v->is_number_integer()) return -1;
  TESSERA_CHECK(io::json_int_in(*v, -1, vocab - 1), source, ": key '", key, "' is ", v->dump(),
                ", outside the vocabulary [0, ", vocab, ")");
  return v->get<int64_t>();
}

// A finite float key in (0, hi] (epsilons, rope theta): nan, inf and 1e300 would turn every
// activation into nan or inf without a word.
double get_positive(const json& j, const std::string& source, const char* key, double dflt, double hi) {
  const double v = get_float(j, source, key, dflt);
  TESSERA_CHECK(std::isfinite(v) && v > 0 && v <= hi, source, ": key '", key, "' must be in (0, ", hi, "], got ", v);
  return v;
}

// A finite float key in [0, hi] (loss weights, noise levels).
double get_nonnegative(const json& j, const std::string& source, const char* key, double dflt, double hi) {
  const double v = get_float(j, source, key, dflt);
  TESSERA_CHECK(std::isfinite(v) && v >= 0 && v <= hi, source, ": key '", key, "' must be in [0, ", hi, "], got ", v);
  return v;
}


// Sliding windows as transformers reads them: mistral's sliding_window (4096 when the key
// is absent, as MistralConfig's default; null: none), mixtral's (default none), and qwen2's
// use_sliding_window (default false) with sliding_window (4096) from layer
// max_window_layers (28) on. A layer_types list must agree with that.
void read_sliding_window(const json& j, const std::string& source, ModelConfig& c) {
  const std::string& t = c.model_type;
  if (t == "mistral" || t == "mixtral") {
    const auto sw = j.find("sliding_window");
    if (sw == j.end() ? t == "mistral" : !sw->is_null())
      c.sliding_window = get_int(j, source, "sliding_window", 1, kMaxPositions, 4096, false);
  } else if ((t == "qwen2" || t == "qwen2_moe" || t == "qwen3") && get_bool(j, source, "use_sliding_window", false)) {
    c.sliding_window = get_int(j, source, "sliding_window", 1, kMaxPositions, 4096, false);
    c.max_window_layers = get_int(j, source, "max_window_layers", 0, kMaxLayers, 28, false);
    if (c.max_window_layers >= c.num_layers) c.sliding_window = 0, c.max_window_layers = 0;  // no layer windowed
  }
  const auto lt = j.find("layer_types");
  if (lt == j.end() || lt->is_null()) return;
  TESSERA_CHECK(lt->is_array() && static_cast<int64_t>(lt->size()) == c.num_layers, source,
                ": 'layer_types' must list the ", c.num_layers, " layers, got ", io::json_brief(*lt));
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const auto& v = (*lt)[l];
    const std::string want = c.layer_window(l) > 0 ? "sliding_attention" : "full_attention";
    TESSERA_CHECK(v.is_string() && v.get<std::string>() == want, source, ": 'layer_types' says ", io::json_brief(v),
                  " for layer ", l, " where sliding_window / use_sliding_window / max_window_layers give \"", want,
                  "\" (other layer patterns are not supported)");
  }
}

// The sizes every transformers decoder config names alike.
void read_sizes(const json& j, const std::string& source, ModelConfig& c) {
  c.vocab_size = get_int(j, source, "vocab_size", 1, kMaxVocab);
  c.hidden_size = get_int(j, source, "hidden_size", 1, kMaxHidden);
  c.intermediate_size = get_int(j, source, "intermediate_size", 1, kMaxIntermediate);
  c.num_layers = get_int(j, source, "num_hidden_layers", 1, kMaxLayers);
  c.num_heads = get_int(j, source, "num_attention_heads", 1, kMaxHeads);
}

// A float key that may be null (none: 0), in [0, hi].
double get_optional_nonnegative(const json& j, const std::string& source, const char* key, double dflt, double hi) {
  const auto it = j.find(key);
  if (it != j.end() && it->is_null()) return 0;
  return get_nonnegative(j, source, key, dflt, hi);
}

// Gemma 2 (modeling_gemma2.py's Gemma2Config, its defaults where a key is absent).
void parse_gemma2(const json& j, const std::string& source, ModelConfig& c) {
  c.arch = Arch::kLlama;
  read_sizes(j, source, c);
  c.num_kv_heads = get_int(j, source, "num_key_value_heads", 1, kMaxHeads, c.num_heads, false);
  c.head_dim = get_int(j, source, "head_dim", 1, kMaxHeadDim, 256, false);
  c.max_position_embeddings = get_int(j, source, "max_position_embeddings", 1, kMaxPositions, 8192, false);
  c.norm_eps = static_cast<float>(get_positive(j, source, "rms_norm_eps", 1e-6, 0.1));
  c.rope_theta = static_cast<float>(get_positive(j, source, "rope_theta", 10000.0, 1e12));
  c.tie_word_embeddings = get_bool(j, source, "tie_word_embeddings", true);
  TESSERA_CHECK(!get_bool(j, source, "attention_bias", false), source, ": 'attention_bias': true is not supported");
  for (const char* key : {"hidden_activation", "hidden_act"}) {
    const auto act = j.find(key);
    if (act == j.end() || act->is_null()) continue;
    TESSERA_CHECK(act->is_string() && (act->get<std::string>() == "gelu_pytorch_tanh" || act->get<std::string>() == "gelu_new"),
                  source, ": '", key, "' ", io::json_brief(*act), " is not supported (gelu_pytorch_tanh)");
  }
  if (auto rs = j.find("rope_scaling"); rs != j.end() && !rs->is_null()) c.rope_scaling = parse_rope_scaling(*rs, source);
  c.gelu_mlp = c.norm_offset = c.sandwich_norms = c.embed_scale = true;
  c.query_pre_attn_scalar = get_positive(j, source, "query_pre_attn_scalar", 256.0, 1e9);
  c.attn_softcap = static_cast<float>(get_optional_nonnegative(j, source, "attn_logit_softcapping", 50.0, 1e9));
  c.final_softcap = static_cast<float>(get_optional_nonnegative(j, source, "final_logit_softcapping", 30.0, 1e9));
  const auto sw = j.find("sliding_window");
  if (sw == j.end() || !sw->is_null()) {
    c.sliding_window = get_int(j, source, "sliding_window", 1, kMaxPositions, 4096, false);
    c.window_alternate = true;
  }
  if (const auto lt = j.find("layer_types"); lt != j.end() && !lt->is_null()) {
    TESSERA_CHECK(lt->is_array() && static_cast<int64_t>(lt->size()) == c.num_layers, source,
                  ": 'layer_types' must list the ", c.num_layers, " layers, got ", io::json_brief(*lt));
    for (int64_t l = 0; l < c.num_layers; ++l) {
      const std::string want = c.layer_window(l) > 0 ? "sliding_attention" : "full_attention";
      TESSERA_CHECK((*lt)[l].is_string() && (*lt)[l].get<std::string>() == want, source, ": 'layer_types' says ",
                    io::json_brief((*lt)[l]), " for layer ", l, " where gemma2 alternates (\"", want,
                    "\"; other patterns are not supported)");
    }
  }
}

// DeepSeek-V2 / V3 (modeling_deepseek.py's DeepseekV2Config / DeepseekV3Config).
void parse_deepseek(const json& j, const std::string& source, ModelConfig& c) {
  c.arch = Arch::kLlama;
  read_sizes(j, source, c);
  c.max_position_embeddings = get_int(j, source, "max_position_embeddings", 1, kMaxPositions, 2048, false);
  c.norm_eps = static_cast<float>(get_positive(j, source, "rms_norm_eps", 1e-6, 0.1));
  c.rope_theta = static_cast<float>(get_positive(j, source, "rope_theta", 10000.0, 1e12));
  c.tie_word_embeddings = get_bool(j, source, "tie_word_embeddings", false);
  TESSERA_CHECK(!get_bool(j, source, "attention_bias", false), source, ": 'attention_bias': true is not supported");
  auto act = j.find("hidden_act");
  TESSERA_CHECK(act == j.end() || (act->is_string() && act->get<std::string>() == "silu"), source, ": 'hidden_act' ",
                act == j.end() ? "" : io::json_brief(*act), " is not supported (only \"silu\")");
  if (auto rs = j.find("rope_scaling"); rs != j.end() && !rs->is_null()) c.rope_scaling = parse_rope_scaling(*rs, source);
  // Multi-head latent attention.
  c.q_lora_rank = get_int(j, source, "q_lora_rank", 1, kMaxHidden, 0, false);
  c.kv_lora_rank = get_int(j, source, "kv_lora_rank", 1, kMaxHidden);
  c.qk_nope_head_dim = get_int(j, source, "qk_nope_head_dim", 0, kMaxHeadDim);
  c.qk_rope_head_dim = get_int(j, source, "qk_rope_head_dim", 2, kMaxHeadDim);
  c.v_head_dim = get_int(j, source, "v_head_dim", 1, kMaxHeadDim);
  TESSERA_CHECK(c.qk_rope_head_dim % 2 == 0, source, ": 'qk_rope_head_dim' ", c.qk_rope_head_dim, " must be even");
  c.num_kv_heads = c.num_heads;  // every head has its own k (from the shared latent)
  c.head_dim = c.qk_nope_head_dim + c.qk_rope_head_dim;
  // Experts (none: every layer dense).
  c.num_experts = get_int(j, source, "n_routed_experts", 1, kMaxExperts, 0, false);
  const bool v3 = c.model_type == "deepseek_v3";
  if (c.num_experts > 0) {
    c.experts_per_token = get_int(j, source, "num_experts_per_tok", 1, c.num_experts);
    c.moe_intermediate_size = get_int(j, source, "moe_intermediate_size", 1, kMaxIntermediate);
    c.n_shared_experts = get_int(j, source, "n_shared_experts", 0, kMaxExperts, 0, false);
    c.first_k_dense_replace = get_int(j, source, "first_k_dense_replace", 0, kMaxLayers, 0, false);
    c.moe_layer_freq = get_int(j, source, "moe_layer_freq", 1, kMaxLayers, 1, false);
    c.norm_topk_prob = get_bool(j, source, "norm_topk_prob", v3);
    auto sf = j.find("scoring_func");
    const std::string scoring = sf == j.end() || sf->is_null() ? (v3 ? "sigmoid" : "softmax")
                                : sf->is_string() ? sf->get<std::string>() : io::json_brief(*sf);
    TESSERA_CHECK(scoring == "softmax" || scoring == "sigmoid", source, ": 'scoring_func' ", scoring,
                  " is not supported (softmax or sigmoid)");
    c.moe_sigmoid = scoring == "sigmoid";
    c.topk_method = j.contains("topk_method") ? read_topk_method(j, source, true) : (v3 ? "noaux_tc" : "greedy");
    c.router_bias = c.topk_method == "noaux_tc";
    if (c.topk_method != "greedy") {
      c.n_group = get_int(j, source, "n_group", 1, c.num_experts, 1, false);
      c.topk_group = get_int(j, source, "topk_group", 1, c.n_group, 1, false);
      TESSERA_CHECK(c.num_experts % c.n_group == 0, source, ": 'n_group' ", c.n_group, " does not divide the ",
                    c.num_experts, " routed experts");
      TESSERA_CHECK(c.topk_method != "noaux_tc" || c.num_experts / c.n_group >= 2, source,
                    ": topk_method noaux_tc scores a group by its two best experts; groups of ",
                    c.num_experts / c.n_group, " expert are too small");
      TESSERA_CHECK(c.topk_group * (c.num_experts / c.n_group) >= c.experts_per_token, source, ": 'topk_group' ",
                    c.topk_group, " groups of ", c.num_experts / c.n_group, " experts hold fewer than the ",
                    c.experts_per_token, " experts per token");
    }
    c.routed_scaling_factor = get_positive(j, source, "routed_scaling_factor", 1.0, 1e6);
    c.aux_loss_alpha = get_nonnegative(j, source, "aux_loss_alpha", 0.0, 1e6);
    c.seq_aux = get_bool(j, source, "seq_aux", true);
  }
  c.mtp_layers = get_int(j, source, "num_nextn_predict_layers", 0, 1, 0, false);
}

}  // namespace

ModelConfig ModelConfig::from_json(const json& j, const std::string& source) {
  TESSERA_CHECK(j.is_object(), source, ": expected a JSON object");
  ModelConfig c;
  auto mt = j.find("model_type");
  TESSERA_CHECK(mt != j.end() && mt->is_string(), source, ": missing string key 'model_type'");
  c.model_type = mt->get<std::string>();
  if (c.model_type == "llama" || c.model_type == "qwen2" || c.model_type == "mistral" ||
      c.model_type == "mixtral" || c.model_type == "qwen2_moe" || c.model_type == "qwen3") {
    c.arch = c.model_type == "qwen2" || c.model_type == "qwen2_moe" ? Arch::kQwen2 : Arch::kLlama;
    read_sizes(j, source, c);
    c.num_kv_heads = get_int(j, source, "num_key_value_heads", 1, kMaxHeads, c.num_heads, false);
    c.head_dim = get_int(j, source, "head_dim", 1, kMaxHeadDim,
                         c.model_type == "qwen3" ? 128 : c.hidden_size / c.num_heads, false);  // (Qwen3Config: 128)
    c.max_position_embeddings = get_int(j, source, "max_position_embeddings", 1, kMaxPositions, 2048, false);
    c.norm_eps = static_cast<float>(get_positive(j, source, "rms_norm_eps", 1e-6, 0.1));
    c.rope_theta = static_cast<float>(get_positive(j, source, "rope_theta", 10000.0, 1e12));
    c.tie_word_embeddings = get_bool(j, source, "tie_word_embeddings", false);
    c.qkv_bias = c.arch == Arch::kQwen2 || get_bool(j, source, "attention_bias", false);
    c.qk_norm = c.model_type == "qwen3";
    TESSERA_CHECK(!get_bool(j, source, "mlp_bias", false), source,
                  ": 'mlp_bias': true is not supported");
    auto act = j.find("hidden_act");
    TESSERA_CHECK(act == j.end() || (act->is_string() && act->get<std::string>() == "silu"),
                  source, ": 'hidden_act' ", act == j.end() ? "" : io::json_brief(*act),
                  " is not supported (only \"silu\")");
    if (auto rs = j.find("rope_scaling"); rs != j.end() && !rs->is_null())
      c.rope_scaling = parse_rope_scaling(*rs, source);
    c.partial_rotary_factor = get_positive(j, source, "partial_rotary_factor", 1.0, 1.0);
    if (c.model_type == "qwen2_moe") {
      // Qwen1.5-MoE / Qwen2-MoE: routed experts plus a gated shared expert in every layer.
      c.num_experts = get_int(j, source, "num_experts", 1, kMaxExperts);
      c.experts_per_token = get_int(j, source, "num_experts_per_tok", 1, c.num_experts);
      c.moe_intermediate_size = get_int(j, source, "moe_intermediate_size", 1, kMaxIntermediate);
      c.dense_intermediate_size = c.intermediate_size;
      c.intermediate_size = get_int(j, source, "shared_expert_intermediate_size", 1, kMaxIntermediate);
      c.shared_expert = true;
      c.norm_topk_prob = get_bool(j, source, "norm_topk_prob", false);
      c.router_aux_loss_coef = get_nonnegative(j, source, "router_aux_loss_coef", 0.001, 1e6);
      c.output_router_logits = get_bool(j, source, "output_router_logits", false);
      c.router_bias = read_topk_method(j, source) == "noaux_tc";
      TESSERA_CHECK(get_int(j, source, "decoder_sparse_step", 1, kMaxLayers, 1, false) == 1, source,
                    ": 'decoder_sparse_step' other than 1 is not supported (every layer sparse)");
      auto dense = j.find("mlp_only_layers");
      TESSERA_CHECK(dense == j.end() || dense->is_null() || (dense->is_array() && dense->empty()), source,
                    ": 'mlp_only_layers' ", dense == j.end() ? "" : io::json_brief(*dense),
                    " is not supported (every layer sparse)");
    }
    if (c.model_type == "mixtral") {
      c.num_experts = get_int(j, source, "num_local_experts", 1, kMaxExperts);
      c.experts_per_token = get_int(j, source, "num_experts_per_tok", 1, c.num_experts);
      c.moe_intermediate_size = c.intermediate_size;
      c.router_aux_loss_coef = get_nonnegative(j, source, "router_aux_loss_coef", 0.001, 1e6);
      c.output_router_logits = get_bool(j, source, "output_router_logits", false);
      c.router_bias = read_topk_method(j, source) == "noaux_tc";
      const double jitter = get_nonnegative(j, source, "router_jitter_noise", 0.0, 1e6);
      TESSERA_CHECK(jitter == 0.0, source, ": 'router_jitter_noise' ", jitter,
                    " is not supported (0: the router sees its input unperturbed)");
    }
    read_sliding_window(j, source, c);
  } else if (c.model_type == "deepseek_v2" || c.model_type == "deepseek_v3") {
    parse_deepseek(j, source, c);
  } else if (c.model_type == "gemma2") {
    parse_gemma2(j, source, c);
  } else if (c.model_type == "gpt2") {
    c.arch = Arch::kGpt2;
    c.vocab_size = get_int(j, source, "vocab_size", 1, kMaxVocab);
    c.hidden_size = get_int(j, source, "n_embd", 1, kMaxHidden);
    c.num_layers = get_int(j, source, "n_layer", 1, kMaxLayers);
    c.num_heads = get_int(j, source, "n_head", 1, kMaxHeads);
    c.num_kv_heads = c.num_heads;
    c.head_dim = c.hidden_size / c.num_heads;
    TESSERA_CHECK(c.head_dim <= kMaxHeadDim, source, ": 'n_embd' / 'n_head' = ", c.head_dim,
                  " is more than the largest supported head dimension ", kMaxHeadDim);
    c.intermediate_size = get_int(j, source, "n_inner", 1, kMaxIntermediate, 4 * c.hidden_size, false);
    c.max_position_embeddings = get_int(j, source, "n_positions", 1, kMaxPositions, 1024, false);
    c.norm_eps = static_cast<float>(get_positive(j, source, "layer_norm_epsilon", 1e-5, 0.1));
    c.tie_word_embeddings = get_bool(j, source, "tie_word_embeddings", true);
    TESSERA_CHECK(c.tie_word_embeddings, source,
                  ": gpt2 with 'tie_word_embeddings': false is not supported");
    auto act = j.find("activation_function");
    if (act != j.end() && !act->is_null()) {
      const std::string a = act->is_string() ? act->get<std::string>() : io::json_brief(*act);
      TESSERA_CHECK(a == "gelu_new" || a == "gelu_pytorch_tanh", source,
                    ": 'activation_function' \"", a,
                    "\" is not supported (gelu_new or gelu_pytorch_tanh)");
    }
    TESSERA_CHECK(get_bool(j, source, "scale_attn_weights", true), source,
                  ": 'scale_attn_weights': false is not supported");
    TESSERA_CHECK(!get_bool(j, source, "scale_attn_by_inverse_layer_idx", false), source,
                  ": 'scale_attn_by_inverse_layer_idx' is not supported");
  } else {
    fail(source, ": unknown model_type '", c.model_type,
         "' (supported: llama, qwen2, qwen3, gemma2, mistral, mixtral, qwen2_moe, deepseek_v2, deepseek_v3, gpt2)");
  }
  c.bos_token_id = get_token_id(j, source, "bos_token_id", c.vocab_size);
  c.eos_token_id = get_token_id(j, source, "eos_token_id", c.vocab_size);
  if (auto q = j.find("quantization_config"); q != j.end() && !q->is_null())
    c.quantization = io::parse_quantization_config(*q, source);
  c.validate(source);
  return c;
}

void ModelConfig::validate(const std::string& source) const {
  auto bounded = [&](int64_t v, const char* what, int64_t hi) {
    TESSERA_CHECK(v > 0 && v <= hi, source, ": ", what, " must be in [1, ", hi, "], got ", v);
  };
  bounded(vocab_size, "vocab_size", kMaxVocab);
  bounded(hidden_size, "hidden size", kMaxHidden);
  bounded(intermediate_size, "intermediate size", kMaxIntermediate);
  bounded(num_layers, "number of layers", kMaxLayers);
  bounded(num_heads, "number of attention heads", kMaxHeads);
  bounded(num_kv_heads, "number of key/value heads", kMaxHeads);
  bounded(head_dim, "head_dim", kMaxHeadDim);
  bounded(max_position_embeddings, "max_position_embeddings", kMaxPositions);
  TESSERA_CHECK(uses_mla() || hidden_size % num_heads == 0, source, ": hidden size ", hidden_size,
                " is not divisible by the number of attention heads ", num_heads);
  TESSERA_CHECK(num_heads % num_kv_heads == 0, source, ": number of key/value heads ",
                num_kv_heads, " does not divide the number of attention heads ", num_heads);
  TESSERA_CHECK(!uses_rope() || head_dim % 2 == 0, source, ": head_dim ", head_dim,
                " must be even for rotary embeddings");
  TESSERA_CHECK(std::isfinite(norm_eps) && norm_eps > 0 && norm_eps <= 0.1f, source,
                ": norm epsilon must be in (0, 0.1], got ", norm_eps);
  TESSERA_CHECK(std::isfinite(rope_theta) && rope_theta > 0, source, ": rope_theta must be positive and finite");
  if (is_moe()) {
    bounded(num_experts, "number of experts", kMaxExperts);
    TESSERA_CHECK(experts_per_token >= 1 && experts_per_token <= num_experts, source, ": experts per token ",
                  experts_per_token, " must be in [1, ", num_experts, "]");
    bounded(moe_intermediate_size, "expert intermediate size", kMaxIntermediate);
    TESSERA_CHECK(shared_expert ? arch == Arch::kQwen2 : (arch == Arch::kLlama && !qkv_bias), source,
                  ": experts are supported in mixtral (Llama attention), qwen2_moe (Qwen2 attention) and deepseek models");
    TESSERA_CHECK(!quantization, source, ": quantized mixture-of-experts checkpoints are not supported yet");
  }
  if (uses_mla()) {
    TESSERA_CHECK(is_deepseek() && num_kv_heads == num_heads && head_dim == qk_nope_head_dim + qk_rope_head_dim &&
                      qk_rope_head_dim > 0 && qk_rope_head_dim % 2 == 0 && v_head_dim > 0 && !qkv_bias,
                  source, ": latent attention (kv_lora_rank ", kv_lora_rank, ") needs a deepseek model with even "
                  "qk_rope_head_dim, v_head_dim > 0, one kv head per head and head_dim = qk_nope + qk_rope");
    TESSERA_CHECK(!quantization, source, ": quantized deepseek checkpoints are not supported yet");
  }
  if (rope_scaling && uses_mla())
    TESSERA_CHECK(rope_scaling->type == "yarn" && rope_scaling->factor > 0 &&
                      rope_scaling->original_max_position_embeddings > 0,
                  source, ": latent attention's rope_scaling must be yarn with 'factor' and "
                  "'original_max_position_embeddings' (as DeepSeek writes it), got ", rope_scaling->type);
  TESSERA_CHECK(!rope_scaling || uses_rope(), source, ": rope_scaling needs rotary embeddings");
  TESSERA_CHECK(!(gelu_mlp || norm_offset || sandwich_norms || embed_scale) || (uses_rope() && !uses_mla() && !is_moe()),
                source, ": gemma2's layers are supported on dense rotary attention only");
  TESSERA_CHECK(std::isfinite(attn_softcap) && attn_softcap >= 0 && std::isfinite(final_softcap) && final_softcap >= 0,
                source, ": soft-capping values must be finite and >= 0");
  TESSERA_CHECK(!qk_norm || (uses_rope() && !uses_mla() && !is_moe()), source,
                ": q/k norms (qwen3) are supported on dense rotary attention only");
  TESSERA_CHECK(sliding_window >= 0 && max_window_layers >= 0 && (sliding_window == 0 || !uses_mla()), source,
                ": sliding_window ", sliding_window, " is not supported here");
  TESSERA_CHECK(std::isfinite(partial_rotary_factor) && partial_rotary_factor > 0 && partial_rotary_factor <= 1 &&
                    (partial_rotary_factor == 1 || !uses_mla()),
                source, ": partial_rotary_factor ", partial_rotary_factor, " must be in (0, 1] (1 for latent attention)");
  if (uses_rope()) {
    const int64_t rd = rotary_dim(*this);
    TESSERA_CHECK(rd >= 2 && rd % 2 == 0, source, ": partial_rotary_factor ", partial_rotary_factor, " rotates ", rd,
                  " of head_dim ", head_dim, " features; that must be even and at least 2");
  }
  TESSERA_CHECK(mtp_layers == 0 || (is_deepseek() && mtp_layers == 1), source,
                ": multi-token prediction (num_nextn_predict_layers ", mtp_layers, ") is supported with one "
                "module in deepseek models");
  (void)num_parameters();  // every size below fits in int64 (checked; throws naming the config)
}

int64_t ModelConfig::mlp_size(int64_t layer) const {
  if (!layer_is_moe(layer) || shared_expert) return intermediate_size;  // dense, or qwen2_moe's shared expert
  return n_shared_experts * moe_intermediate_size;                      // DeepSeek's shared experts (or none)
}

// The sizes use checked arithmetic: the bounds above keep them far inside int64, but a
// struct filled by hand (tests, TOML [model] tables) is not guaranteed to be validated.
namespace {

// Matmul weights of one layer's attention.
int64_t attention_elements(const ModelConfig& c, const std::string& what) {
  const int64_t H = c.hidden_size;
  if (!c.uses_mla())
    return checked_add(checked_mul(H, checked_add(c.q_dim(), 2 * c.kv_dim(), what), what),
                       checked_mul(c.q_dim(), H, what), what);
  const int64_t qk = c.q_dim();  // heads x (nope + rope)
  const int64_t q = c.q_lora_rank > 0 ? checked_add(checked_mul(H, c.q_lora_rank, what),
                                                     checked_mul(c.q_lora_rank, qk, what), what)
                                      : checked_mul(H, qk, what);
  const int64_t kv = checked_add(checked_mul(H, c.kv_lora_rank + c.qk_rope_head_dim, what),
                                 checked_product({c.kv_lora_rank, c.num_heads, c.qk_nope_head_dim + c.v_head_dim}, what),
                                 what);
  return checked_add(checked_add(q, kv, what), checked_product({c.num_heads, c.v_head_dim, H}, what), what);
}

// Matmul weights of layer l's MLP: read per token (`active`: the chosen experts only) or all.
int64_t mlp_elements(const ModelConfig& c, int64_t l, bool active, const std::string& what) {
  const int64_t H = c.hidden_size;
  const int64_t dense = checked_product({c.gated_mlp() ? 3 : 2, H, c.mlp_size(l)}, what);
  if (!c.layer_is_moe(l)) return dense;
  // The experts, the router, the dense part (a shared expert) and qwen2_moe's shared gate.
  const int64_t expert = checked_product({3, H, c.moe_intermediate_size}, what);
  const int64_t experts = checked_mul(active ? c.experts_per_token : c.num_experts, expert, what);
  return checked_add(checked_add(experts, checked_mul(c.num_experts, H, what), what),
                     checked_add(dense, c.shared_expert ? H : 0, what), what);
}

}  // namespace

int64_t ModelConfig::matmul_weight_elements() const {
  const std::string what = "model size (" + std::to_string(hidden_size) + " hidden, " +
                           std::to_string(num_layers) + " layers, " + std::to_string(vocab_size) + " vocab)";
  int64_t n = checked_mul(vocab_size, hidden_size, what);  // lm_head
  const int64_t attn = attention_elements(*this, what);
  for (int64_t l = 0; l < num_layers; ++l) n = checked_add(n, checked_add(attn, mlp_elements(*this, l, true, what), what), what);
  return n;
}

int64_t ModelConfig::num_parameters() const {
  const std::string what = "parameter count";
  int64_t n = checked_mul(vocab_size, hidden_size, what);  // lm_head
  const int64_t attn = attention_elements(*this, what);
  for (int64_t l = 0; l < num_layers; ++l) n = checked_add(n, checked_add(attn, mlp_elements(*this, l, false, what), what), what);
  const int64_t table = checked_mul(vocab_size, hidden_size, what);
  if (!tie_word_embeddings) n = checked_add(n, table, what);  // embedding separate from lm_head
  const int64_t norms = uses_layernorm() ? 2 : 1;
  n = checked_add(n, checked_product({num_layers, 2, hidden_size, norms}, what) + hidden_size * norms, what);
  if (uses_mla())  // q_a_layernorm, kv_a_layernorm
    n = checked_add(n, checked_mul(num_layers, q_lora_rank + kv_lora_rank, what), what);
  if (mtp_layers > 0)  // the module's layer (MoE when the model is), eh_proj, enorm, hnorm, shared_head.norm
    n = checked_add(n, checked_add(checked_add(attn, mlp_elements(*this, num_layers, false, what), what),
                                   checked_add(checked_mul(2 * hidden_size, hidden_size, what),
                                               5 * hidden_size + q_lora_rank + kv_lora_rank, what), what), what);
  const int64_t qkv = checked_mul(num_heads + 2 * num_kv_heads, head_dim, what);
  if (qkv_bias || linear_biases()) n = checked_add(n, checked_mul(num_layers, qkv, what), what);
  if (linear_biases())
    n = checked_add(n,
                    checked_add(checked_mul(num_layers, 2 * hidden_size + intermediate_size, what),
                                checked_mul(max_position_embeddings, hidden_size, what), what),
                    what);
  return n;
}

void ModelConfig::check_model_path(const std::string& path) {
  std::error_code ec;
  TESSERA_CHECK(!std::filesystem::is_regular_file(path, ec), path,
                " is a file but not a GGUF file (it does not start with 'GGUF'): a model is a "
                "Hugging Face model directory or a .gguf file");
}

ModelConfig ModelConfig::load(const std::string& model_dir) {
  if (io::is_gguf_path(model_dir))
    return gguf_model_config(io::GgufFile::open(model_dir)->header(), model_dir);
  check_model_path(model_dir);
  const std::string path = model_dir + "/config.json";
  return from_json(io::read_json_file(path), path);
}

namespace {

// A float as the shortest decimal that reads back as it (0.1f as 0.1, not
// 0.10000000149011612): what config.json said, and within the bounds from_json checks.
double shortest(float f) {
  char buf[32];
  const auto r = std::to_chars(buf, buf + sizeof(buf), f);
  return std::strtod(std::string(buf, r.ptr).c_str(), nullptr);
}

}  // namespace

json ModelConfig::to_json() const {
  json j;
  if (arch == Arch::kGpt2) {
    j["architectures"] = {"GPT2LMHeadModel"};
    j["model_type"] = "gpt2";
    j["vocab_size"] = vocab_size;
    j["n_embd"] = hidden_size;
    j["n_layer"] = num_layers;
    j["n_head"] = num_heads;
    j["n_inner"] = intermediate_size;
    j["n_positions"] = max_position_embeddings;
    j["n_ctx"] = max_position_embeddings;
    j["layer_norm_epsilon"] = shortest(norm_eps);
    j["activation_function"] = "gelu_new";
    j["tie_word_embeddings"] = true;
  } else if (model_type == "gemma2") {
    j["architectures"] = {"Gemma2ForCausalLM"};
    j["model_type"] = "gemma2";
    for (auto [key, v] : std::initializer_list<std::pair<const char*, int64_t>>{
             {"vocab_size", vocab_size}, {"hidden_size", hidden_size}, {"intermediate_size", intermediate_size},
             {"num_hidden_layers", num_layers}, {"num_attention_heads", num_heads},
             {"num_key_value_heads", num_kv_heads}, {"head_dim", head_dim},
             {"max_position_embeddings", max_position_embeddings}})
      j[key] = v;
    j["rms_norm_eps"] = shortest(norm_eps);
    j["rope_theta"] = shortest(rope_theta);
    j["rope_scaling"] = rope_scaling ? rope_scaling_json(*rope_scaling) : json(nullptr);
    j["tie_word_embeddings"] = tie_word_embeddings;
    j["hidden_activation"] = "gelu_pytorch_tanh";
    j["attention_bias"] = false;
    j["query_pre_attn_scalar"] = query_pre_attn_scalar;
    j["attn_logit_softcapping"] = attn_softcap > 0 ? json(shortest(attn_softcap)) : json(nullptr);
    j["final_logit_softcapping"] = final_softcap > 0 ? json(shortest(final_softcap)) : json(nullptr);
    j["sliding_window"] = sliding_window > 0 ? json(sliding_window) : json(nullptr);
  } else if (is_deepseek()) {
    const bool v3 = model_type == "deepseek_v3";
    j["architectures"] = {v3 ? "DeepseekV3ForCausalLM" : "DeepseekV2ForCausalLM"};
    j["model_type"] = model_type;
    for (auto [key, v] : std::initializer_list<std::pair<const char*, int64_t>>{
             {"vocab_size", vocab_size}, {"hidden_size", hidden_size}, {"intermediate_size", intermediate_size},
             {"num_hidden_layers", num_layers}, {"num_attention_heads", num_heads},
             {"num_key_value_heads", num_kv_heads}, {"max_position_embeddings", max_position_embeddings},
             {"kv_lora_rank", kv_lora_rank}, {"qk_nope_head_dim", qk_nope_head_dim},
             {"qk_rope_head_dim", qk_rope_head_dim}, {"v_head_dim", v_head_dim}})
      j[key] = v;
    j["q_lora_rank"] = q_lora_rank > 0 ? json(q_lora_rank) : json(nullptr);
    j["rms_norm_eps"] = shortest(norm_eps);
    j["rope_theta"] = shortest(rope_theta);
    j["rope_scaling"] = rope_scaling ? rope_scaling_json(*rope_scaling) : json(nullptr);
    j["tie_word_embeddings"] = tie_word_embeddings;
    j["hidden_act"] = "silu";
    j["attention_bias"] = false;
    if (is_moe()) {
      j["n_routed_experts"] = num_experts;
      j["num_experts_per_tok"] = experts_per_token;
      j["moe_intermediate_size"] = moe_intermediate_size;
      j["n_shared_experts"] = n_shared_experts;
      j["first_k_dense_replace"] = first_k_dense_replace;
      j["moe_layer_freq"] = moe_layer_freq;
      j["norm_topk_prob"] = norm_topk_prob;
      j["scoring_func"] = moe_sigmoid ? "sigmoid" : "softmax";
      j["topk_method"] = topk_method;
      j["n_group"] = n_group;
      j["topk_group"] = topk_group;
      j["routed_scaling_factor"] = routed_scaling_factor;
      j["aux_loss_alpha"] = aux_loss_alpha;
      j["seq_aux"] = seq_aux;
    } else {
      j["n_routed_experts"] = nullptr;
    }
    j["num_nextn_predict_layers"] = mtp_layers;
  } else {
    const bool qwen_moe = is_moe() && shared_expert;
    const bool mistral = model_type == "mistral" && !is_moe();
    j["architectures"] = {qwen_moe ? "Qwen2MoeForCausalLM" : is_moe() ? "MixtralForCausalLM"
                          : mistral ? "MistralForCausalLM" : qk_norm ? "Qwen3ForCausalLM"
                          : arch == Arch::kQwen2 ? "Qwen2ForCausalLM" : "LlamaForCausalLM"};
    j["model_type"] = qwen_moe ? "qwen2_moe" : is_moe() ? "mixtral" : mistral ? "mistral" : qk_norm ? "qwen3"
                      : arch_name(arch);
    j["vocab_size"] = vocab_size;
    j["hidden_size"] = hidden_size;
    j["intermediate_size"] = intermediate_size;
    j["num_hidden_layers"] = num_layers;
    j["num_attention_heads"] = num_heads;
    j["num_key_value_heads"] = num_kv_heads;
    j["head_dim"] = head_dim;
    j["max_position_embeddings"] = max_position_embeddings;
    j["rms_norm_eps"] = shortest(norm_eps);
    j["rope_theta"] = shortest(rope_theta);
    j["rope_scaling"] = rope_scaling ? rope_scaling_json(*rope_scaling) : json(nullptr);
    if (partial_rotary_factor != 1) j["partial_rotary_factor"] = partial_rotary_factor;
    j["tie_word_embeddings"] = tie_word_embeddings;
    j["hidden_act"] = "silu";
    if (arch == Arch::kLlama && !is_moe()) j["attention_bias"] = qkv_bias;
    if (is_moe()) {
      j[shared_expert ? "num_experts" : "num_local_experts"] = num_experts;
      j["num_experts_per_tok"] = experts_per_token;
      j["router_aux_loss_coef"] = router_aux_loss_coef;
      j["output_router_logits"] = output_router_logits;
      if (router_bias) j["topk_method"] = "noaux_tc";
      if (shared_expert) {
        j["intermediate_size"] = dense_intermediate_size > 0 ? dense_intermediate_size : intermediate_size;
        j["moe_intermediate_size"] = moe_intermediate_size;
        j["shared_expert_intermediate_size"] = intermediate_size;
        j["norm_topk_prob"] = norm_topk_prob;
        j["decoder_sparse_step"] = 1;
        j["mlp_only_layers"] = nlohmann::json::array();
      }
    }
    if (arch == Arch::kQwen2 || qk_norm) {
      j["use_sliding_window"] = sliding_window > 0;
      if (sliding_window > 0) j["sliding_window"] = sliding_window, j["max_window_layers"] = max_window_layers;
    } else if (mistral || is_moe()) {
      j["sliding_window"] = sliding_window > 0 ? json(sliding_window) : json(nullptr);
    }
  }
  if (bos_token_id >= 0) j["bos_token_id"] = bos_token_id;
  if (eos_token_id >= 0) j["eos_token_id"] = eos_token_id;
  j["torch_dtype"] = "float32";
  if (quantization) j["quantization_config"] = io::quantization_config_json(*quantization);
  return j;
}

ModelConfig ModelConfig::named_shape(const std::string& name) {
  ModelConfig c;
  c.arch = Arch::kLlama;
  c.model_type = "llama";
  c.norm_eps = 1e-5f;
  c.rope_theta = 10000.f;
  c.bos_token_id = 1;
  c.eos_token_id = 2;
  if (name == "small") {
    c.vocab_size = 32000, c.hidden_size = 768, c.num_layers = 12, c.num_heads = 12;
    c.num_kv_heads = 4, c.intermediate_size = 2048, c.max_position_embeddings = 2048;
  } else if (name == "1b") {
    c.vocab_size = 32000, c.hidden_size = 2048, c.num_layers = 22, c.num_heads = 32;
    c.num_kv_heads = 4, c.intermediate_size = 5632, c.max_position_embeddings = 2048;
  } else if (name == "tiny") {
    c.vocab_size = 256, c.hidden_size = 64, c.num_layers = 2, c.num_heads = 4;
    c.num_kv_heads = 2, c.intermediate_size = 128, c.max_position_embeddings = 256;
  } else if (name == "gpt2-124m") {
    c.arch = Arch::kGpt2, c.model_type = "gpt2";
    c.vocab_size = 50257, c.hidden_size = 768, c.num_layers = 12, c.num_heads = 12;
    c.num_kv_heads = 12, c.intermediate_size = 3072, c.max_position_embeddings = 1024;
    c.tie_word_embeddings = true;
    c.bos_token_id = c.eos_token_id = 50256;
  } else {
    fail("unknown model shape '", name, "' (expected tiny, small, 1b or gpt2-124m)");
  }
  c.head_dim = c.hidden_size / c.num_heads;
  return c;
}

}  // namespace tessera::model
