// PEFT adapter files (adapter_config.json, adapter_model.safetensors) and merging an
// adapter into the base weights.
#include "tessera/model/lora_io.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>

#include "tessera/base/error.h"
#include "tessera/io/gguf_tokenizer.h"
#include "tessera/io/json_file.h"
#include "tessera/io/safetensors.h"
#include "tessera/kernels/matmul.h"
#include "tessera/model/model.h"

namespace tessera::model {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kConfigFile = "adapter_config.json";
constexpr const char* kWeightsFile = "adapter_model.safetensors";

// Every module's expected A and B shapes, by PEFT name; lora_module_rows' errors pass on.
struct Expected {
  int64_t layer;
  LoraModule module;
  bool is_a;
  Shape shape;
};
std::map<std::string, Expected> expected_tensors(const ModelConfig& c, const LoraConfig& config) {
  // The names come from LoraWeights::named() over a layout of empty placeholders, which
  // lists each layer's modules in LoraModule order, A before B: the order built here.
  LoraWeights layout;
  layout.config = config;
  layout.layers.resize(static_cast<size_t>(c.num_layers));
  std::vector<Expected> order;
  const Tensor placeholder = Tensor::empty({0}, DType::kF32);
  for (int64_t l = 0; l < c.num_layers; ++l)
    for (int i = 0; i < kLoraModules; ++i) {
      const auto m = static_cast<LoraModule>(i);
      if (!config.targets_module(m)) continue;
      const LoraRows g = lora_module_rows(c, l, m);
      layout.layers[l][i] = {placeholder, placeholder};
      order.push_back({l, m, true, {config.rank, g.in}});
      order.push_back({l, m, false, {g.rows, config.rank}});
    }
  const auto named = layout.named(c);
  TESSERA_CHECK(named.size() == order.size(), "LoRA: ", named.size(), " adapter tensor names for ", order.size(),
                " tensors");
  std::map<std::string, Expected> out;
  for (size_t k = 0; k < named.size(); ++k) out.emplace(named[k].first, order[k]);
  return out;
}

// PEFT's optional keys that must hold their "off" value for the adapter to be applied
// exactly as r, lora_alpha and target_modules say.
void check_empty_pattern(const json& j, const char* key, const std::string& where) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return;
  TESSERA_CHECK(it->is_object(), where, ": ", key, ": expected an object, got ", io::json_brief(*it));
  TESSERA_CHECK(it->empty(), where, ": ", key, " sets ", it->begin().key(), " (", it->size(),
                " entries); per-module ranks and alphas are not supported");
}

std::vector<LoraModule> parse_targets(const json& j, const std::string& where) {
  const auto it = j.find("target_modules");
  TESSERA_CHECK(it != j.end() && !it->is_null(), where, ": target_modules is missing");
  std::vector<LoraModule> out;
  auto add = [&](const std::string& name) {
    const auto m = parse_lora_module(name);
    TESSERA_CHECK(m.has_value(), where, ": target_modules: '", name,
                  "' is not a module Tessera adapts (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj)");
    if (std::find(out.begin(), out.end(), *m) == out.end()) out.push_back(*m);
  };
  if (it->is_string()) {
    // PEFT reads a string as a regex over module paths: only the plain names are taken.
    const std::string s = it->get<std::string>();
    if (s == "all-linear") {
      for (int i = 0; i < kLoraModules; ++i) out.push_back(static_cast<LoraModule>(i));
      return out;
    }
    TESSERA_CHECK(parse_lora_module(s).has_value(), where, ": target_modules '", s.substr(0, 80),
                  "' is a regular expression; only a list of module names, one module name or "
                  "\"all-linear\" is supported");
    add(s);
    return out;
  }
  TESSERA_CHECK(it->is_array(), where, ": target_modules: expected a list of module names, got ",
                io::json_brief(*it));
  for (const auto& v : *it) {
    TESSERA_CHECK(v.is_string(), where, ": target_modules: expected module names, got ", io::json_brief(v));
    add(v.get<std::string>());
  }
  TESSERA_CHECK(!out.empty(), where, ": target_modules is empty");
  return out;
}

