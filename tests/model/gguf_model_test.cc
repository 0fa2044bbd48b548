// GGUF export and import of whole models: f32 files hold the checkpoint exactly as
// convert_hf_to_gguf.py lays it out (checked by an independent NumPy reader,
// tests/parity/gguf_blocks_reference.py) and load back to identical logits; f16 / bf16 files
// give the logits of the model with its weights so rounded; quantized files run with their
// quantization and give the logits of the float model holding the same dequantized values;
// files Tessera cannot run are one-line errors.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <optional>
#include <random>
#include <set>

#include "tessera/io/gguf_blocks.h"
#include "tessera/kernels/bf16_speed.h"
#include "tessera/model/gguf_model.h"
#include "tessera/model/model.h"
#include "test_util/run_command.h"
#include "test_util/tensor_diff.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using io::GgmlType;

class TempDir {
 public:
  TempDir() : path_(fs::temp_directory_path() / ("tessera_gguf_" + std::to_string(::getpid()) + "_" +
                                                ::testing::UnitTest::GetInstance()->current_test_info()->name())) {
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string file(const std::string& n) const { return (path_ / n).string(); }

 private:
  fs::path path_;
};

std::vector<int32_t> prompt(int64_t vocab) {
  std::vector<int32_t> p;
  for (int i = 0; i < 12; ++i) p.push_back(static_cast<int32_t>((i * 37 + 5) % vocab));
  return p;
}

Tensor logits_of(const model::Model& m) {
  auto cache = model::KVCache::create(m.config(), 32);
  return m.forward(prompt(m.config().vocab_size), cache, true);
}

using tessera::testing::max_abs;
using tessera::testing::max_abs_diff;

model::ModelConfig llama(int64_t hidden = 64, int64_t ffn = 128) {
  auto c = model::ModelConfig::named_shape("tiny");
  c.hidden_size = hidden;
  c.intermediate_size = ffn;
  c.head_dim = hidden / c.num_heads;
  return c;
}

model::ModelConfig qwen2(int64_t hidden = 64, int64_t ffn = 128) {
  auto c = llama(hidden, ffn);
  c.arch = model::Arch::kQwen2;
  c.model_type = "qwen2";
  c.qkv_bias = true;
  c.tie_word_embeddings = true;
  c.rope_theta = 1e6f;
  c.norm_eps = 1e-6f;
  return c;
}

// A random model whose biases (zero in Model::random) are random too, so their
// placement is checked.
model::Model random_model(const model::ModelConfig& c, uint64_t seed) {
  model::Model m = model::Model::random(c, DType::kF32, seed);
  std::mt19937 rng(static_cast<uint32_t>(seed));
  std::normal_distribution<float> n(0.f, 0.1f);
  for (auto& L : m.weights().layers)
    if (L.qkv.bias.defined())
      for (int64_t i = 0; i < L.qkv.bias.numel(); ++i) L.qkv.bias.data<float>()[i] = n(rng);
  return m;
}

std::string export_file(const model::Model& m, const TempDir& dir, const std::string& type) {
  const std::string path = dir.file(type + ".gguf");
  model::GgufExportOptions o;
  o.type = model::parse_gguf_export_type(type);
  o.name = "test";
  model::export_gguf(m, nullptr, path, o);
  return path;
}

// The float model holding, in every tensor, what `path` stores for it dequantized: each
// Hugging Face tensor of `m` taken through quantize_rows and dequantize_rows of the type
// the file gave it (rows are quantized independently, so Llama's q / k row order in the
// file does not change the values).
model::Model dequantized_reference(const model::Model& m, const std::string& path) {
  const auto f = io::GgufFile::open(path);
  model::Model ref = m.shard(model::TpShard{});
  for (auto& [hf, view] : ref.weights().named(ref.config())) {
    if (view.dim() != 2) continue;
    const io::GgufTensorInfo* t = f->tensor(model::gguf_tensor_name(hf));
    EXPECT_TRUE(t) << hf;
    if (!t) continue;
    const Tensor w = view.contiguous();
    const std::string q = io::quantize_rows(t->type, w.data<float>(), w.size(0), w.size(1), hf);
    Tensor back = Tensor::empty(w.shape(), DType::kF32);
    io::dequantize_rows(t->type, reinterpret_cast<const uint8_t*>(q.data()), w.size(0), w.size(1),
                        back.data<float>(), hf);
    view.copy_from(back);
  }
  return ref;
}

// Logits of a quantized model against the float model holding its values: the product sums
// in another order (GEMV per group, or bf16 operands where this CPU's GEMM is faster in bf16).
float product_tolerance(const Tensor& logits) {
  return (kernels::bf16_native_gemm_faster() ? 1e-2f : 2e-4f) * max_abs(logits);
}

TEST(GgufModel, F32ExportHoldsTheCheckpointAndLoadsBackToIdenticalLogits) {
  TempDir dir;
  auto tied_llama = llama();
  tied_llama.tie_word_embeddings = true;
  tied_llama.qkv_bias = true;  // attention_bias: Llama's q / k biases are permuted too
  for (const auto& c : {llama(), tied_llama, qwen2()}) {
    SCOPED_TRACE(std::string(model::arch_name(c.arch)) + (c.tie_word_embeddings ? " tied" : ""));
    const model::Model m = random_model(c, 3);
    const std::string hf = dir.file("hf");
    m.save(hf);
    const std::string path = export_file(m, dir, "f32");
    const auto r = tessera::testing::run_command(std::string(TESSERA_PYTHON) + " " + TESSERA_SOURCE_DIR +
                                                 "/tests/parity/gguf_blocks_reference.py convert " + hf + " " + path);
    EXPECT_EQ(r.code, 0) << r.out;
    EXPECT_EQ(r.out.rfind("ok ", 0), 0u) << r.out;

    const model::Model back = model::Model::load(path);
    EXPECT_FALSE(back.quantized());
    EXPECT_EQ(back.config().to_json(), m.config().to_json());
    EXPECT_EQ(model::ModelConfig::load(path).to_json(), m.config().to_json());
    EXPECT_EQ(max_abs_diff(logits_of(back), logits_of(m)), 0.f);
    const model::Model bf = model::Model::load(path, DType::kBF16);
    EXPECT_EQ(bf.dtype(), DType::kBF16);
    // A tensor-parallel shard (kv heads split at tp 2, replicated at tp 4) or a pipeline
    // stage reads its blocks from the file: the blocks the directory gives.
    const std::pair<model::TpShard, int> layouts[] = {{{1, 2}, -1}, {{3, 4}, -1}, {{0, 2}, 1}, {{0, 1}, 0}};
    for (const auto& [shard, stage_rank] : layouts) {
      SCOPED_TRACE("tp rank " + std::to_string(shard.rank) + " of " + std::to_string(shard.size) +
                   ", pp rank " + std::to_string(stage_rank));
      const model::PpStage stage = stage_rank < 0 ? model::PpStage{} : model::pipeline_stage(c, stage_rank, 2);
      const model::Model from_file = model::Model::load(path, DType::kBF16, shard, stage);
      const model::Model from_dir = model::Model::load(hf, DType::kBF16, shard, stage);
      const auto a = from_file.weights().pieces(c, shard), b = from_dir.weights().pieces(c, shard);
      ASSERT_EQ(a.size(), b.size());
      for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_EQ(a[i].name, b[i].name);
        const Tensor x = a[i].view.contiguous(), y = b[i].view.contiguous();
        EXPECT_EQ(std::memcmp(x.raw_data(), y.raw_data(), x.nbytes()), 0) << a[i].name;
      }
    }
  }
}

