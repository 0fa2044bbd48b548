// Model shapes for the planner: presets, Hugging Face config.json reading (dense, MoE,
// MLA), a parametric shape from a parameter count, and parameter counting.
#include "tessera/plan/model_spec.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <sstream>

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/io/json_file.h"
#include "tessera/model/config.h"

namespace tessera::plan {

using nlohmann::json;

bool ModelSpec::layer_is_moe(int64_t l) const {
  if (!is_moe() || l < dense_layers) return false;
  return (l - dense_layers) % std::max<int64_t>(moe_every, 1) == 0;
}

int64_t ModelSpec::moe_layer_count() const {
  int64_t n = 0;
  for (int64_t l = 0; l < layers; ++l) n += layer_is_moe(l);
  return n;
}

int64_t ModelSpec::attention_params() const {
  if (mla) {
    const int64_t q = q_lora_rank > 0 ? hidden * q_lora_rank + q_lora_rank * heads * qk_dim()
                                      : hidden * heads * qk_dim();
    const int64_t kv_a = hidden * (kv_lora_rank + rope_head_dim);
    const int64_t kv_b = kv_lora_rank * heads * (nope_head_dim + v_head_dim);
    return q + kv_a + kv_b + o_width() * hidden;
  }
  int64_t n = hidden * (q_width() + k_width() + v_width()) + o_width() * hidden;
  if (qkv_bias || linear_biases) n += q_width() + k_width() + v_width();
  if (linear_biases) n += hidden;
  return n;
}

int64_t ModelSpec::dense_mlp_params() const {
  int64_t n = (gated_mlp ? 3 : 2) * hidden * ffn;
  if (linear_biases) n += ffn + hidden;
  return n;
}

int64_t ModelSpec::expert_params() const { return (gated_mlp ? 3 : 2) * hidden * moe_ffn; }

int64_t ModelSpec::shared_expert_params() const {
  return shared_experts * (gated_mlp ? 3 : 2) * hidden * shared_ffn;
}

int64_t ModelSpec::router_params() const { return experts * hidden; }

int64_t ModelSpec::norm_params() const {
  int64_t n = (layernorm ? 4 : 2) * hidden;
  if (mla) n += kv_lora_rank + (q_lora_rank > 0 ? q_lora_rank : 0);  // latent RMSNorms
  return n;
}

int64_t ModelSpec::layer_routed_params(int64_t l) const {
  return layer_is_moe(l) ? experts * expert_params() : 0;
}

int64_t ModelSpec::layer_params(int64_t l) const {
  int64_t n = attention_params() + norm_params();
  if (layer_is_moe(l))
    n += layer_routed_params(l) + shared_expert_params() + router_params();
  else
    n += dense_mlp_params();
  return n;
}

int64_t ModelSpec::embedding_params() const { return (vocab + learned_positions) * hidden; }
int64_t ModelSpec::lm_head_params() const { return tied ? 0 : vocab * hidden; }
int64_t ModelSpec::final_norm_params() const { return (layernorm ? 2 : 1) * hidden; }

int64_t ModelSpec::total_params() const {
  int64_t n = embedding_params() + lm_head_params() + final_norm_params();
  for (int64_t l = 0; l < layers; ++l) n += layer_params(l);
  return n;
}

int64_t ModelSpec::routed_expert_params() const {
  int64_t n = 0;
  for (int64_t l = 0; l < layers; ++l) n += layer_routed_params(l);
  return n;
}

int64_t ModelSpec::active_params() const {
  const int64_t inactive = moe_layer_count() * (experts - top_k) * expert_params();
  return total_params() - inactive;
}

int64_t ModelSpec::active_matmul_params() const {
  int64_t n = 0;
  for (int64_t l = 0; l < layers; ++l) {
    n += attention_params();
    if (layer_is_moe(l))
      n += top_k * expert_params() + shared_expert_params() + router_params();
    else
      n += dense_mlp_params();
  }
  return n + vocab * hidden;  // lm_head, tied or not
}

int64_t ModelSpec::kv_elements_per_token_layer() const {
  return mla ? kv_lora_rank + rope_head_dim : 2 * kv_heads * head_dim;
}

void ModelSpec::validate(const std::string& source) const {
  auto positive = [&](int64_t v, const char* what) {
    TESSERA_CHECK(v > 0, source, ": ", what, " must be positive, got ", v);
  };
  positive(layers, "number of layers");
  positive(hidden, "hidden size");
  positive(heads, "number of attention heads");
  positive(vocab, "vocab size");
  if (mla) {
    positive(kv_lora_rank, "kv_lora_rank");
    positive(nope_head_dim + rope_head_dim, "qk head dim");
    positive(v_head_dim, "v_head_dim");
  } else {
    positive(kv_heads, "number of key/value heads");
    positive(head_dim, "head_dim");
    TESSERA_CHECK(heads % kv_heads == 0, source, ": ", kv_heads,
                  " key/value heads do not divide ", heads, " attention heads");
  }
  if (dense_layers < layers) {
    if (!is_moe()) positive(ffn, "intermediate size");
  }
  if (dense_layers > 0) positive(ffn, "intermediate size of the dense layers");
  if (is_moe()) {
    positive(top_k, "experts per token (num_experts_per_tok)");
    positive(moe_ffn, "expert intermediate size");
    TESSERA_CHECK(top_k <= experts, source, ": ", top_k, " experts per token exceed the ",
                  experts, " experts");
  }
}

std::string ModelSpec::describe() const {
  std::ostringstream os;
  os.precision(3);
  os << name << ": " << total_params() / 1e9 << "B params";
  if (is_moe()) os << " (" << active_params() / 1e9 << "B active)";
  os << ", " << layers << " layers, hidden " << hidden << ", " << heads << " heads";
  if (mla)
    os << " (MLA, kv latent " << kv_lora_rank << ")";
  else if (kv_heads != heads)
    os << " (" << kv_heads << " KV)";
  if (is_moe()) {
    os << ", " << experts << " experts top-" << top_k;
    if (shared_experts) os << " + " << shared_experts << " shared";
  }
  os << ", vocab " << vocab << (tied ? " (tied)" : "");
  return os.str();
}

namespace {

ModelSpec llama(const std::string& name, int64_t L, int64_t h, int64_t a, int64_t kv, int64_t f,
                int64_t V) {
  ModelSpec m;
  m.name = name, m.layers = L, m.hidden = h, m.heads = a, m.kv_heads = kv, m.head_dim = h / a;
  m.ffn = f, m.vocab = V;
  return m;
}

}  // namespace

std::vector<std::string> model_preset_names() {
  return {"llama2-7b",   "llama2-13b", "llama2-70b",   "llama3-8b",  "llama3-70b",
          "llama3-405b", "gpt3-175b",  "mixtral-8x7b", "deepseek-v3"};
}

ModelSpec model_preset(const std::string& name) {
  // Shapes from each model's published config.json (GPT-3: Brown et al. 2020, Table 2.1).
  if (name == "llama2-7b") return llama(name, 32, 4096, 32, 32, 11008, 32000);
  if (name == "llama2-13b") return llama(name, 40, 5120, 40, 40, 13824, 32000);
  if (name == "llama2-70b") return llama(name, 80, 8192, 64, 8, 28672, 32000);
  if (name == "llama3-8b") return llama(name, 32, 4096, 32, 8, 14336, 128256);
  if (name == "llama3-70b") return llama(name, 80, 8192, 64, 8, 28672, 128256);
  if (name == "llama3-405b") return llama(name, 126, 16384, 128, 8, 53248, 128256);
  if (name == "gpt3-175b") {
    ModelSpec m = llama(name, 96, 12288, 96, 96, 4 * 12288, 50257);
    m.tied = true, m.gated_mlp = false, m.layernorm = true, m.linear_biases = true;
    m.learned_positions = 2048;
    return m;
  }
  if (name == "mixtral-8x7b") {
    ModelSpec m = llama(name, 32, 4096, 32, 8, 14336, 32000);
    m.experts = 8, m.top_k = 2, m.moe_ffn = 14336;
    return m;
  }
  if (name == "deepseek-v3") {
    ModelSpec m = llama(name, 61, 7168, 128, 128, 18432, 129280);
    m.experts = 256, m.top_k = 8, m.moe_ffn = 2048, m.shared_experts = 1, m.shared_ffn = 2048;
    m.dense_layers = 3;
    m.mla = true, m.q_lora_rank = 1536, m.kv_lora_rank = 512, m.rope_head_dim = 64;
    m.nope_head_dim = 128, m.v_head_dim = 128, m.head_dim = 128;
    return m;
  }
  std::string list;
  for (const auto& n : model_preset_names()) list += (list.empty() ? "" : ", ") + n;
  fail("unknown model '", name, "' (presets: ", list,
       "; or a config.json path, or --params with a count such as 200b)");
}

namespace {

// An integer key in [0, hi] (the first of `keys` present); the bounds are model::limits', so
// every size the planner multiplies out of them stays inside int64.
int64_t get_int(const json& j, const std::string& source, std::initializer_list<const char*> keys,
                int64_t dflt, bool required, int64_t hi) {
  for (const char* key : keys) {
    auto it = j.find(key);
    if (it == j.end() || it->is_null()) continue;
    TESSERA_CHECK(it->is_number_integer(), source, ": key '", key, "' must be an integer, got ",
                  io::json_brief(*it));
    TESSERA_CHECK(io::json_int_in(*it, 0, hi), source, ": key '", key, "' must be in [0, ", hi, "], got ",
                  io::json_brief(*it));
    return it->get<int64_t>();
  }
  TESSERA_CHECK(!required, source, ": missing key '", *keys.begin(), "'");
  return dflt;
}

bool get_bool(const json& j, const std::string& source, const char* key, bool dflt) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  TESSERA_CHECK(it->is_boolean(), source, ": key '", key, "' must be true or false, got ",
                io::json_brief(*it));
  return it->get<bool>();
}

}  // namespace

