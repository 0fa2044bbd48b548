// Writing a model as a GGUF file: convert_hf_to_gguf.py's metadata and tensor names, through
// the Hugging Face names of the model's tensors (embedding_name, hf_prefix, linear_modules).
#include <algorithm>
#include <memory>

#include "tessera/base/error.h"
#include "tessera/base/logging.h"
#include "tessera/io/gguf_blocks.h"
#include "tessera/io/gguf_tokenizer.h"
#include "tessera/kernels/quant.h"
#include "tessera/model/gguf_model.h"
#include "tessera/model/model.h"

namespace tessera::model {

namespace {

// One tensor to write: its source as an f32 (rows, cols) or (n) tensor, produced when the
// writer reaches it so only one tensor's copies are alive at a time.
struct Item {
  std::string name;
  std::vector<int64_t> ne;
  io::GgmlType type = io::GgmlType::kF32;
  std::function<Tensor()> values;
  int64_t permute_heads = 0;  // Llama q / k: rows go to GGML's rope order
};

// llama.cpp's general.file_type (llama_ftype) for the type the weights were asked in.
uint32_t file_type(io::GgmlType t) {
  switch (t) {
    case io::GgmlType::kF32: return 0;    // ALL_F32
    case io::GgmlType::kF16: return 1;    // MOSTLY_F16
    case io::GgmlType::kQ4_0: return 2;   // MOSTLY_Q4_0
    case io::GgmlType::kQ8_0: return 7;   // MOSTLY_Q8_0
    case io::GgmlType::kQ4_K: return 14;  // MOSTLY_Q4_K_S: Q4_K throughout, a higher-bit head
    default: return 32;                   // MOSTLY_BF16
  }
}

// The type a 2-D weight of `cols` columns is written in (see export_gguf).
io::GgmlType weight_type(io::GgmlType want, int64_t cols, bool head) {
  io::GgmlType t = want;
  if (head && (t == io::GgmlType::kQ4_0 || t == io::GgmlType::kQ4_K)) t = io::GgmlType::kQ8_0;
  auto fits = [&](io::GgmlType x) { return cols % io::ggml_type_traits(static_cast<uint32_t>(x))->block == 0; };
  if (t == io::GgmlType::kQ4_K && !fits(t)) t = io::GgmlType::kQ4_0;
  if (!fits(t)) t = io::GgmlType::kF16;
  return t;
}

Tensor f32_contiguous(const Tensor& t) { return t.to(DType::kF32).contiguous(); }

}  // namespace

GgufExportReport export_gguf(const Model& m, const io::Tokenizer* tok, const std::string& path,
                             const GgufExportOptions& o) {
  const ModelConfig& c = m.config();
  TESSERA_CHECK(c.arch == Arch::kLlama || c.arch == Arch::kQwen2, "GGUF export: ", arch_name(c.arch),
                " models are not supported (llama and qwen2 are)");
  TESSERA_CHECK(m.tp_shard().size == 1 && m.pp_stage().whole(),
                "GGUF export needs the whole model, not a tensor-parallel shard or pipeline stage");
  TESSERA_CHECK(!c.is_moe(), "GGUF export of mixture-of-experts models is not supported yet");
  TESSERA_CHECK(!c.qk_norm && !c.sandwich_norms, "GGUF export of ", c.model_type, " is not supported yet");
  TESSERA_CHECK(c.sliding_window == 0 && !c.rope_scaling && c.partial_rotary_factor == 1, "GGUF export of ",
                c.model_type, " with ", c.sliding_window ? "sliding-window attention" : "rope scaling or a partial rotary",
                " is not supported yet (llama.cpp's llama / qwen2 metadata would drop it)");
  TESSERA_CHECK(io::ggml_can_quantize(o.type), "GGUF export: type ", io::ggml_type_name(o.type),
                " cannot be written");
  const Params& w = m.weights();
  const bool llama = c.arch == Arch::kLlama;

  std::vector<Item> items;
  auto add_1d = [&](const std::string& hf, const Tensor& t, int64_t permute_heads = 0) {
    items.push_back({gguf_tensor_name(hf), {t.size(0)}, io::GgmlType::kF32, [t] { return f32_contiguous(t); },
                     permute_heads});
  };
  auto add_2d = [&](const std::string& hf, int64_t rows, int64_t cols, std::function<Tensor()> values,
                    bool head, int64_t permute_heads = 0) {
    items.push_back({gguf_tensor_name(hf), {cols, rows}, weight_type(o.type, cols, head), std::move(values),
                     permute_heads});
  };
  // A block linear's float weight (out, in), dequantized once per linear when quantized.
  auto cache = std::make_shared<std::pair<const kernels::QuantWeight*, Tensor>>();
  auto linear_rows = [cache](const Linear* lin, int64_t r0, int64_t r1) {
    return [cache, lin, r0, r1] {
      if (!lin->quant) return f32_contiguous(lin->weight.slice(0, r0, r1));
      if (cache->first != lin->quant.get()) *cache = {lin->quant.get(), kernels::dequantize(*lin->quant)};
      return cache->second.slice(0, r0, r1).contiguous();
    };
  };

  const std::string embed = embedding_name(c);
  add_2d(embed, c.vocab_size, c.hidden_size, [t = w.embed] { return f32_contiguous(t); },
         c.tie_word_embeddings);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const LayerParams& L = w.layers[l];
    const std::string pre = hf_prefix(c) + "layers." + std::to_string(l) + ".";
    add_1d(pre + "input_layernorm.weight", L.norm1_w);
    for (int which = 0; which < 4; ++which) {
      const Linear& lin = L.linear(which);
      int64_t row = 0;
      for (const LinearModule& mod : linear_modules(c, l, which)) {
        const int64_t in = lin.quant ? lin.quant->in : lin.weight.size(1);
        const bool q = mod.name.ends_with("q_proj"), k = mod.name.ends_with("k_proj");
        const int64_t heads = llama && (q || k) ? (q ? c.num_heads : c.num_kv_heads) : 0;
        add_2d(mod.name + ".weight", mod.rows, in, linear_rows(&lin, row, row + mod.rows), false, heads);
        if (lin.bias.defined()) add_1d(mod.name + ".bias", lin.bias.slice(0, row, row + mod.rows), heads);
        row += mod.rows;
      }
      if (which == 1) add_1d(pre + "post_attention_layernorm.weight", L.norm2_w);
    }
  }
  add_1d(hf_prefix(c) + "norm.weight", w.final_norm_w);
  if (!c.tie_word_embeddings) {
    if (const kernels::QuantWeight* q = m.quantized_lm_head())  // (dequantized, as the linears are)
      add_2d("lm_head.weight", c.vocab_size, c.hidden_size, [q] { return kernels::dequantize(*q); }, true);
    else
      add_2d("lm_head.weight", c.vocab_size, c.hidden_size, [t = w.lm_head] { return f32_contiguous(t); }, true);
  }

