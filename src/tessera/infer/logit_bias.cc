// logit_bias and prompt_logprobs: parsing, checks, and the bias itself (see logit_bias.h).
#include "tessera/infer/logit_bias.h"

#include <algorithm>
#include <charconv>
#include <cfloat>
#include <cmath>

#include "tessera/base/error.h"
#include "tessera/io/json_file.h"

namespace tessera::infer {
namespace {

constexpr int kMaxPromptLogprobs = 20;  // as logprobs (OpenAI's top_logprobs limit)

// A key shown in an error: at most 40 bytes, so a megabyte key does not make a megabyte message.
std::string brief_key(const std::string& k) { return k.size() <= 40 ? k : k.substr(0, 40) + "..."; }

}  // namespace

void parse_logit_bias_fields(const nlohmann::json& j, const std::string& where, SamplingParams& p) {
  if (auto it = j.find("prompt_logprobs"); it != j.end() && !it->is_null()) {
    if (!io::json_int_in(*it, 0, kMaxPromptLogprobs))
      fail_field("prompt_logprobs", where, ": 'prompt_logprobs' must be an integer in [0, ", kMaxPromptLogprobs,
                 "], got ", io::json_brief(*it));
    p.prompt_logprobs = it->get<int>();
  }
  auto it = j.find("logit_bias");
  if (it == j.end() || it->is_null()) return;
  if (!it->is_object())
    fail_field("logit_bias", where, ": 'logit_bias' must be an object mapping token ids (strings) to biases in "
               "[-100, 100], got ", io::json_brief(*it));
  std::vector<std::pair<int32_t, float>> bias;
  bias.reserve(it->size());
  for (const auto& [key, value] : it->items()) {
    int64_t id = -1;
    const char* end = key.data() + key.size();
    const auto [ptr, ec] = std::from_chars(key.data(), end, id);
    if (key.empty() || ptr != end || (ec != std::errc() && ec != std::errc::result_out_of_range))
      fail_field("logit_bias", where, ": 'logit_bias' key '", brief_key(key), "' is not a token id (a decimal "
                 "integer string such as \"50256\")");
    if (ec == std::errc::result_out_of_range || id < 0 || id > INT32_MAX)
      fail_field("logit_bias", where, ": 'logit_bias' key '", brief_key(key), "' is outside the vocabulary");
    if (!value.is_number())
      fail_field("logit_bias", where, ": 'logit_bias' value of token ", id, " must be a number in [-100, 100], got ",
                 io::json_brief(value));
    const double v = value.get<double>();
    if (!(v >= -kMaxLogitBias && v <= kMaxLogitBias))
      fail_field("logit_bias", where, ": 'logit_bias' value of token ", id, " must be in [-100, 100], got ",
                 io::json_brief(value));
    bias.emplace_back(static_cast<int32_t>(id), static_cast<float>(v));
  }
  std::sort(bias.begin(), bias.end());
  for (size_t i = 1; i < bias.size(); ++i)
    if (bias[i].first == bias[i - 1].first)
      fail_field("logit_bias", where, ": 'logit_bias' names token ", bias[i].first, " twice");
  p.logit_bias = std::move(bias);
}

std::optional<ParamError> find_logit_bias_error(const SamplingParams& p, int64_t vocab_size) {
  auto error = [](const char* field, std::string message) {
    return ParamError{field, std::string(field) + " " + message};
  };
  if (p.prompt_logprobs && (*p.prompt_logprobs < 0 || *p.prompt_logprobs > kMaxPromptLogprobs))
    return error("prompt_logprobs", "must be in [0, " + std::to_string(kMaxPromptLogprobs) + "], got " +
                                        std::to_string(*p.prompt_logprobs));
  if (p.logit_bias.empty()) return std::nullopt;
  std::vector<int32_t> ids;
  ids.reserve(p.logit_bias.size());
  for (const auto& [t, b] : p.logit_bias) {
    if (t < 0 || (vocab_size > 0 && t >= vocab_size))
      return error("logit_bias", "has token " + std::to_string(t) + ", outside the vocabulary [0, " +
                                     (vocab_size > 0 ? std::to_string(vocab_size) : std::string("V")) + ")");
    if (!(b >= -kMaxLogitBias && b <= kMaxLogitBias))
      return error("logit_bias", "value of token " + std::to_string(t) + " must be in [-100, 100], got " +
                                     std::to_string(b));
    ids.push_back(t);
  }
  std::sort(ids.begin(), ids.end());
  if (auto d = std::adjacent_find(ids.begin(), ids.end()); d != ids.end())
    return error("logit_bias", "names token " + std::to_string(*d) + " twice");
  return std::nullopt;
}

void apply_logit_bias(const std::vector<std::pair<int32_t, float>>& bias, float* logits, int64_t vocab) {
  for (const auto& [t, b] : bias)
    if (t >= 0 && t < vocab) logits[t] += b;
}

}  // namespace tessera::infer