LoraConfig parse_adapter_config(const json& j, const std::string& where) {
  TESSERA_CHECK(j.is_object(), where, ": expected a JSON object");
  const std::string type = io::json_string(j, "peft_type", "", where);
  TESSERA_CHECK(type == "LORA", where, ": peft_type '", type, "' is not LORA (only LoRA adapters are supported)");
  LoraConfig c;
  const auto r = j.find("r");
  TESSERA_CHECK(r != j.end() && io::json_int_in(*r, 1, 1 << 20), where, ": r: expected a rank >= 1, got ",
                r == j.end() ? std::string("nothing") : io::json_brief(*r));
  c.rank = r->get<int64_t>();
  if (const auto a = j.find("lora_alpha"); a != j.end() && !a->is_null()) {
    TESSERA_CHECK(a->is_number() && std::isfinite(a->get<double>()), where, ": lora_alpha: expected a number, got ",
                  io::json_brief(*a));
    c.alpha = a->get<double>();
  } else {
    c.alpha = 8;  // PEFT's default
  }
  if (const auto d = j.find("lora_dropout"); d != j.end() && !d->is_null()) {
    TESSERA_CHECK(d->is_number() && d->get<double>() >= 0 && d->get<double>() < 1, where,
                  ": lora_dropout: expected a number in [0, 1), got ", io::json_brief(*d));
    c.dropout = d->get<double>();
  }
  c.rslora = io::json_bool(j, "use_rslora", false, where);
  TESSERA_CHECK(!io::json_bool(j, "use_dora", false, where), where,
                ": use_dora is true: DoRA adapters are not supported");
  const std::string bias = io::json_string(j, "bias", "none", where);
  TESSERA_CHECK(bias == "none", where, ": bias '", bias, "' is not supported (only \"none\": no trained biases)");
  TESSERA_CHECK(!io::json_bool(j, "fan_in_fan_out", false, where), where,
                ": fan_in_fan_out is true: that layout is for GPT-2's Conv1D modules, which are not supported");
  check_empty_pattern(j, "rank_pattern", where);
  check_empty_pattern(j, "alpha_pattern", where);
  if (const auto m = j.find("modules_to_save"); m != j.end() && !m->is_null())
    fail(where, ": modules_to_save is ", io::json_brief(*m),
         ": adapters that train whole modules besides LoRA are not supported");
  if (const auto l = j.find("layers_to_transform"); l != j.end() && !l->is_null())
    fail(where, ": layers_to_transform is ", io::json_brief(*l),
         ": adapters on some layers only are not supported");
  c.targets = parse_targets(j, where);
  return c;
}

// "...q_proj.lora_A.default.weight" -> "...q_proj.lora_A.weight" (PEFT's adapter-name infix).
std::string strip_adapter_name(const std::string& name) {
  for (const char* part : {".lora_A.default.", ".lora_B.default."}) {
    const size_t at = name.find(part);
    if (at != std::string::npos) return name.substr(0, at + 7) + name.substr(at + 15);
  }
  return name;
}

std::string path_in(const std::string& dir, const char* file) { return (fs::path(dir) / file).string(); }

}  // namespace

std::string peft_adapter_config_json(const LoraConfig& config, const std::string& base_model_name_or_path) {
  json targets = json::array();
  for (LoraModule m : config.targets) targets.push_back(lora_module_name(m));
  json j = json::object();  // keys sorted, as PEFT's json.dumps(sort_keys=True)
  j["alpha_pattern"] = json::object();
  j["base_model_name_or_path"] = base_model_name_or_path;
  j["bias"] = "none";
  j["fan_in_fan_out"] = false;
  j["inference_mode"] = true;
  j["init_lora_weights"] = true;
  j["layers_pattern"] = nullptr;
  j["layers_to_transform"] = nullptr;
  // PEFT's lora_alpha is an int unless it was given a float.
  if (config.alpha == std::floor(config.alpha) && std::abs(config.alpha) < 1e15)
    j["lora_alpha"] = static_cast<int64_t>(config.alpha);
  else
    j["lora_alpha"] = config.alpha;
  j["lora_dropout"] = config.dropout;
  j["modules_to_save"] = nullptr;
  j["peft_type"] = "LORA";
  j["r"] = config.rank;
  j["rank_pattern"] = json::object();
  j["revision"] = nullptr;
  j["target_modules"] = targets;
  j["task_type"] = "CAUSAL_LM";
  j["use_dora"] = false;
  j["use_rslora"] = config.rslora;
  return j.dump(2, ' ', /*ensure_ascii=*/true);  // Python's json.dumps escapes non-ASCII
}