TEST(GgufModel, F16AndBf16ExportsGiveTheRoundedModelsLogits) {
  TempDir dir;
  for (const auto& c : {llama(), qwen2()})
    for (const char* type : {"f16", "bf16"}) {
      SCOPED_TRACE(std::string(model::arch_name(c.arch)) + " " + type);
      const model::Model m = random_model(c, 4);
      const std::string path = export_file(m, dir, type);
      const model::Model back = model::Model::load(path);
      EXPECT_FALSE(back.quantized());
      model::Model ref = m.shard(model::TpShard{});
      for (auto& [hf, view] : ref.weights().named(ref.config()))
        if (view.dim() == 2) view.copy_from(std::string(type) == "f16" ? f16_rounded(view) : bf16_rounded(view));
      EXPECT_EQ(max_abs_diff(logits_of(back), logits_of(ref)), 0.f);
      EXPECT_GT(max_abs_diff(logits_of(back), logits_of(m)), 0.f) << "rounding changed nothing";
    }
}

TEST(GgufModel, QuantizedExportsRunQuantizedWithTheirDequantizedValues) {
  TempDir dir;
  struct Case {
    model::ModelConfig c;
    const char* type;
    const char* scheme;
  };
  // Q4_K needs rows that are whole 256-value super-blocks.
  for (const Case& k : {Case{llama(), "q8_0", "int8 g32"}, Case{qwen2(), "q8_0", "int8 g32"},
                        Case{llama(), "q4_0", "int4 g32"}, Case{qwen2(), "q4_0", "int4 g32"},
                        Case{llama(256, 512), "q4_k", "int4 g32"}, Case{qwen2(256, 512), "q4_k", "int4 g32"}}) {
    SCOPED_TRACE(std::string(model::arch_name(k.c.arch)) + " " + k.type);
    const model::Model m = random_model(k.c, 5);
    const std::string path = export_file(m, dir, k.type);
    const auto f = io::GgufFile::open(path);
    EXPECT_EQ(f->tensor("blk.0.attn_q.weight")->type, model::parse_gguf_export_type(k.type));
    EXPECT_EQ(f->tensor("blk.1.ffn_down.weight")->type, model::parse_gguf_export_type(k.type));
    const model::Model q = model::Model::load(path);
    ASSERT_TRUE(q.quantized());
    // The head runs as stored too: export writes it at Q8_0 under every quantized type.
    EXPECT_EQ(q.weights_description(), std::string(k.scheme) + ", lm_head int8 g32");
    ASSERT_NE(q.quantized_lm_head(), nullptr);
    EXPECT_LT(q.matmul_weight_bytes(), m.matmul_weight_bytes());
    const Tensor got = logits_of(q), want = logits_of(dequantized_reference(m, path));
    EXPECT_LT(max_abs_diff(got, want), product_tolerance(want));
    EXPECT_GT(max_abs_diff(got, logits_of(m)), 0.f) << "quantization changed nothing";
    // Saving would need a checkpoint format for these weights: refused, one line.
    try {
      q.save(dir.file("resaved"));
      ADD_FAILURE() << "a GGUF-quantized model saved";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("not supported"), std::string::npos) << e.what();
    }
    // ... and so is a tensor-parallel shard of them.
    try {
      model::Model::load(path, DType::kF32, model::TpShard{0, 2});
      ADD_FAILURE() << "a GGUF-quantized model loaded as a tp shard";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("quantized weights load whole"), std::string::npos) << e.what();
    }
  }
}

