// Parsing and validation of Hugging Face config.json files.
#include "tessera/model/config.h"

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/io/json_file.h"

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

int64_t get_int(const json& j, const std::string& source, const char* key, int64_t dflt = -1,
                bool required = true) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) {
    TESSERA_CHECK(!required, source, ": missing key '", key, "'");
    return dflt;
  }
  TESSERA_CHECK(it->is_number_integer(), source, ": key '", key, "' must be an integer, got ",
                it->dump());
  return it->get<int64_t>();
}

double get_float(const json& j, const std::string& source, const char* key, double dflt) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  TESSERA_CHECK(it->is_number(), source, ": key '", key, "' must be a number, got ", it->dump());
  return it->get<double>();
}

bool get_bool(const json& j, const std::string& source, const char* key, bool dflt) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  TESSERA_CHECK(it->is_boolean(), source, ": key '", key, "' must be true or false, got ",
                it->dump());
  return it->get<bool>();
}

// eos_token_id may be an int or a list of ints (Llama 3); keep the first.
int64_t get_token_id(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return -1;
  if (it->is_number_integer()) return it->get<int64_t>();
  if (it->is_array() && !it->empty() && (*it)[0].is_number_integer()) return (*it)[0].get<int64_t>();
  return -1;
}

}  // namespace

ModelConfig ModelConfig::from_json(const json& j, const std::string& source) {
  TESSERA_CHECK(j.is_object(), source, ": expected a JSON object");
  ModelConfig c;
  auto mt = j.find("model_type");
  TESSERA_CHECK(mt != j.end() && mt->is_string(), source, ": missing string key 'model_type'");
  c.model_type = mt->get<std::string>();
  if (c.model_type == "llama" || c.model_type == "qwen2" || c.model_type == "mistral") {
    c.arch = c.model_type == "qwen2" ? Arch::kQwen2 : Arch::kLlama;
    c.vocab_size = get_int(j, source, "vocab_size");
    c.hidden_size = get_int(j, source, "hidden_size");
    c.intermediate_size = get_int(j, source, "intermediate_size");
    c.num_layers = get_int(j, source, "num_hidden_layers");
    c.num_heads = get_int(j, source, "num_attention_heads");
    c.num_kv_heads = get_int(j, source, "num_key_value_heads", c.num_heads, false);
    TESSERA_CHECK(c.num_heads > 0, source, ": 'num_attention_heads' must be positive, got ",
                  c.num_heads);
    c.head_dim = get_int(j, source, "head_dim", c.hidden_size / c.num_heads, false);
    c.max_position_embeddings = get_int(j, source, "max_position_embeddings", 2048, false);
    c.norm_eps = static_cast<float>(get_float(j, source, "rms_norm_eps", 1e-6));
    c.rope_theta = static_cast<float>(get_float(j, source, "rope_theta", 10000.0));
    c.tie_word_embeddings = get_bool(j, source, "tie_word_embeddings", false);
    c.qkv_bias = c.arch == Arch::kQwen2 || get_bool(j, source, "attention_bias", false);
    TESSERA_CHECK(!get_bool(j, source, "mlp_bias", false), source,
                  ": 'mlp_bias': true is not supported");
    auto act = j.find("hidden_act");
    TESSERA_CHECK(act == j.end() || (act->is_string() && act->get<std::string>() == "silu"),
                  source, ": 'hidden_act' ", act == j.end() ? "" : act->dump(),
                  " is not supported (only \"silu\")");
    auto rs = j.find("rope_scaling");
    TESSERA_CHECK(rs == j.end() || rs->is_null(), source, ": 'rope_scaling' ", rs->dump(),
                  " is not supported yet");
    if (c.model_type == "mistral") {
      auto sw = j.find("sliding_window");
      TESSERA_CHECK(sw == j.end() || sw->is_null(), source,
                    ": 'sliding_window' attention is not supported");
    }
  } else if (c.model_type == "gpt2") {
    c.arch = Arch::kGpt2;
    c.vocab_size = get_int(j, source, "vocab_size");
    c.hidden_size = get_int(j, source, "n_embd");
    c.num_layers = get_int(j, source, "n_layer");
    c.num_heads = get_int(j, source, "n_head");
    c.num_kv_heads = c.num_heads;
    TESSERA_CHECK(c.num_heads > 0, source, ": 'n_head' must be positive, got ", c.num_heads);
    c.head_dim = c.hidden_size / c.num_heads;
    c.intermediate_size = get_int(j, source, "n_inner", 4 * c.hidden_size, false);
    c.max_position_embeddings = get_int(j, source, "n_positions", 1024, false);
    c.norm_eps = static_cast<float>(get_float(j, source, "layer_norm_epsilon", 1e-5));
    c.tie_word_embeddings = get_bool(j, source, "tie_word_embeddings", true);
    TESSERA_CHECK(c.tie_word_embeddings, source,
                  ": gpt2 with 'tie_word_embeddings': false is not supported");
    auto act = j.find("activation_function");
    if (act != j.end() && !act->is_null()) {
      const std::string a = act->is_string() ? act->get<std::string>() : act->dump();
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
         "' (supported: llama, qwen2, mistral, gpt2)");
  }
  c.bos_token_id = get_token_id(j, "bos_token_id");
  c.eos_token_id = get_token_id(j, "eos_token_id");
  c.validate(source);
  return c;
}

