// OpenAI's logit_bias and vLLM's prompt_logprobs request fields: parsing from a request
// object, their checks, and adding the bias to a row of logits (Sampler::process).
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/infer/sampler.h"

namespace tessera::infer {

constexpr float kMaxLogitBias = 100.f;  // OpenAI: biases are in [-100, 100]

// j["logit_bias"]: an object mapping token ids written as decimal strings ("50256") to a
// number in [-100, 100], or null. Into p.logit_bias sorted by token. Keys that are not
// integer strings, duplicates ("7" and "07"), negative ids and values that are not finite
// numbers in range throw FieldError naming "logit_bias"; ids beyond the vocabulary are left
// to find_logit_bias_error (the parser does not know the vocabulary).
// j["prompt_logprobs"] (vLLM): an integer in [0, 20] or null, into p.prompt_logprobs.
void parse_logit_bias_fields(const nlohmann::json& j, const std::string& where, SamplingParams& p);

// The first problem of p.logit_bias / p.prompt_logprobs: a token outside [0, vocab_size)
// (vocab_size > 0), a repeated token, a bias outside [-100, 100] or NaN; prompt_logprobs
// outside [0, 20].
std::optional<ParamError> find_logit_bias_error(const SamplingParams& p, int64_t vocab_size);

// logits[t] += bias for every (t, bias) with t < vocab.
void apply_logit_bias(const std::vector<std::pair<int32_t, float>>& bias, float* logits, int64_t vocab);

}  // namespace tessera::infer