TEST(GgufModel, ABlockLinearWithoutAQuantizedFormMakesTheWholeModelFloat) {
  // FFN 80: ffn_down's rows are not whole Q8_0 blocks, so export writes it in F16, and the
  // import dequantizes every block linear (quantized Tessera models are quantized throughout).
  TempDir dir;
  const model::Model m = random_model(llama(64, 80), 6);
  const std::string path = export_file(m, dir, "q8_0");
  const auto f = io::GgufFile::open(path);
  EXPECT_EQ(f->tensor("blk.0.ffn_down.weight")->type, GgmlType::kF16);
  EXPECT_EQ(f->tensor("blk.0.ffn_up.weight")->type, GgmlType::kQ8_0);
  const model::Model back = model::Model::load(path);
  EXPECT_FALSE(back.quantized());
  EXPECT_EQ(max_abs_diff(logits_of(back), logits_of(dequantized_reference(m, path))), 0.f);
}

// `path` rewritten with the tensors in `q6` replaced by Q6_K blocks of random bytes (finite
// scales): the mix of a llama.cpp Q4_K_M file.
void with_q6_k(const std::string& path, const std::string& out, const std::set<std::string>& q6) {
  const auto f = io::GgufFile::open(path);
  std::vector<io::GgufTensorSpec> specs;
  std::vector<std::string> bytes;
  std::mt19937 rng(9);
  std::uniform_real_distribution<float> d(1e-5f, 4e-5f);  // |d sc (q - 32)| ~ 0.02
  for (const io::GgufTensorInfo& t : f->header().tensors) {
    specs.push_back({t.name, t.ne, q6.count(t.name) ? GgmlType::kQ6_K : t.type});
    std::string b(reinterpret_cast<const char*>(f->data(t)), t.nbytes);
    if (q6.count(t.name)) {
      b.assign(static_cast<size_t>(t.rows() * t.ne[0] / 256 * 210), '\0');
      for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<char>(rng());
      for (size_t blk = 0; blk < b.size(); blk += 210) {
        const uint16_t h = f32_to_f16(d(rng));
        b[blk + 208] = static_cast<char>(h);
        b[blk + 209] = static_cast<char>(h >> 8);
      }
    }
    bytes.push_back(std::move(b));
  }
  io::write_gguf(out, f->header().metadata, specs, [&](size_t i) { return bytes[i]; });
}

