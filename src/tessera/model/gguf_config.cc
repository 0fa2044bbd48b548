// The GGUF side of a model's description: its configuration from the metadata, llama.cpp's
// tensor names, and Llama's q / k row order. No tensor data (the config fuzz target and
// ModelConfig::load build this file on its own).
#include <cstring>
#include <regex>

#include "tessera/base/checked.h"
#include "tessera/base/error.h"
#include "tessera/model/gguf_model.h"

namespace tessera::model {

namespace {

using namespace limits;

struct Meta {
  const io::GgufHeader& h;
  const std::string& source;
  std::string arch;

  const io::GgufValue* find(const std::string& key) const { return h.find(key); }
  std::string what(const std::string& key) const { return source + ": " + key; }
  // An integer key in [lo, hi]; `dflt` when absent and not required.
  int64_t integer(const std::string& key, int64_t lo, int64_t hi, int64_t dflt = -1) const {
    const io::GgufValue* v = find(key);
    if (!v) {
      TESSERA_CHECK(dflt >= 0, source, ": no metadata key '", key, "'");
      return dflt;
    }
    const uint64_t u = v->as_uint(what(key));
    TESSERA_CHECK(u >= static_cast<uint64_t>(lo) && u <= static_cast<uint64_t>(hi), source, ": ", key,
                  " must be in [", lo, ", ", hi, "], got ", u);
    return static_cast<int64_t>(u);
  }
  double number(const std::string& key, double dflt, bool required) const {
    const io::GgufValue* v = find(key);
    if (!v) {
      TESSERA_CHECK(!required, source, ": no metadata key '", key, "'");
      return dflt;
    }
    return v->is_integer() ? static_cast<double>(v->as_int(what(key))) : v->as_float(what(key));
  }
};

}  // namespace

ModelConfig gguf_model_config(const io::GgufHeader& h, const std::string& source) {
  Meta m{h, source, ""};
  const io::GgufValue* a = m.find("general.architecture");
  TESSERA_CHECK(a, source, ": no metadata key 'general.architecture'");
  m.arch = a->as_string(m.what("general.architecture"));
  TESSERA_CHECK(m.arch == "llama" || m.arch == "qwen2", source, ": general.architecture '", m.arch,
                "' is not supported (Tessera runs llama and qwen2 GGUF files)");
  const std::string p = m.arch + ".";
  ModelConfig c;
  c.arch = m.arch == "qwen2" ? Arch::kQwen2 : Arch::kLlama;
  c.model_type = m.arch;
  c.num_layers = m.integer(p + "block_count", 1, kMaxLayers);
  c.hidden_size = m.integer(p + "embedding_length", 1, kMaxHidden);
  c.intermediate_size = m.integer(p + "feed_forward_length", 1, kMaxIntermediate);
  c.num_heads = m.integer(p + "attention.head_count", 1, kMaxHeads);
  c.num_kv_heads = m.integer(p + "attention.head_count_kv", 1, kMaxHeads, c.num_heads);
  c.head_dim = m.integer(p + "attention.key_length", 1, kMaxHeadDim, c.hidden_size / c.num_heads);
  const int64_t vdim = m.integer(p + "attention.value_length", 1, kMaxHeadDim, c.head_dim);
  TESSERA_CHECK(vdim == c.head_dim, source, ": ", p, "attention.value_length ", vdim, " differs from key_length ",
                c.head_dim, " (not supported)");
  const int64_t rot = m.integer(p + "rope.dimension_count", 1, kMaxHeadDim, c.head_dim);
  TESSERA_CHECK(rot == c.head_dim, source, ": ", p, "rope.dimension_count ", rot, " rotates part of the head_dim ",
                c.head_dim, " (partial rotary embeddings are not supported)");
  c.max_position_embeddings = m.integer(p + "context_length", 1, kMaxPositions, 2048);
  c.norm_eps = static_cast<float>(m.number(p + "attention.layer_norm_rms_epsilon", 0, true));
  c.rope_theta = static_cast<float>(m.number(p + "rope.freq_base", 10000.0, false));
  if (const io::GgufValue* s = m.find(p + "rope.scaling.type")) {
    const std::string type = s->as_string(m.what(p + "rope.scaling.type"));
    TESSERA_CHECK(type == "none", source, ": ", p, "rope.scaling.type '", type, "' is not supported");
  }
  TESSERA_CHECK(m.integer(p + "expert_count", 0, INT32_MAX, 0) == 0, source, ": ", p,
                "expert_count: mixture-of-experts GGUF files are not supported");
  TESSERA_CHECK(!m.find(p + "attention.sliding_window"), source, ": ", p,
                "attention.sliding_window: sliding-window attention is not supported");

  const io::GgufTensorInfo* embd = nullptr;
  bool has_output = false, has_q_bias = false;
  for (const io::GgufTensorInfo& t : h.tensors) {
    if (t.name == "token_embd.weight") embd = &t;
    has_output = has_output || t.name == "output.weight";
    has_q_bias = has_q_bias || t.name == "blk.0.attn_q.bias";
    TESSERA_CHECK(t.name != "rope_freqs.weight", source,
                  ": tensor 'rope_freqs.weight' scales the rope frequencies (not supported)");
  }
  TESSERA_CHECK(embd && embd->ne.size() == 2, source, ": no 2-D tensor 'token_embd.weight'");
  TESSERA_CHECK(embd->ne[1] >= 1 && embd->ne[1] <= kMaxVocab, source, ": token_embd.weight has ", embd->ne[1],
                " rows; the vocabulary must be in [1, ", kMaxVocab, "]");
  c.vocab_size = embd->ne[1];
  c.tie_word_embeddings = !has_output;  // llama.cpp then uses token_embd as the head
  c.qkv_bias = c.arch == Arch::kQwen2 || has_q_bias;
  auto token = [&](const char* key) -> int64_t {
    const io::GgufValue* v = m.find(key);
    if (!v) return -1;
    const uint64_t id = v->as_uint(m.what(key));
    return id < static_cast<uint64_t>(c.vocab_size) ? static_cast<int64_t>(id) : -1;
  };
  c.bos_token_id = token("tokenizer.ggml.bos_token_id");
  c.eos_token_id = token("tokenizer.ggml.eos_token_id");
  c.validate(source);
  return c;
}

std::string gguf_tensor_name(const std::string& hf) {
  static const std::pair<const char*, const char*> kTop[] = {
      {"model.embed_tokens.weight", "token_embd.weight"},
      {"model.norm.weight", "output_norm.weight"},
      {"lm_head.weight", "output.weight"},
  };
  for (const auto& [from, to] : kTop)
    if (hf == from) return to;
  static const std::regex kLayer(R"(model\.layers\.(\d+)\.(.+)\.(weight|bias))");
  static const std::pair<const char*, const char*> kBlock[] = {
      {"input_layernorm", "attn_norm"},  {"self_attn.q_proj", "attn_q"},
      {"self_attn.k_proj", "attn_k"},    {"self_attn.v_proj", "attn_v"},
      {"self_attn.o_proj", "attn_output"}, {"post_attention_layernorm", "ffn_norm"},
      {"mlp.gate_proj", "ffn_gate"},     {"mlp.up_proj", "ffn_up"},
      {"mlp.down_proj", "ffn_down"},
  };
  std::smatch mt;
  if (!std::regex_match(hf, mt, kLayer)) return "";
  for (const auto& [from, to] : kBlock)
    if (mt[2] == from) return "blk." + mt[1].str() + "." + to + "." + mt[3].str();
  return "";
}

std::vector<int64_t> llama_gguf_row_order(int64_t heads, int64_t rows) {
  TESSERA_CHECK(heads > 0 && rows % (2 * heads) == 0, "llama_gguf_row_order: ", rows,
                " rows are not heads x an even head_dim (", heads, " heads)");
  const int64_t hd = rows / heads, half = hd / 2;
  std::vector<int64_t> order(rows);
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t i = 0; i < half; ++i)
      for (int64_t j = 0; j < 2; ++j) order[h * hd + 2 * i + j] = h * hd + j * half + i;
  return order;
}

void reorder_llama_rows(const uint8_t* src, uint8_t* dst, int64_t heads, int64_t rows, int64_t row_bytes,
                        bool to_gguf) {
  const std::vector<int64_t> order = llama_gguf_row_order(heads, rows);
  const auto n = static_cast<size_t>(row_bytes);
  for (int64_t r = 0; r < rows; ++r) {
    if (to_gguf)
      std::memcpy(dst + r * row_bytes, src + order[r] * row_bytes, n);
    else
      std::memcpy(dst + order[r] * row_bytes, src + r * row_bytes, n);
  }
}

io::GgmlType parse_gguf_export_type(const std::string& name) {
  static const std::pair<const char*, io::GgmlType> kTypes[] = {
      {"f32", io::GgmlType::kF32},   {"f16", io::GgmlType::kF16},   {"bf16", io::GgmlType::kBF16},
      {"q8_0", io::GgmlType::kQ8_0}, {"q4_0", io::GgmlType::kQ4_0}, {"q4_k", io::GgmlType::kQ4_K},
  };
  for (const auto& [n, t] : kTypes)
    if (name == n) return t;
  fail("--type '", name, "' is not one of f32, f16, bf16, q8_0, q4_0, q4_k");
}

}  // namespace tessera::model
