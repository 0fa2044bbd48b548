// config.json's quantization_config, as AutoGPTQ, AutoAWQ and llm-compressor write it.
#include "tessera/io/quant_config.h"

#include <cctype>
#include <regex>

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/io/json_file.h"

namespace tessera::io {

// What every function needs of f, whatever it came from: `where` names the caller.
void check_quant_format(const QuantCheckpointFormat& f, const std::string& where) {
  TESSERA_CHECK(f.method == "gptq" || f.method == "awq" || f.method == kCompressedTensors, where,
                ": quant_method '", f.method, "' is not supported (gptq, awq or compressed-tensors)");
  if (f.method == kCompressedTensors) {
    TESSERA_CHECK(f.bits == 8 && f.sym && !f.desc_act && (f.group_size == -1 || (f.fp8 && f.group_size > 0)),
                  where, ": compressed-tensors is read and written as W8A8 int8 (8 bits, symmetric, per "
                  "channel) or fp8 weights (per channel or group)");
    TESSERA_CHECK(f.fp8 || !f.fp8_activations, where, ": fp8 activations with int8 weights are not a scheme");
  } else if (f.method == "gptq") {
    TESSERA_CHECK(f.bits == 4 || f.bits == 8, where, ": gptq bits = ", f.bits,
                  " is not supported (4 or 8)");
    TESSERA_CHECK(f.group_size == -1 || f.group_size > 0, where, ": group_size = ", f.group_size,
                  " is not supported (-1 or a positive number of input features)");
    TESSERA_CHECK(f.gptq_version == 1 || f.gptq_version == 2, where, ": gptq checkpoint format v",
                  f.gptq_version, " is not supported (gptq or gptq_v2)");
    if (const auto& o = f.lm_head_override) {
      TESSERA_CHECK(o->bits == 4 || o->bits == 8, where, ": lm_head bits = ", o->bits, " is not supported (4 or 8)");
      TESSERA_CHECK(o->group_size == -1 || o->group_size > 0, where, ": lm_head group_size = ", o->group_size,
                    " is not supported (-1 or a positive number of input features)");
    }
  } else {
    TESSERA_CHECK(f.bits == 4, where, ": awq bits = ", f.bits, " is not supported (4)");
    TESSERA_CHECK(f.group_size > 0, where, ": awq group_size = ", f.group_size,
                  " is not supported (a positive number of input features)");
    TESSERA_CHECK(!f.desc_act, where, ": awq has no act-order (desc_act must be false)");
  }
  TESSERA_CHECK(f.method == "gptq" || (!f.lm_head && !f.lm_head_override), where, ": a quantized lm_head is ",
                "written in gptq's format only (", f.method, " keeps lm_head in float)");
}

QuantCheckpointFormat QuantCheckpointFormat::lm_head_format() const {
  QuantCheckpointFormat h = *this;
  if (lm_head_override) {
    h.bits = lm_head_override->bits;
    h.group_size = lm_head_override->group_size;
    h.sym = lm_head_override->sym;
    h.desc_act = lm_head_override->desc_act;
  }
  h.lm_head = false;
  h.lm_head_override.reset();
  return h;
}

// ---- quantization_config ---------------------------------------------------------------

namespace {

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// An optional integer key: `dflt` when missing or null.
int64_t json_int(const nlohmann::json& j, const char* key, int64_t dflt, const std::string& where) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return dflt;
  TESSERA_CHECK(json_int_in(*it, -(int64_t{1} << 40), int64_t{1} << 40), where, ".", key,
                ": expected an integer, got ", json_brief(*it));
  return it->get<int64_t>();
}

// meta.quantizer (AutoGPTQ: a string, GPTQModel: a list): "tessera:NAME" is ours.
std::string quantizer_of(const nlohmann::json& j, const std::string& where) {
  std::string quantizer;
  if (const auto it = j.find("meta"); it != j.end() && !it->is_null()) {
    TESSERA_CHECK(it->is_object(), where, ".meta: expected an object, got ", json_brief(*it));
    std::vector<std::string> names;
    if (const auto q = it->find("quantizer"); q != it->end() && !q->is_null()) {
      TESSERA_CHECK(q->is_string() || q->is_array(), where, ".meta.quantizer: expected a string or a list, got ",
                    json_brief(*q));
      for (const auto& v : q->is_string() ? nlohmann::json::array({*q}) : *q) {
        TESSERA_CHECK(v.is_string(), where, ".meta.quantizer: expected strings, got ", json_brief(v));
        names.push_back(v.get<std::string>());
      }
    }
    for (const auto& n : names)
      if (n.rfind("tessera:", 0) == 0 && quantizer.empty()) quantizer = n.substr(8);
    if (quantizer.empty() && !names.empty()) quantizer = names[0];
  }
  return quantizer;
}

// llm-compressor's schemes vLLM runs that Tessera runs too, one config group targeting
// Linear: W8A8 int8 ("int-quantized": int8 symmetric weights per output channel, int8
// symmetric activations per token at run time; CompressedTensorsW8A8Int8) and fp8 weights
// ("float-quantized": e4m3 per output channel, per tensor or per group, with no activation
// quantization or dynamic fp8 per token, which runs here with float activations; the FP8
// and FP8_DYNAMIC presets). Anything else names its field.
QuantCheckpointFormat parse_compressed_tensors(const nlohmann::json& j, const std::string& where) {
  QuantCheckpointFormat f;
  f.method = kCompressedTensors;
  f.bits = 8, f.group_size = -1, f.sym = true;
  const auto get = [](const nlohmann::json& obj, const char* key) {
    const auto it = obj.find(key);
    return it == obj.end() ? nlohmann::json(nullptr) : *it;
  };
  const nlohmann::json format = get(j, "format");
  TESSERA_CHECK(format == "int-quantized" || format == "float-quantized", where, ".format = ", json_brief(format),
                " is not supported (\"int-quantized\": W8A8 int8, or \"float-quantized\": fp8 weights)");
  f.fp8 = format == "float-quantized";
  const std::string scheme = f.fp8 ? "fp8 e4m3 weights per channel, tensor or group; activations float or dynamic "
                                     "fp8 per token"
                                   : "W8A8 int8, per-channel weights, per-token dynamic activations";
  const auto need = [&](const nlohmann::json& obj, const std::string& path, const char* key,
                        const nlohmann::json& want) {
    const nlohmann::json got = get(obj, key);
    TESSERA_CHECK(got == want, where, ".", path, path.empty() ? "" : ".", key, " = ", json_brief(got),
                  " is not supported (", json_brief(want), ": ", scheme, ")");
  };
  if (const auto it = j.find("quantization_status"); it != j.end() && !it->is_null())
    need(j, "", "quantization_status", "compressed");
  if (const auto it = j.find("kv_cache_scheme"); it != j.end())
    TESSERA_CHECK(it->is_null(), where, ".kv_cache_scheme = ", json_brief(*it),
                  " is not supported (null: the KV cache dtype is a serving flag here)");
  const auto groups = j.find("config_groups");
  TESSERA_CHECK(groups != j.end() && groups->is_object() && groups->size() == 1, where,
                ".config_groups: expected one group, got ",
                groups == j.end() ? std::string("nothing") : json_brief(*groups));
  const std::string g = "config_groups." + groups->begin().key();
  const nlohmann::json& grp = groups->begin().value();
  TESSERA_CHECK(grp.is_object(), where, ".", g, ": expected an object, got ", json_brief(grp));
  need(grp, g, "targets", nlohmann::json::array({"Linear"}));
  const std::string type = f.fp8 ? "float" : "int";
  for (const char* side : {"weights", "input_activations"}) {
    const bool w = std::string(side) == "weights";
    const auto it = grp.find(side);
    const std::string path = g + "." + side;
    if (!w && f.fp8 && (it == grp.end() || it->is_null())) continue;  // weight-only fp8
    TESSERA_CHECK(it != grp.end() && it->is_object(), where, ".", path, ": expected an object (", scheme, ")");
    need(*it, path, "num_bits", 8);
    need(*it, path, "type", type);
    need(*it, path, "symmetric", true);
    need(*it, path, "dynamic", !w);
    const nlohmann::json strategy = get(*it, "strategy");
    if (w && f.fp8 && strategy == "group") {
      const nlohmann::json gs = get(*it, "group_size");
      TESSERA_CHECK(json_int_in(gs, 1, int64_t{1} << 30), where, ".", path, ".group_size = ", json_brief(gs),
                    " is not a positive number of input features");
      f.group_size = gs.get<int64_t>();
      continue;
    }
    if (w && f.fp8 && strategy == "tensor") {  // one scale: read as per channel
      if (const auto gs = it->find("group_size"); gs != it->end()) need(*it, path, "group_size", nullptr);
      continue;
    }
    need(*it, path, "strategy", w ? "channel" : "token");
    if (const auto gs = it->find("group_size"); gs != it->end()) need(*it, path, "group_size", nullptr);
    if (!w) f.fp8_activations = f.fp8;
  }
  if (const auto it = grp.find("output_activations"); it != grp.end())
    need(grp, g, "output_activations", nullptr);
  if (const auto it = j.find("ignore"); it != j.end() && !it->is_null()) {
    TESSERA_CHECK(it->is_array(), where, ".ignore: expected a list of module names, got ", json_brief(*it));
    for (const auto& m : *it)
      TESSERA_CHECK(m.is_string() && m.get<std::string>() == "lm_head", where, ".ignore: ", json_brief(m),
                    " is not supported (only lm_head stays unquantized here)");
  }
  f.quantizer = quantizer_of(j, where);
  return f;
}

// GPTQModel's per-module rules, "dynamic": {"+:REGEX" (or "REGEX"): {overrides}, "-:REGEX":
// {}} matched from the start of a module's name (Python's re.match), as GPTQModel and vLLM
// apply them. Rules for lm_head alone are read (its bits, group_size, sym, desc_act, or
// "-:" leaving it float); a rule that reaches the block's modules is a one-line error.
void parse_dynamic(const nlohmann::json& j, QuantCheckpointFormat& f, const std::string& where) {
  const auto it = j.find("dynamic");
  if (it == j.end() || it->is_null()) return;
  TESSERA_CHECK(it->is_object(), where, ".dynamic: expected an object of module rules, got ", json_brief(*it));
  for (const auto& [key, rule] : it->items()) {
    const std::string path = where + ".dynamic[\"" + key + "\"]";
    const bool negative = key.rfind("-:", 0) == 0;
    const std::string pattern = negative || key.rfind("+:", 0) == 0 ? key.substr(2) : key;
    std::regex re;
    try {
      re = std::regex(pattern, std::regex::ECMAScript);
    } catch (const std::regex_error&) {
      fail(path, ": '", pattern, "' is not a regular expression");
    }
    const auto matches = [&](const char* name) {
      return std::regex_search(name, re, std::regex_constants::match_continuous);
    };
    TESSERA_CHECK(matches("lm_head"), path, ": per-module rules are read for lm_head only (this one does not "
                  "match lm_head)");
    for (const char* block : {"model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"})
      TESSERA_CHECK(!matches(block), path, ": per-module rules are read for lm_head only (this one also matches ",
                    block, ")");
    if (negative) {  // lm_head is skipped: it stays float
      f.lm_head = false;
      continue;
    }
    TESSERA_CHECK(rule.is_object(), path, ": expected an object of overrides, got ", json_brief(rule));
    QuantCheckpointFormat::ModuleOverride o{f.bits, f.group_size, f.sym, f.desc_act};
    for (const auto& [k, v] : rule.items()) {
      if (k == "bits") {
        TESSERA_CHECK(v == 4 || v == 8, path, ".bits = ", json_brief(v), " is not supported (4 or 8)");
        o.bits = v.get<int>();
      } else if (k == "group_size") {
        TESSERA_CHECK(json_int_in(v, -1, int64_t{1} << 30) && v != 0, path, ".group_size = ", json_brief(v),
                      " is not supported (-1 or a positive number of input features)");
        o.group_size = v.get<int64_t>();
      } else if (k == "sym" || k == "desc_act") {
        TESSERA_CHECK(v.is_boolean(), path, ".", k, ": expected true or false, got ", json_brief(v));
        (k == "sym" ? o.sym : o.desc_act) = v.get<bool>();
      } else {
        fail(path, ".", k, " is not supported (bits, group_size, sym, desc_act)");
      }
    }
    f.lm_head_override = o;
  }
}

}  // namespace

