// Sampling fields of a JSON request object into SamplingParams.
#include "tessera/infer/sampling_json.h"

#include <cfloat>
#include <cmath>

#include "tessera/infer/structured/guided.h"

namespace tessera::infer {
namespace {

// A double field as float: beyond float's range it saturates to +-inf (a plain cast would be
// undefined behaviour), which the range checks in find_error then reject by name.
float to_float(double v) {
  if (v > FLT_MAX) return INFINITY;
  if (v < -FLT_MAX) return -INFINITY;
  return static_cast<float>(v);
}

}  // namespace

SamplingParams sampling_params_from_json(const nlohmann::json& j, const std::string& where,
                                         int64_t default_max_tokens) {
  SamplingParams d;
  d.max_tokens = default_max_tokens;
  return sampling_params_from_json(j, where, d);
}

SamplingParams sampling_params_from_json(const nlohmann::json& j, const std::string& where,
                                         const SamplingParams& defaults) {
  TESSERA_CHECK(j.is_object(), where, ": a request must be a JSON object");
  SamplingParams p = defaults;
  if (auto v = optional_field<int64_t>(j, "max_tokens", where)) p.max_tokens = *v;
  if (auto v = optional_field<int64_t>(j, "max_completion_tokens", where)) p.max_tokens = *v;
  if (auto v = optional_field<double>(j, "temperature", where)) p.temperature = to_float(*v);
  if (auto v = optional_field<double>(j, "top_p", where)) p.top_p = to_float(*v);
  if (auto v = optional_field<int64_t>(j, "top_k", where)) p.top_k = *v;
  if (auto v = optional_field<double>(j, "min_p", where)) p.min_p = to_float(*v);
  if (auto v = optional_field<int64_t>(j, "n", where)) p.n = *v;
  if (auto v = optional_field<uint64_t>(j, "seed", where)) p.seed = *v;
  if (auto v = optional_field<double>(j, "presence_penalty", where)) p.presence_penalty = to_float(*v);
  if (auto v = optional_field<double>(j, "frequency_penalty", where)) p.frequency_penalty = to_float(*v);
  if (auto v = optional_field<double>(j, "repetition_penalty", where)) p.repetition_penalty = to_float(*v);
  if (auto v = optional_field<int64_t>(j, "min_tokens", where)) p.min_tokens = *v;
  if (auto v = optional_field<bool>(j, "ignore_eos", where)) p.ignore_eos = *v;
  if (auto it = j.find("logprobs"); it != j.end() && !it->is_null()) {
    // OpenAI chat: logprobs true + top_logprobs N; completions: logprobs N.
    if (it->is_boolean()) {
      if (it->get<bool>()) p.logprobs = static_cast<int>(optional_field<int64_t>(j, "top_logprobs", where).value_or(0));
    } else {
      if (!it->is_number_integer())
        fail_field("logprobs", where, ": 'logprobs' must be an integer or a boolean");
      if (it->get<int64_t>() < 0 || it->get<int64_t>() > 20)
        fail_field("logprobs", where, ": 'logprobs' must be in [0, 20]");
      p.logprobs = it->get<int>();
    }
  }
  if (auto it = j.find("stop"); it != j.end() && !it->is_null()) {
    if (it->is_string()) {
      p.stop = {it->get<std::string>()};
    } else {
      if (!it->is_array()) fail_field("stop", where, ": 'stop' must be a string or a list of strings");
      for (const auto& s : *it) {
        if (!s.is_string()) fail_field("stop", where, ": 'stop' must be a string or a list of strings");
        p.stop.push_back(s.get<std::string>());
      }
    }
  }
  if (auto it = j.find("stop_token_ids"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) fail_field("stop_token_ids", where, ": 'stop_token_ids' must be a list of token ids");
    for (const auto& s : *it) {
      if (!s.is_number_integer() || s.get<int64_t>() < 0 || s.get<int64_t>() > INT32_MAX)
        fail_field("stop_token_ids", where, ": 'stop_token_ids' must be a list of token ids");
      p.stop_token_ids.push_back(s.get<int32_t>());
    }
  }
  if (auto g = structured::guided_from_json(j, where)) p.guided = std::move(*g);
  if (const auto err = p.find_error()) fail_field(err->field, where, ": ", err->message);
  return p;
}

}  // namespace tessera::infer