ModelSpec model_from_hf_json(const json& j, const std::string& source) {
  TESSERA_CHECK(j.is_object(), source, ": expected a JSON object");
  auto mt = j.find("model_type");
  TESSERA_CHECK(mt != j.end() && mt->is_string(), source, ": missing string key 'model_type'");
  const std::string type = mt->get<std::string>();
  ModelSpec m;
  m.name = std::filesystem::path(source).parent_path().filename().string();
  if (m.name.empty()) m.name = type;
  if (type == "gpt2") {
    m.hidden = get_int(j, source, {"n_embd"}, 0, true, model::limits::kMaxHidden);
    m.layers = get_int(j, source, {"n_layer"}, 0, true, model::limits::kMaxLayers);
    m.heads = get_int(j, source, {"n_head"}, 0, true, model::limits::kMaxHeads);
    m.vocab = get_int(j, source, {"vocab_size"}, 0, true, model::limits::kMaxVocab);
    m.ffn = get_int(j, source, {"n_inner"}, 4 * m.hidden, false, model::limits::kMaxIntermediate);
    m.learned_positions = get_int(j, source, {"n_positions"}, 1024, false, model::limits::kMaxPositions);
    m.kv_heads = m.heads;
    TESSERA_CHECK(m.heads > 0, source, ": 'n_head' must be positive, got ", m.heads);
    m.head_dim = m.hidden / m.heads;
    m.tied = get_bool(j, source, "tie_word_embeddings", true);
    m.gated_mlp = false, m.layernorm = true, m.linear_biases = true;
    m.validate(source);
    return m;
  }
  m.hidden = get_int(j, source, {"hidden_size"}, 0, true, model::limits::kMaxHidden);
  m.layers = get_int(j, source, {"num_hidden_layers"}, 0, true, model::limits::kMaxLayers);
  m.heads = get_int(j, source, {"num_attention_heads"}, 0, true, model::limits::kMaxHeads);
  m.vocab = get_int(j, source, {"vocab_size"}, 0, true, model::limits::kMaxVocab);
  TESSERA_CHECK(m.heads > 0, source, ": 'num_attention_heads' must be positive, got ", m.heads);
  m.kv_heads = get_int(j, source, {"num_key_value_heads"}, m.heads, false, model::limits::kMaxHeads);
  m.head_dim = get_int(j, source, {"head_dim"}, m.hidden / m.heads, false, model::limits::kMaxHeadDim);
  m.tied = get_bool(j, source, "tie_word_embeddings", false);
  m.qkv_bias = type == "qwen2" || type == "qwen2_moe" || get_bool(j, source, "attention_bias", false);
  if (type == "gpt_neox") {
    m.gated_mlp = false, m.layernorm = true, m.linear_biases = true;
  }
  // MoE: Mixtral names experts num_local_experts, DeepSeek n_routed_experts, Qwen-MoE num_experts.
  m.experts = get_int(j, source, {"num_local_experts", "n_routed_experts", "num_experts"}, 0, false,
                      model::limits::kMaxExperts);
  const bool has_dense_mlp =
      m.experts == 0 || get_int(j, source, {"first_k_dense_replace"}, 0, false, model::limits::kMaxLayers) > 0;
  m.ffn = get_int(j, source, {"intermediate_size"}, 0, has_dense_mlp, model::limits::kMaxIntermediate);
  if (m.experts > 0) {
    m.top_k = get_int(j, source, {"num_experts_per_tok"}, 0, true, model::limits::kMaxExperts);
    m.moe_ffn = get_int(j, source, {"moe_intermediate_size"}, m.ffn, false, model::limits::kMaxIntermediate);
    m.shared_experts = get_int(j, source, {"n_shared_experts"}, 0, false, model::limits::kMaxExperts);
    m.shared_ffn = m.moe_ffn;
    const int64_t qwen_shared =
        get_int(j, source, {"shared_expert_intermediate_size"}, 0, false, model::limits::kMaxIntermediate);
    if (qwen_shared > 0) m.shared_experts = 1, m.shared_ffn = qwen_shared;
    m.dense_layers = get_int(j, source, {"first_k_dense_replace"}, 0, false, model::limits::kMaxLayers);
    m.moe_every =
        get_int(j, source, {"moe_layer_freq", "decoder_sparse_step"}, 1, false, model::limits::kMaxLayers);
    TESSERA_CHECK(m.moe_every >= 1, source, ": 'moe_layer_freq' must be at least 1, got ",
                  m.moe_every);
  }
  // DeepSeek's multi-head latent attention.
  const int64_t kv_lora = get_int(j, source, {"kv_lora_rank"}, 0, false, model::limits::kMaxHidden);
  if (kv_lora > 0) {
    m.mla = true;
    m.kv_lora_rank = kv_lora;
    m.q_lora_rank = get_int(j, source, {"q_lora_rank"}, 0, false, model::limits::kMaxHidden);
    m.rope_head_dim = get_int(j, source, {"qk_rope_head_dim"}, 0, true, model::limits::kMaxHeadDim);
    m.nope_head_dim = get_int(j, source, {"qk_nope_head_dim"}, 0, true, model::limits::kMaxHeadDim);
    m.v_head_dim = get_int(j, source, {"v_head_dim"}, 0, true, model::limits::kMaxHeadDim);
    m.kv_heads = m.heads;
  }
  m.validate(source);
  return m;
}