TEST(GgufModel, Q6KPartsKeepTheirValuesInTheFinestCommonForm) {
  // Qwen2 (no row permutation): v and ffn_down of layer 0 in Q6_K among Q4_K tensors. The
  // fused qkv of layer 0 is stacked as int8 group 16; the file's dequantized values are
  // what the model computes with.
  TempDir dir;
  const auto c = qwen2(256, 512);
  const model::Model m = random_model(c, 7);
  const std::string mixed = dir.file("mixed.gguf");
  with_q6_k(export_file(m, dir, "q4_k"), mixed, {"blk.0.attn_v.weight", "blk.0.ffn_down.weight"});
  const model::Model q = model::Model::load(mixed);
  ASSERT_TRUE(q.quantized());
  const auto& L0 = q.weights().layers[0];
  EXPECT_EQ(L0.qkv.quant->scheme, kernels::QuantScheme::kInt8);
  EXPECT_EQ(L0.qkv.quant->group, 16);
  EXPECT_EQ(L0.down.quant->group, 16);
  EXPECT_EQ(L0.up.quant->scheme, kernels::QuantScheme::kInt4);
  EXPECT_EQ(q.weights().layers[1].qkv.quant->scheme, kernels::QuantScheme::kInt4);

  // The reference: every tensor of the file dequantized into a float model.
  const auto f = io::GgufFile::open(mixed);
  model::Model ref = m.shard(model::TpShard{});
  for (auto& [hf, view] : ref.weights().named(c)) {
    const io::GgufTensorInfo* t = f->tensor(model::gguf_tensor_name(hf));
    ASSERT_TRUE(t) << hf;
    Tensor v = Tensor::empty(view.shape(), DType::kF32);
    io::dequantize_rows(t->type, f->data(*t), view.dim() == 2 ? view.size(0) : 1, t->ne[0], v.data<float>(), hf);
    view.copy_from(v);
  }
  const Tensor want = logits_of(ref);
  EXPECT_LT(max_abs_diff(logits_of(q), want), product_tolerance(want));
}

