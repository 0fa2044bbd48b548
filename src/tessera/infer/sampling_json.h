// Sampling fields of a JSON request object (OpenAI / vLLM names) into SamplingParams, for
// the server's request parser and offline request files; no engine or tensor code.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/infer/sampler.h"

namespace tessera::infer {

// Sampling fields of a request object with OpenAI / vLLM names: max_tokens,
// temperature, top_p, top_k, min_p, n, stop (string or list), stop_token_ids, seed,
// presence_penalty, frequency_penalty, repetition_penalty, logprobs, min_tokens,
// ignore_eos, logit_bias, prompt_logprobs (logit_bias.h), use_beam_search, best_of,
// length_penalty (use_beam_search without a temperature sets it to 0). Wrong types and
// invalid values throw naming `where` and the field.
// Errors are tessera::FieldError naming the field.
SamplingParams sampling_params_from_json(const nlohmann::json& j, const std::string& where,
                                         int64_t default_max_tokens = 16);
// The same with `defaults` for every field the object leaves out (a server's temperature 1).
SamplingParams sampling_params_from_json(const nlohmann::json& j, const std::string& where,
                                         const SamplingParams& defaults);

// j[key] as T, or nothing when the key is absent or null. A value of the wrong type throws
// FieldError naming `where` and the key; integers beyond int64 are "too large", not wrapped.
template <typename T>
std::optional<T> optional_field(const nlohmann::json& j, const char* key, const std::string& where) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if constexpr (std::is_same_v<T, bool>) {
    if (!it->is_boolean()) fail_field(key, where, ": '", key, "' must be true or false");
  } else if constexpr (std::is_unsigned_v<T>) {
    if (!it->is_number_unsigned()) fail_field(key, where, ": '", key, "' must be a non-negative integer");
  } else if constexpr (std::is_integral_v<T>) {
    if (!it->is_number_integer()) fail_field(key, where, ": '", key, "' must be an integer");
    // Out-of-range integers (beyond int64) arrive as unsigned; reject rather than wrap.
    if (it->is_number_unsigned() && it->template get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
      fail_field(key, where, ": '", key, "' is too large");
  } else if constexpr (std::is_floating_point_v<T>) {
    if (!it->is_number()) fail_field(key, where, ": '", key, "' must be a number");
  }
  return it->template get<T>();
}

}  // namespace tessera::infer
