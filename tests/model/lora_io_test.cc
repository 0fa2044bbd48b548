// PEFT LoRA adapter files and merging (model/lora_io.h): a save -> load round trip is
// bit-exact, adapter_config.json holds exactly PEFT's keys, the variants PEFT writes load
// (target_modules as a string or "all-linear", ".default" names, bf16 tensors), merge_lora
// equals PEFT's merge transcribed in torch (tests/parity/lora_reference.py), and every file
// Tessera cannot apply exactly is a one-line error naming the key or tensor.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>

#include "model/parity_fixture.h"
#include "tessera/io/json_file.h"
#include "tessera/io/safetensors.h"
#include "tessera/model/lora_io.h"
#include "tessera/model/model.h"
#include "tessera/model/quantize.h"
#include "test_util/run_command.h"
#include "test_util/throws.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using model::LoraConfig;
using model::LoraModule;
using model::LoraWeights;
using nlohmann::json;

class TempDir {
 public:
  explicit TempDir(const std::string& tag)
      : path_(fs::temp_directory_path() / ("tessera_lora_" + tag + "_" + std::to_string(::getpid()))) {
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  fs::path path_;
};

model::ModelConfig tiny() { return model::ModelConfig::named_shape("tiny"); }

const std::vector<LoraModule> kAll = {LoraModule::kQ, LoraModule::kK,    LoraModule::kV,   LoraModule::kO,
                                      LoraModule::kGate, LoraModule::kUp, LoraModule::kDown};

// PEFT's initialisation, then B drawn too (at init B = 0 and a merge would change nothing).
LoraWeights trained_adapter(const model::ModelConfig& c, const LoraConfig& config, uint64_t seed) {
  LoraWeights w = LoraWeights::init(c, config, seed);
  uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
  for (auto& layer : w.layers)
    for (auto& p : layer)
      if (p.b.defined())
        for (int64_t i = 0; i < p.b.numel(); ++i) {
          s = s * 6364136223846793005ull + 1442695040888963407ull;
          p.b.data<float>()[i] = (static_cast<float>(s >> 40) / static_cast<float>(1 << 24) - 0.5f) * 0.1f;
        }
  return w;
}

LoraConfig config_of(int64_t rank, double alpha, std::vector<LoraModule> targets, bool rslora = false,
                     double dropout = 0.0) {
  LoraConfig c;
  c.rank = rank;
  c.alpha = alpha;
  c.rslora = rslora;
  c.dropout = dropout;
  c.targets = std::move(targets);
  return c;
}

void expect_bit_equal(const Tensor& got, const Tensor& want, const std::string& what) {
  ASSERT_EQ(got.shape(), want.shape()) << what;
  ASSERT_EQ(got.dtype(), DType::kF32) << what;
  const Tensor g = got.contiguous(), w = want.to(DType::kF32).contiguous();
  for (int64_t i = 0; i < w.numel(); ++i)
    ASSERT_EQ(g.data<float>()[i], w.data<float>()[i]) << what << " element " << i;
}

void expect_same_adapter(const LoraWeights& got, const LoraWeights& want) {
  EXPECT_EQ(got.config.rank, want.config.rank);
  EXPECT_EQ(got.config.alpha, want.config.alpha);
  EXPECT_EQ(got.config.dropout, want.config.dropout);
  EXPECT_EQ(got.config.rslora, want.config.rslora);
  EXPECT_EQ(got.config.targets, want.config.targets);
  ASSERT_EQ(got.layers.size(), want.layers.size());
  for (size_t l = 0; l < want.layers.size(); ++l)
    for (int m = 0; m < model::kLoraModules; ++m) {
      ASSERT_EQ(got.layers[l][m].a.defined(), want.layers[l][m].a.defined()) << l << " " << m;
      if (!want.layers[l][m].a.defined()) continue;
      const std::string what = "layer " + std::to_string(l) + " " + model::lora_module_name(static_cast<LoraModule>(m));
      expect_bit_equal(got.layers[l][m].a, want.layers[l][m].a, what + " A");
      expect_bit_equal(got.layers[l][m].b, want.layers[l][m].b, what + " B");
    }
}

json read_config(const std::string& dir) { return io::read_json_file(dir + "/adapter_config.json"); }
void write_config(const std::string& dir, const json& j) {
  std::ofstream(dir + "/adapter_config.json") << j.dump(2);
}

// The adapter's tensors as stored (name, tensor), for rewriting.
std::vector<std::pair<std::string, Tensor>> read_tensors(const std::string& dir) {
  const auto f = io::SafetensorsFile::open(dir + "/adapter_model.safetensors");
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& info : f->header().tensors) out.emplace_back(info.name, f->get(info.name).clone());
  return out;
}
void write_tensors(const std::string& dir, const std::vector<std::pair<std::string, Tensor>>& t) {
  io::save_safetensors(dir + "/adapter_model.safetensors", t, {{"format", "pt"}});
}