ModelSpec load_model(const std::string& name_or_path) {
  namespace fs = std::filesystem;
  const bool looks_like_path = name_or_path.find('/') != std::string::npos ||
                               name_or_path.ends_with(".json") || fs::exists(name_or_path);
  if (!looks_like_path) return model_preset(name_or_path);
  std::string path = name_or_path;
  if (fs::is_directory(path)) path += "/config.json";
  return model_from_hf_json(io::read_json_file(path), path);
}

double parse_count(const std::string& text, const std::string& what) {
  std::string t = text;
  double mult = 1;
  if (!t.empty()) {
    const char s = static_cast<char>(std::tolower(static_cast<unsigned char>(t.back())));
    const double m = s == 'k' ? 1e3 : s == 'm' ? 1e6 : s == 'b' || s == 'g' ? 1e9 : s == 't' ? 1e12 : 0;
    if (m > 0) mult = m, t.pop_back();
  }
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(t, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TESSERA_CHECK(!t.empty() && used == t.size() && std::isfinite(v) && v > 0, what, ": '", text,
                "' is not a positive count (examples: 200b, 7e9, 1.5T, 4M)");
  return v * mult;
}

ModelSpec parametric_model(const ParametricOptions& o) {
  TESSERA_CHECK(o.params > 0, "--params must be positive");
  auto build = [&](int64_t L, int64_t h) {
    ModelSpec m;
    m.layers = L, m.hidden = h, m.vocab = o.vocab;
    m.heads = o.heads > 0 ? o.heads : std::max<int64_t>(1, h / 128);
    m.head_dim = h / m.heads;
    m.kv_heads = o.kv_heads > 0 ? o.kv_heads : std::gcd<int64_t>(m.heads, 8);
    m.ffn = o.ffn > 0 ? o.ffn : (8 * h / 3 + 255) / 256 * 256;
    return m;
  };
  // A Llama-style block costs about 10.25 h^2 (attention 2.25 h^2 with 8 KV heads, SwiGLU
  // MLP 8 h^2); the aspect ratio h = 128 L (GPT-3 and Llama 3 405B sit near it) gives a
  // hidden size, rounded to a multiple of 1024 (128 below 2048) so heads of 128 come in
  // eights; the layer count then matches the parameter count.
  auto layers_for = [&](int64_t h) {
    const ModelSpec one = build(1, h);
    const double outside = static_cast<double>(one.total_params() - one.layer_params(0));
    return std::max<int64_t>(1, std::llround((o.params - outside) / one.layer_params(0)));
  };
  int64_t L = o.layers, h = o.hidden;
  if (h <= 0 && L <= 0) {
    const double L0 = std::cbrt(o.params / (10.25 * 128 * 128));
    const int64_t step = 128 * L0 >= 2048 ? 1024 : 128;
    h = std::max<int64_t>(128, std::llround(128 * L0 / step) * step);
  }
  if (L <= 0) L = layers_for(h);
  if (h <= 0) {
    // The multiple of 128 whose model comes nearest the count at L layers.
    int64_t lo = 128;
    while (build(L, lo + 128).total_params() < o.params && lo < (int64_t{1} << 22)) lo += 128;
    const double below = o.params - static_cast<double>(build(L, lo).total_params());
    const double above = static_cast<double>(build(L, lo + 128).total_params()) - o.params;
    h = std::abs(below) <= std::abs(above) ? lo : lo + 128;
  }
  ModelSpec m = build(L, h);
  TESSERA_CHECK(m.total_params() <= 1.25 * o.params, "--params ", o.params / 1e9, "B: the smallest "
                "such model (", L, " layers of hidden ", h, ", vocabulary ", o.vocab, ") already has ",
                m.total_params() / 1e9, "B parameters; pass a smaller --vocab or --hidden");
  std::ostringstream name;
  name.precision(4);
  name << "params-" << o.params / 1e9 << "b";
  m.name = name.str();
  TESSERA_CHECK(m.hidden % m.heads == 0, "--hidden ", m.hidden, " is not divisible by --heads ",
                m.heads);
  m.validate("--params");
  return m;
}

}  // namespace tessera::plan