void save_peft_adapter(const std::string& dir, const ModelConfig& c, const LoraWeights& w,
                       const std::string& base_model_name_or_path) {
  TESSERA_CHECK(static_cast<int64_t>(w.layers.size()) == c.num_layers, "save_peft_adapter: the adapter has ",
                w.layers.size(), " layers, the model ", c.num_layers);
  const auto expected = expected_tensors(c, w.config);
  auto tensors = w.named(c);
  TESSERA_CHECK(tensors.size() == expected.size(), "save_peft_adapter: ", tensors.size(),
                " tensors for ", expected.size(), " (every layer's ", w.config.targets.size(), " target modules)");
  for (auto& [name, t] : tensors) {
    const auto it = expected.find(name);
    TESSERA_CHECK(it != expected.end() && t.shape() == it->second.shape, "save_peft_adapter: tensor '", name,
                  "' has shape ", shape_str(t.shape()), ", expected ",
                  it == expected.end() ? std::string("none") : shape_str(it->second.shape));
    if (t.dtype() != DType::kF32) t = t.to(DType::kF32);
  }
  fs::create_directories(dir);
  io::save_safetensors(path_in(dir, kWeightsFile), tensors, {{"format", "pt"}});
  io::write_file_atomic(path_in(dir, kConfigFile), peft_adapter_config_json(w.config, base_model_name_or_path));
}

LoraWeights load_peft_adapter(const std::string& dir, const ModelConfig& c) {
  TESSERA_CHECK(fs::is_directory(dir), "LoRA adapter directory '", dir, "' does not exist");
  const std::string weights_path = path_in(dir, kWeightsFile), config_path = path_in(dir, kConfigFile);
  if (!fs::exists(weights_path) && fs::exists(path_in(dir, "adapter_model.bin")))
    fail(path_in(dir, "adapter_model.bin"), ": pickle checkpoints are not supported; save with safe_serialization");
  LoraWeights w;
  w.config = parse_adapter_config(io::read_json_file(config_path), config_path);
  const auto expected = expected_tensors(c, w.config);  // lora_module_rows' errors pass on
  const auto file = io::SafetensorsFile::open(weights_path);
  w.layers.resize(static_cast<size_t>(c.num_layers));
  std::set<std::string> seen;
  for (const auto& info : file->header().tensors) {
    const std::string name = strip_adapter_name(info.name);
    const auto it = expected.find(name);
    TESSERA_CHECK(it != expected.end(), weights_path, ": unexpected tensor '", info.name,
                  "' (adapter_config.json targets ",
                  w.config.targets.size(), " modules of ", c.num_layers, " layers)");
    TESSERA_CHECK(seen.insert(name).second, weights_path, ": tensor '", info.name,
                  "' appears twice (with and without .default)");
    const Expected& e = it->second;
    TESSERA_CHECK(info.shape == e.shape, weights_path, ": tensor '", info.name, "' has shape ", shape_str(info.shape),
                  ", expected ", shape_str(e.shape), " (r = ", w.config.rank, ")");
    TESSERA_CHECK(info.dtype == DType::kF32 || info.dtype == DType::kBF16 || info.dtype == DType::kF16, weights_path,
                  ": tensor '", info.name, "' has dtype ", dtype_name(info.dtype), ", expected a float type");
    Tensor t = Tensor::empty(e.shape, DType::kF32);  // own memory: the mapping is not kept
    t.copy_from(file->get(info.name));
    LoraPair& p = w.layers[e.layer][static_cast<int>(e.module)];
    (e.is_a ? p.a : p.b) = t;
  }
  for (const auto& [name, e] : expected)
    TESSERA_CHECK(seen.count(name), weights_path, ": tensor '", name, "' is missing (adapter_config.json targets ",
                  lora_module_name(e.module), ")");
  return w;
}