TEST(LoraIo, SaveLoadRoundTripIsBitExact) {
  TempDir tmp("roundtrip");
  const auto c = tiny();
  for (const LoraConfig& config :
       {config_of(4, 8, kAll, false, 0.05), config_of(3, 6.5, {LoraModule::kV, LoraModule::kQ, LoraModule::kDown}, true),
        config_of(16, 32, {LoraModule::kO})}) {
    const LoraWeights w = trained_adapter(c, config, 7);
    model::save_peft_adapter(tmp.file("a"), c, w, "meta-llama/Llama-3.2-1B");
    const LoraWeights back = model::load_peft_adapter(tmp.file("a"), c);
    expect_same_adapter(back, w);
    // The stored names are LoraWeights::named()'s, f32, with PEFT's "format": "pt".
    const auto f = io::SafetensorsFile::open(tmp.file("a/adapter_model.safetensors"));
    const auto named = w.named(c);
    EXPECT_EQ(f->header().tensors.size(), named.size());
    for (const auto& [name, t] : named) {
      ASSERT_TRUE(f->has(name)) << name;
      EXPECT_EQ(f->info(name).dtype, DType::kF32);
    }
    EXPECT_EQ(f->header().metadata.at("format"), "pt");
  }
}

TEST(LoraIo, AdapterConfigHasExactlyPeftsKeys) {
  TempDir tmp("config");
  const auto c = tiny();
  const LoraWeights w =
      trained_adapter(c, config_of(8, 16, {LoraModule::kQ, LoraModule::kV, LoraModule::kGate}, false, 0.05), 1);
  model::save_peft_adapter(tmp.file("a"), c, w, "base/dir");
  const json j = read_config(tmp.file("a"));
  const json want = {
      {"alpha_pattern", json::object()}, {"base_model_name_or_path", "base/dir"}, {"bias", "none"},
      {"fan_in_fan_out", false}, {"inference_mode", true}, {"init_lora_weights", true},
      {"layers_pattern", nullptr}, {"layers_to_transform", nullptr}, {"lora_alpha", 16},
      {"lora_dropout", 0.05}, {"modules_to_save", nullptr}, {"peft_type", "LORA"}, {"r", 8},
      {"rank_pattern", json::object()}, {"revision", nullptr},
      {"target_modules", json::array({"q_proj", "v_proj", "gate_proj"})}, {"task_type", "CAUSAL_LM"},
      {"use_dora", false}, {"use_rslora", false}};
  EXPECT_EQ(j, want) << j.dump(2);
  EXPECT_TRUE(j.at("lora_alpha").is_number_integer());  // PEFT writes an int alpha as an int
  EXPECT_TRUE(j.at("r").is_number_integer());
  // Python's json.dumps(indent=2, sort_keys=True) layout: sorted keys, two-space indent.
  const std::string text = io::read_file_bytes(tmp.file("a/adapter_config.json"));
  EXPECT_EQ(text.rfind("{\n  \"alpha_pattern\": {},\n  \"base_model_name_or_path\": \"base/dir\",", 0), 0u) << text;
  // rsLoRA and a fractional alpha.
  model::save_peft_adapter(tmp.file("b"), c, trained_adapter(c, config_of(4, 6.5, kAll, true), 2), "x");
  const json k = read_config(tmp.file("b"));
  EXPECT_EQ(k.at("use_rslora"), true);
  EXPECT_EQ(k.at("lora_alpha"), 6.5);
  EXPECT_EQ(k.at("lora_dropout"), 0.0);
  EXPECT_EQ(k.at("target_modules").size(), 7u);
}