QuantCheckpointFormat parse_quantization_config(const nlohmann::json& j, const std::string& source) {
  const std::string where = source + ": quantization_config";
  TESSERA_CHECK(j.is_object(), where, ": expected an object, got ", json_brief(j));
  const auto unsupported = [&](const char* key, const std::string& want) {
    fail(where, ".", key, " = ", json_brief(j.at(key)), " is not supported (", want, ")");
  };
  QuantCheckpointFormat f;
  TESSERA_CHECK(j.contains("quant_method") && !j.at("quant_method").is_null(), where,
                ".quant_method is missing (gptq, awq or compressed-tensors)");
  f.method = lower(json_string(j, "quant_method", "", where));
  if (f.method == kCompressedTensors) return parse_compressed_tensors(j, where);
  if (f.method != "gptq" && f.method != "awq") unsupported("quant_method", "gptq, awq or compressed-tensors");
  const bool gptq = f.method == "gptq";

  // transformers' GPTQConfig requires bits; AwqConfig defaults to 4. Both default group 128.
  TESSERA_CHECK(!gptq || (j.contains("bits") && !j.at("bits").is_null()), where, ".bits is missing (4 or 8)");
  f.bits = static_cast<int>(std::clamp<int64_t>(json_int(j, "bits", 4, where), -1, 1 << 20));
  if (gptq && f.bits != 4 && f.bits != 8) unsupported("bits", "4 or 8");
  if (!gptq && f.bits != 4) unsupported("bits", "4 with quant_method awq");
  f.group_size = json_int(j, "group_size", 128, where);
  if (gptq && f.group_size != -1 && f.group_size <= 0)
    unsupported("group_size", "-1 or a positive number of input features");
  if (!gptq && f.group_size <= 0) unsupported("group_size", "a positive number of input features with awq");

  f.desc_act = json_bool(j, "desc_act", false, where);
  f.sym = json_bool(j, "sym", true, where);
  json_bool(j, "true_sequential", true, where);
  json_bool(j, "static_groups", false, where);
  if (json_bool(j, "is_marlin_format", false, where))
    unsupported("is_marlin_format", "false: Marlin's repacked layout is not read");
  if (const auto it = j.find("damp_percent"); it != j.end() && !it->is_null())
    TESSERA_CHECK(it->is_number() && it->get<double>() > 0 && it->get<double>() < 1, where,
                  ".damp_percent = ", json_brief(*it), " is not a number in (0, 1)");
  const std::string format = lower(json_string(j, "checkpoint_format", gptq ? "gptq" : "gemm", where));
  if (gptq) {
    if (format != "gptq" && format != "gptq_v2") unsupported("checkpoint_format", "gptq or gptq_v2");
    f.gptq_version = format == "gptq_v2" ? 2 : 1;
  } else {
    if (format != "gemm") unsupported("checkpoint_format", "gemm with quant_method awq");
    if (lower(json_string(j, "version", "gemm", where)) != "gemm")
      unsupported("version", "gemm: AutoAWQ's GEMM layout");
    if (!json_bool(j, "zero_point", true, where))
      unsupported("zero_point", "true: AutoAWQ's GEMM layout has zero points");
    if (f.desc_act) unsupported("desc_act", "false with quant_method awq");
  }

  if (const auto it = j.find("modules_to_not_convert"); it != j.end() && !it->is_null()) {
    TESSERA_CHECK(it->is_array(), where, ".modules_to_not_convert: expected a list of module names, got ",
                  json_brief(*it));
    for (const auto& m : *it) {
      TESSERA_CHECK(m.is_string(), where, ".modules_to_not_convert: expected module names, got ",
                    json_brief(m));
      f.modules_to_not_convert.push_back(m.get<std::string>());
    }
  }
  if (gptq) {
    f.lm_head = json_bool(j, "lm_head", false, where);
    parse_dynamic(j, f, where);
    if (!f.lm_head) f.lm_head_override.reset();
  }
  f.quantizer = quantizer_of(j, where);
  return f;
}