void ModelConfig::validate(const std::string& source) const {
  auto positive = [&](int64_t v, const char* what) {
    TESSERA_CHECK(v > 0, source, ": ", what, " must be positive, got ", v);
  };
  positive(vocab_size, "vocab_size");
  positive(hidden_size, "hidden size");
  positive(intermediate_size, "intermediate size");
  positive(num_layers, "number of layers");
  positive(num_heads, "number of attention heads");
  positive(num_kv_heads, "number of key/value heads");
  positive(head_dim, "head_dim");
  positive(max_position_embeddings, "max_position_embeddings");
  TESSERA_CHECK(hidden_size % num_heads == 0, source, ": hidden size ", hidden_size,
                " is not divisible by the number of attention heads ", num_heads);
  TESSERA_CHECK(num_heads % num_kv_heads == 0, source, ": number of key/value heads ",
                num_kv_heads, " does not divide the number of attention heads ", num_heads);
  TESSERA_CHECK(!uses_rope() || head_dim % 2 == 0, source, ": head_dim ", head_dim,
                " must be even for rotary embeddings");
  TESSERA_CHECK(norm_eps > 0, source, ": norm epsilon must be positive");
  TESSERA_CHECK(rope_theta > 0, source, ": rope_theta must be positive");
}

int64_t ModelConfig::matmul_weight_elements() const {
  const int64_t per_layer = hidden_size * qkv_dim() + q_dim() * hidden_size +
                            (gated_mlp() ? 3 : 2) * hidden_size * intermediate_size;
  return num_layers * per_layer + vocab_size * hidden_size;  // + lm_head
}

int64_t ModelConfig::num_parameters() const {
  int64_t n = matmul_weight_elements();
  if (!tie_word_embeddings) n += vocab_size * hidden_size;  // embedding separate from lm_head
  const int64_t norms = uses_layernorm() ? 2 : 1;
  n += num_layers * 2 * hidden_size * norms + hidden_size * norms;
  if (qkv_bias || linear_biases()) n += num_layers * qkv_dim();
  if (linear_biases())
    n += num_layers * (hidden_size + intermediate_size + hidden_size) +
         max_position_embeddings * hidden_size;
  return n;
}

ModelConfig ModelConfig::load(const std::string& model_dir) {
  const std::string path = model_dir + "/config.json";
  return from_json(io::read_json_file(path), path);
}

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
    j["layer_norm_epsilon"] = norm_eps;
    j["activation_function"] = "gelu_new";
    j["tie_word_embeddings"] = true;
  } else {
    j["architectures"] = {arch == Arch::kQwen2 ? "Qwen2ForCausalLM" : "LlamaForCausalLM"};
    j["model_type"] = arch_name(arch);
    j["vocab_size"] = vocab_size;
    j["hidden_size"] = hidden_size;
    j["intermediate_size"] = intermediate_size;
    j["num_hidden_layers"] = num_layers;
    j["num_attention_heads"] = num_heads;
    j["num_key_value_heads"] = num_kv_heads;
    j["head_dim"] = head_dim;
    j["max_position_embeddings"] = max_position_embeddings;
    j["rms_norm_eps"] = norm_eps;
    j["rope_theta"] = rope_theta;
    j["tie_word_embeddings"] = tie_word_embeddings;
    j["hidden_act"] = "silu";
    if (arch == Arch::kLlama) j["attention_bias"] = qkv_bias;
  }
  if (bos_token_id >= 0) j["bos_token_id"] = bos_token_id;
  if (eos_token_id >= 0) j["eos_token_id"] = eos_token_id;
  j["torch_dtype"] = "float32";
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