TEST(LoraIo, LoadsTheVariantsPeftWrites) {
  TempDir tmp("variants");
  const auto c = tiny();
  const LoraWeights all = trained_adapter(c, config_of(4, 8, kAll), 3);
  const LoraWeights q = trained_adapter(c, config_of(4, 8, {LoraModule::kQ}), 4);
  // target_modules "all-linear" and a single module name as a string.
  model::save_peft_adapter(tmp.file("all"), c, all, "b");
  json j = read_config(tmp.file("all"));
  j["target_modules"] = "all-linear";
  write_config(tmp.file("all"), j);
  expect_same_adapter(model::load_peft_adapter(tmp.file("all"), c), all);
  model::save_peft_adapter(tmp.file("q"), c, q, "b");
  j = read_config(tmp.file("q"));
  j["target_modules"] = "q_proj";
  write_config(tmp.file("q"), j);
  expect_same_adapter(model::load_peft_adapter(tmp.file("q"), c), q);
  // Names with the ".default" adapter-name infix; only the keys PEFT requires (the rest default).
  auto tensors = read_tensors(tmp.file("all"));
  for (auto& [name, t] : tensors) {
    const size_t at = name.find(".weight");
    name = name.substr(0, at) + ".default" + name.substr(at);
  }
  write_tensors(tmp.file("all"), tensors);
  write_config(tmp.file("all"), {{"peft_type", "LORA"}, {"r", 4}, {"lora_alpha", 8}, {"target_modules", "all-linear"}});
  EXPECT_NE(tensors[0].first.find(".lora_A.default.weight"), std::string::npos) << tensors[0].first;
  expect_same_adapter(model::load_peft_adapter(tmp.file("all"), c), all);
  // bf16 and f16 tensors load as f32 of the same values.
  const auto f32 = read_tensors(tmp.file("q"));
  for (DType dt : {DType::kBF16, DType::kF16}) {
    auto half = f32;
    for (auto& [name, t] : half) t = t.to(dt);
    write_tensors(tmp.file("q"), half);
    LoraWeights want = model::load_peft_adapter(tmp.file("q"), c);
    for (auto* t : want.tensors()) ASSERT_EQ(t->dtype(), DType::kF32);
    const auto& p = want.layers[1][0];
    const auto& o = q.layers[1][0];
    expect_bit_equal(p.a, o.a.to(dt).to(DType::kF32), std::string(dtype_name(dt)) + " A");
    expect_bit_equal(p.b, o.b.to(dt).to(DType::kF32), std::string(dtype_name(dt)) + " B");
  }
}