nlohmann::json quantization_config_json(const QuantCheckpointFormat& f) {
  check_quant_format(f, "quantization_config");
  nlohmann::json j;
  auto not_convert = f.modules_to_not_convert.empty() ? nlohmann::json(nullptr)
                                                      : nlohmann::json(f.modules_to_not_convert);
  if (f.method == kCompressedTensors) {  // what llm-compressor writes for its W8A8 / FP8 schemes
    const auto args = [&](bool weights) {
      const bool group = weights && f.group_size > 0;
      return nlohmann::json{{"num_bits", 8},
                            {"type", f.fp8 ? "float" : "int"},
                            {"symmetric", true},
                            {"strategy", group ? "group" : weights ? "channel" : "token"},
                            {"dynamic", !weights},
                            {"group_size", group ? nlohmann::json(f.group_size) : nlohmann::json(nullptr)},
                            {"block_structure", nullptr},
                            {"actorder", nullptr},
                            {"observer", weights ? nlohmann::json("minmax") : nlohmann::json(nullptr)},
                            {"observer_kwargs", nlohmann::json::object()}};
    };
    const bool acts = !f.fp8 || f.fp8_activations;
    j = {{"quant_method", kCompressedTensors},
         {"format", f.fp8 ? "float-quantized" : "int-quantized"},
         {"quantization_status", "compressed"},
         {"config_groups",
          {{"group_0",
            {{"targets", {"Linear"}},
             {"weights", args(true)},
             {"input_activations", acts ? args(false) : nlohmann::json(nullptr)},
             {"output_activations", nullptr}}}}},
         {"ignore", {"lm_head"}},
         {"kv_cache_scheme", nullptr}};
  } else if (f.method == "awq") {  // what AutoAWQ's to_transformers_dict writes
    j = {{"quant_method", "awq"}, {"zero_point", true}, {"group_size", f.group_size},
         {"bits", 4},             {"version", "gemm"},  {"modules_to_not_convert", not_convert}};
  } else {  // AutoGPTQ's BaseQuantizeConfig.to_dict, less the search settings we have no value for
    j = {{"quant_method", "gptq"},
         {"bits", f.bits},
         {"group_size", f.group_size},
         {"desc_act", f.desc_act},
         {"static_groups", false},
         {"sym", f.sym},
         {"checkpoint_format", f.gptq_version == 2 ? "gptq_v2" : "gptq"},
         {"model_name_or_path", nullptr},
         {"model_file_base_name", "model"}};
    if (!not_convert.is_null()) j["modules_to_not_convert"] = not_convert;
    if (f.lm_head) j["lm_head"] = true;
    if (f.lm_head && f.lm_head_override) {
      const auto& o = *f.lm_head_override;
      j["dynamic"] = {{"+:lm_head",
                       {{"bits", o.bits}, {"group_size", o.group_size}, {"sym", o.sym}, {"desc_act", o.desc_act}}}};
    }
  }
  if (!f.quantizer.empty())
    j["meta"] = {{"quantizer", nlohmann::json::array({f.quantizer.find(':') == std::string::npos
                                                          ? "tessera:" + f.quantizer
                                                          : f.quantizer})}};
  return j;
}

}  // namespace tessera::io