TEST(GgufModel, FilesTesseraCannotRunAreOneLineErrors) {
  TempDir dir;
  const model::Model m = random_model(llama(), 8);
  const std::string good = export_file(m, dir, "f32");
  const auto f = io::GgufFile::open(good);
  // Rewrites `good` with one metadata key changed (or added) and tensors dropped.
  int variants = 0;
  auto variant = [&](const std::string& key, std::optional<io::GgufValue> value, const std::string& drop = "") {
    io::GgufMetadata md;
    bool seen = false;
    for (const auto& [k, v] : f->header().metadata) {
      if (k == key) {
        seen = true;
        if (value) md.emplace_back(k, *value);
      } else {
        md.emplace_back(k, v);
      }
    }
    if (!seen && value) md.emplace_back(key, *value);
    std::vector<io::GgufTensorSpec> specs;
    std::vector<const io::GgufTensorInfo*> infos;
    for (const auto& t : f->header().tensors)
      if (t.name != drop) {
        specs.push_back({t.name, t.ne, t.type});
        infos.push_back(&t);
      }
    const std::string out = dir.file("variant" + std::to_string(++variants) + ".gguf");
    io::write_gguf(out, md, specs, [&](size_t i) {
      return std::string(reinterpret_cast<const char*>(f->data(*infos[i])), infos[i]->nbytes);
    });
    return out;
  };
  auto load_error = [](const std::string& path) {
    try {
      model::Model::load(path);
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
      return std::string(e.what());
    }
    return std::string("<no error>");
  };
  const std::pair<std::string, std::string> cases[] = {
      {variant("general.architecture", io::GgufValue::string("phi3")), "general.architecture 'phi3' is not supported"},
      {variant("general.architecture", std::nullopt), "no metadata key 'general.architecture'"},
      {variant("llama.block_count", std::nullopt), "no metadata key 'llama.block_count'"},
      {variant("llama.block_count", io::GgufValue::string("2")), "llama.block_count: expected an integer"},
      {variant("llama.block_count", io::GgufValue::u32(3)), "tensor 'blk.2.attn_q.weight' is missing"},
      {variant("llama.embedding_length", io::GgufValue::u32(0)), "llama.embedding_length must be in [1, "},
      {variant("llama.rope.scaling.type", io::GgufValue::string("yarn")), "rope.scaling.type 'yarn' is not supported"},
      {variant("llama.rope.dimension_count", io::GgufValue::u32(8)), "partial rotary embeddings are not supported"},
      {variant("llama.expert_count", io::GgufValue::u32(8)), "mixture-of-experts"},
      {variant("llama.feed_forward_length", io::GgufValue::u32(96)),
       "tensor 'blk.0.ffn_gate.weight' has dims [64, 128] (innermost first), the metadata implies [64, 96]"},
      {variant("", std::nullopt, "blk.1.ffn_norm.weight"), "tensor 'blk.1.ffn_norm.weight' is missing"},
      {variant("", std::nullopt, "token_embd.weight"), "no 2-D tensor 'token_embd.weight'"},
  };
  for (const auto& [path, needle] : cases)
    EXPECT_NE(load_error(path).find(needle), std::string::npos) << "wanted '" << needle << "', got: " << load_error(path);

  // Export refuses what llama.cpp's converter has no layout for here.
  auto gpt2 = model::ModelConfig::named_shape("gpt2-124m");
  gpt2.vocab_size = 64, gpt2.hidden_size = 32, gpt2.num_layers = 1, gpt2.num_heads = gpt2.num_kv_heads = 2;
  gpt2.head_dim = 16, gpt2.intermediate_size = 64, gpt2.max_position_embeddings = 16;
  try {
    export_file(model::Model::random(gpt2, DType::kF32, 1), dir, "f16");
    ADD_FAILURE() << "gpt2 exported";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("gpt2 models are not supported"), std::string::npos) << e.what();
  }
  EXPECT_THROW(model::parse_gguf_export_type("q5_k"), Error);
}

TEST(GgufModel, LlamaRowOrderIsConvertHfToGgufsPermute) {
  // One head of dim 8: HF rows (0..3 | 4..7) are the halves rotate_half pairs; GGUF
  // interleaves them (0, 4, 1, 5, ...). Two kv heads: each head separately.
  EXPECT_EQ(model::llama_gguf_row_order(1, 8), (std::vector<int64_t>{0, 4, 1, 5, 2, 6, 3, 7}));
  EXPECT_EQ(model::llama_gguf_row_order(2, 8), (std::vector<int64_t>{0, 2, 1, 3, 4, 6, 5, 7}));
  EXPECT_EQ(model::gguf_tensor_name("model.layers.11.mlp.down_proj.weight"), "blk.11.ffn_down.weight");
  EXPECT_EQ(model::gguf_tensor_name("model.layers.0.self_attn.k_proj.bias"), "blk.0.attn_k.bias");
  EXPECT_EQ(model::gguf_tensor_name("model.norm.weight"), "output_norm.weight");
  EXPECT_EQ(model::gguf_tensor_name("model.layers.0.self_attn.rotary_emb.inv_freq"), "");
}

}  // namespace
}  // namespace tessera