void merge_lora(Model& m, const LoraWeights& w) {
  const ModelConfig& c = m.config();
  TESSERA_CHECK(m.dtype() == DType::kF32, "merge_lora: the model holds ", dtype_name(m.dtype()),
                " weights; merging needs f32 master weights (load the model as f32)");
  TESSERA_CHECK(!m.quantized(), "merge_lora: the model is quantized (", m.weights_description(),
                "); merge into the float model, then quantize");
  TESSERA_CHECK(m.tp_shard().whole() && m.pp_stage().whole(),
                "merge_lora: the model is a tensor-parallel shard or pipeline stage; merge into the whole model");
  TESSERA_CHECK(!m.lora() && m.lora_bank().empty(), "merge_lora: adapters are attached to the model "
                "(Model::set_lora / set_lora_bank); detach them first, or they would apply on top of the merge");
  TESSERA_CHECK(static_cast<int64_t>(w.layers.size()) == c.num_layers, "merge_lora: the adapter has ",
                w.layers.size(), " layers, the model ", c.num_layers);
  // PEFT's merge: W += (B @ A) * scaling, each step rounded to f32 as torch does.
  const float scale = static_cast<float>(w.config.scale());
  for (int64_t l = 0; l < c.num_layers; ++l)
    for (int i = 0; i < kLoraModules; ++i) {
      const LoraPair& p = w.layers[l][i];
      if (!p.a.defined()) continue;
      const auto mod = static_cast<LoraModule>(i);
      const LoraRows g = lora_module_rows(c, l, mod);
      const Shape want_a{w.config.rank, g.in}, want_b{g.rows, w.config.rank};
      TESSERA_CHECK(p.a.shape() == want_a && p.b.shape() == want_b, "merge_lora: layer ", l, " ",
                    lora_module_name(mod), ": A ", shape_str(p.a.shape()), ", B ", shape_str(p.b.shape()),
                    ", expected ", shape_str(want_a), ", ", shape_str(want_b));
      Linear& lin = m.weights().layers[l].linear(g.which);
      TESSERA_CHECK(lin.weight.defined() && !lin.in_out && lin.weight.dtype() == DType::kF32 &&
                        lin.weight.size(0) >= g.row0 + g.rows && lin.weight.size(1) == g.in,
                    "merge_lora: layer ", l, " ", lora_module_name(mod), ": the model's weight ",
                    lin.weight.describe(), " does not hold rows ", g.row0, "..", g.row0 + g.rows, " of ", g.in, " inputs");
      Tensor delta = Tensor::empty({g.rows, g.in}, DType::kF32);
      kernels::matmul(p.b.to(DType::kF32), p.a.to(DType::kF32), delta);
      Tensor rows = lin.weight.slice(0, g.row0, g.row0 + g.rows);
      TESSERA_CHECK(rows.is_contiguous(), "merge_lora: layer ", l, " ", lora_module_name(mod), ": weight not contiguous");
      float* dst = rows.data<float>();
      const float* d = delta.data<float>();
      for (int64_t k = 0; k < rows.numel(); ++k) dst[k] += d[k] * scale;
    }
  m.refresh_compute_weights();
}

MergedLoraExport export_merged_lora(const std::string& adapter_dir, const std::string& base_model,
                                    const std::string& out_dir) {
  std::error_code ec;
  TESSERA_CHECK(!fs::equivalent(base_model, out_dir, ec), "--out ", out_dir, " is the base model");
  TESSERA_CHECK(!fs::equivalent(adapter_dir, out_dir, ec), "--out ", out_dir, " is the adapter directory");
  Model m = Model::load(base_model, DType::kF32);
  MergedLoraExport report;
  const LoraWeights w = load_peft_adapter(adapter_dir, m.config());
  merge_lora(m, w);
  report.config = w.config;
  for (const auto& layer : w.layers)
    for (const auto& p : layer) report.modules += p.a.defined() ? 1 : 0;
  m.save(out_dir);
  if (fs::is_directory(base_model)) {
    for (const char* name : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"})
      if (fs::exists(fs::path(base_model) / name)) {
        fs::copy_file(fs::path(base_model) / name, fs::path(out_dir) / name, fs::copy_options::overwrite_existing);
        report.tokenizer_files.push_back(name);
      }
  } else if (const auto tok = io::load_model_tokenizer(base_model)) {
    tok->save(out_dir);  // a GGUF file's tokenizer, as tokenizer.json (+ tokenizer_config.json)
    for (const char* name : {"tokenizer.json", "tokenizer_config.json"})
      if (fs::exists(fs::path(out_dir) / name)) report.tokenizer_files.push_back(name);
  }
  return report;
}

}  // namespace tessera::model