  const std::string a = arch_name(c.arch);
  io::GgufMetadata md;
  md.emplace_back("general.architecture", io::GgufValue::string(a));
  md.emplace_back("general.type", io::GgufValue::string("model"));
  md.emplace_back("general.name", io::GgufValue::string(o.name.empty() ? "model" : o.name));
  md.emplace_back("general.file_type", io::GgufValue::u32(file_type(o.type)));
  md.emplace_back("general.quantization_version", io::GgufValue::u32(2));  // GGML_QNT_VERSION
  auto u32 = [&](const std::string& key, int64_t v) { md.emplace_back(a + "." + key, io::GgufValue::u32(static_cast<uint32_t>(v))); };
  u32("block_count", c.num_layers);
  u32("context_length", c.max_position_embeddings);
  u32("embedding_length", c.hidden_size);
  u32("feed_forward_length", c.intermediate_size);
  u32("attention.head_count", c.num_heads);
  u32("attention.head_count_kv", c.num_kv_heads);
  md.emplace_back(a + ".rope.freq_base", io::GgufValue::f32(c.rope_theta));
  md.emplace_back(a + ".attention.layer_norm_rms_epsilon", io::GgufValue::f32(c.norm_eps));
  u32("attention.key_length", c.head_dim);
  u32("attention.value_length", c.head_dim);
  u32("rope.dimension_count", c.head_dim);
  u32("vocab_size", c.vocab_size);
  if (tok) {
    for (auto& kv : io::gguf_tokenizer_metadata(*tok, c.vocab_size)) md.push_back(std::move(kv));
  } else {
    TESSERA_LOG(kWarn, path, ": no tokenizer; llama.cpp needs tokenizer.ggml.* to load this file");
  }
  // Special tokens the tokenizer does not name come from config.json, as the converter's
  // SpecialVocab takes them.
  for (const auto& [key, id] : {std::pair<std::string, int64_t>{"tokenizer.ggml.bos_token_id", c.bos_token_id},
                                {"tokenizer.ggml.eos_token_id", c.eos_token_id}}) {
    const bool named = std::any_of(md.begin(), md.end(), [&](const auto& kv) { return kv.first == key; });
    if (!named && id >= 0) md.emplace_back(key, io::GgufValue::u32(static_cast<uint32_t>(id)));
  }

  std::vector<io::GgufTensorSpec> specs;
  GgufExportReport report;
  for (const Item& it : items) {
    TESSERA_CHECK(!it.name.empty(), "GGUF export: a tensor has no llama.cpp name");
    specs.push_back({it.name, it.ne, it.type});
    report.tensors.emplace_back(it.name, it.type);
  }
  io::write_gguf(path, md, specs, [&](size_t i) {
    const Item& it = items[i];
    Tensor t = it.values();
    const int64_t rows = t.dim() == 2 ? t.size(0) : t.numel(), cols = t.dim() == 2 ? t.size(1) : 1;
    if (it.permute_heads > 0) {
      Tensor p = Tensor::empty(t.shape(), DType::kF32);
      reorder_llama_rows(reinterpret_cast<const uint8_t*>(t.data<float>()), reinterpret_cast<uint8_t*>(p.data<float>()),
                         it.permute_heads, rows, cols * static_cast<int64_t>(sizeof(float)), true);
      t = p;
    }
    return io::quantize_rows(it.type, t.data<float>(), t.dim() == 2 ? rows : 1, t.dim() == 2 ? cols : rows,
                             path + ": tensor '" + it.name + "'");
  });
  return report;
}

}  // namespace tessera::model