// Each file Tessera cannot apply exactly: one line naming the file and the key or tensor.
TEST(LoraIo, ErrorsNameTheKeyOrTensor) {
  TempDir tmp("errors");
  const auto c = tiny();
  const LoraWeights w = trained_adapter(c, config_of(4, 8, {LoraModule::kQ, LoraModule::kV}), 5);
  const std::string dir = tmp.file("a");
  model::save_peft_adapter(dir, c, w, "b");
  const json good = read_config(dir);
  const auto good_tensors = read_tensors(dir);
  auto load = [&] { model::load_peft_adapter(dir, c); };
  struct Case {
    const char* key;
    json value;
    std::vector<const char*> needles;
  };
  const std::vector<Case> cases = {
      {"peft_type", "IA3", {"peft_type", "IA3"}},
      {"use_dora", true, {"use_dora"}},
      {"rank_pattern", {{"q_proj", 8}}, {"rank_pattern", "q_proj"}},
      {"alpha_pattern", {{"v_proj", 32}}, {"alpha_pattern", "v_proj"}},
      {"modules_to_save", json::array({"lm_head"}), {"modules_to_save"}},
      {"bias", "lora_only", {"bias", "lora_only"}},
      {"fan_in_fan_out", true, {"fan_in_fan_out"}},
      {"layers_to_transform", json::array({0}), {"layers_to_transform"}},
      {"target_modules", ".*\\.(q|v)_proj", {"target_modules", "regular expression"}},
      {"target_modules", json::array({"q_proj", "lm_head"}), {"target_modules", "lm_head"}},
      {"r", 0, {"r:"}},
  };
  for (const Case& k : cases) {
    json j = good;
    j[k.key] = k.value;
    write_config(dir, j);
    std::vector<const char*> needles = k.needles;
    needles.push_back("adapter_config.json");
    for (const char* n : needles) EXPECT_TRUE(testing::throws_error(load, {n}, true)) << k.key << " " << n;
  }
  write_config(dir, good);
  model::load_peft_adapter(dir, c);  // the good files load

  const std::string qa = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight";
  // A tensor missing.
  auto t = good_tensors;
  t.erase(std::find_if(t.begin(), t.end(), [&](const auto& p) { return p.first == qa; }));
  write_tensors(dir, t);
  EXPECT_TRUE(testing::throws_error(load, {"adapter_model.safetensors", qa.c_str(), "missing"}, true));
  // An unexpected tensor (a module the config does not target).
  t = good_tensors;
  t.emplace_back("base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight", Tensor::zeros({4, 64}, DType::kF32));
  write_tensors(dir, t);
  EXPECT_TRUE(testing::throws_error(
      load,
      {"adapter_model.safetensors", "unexpected tensor 'base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight'"},
      true));
  // A wrong shape: expected and got.
  t = good_tensors;
  for (auto& [name, x] : t)
    if (name == qa) x = Tensor::zeros({5, 64}, DType::kF32);
  write_tensors(dir, t);
  EXPECT_TRUE(testing::throws_error(load, {qa.c_str(), "(5, 64)", "expected (4, 64)"}, true));
  // An integer tensor.
  t = good_tensors;
  for (auto& [name, x] : t)
    if (name == qa) x = Tensor::zeros({4, 64}, DType::kI32);
  write_tensors(dir, t);
  EXPECT_TRUE(testing::throws_error(load, {qa.c_str(), "dtype"}, true));
  // A pickle checkpoint in place of safetensors.
  fs::remove(dir + "/adapter_model.safetensors");
  std::ofstream(dir + "/adapter_model.bin") << "PK";
  EXPECT_TRUE(testing::throws_error(
      load, {"adapter_model.bin", "pickle checkpoints are not supported; save with safe_serialization"}, true));
  // A module the model cannot adapt: lora_module_rows' message passes on.
  write_tensors(dir, good_tensors);
  auto gpt2 = model::ModelConfig::named_shape("gpt2-124m");
  EXPECT_TRUE(testing::throws_error([&] { model::load_peft_adapter(dir, gpt2); }, {"c_attn"}, true));
  auto moe = model::ModelConfig::from_json(
      {{"model_type", "mixtral"}, {"vocab_size", 256}, {"hidden_size", 64}, {"num_hidden_layers", 2},
       {"num_attention_heads", 4}, {"num_key_value_heads", 2}, {"intermediate_size", 128},
       {"num_local_experts", 4}, {"num_experts_per_tok", 2}, {"max_position_embeddings", 256}},
      "mixtral config");
  json j = good;
  j["target_modules"] = json::array({"q_proj", "down_proj"});
  write_config(dir, j);
  EXPECT_TRUE(
      testing::throws_error([&] { model::load_peft_adapter(dir, moe); }, {"down_proj", "mixture-of-experts"}, true));
  EXPECT_TRUE(testing::throws_error([&] { model::load_peft_adapter(tmp.file("none"), c); }, {"none"}, true));
}

