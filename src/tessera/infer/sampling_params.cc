// SamplingParams' checks (find_error, validate), apart from the sampler's tensor code so
// that request parsers (serve/openai.cc, the fuzz targets) link without the engine.
#include "tessera/infer/sampler.h"

#include <cmath>

#include "tessera/base/error.h"
#include "tessera/infer/logit_bias.h"

namespace tessera::infer {
namespace {

constexpr int64_t kMaxN = 128;        // OpenAI's limit on n
constexpr int kMaxLogprobs = 20;      // OpenAI's limit on top_logprobs

template <typename... Args>
ParamError param_error(const char* field, Args&&... parts) {
  return {field, detail::concat(field, " ", std::forward<Args>(parts)...)};
}

}  // namespace

std::optional<ParamError> SamplingParams::find_error(int64_t vocab_size) const {
  // `!(a <= x && x <= b)` also rejects NaN.
  if (!(std::isfinite(temperature) && temperature >= 0.f))
    return param_error("temperature", "must be a finite number >= 0, got ", temperature);
  if (top_k < -1)
    return param_error("top_k", "must be -1 or 0 (off) or a positive count, got ", top_k);
  if (!(top_p > 0.f && top_p <= 1.f)) return param_error("top_p", "must be in (0, 1], got ", top_p);
  if (!(min_p >= 0.f && min_p <= 1.f)) return param_error("min_p", "must be in [0, 1], got ", min_p);
  if (!(std::isfinite(repetition_penalty) && repetition_penalty > 0.f))
    return param_error("repetition_penalty", "must be a finite number > 0, got ", repetition_penalty);
  if (!(presence_penalty >= -2.f && presence_penalty <= 2.f))
    return param_error("presence_penalty", "must be in [-2, 2], got ", presence_penalty);
  if (!(frequency_penalty >= -2.f && frequency_penalty <= 2.f))
    return param_error("frequency_penalty", "must be in [-2, 2], got ", frequency_penalty);
  if (max_tokens < 1) return param_error("max_tokens", "must be >= 1, got ", max_tokens);
  if (min_tokens < 0) return param_error("min_tokens", "must be >= 0, got ", min_tokens);
  if (min_tokens > max_tokens)
    return param_error("min_tokens", "must be <= max_tokens (", max_tokens, "), got ", min_tokens);
  for (size_t i = 0; i < stop.size(); ++i)
    if (stop[i].empty()) return param_error("stop", "entry ", i, " is an empty string");
  for (size_t i = 0; i < stop_token_ids.size(); ++i) {
    const int32_t t = stop_token_ids[i];
    if (t < 0 || (vocab_size > 0 && t >= vocab_size))
      return param_error("stop_token_ids", "entry ", i, " is ", t, ", outside the vocabulary [0, ",
                         vocab_size > 0 ? std::to_string(vocab_size) : std::string("V"), ")");
  }
  if (n < 1 || n > kMaxN) return param_error("n", "must be in [1, ", kMaxN, "], got ", n);
  // OpenAI accepts this and returns n equal choices; we follow vLLM's earlier rule and reject
  // it, since it is almost always a mistake that costs n times the compute for one answer.
  if (n > 1 && is_greedy() && !use_beam_search)
    return param_error("n", "must be 1 with greedy sampling (temperature 0): all ", n,
                       " samples would be identical");
  if (logprobs && (*logprobs < 0 || *logprobs > kMaxLogprobs))
    return param_error("logprobs", "must be in [0, ", kMaxLogprobs, "], got ", *logprobs);
  if (auto e = find_logit_bias_error(*this, vocab_size)) return e;  // logit_bias, prompt_logprobs
  if (auto e = find_beam_error()) return e;
  return std::nullopt;
}

// Beam search (vLLM's rules for use_beam_search / best_of / length_penalty): the search ranks
// raw log-probabilities, so every field that would reshape or sample the distribution is
// refused by name rather than silently ignored.
std::optional<ParamError> SamplingParams::find_beam_error() const {
  if (best_of < 0 || best_of > kMaxN)
    return param_error("best_of", "must be in [1, ", kMaxN, "] (or 0: n), got ", best_of);
  if (best_of > 0 && best_of < n)
    return param_error("best_of", "must be >= n (", n, "), got ", best_of);
  if (!std::isfinite(length_penalty))
    return param_error("length_penalty", "must be a finite number, got ", length_penalty);
  if (!use_beam_search) {
    if (best_of > n)
      return param_error("best_of", "> n needs use_beam_search (best-of sampling is not supported), got ",
                         best_of, " with n ", n);
    if (length_penalty != 1.f)
      return param_error("length_penalty", "applies only to beam search (use_beam_search); must be 1, got ",
                         length_penalty);
    return std::nullopt;
  }
  const char* why = "is not supported with use_beam_search";
  if (!is_greedy()) return param_error("temperature", "must be 0 with use_beam_search, got ", temperature);
  if (top_p != 1.f) return param_error("top_p", "must be 1 with use_beam_search, got ", top_p);
  if (top_k > 0) return param_error("top_k", "must be 0 or -1 (off) with use_beam_search, got ", top_k);
  if (min_p != 0.f) return param_error("min_p", "must be 0 with use_beam_search, got ", min_p);
  if (repetition_penalty != 1.f) return param_error("repetition_penalty", why);
  if (presence_penalty != 0.f) return param_error("presence_penalty", why);
  if (frequency_penalty != 0.f) return param_error("frequency_penalty", why);
  if (min_tokens > 0) return param_error("min_tokens", why);
  if (!stop.empty()) return param_error("stop", why, " (stop_token_ids are)");
  if (logprobs) return param_error("logprobs", why);
  if (prompt_logprobs) return param_error("prompt_logprobs", why);
  if (!logit_bias.empty()) return param_error("logit_bias", why);
  if (!guided.empty()) return param_error("guided", "decoding (structured outputs) ", why);
  return std::nullopt;
}

void SamplingParams::validate(int64_t vocab_size) const {
  if (auto e = find_error(vocab_size)) fail_field(e->field, e->message);
}

}  // namespace tessera::infer