// merge_lora against PEFT's merge (LoraLayer + Linear.merge transcribed in torch): every
// adapted module's merged weight, for plain and rsLoRA scaling.
TEST(LoraIo, MergeMatchesPeftReference) {
  TempDir tmp("merge");
  const auto c = tiny();
  const model::Model base = model::Model::random(c, DType::kF32, 21);
  base.save(tmp.file("base"));
  for (const LoraConfig& config :
       {config_of(4, 8, kAll), config_of(3, 6.5, {LoraModule::kV, LoraModule::kQ, LoraModule::kDown}, true)}) {
    const LoraWeights w = trained_adapter(c, config, 22);
    model::save_peft_adapter(tmp.file("adapter"), c, w, tmp.file("base"));
    const std::string out = tmp.file("merged.safetensors");
    fs::remove(out);
    const auto r = testing::run_command(std::string(TESSERA_PYTHON) + " " + TESSERA_SOURCE_DIR +
                                        "/tests/parity/lora_reference.py " + tmp.file("base") + " " +
                                        tmp.file("adapter") + " " + out);
    ASSERT_EQ(r.code, 0) << r.out;
    model::Model m = model::Model::load(tmp.file("base"));
    model::merge_lora(m, model::load_peft_adapter(tmp.file("adapter"), c));
    const auto ref = io::SafetensorsFile::open(out);
    std::map<std::string, Tensor> merged;
    for (const auto& [name, t] : m.weights().named(c)) merged[name] = t;
    std::map<std::string, Tensor> original;
    for (const auto& [name, t] : base.weights().named(c)) original[name] = t;
    EXPECT_EQ(ref->header().tensors.size(), static_cast<size_t>(c.num_layers) * config.targets.size());
    for (const auto& info : ref->header().tensors) {
      ASSERT_TRUE(merged.count(info.name)) << info.name;
      EXPECT_LE(testing::relative_error(merged.at(info.name), ref->get(info.name)), 1e-6) << info.name;
      // The adapter moved the weight by far more than the tolerance.
      EXPECT_GT(testing::relative_error(original.at(info.name), ref->get(info.name)), 1e-2) << info.name;
    }
    // The modules not adapted are untouched.
    for (const auto& [name, t] : merged)
      if (!ref->has(name)) expect_bit_equal(t, original.at(name), name);
  }
}

TEST(LoraIo, MergeNeedsAWholeF32FloatModel) {
  const auto c = tiny();
  const LoraWeights w = trained_adapter(c, config_of(4, 8, kAll), 1);
  model::Model bf16 = model::Model::random(c, DType::kBF16, 1);
  EXPECT_TRUE(testing::throws_error([&] { model::merge_lora(bf16, w); }, {"merge_lora", "bf16", "f32"}, true));
  model::Model q = model::Model::random(c, DType::kF32, 1);
  model::quantize_model(q, model::quantize_options("rtn", 8, 0));
  EXPECT_TRUE(testing::throws_error([&] { model::merge_lora(q, w); }, {"merge_lora", "quantized"}, true));
  const model::Model whole = model::Model::random(c, DType::kF32, 1);
  model::Model shard = whole.shard(model::TpShard{0, 2});
  EXPECT_TRUE(testing::throws_error([&] { model::merge_lora(shard, w); }, {"merge_lora", "shard"}, true));
  model::Model stage = whole.stage(model::pipeline_stage(c, 0, 2));
  EXPECT_TRUE(testing::throws_error([&] { model::merge_lora(stage, w); }, {"merge_lora", "stage"}, true));
}

}  // namespace
}  // namespace tessera
