// Unknown request fields (issue 22): a misspelt field ("max_token", "logprob") silently did
// nothing. A field within two edits of one we read is a 400 with the suggestion; any other
// unknown field is ignored, as OpenAI and vLLM ignore fields they do not know (new OpenAI
// fields must not break requests), and named once on the server's stderr.
#include <algorithm>
#include <cstdio>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "tessera/base/strings.h"

#include "tessera/serve/openai.h"

namespace tessera::serve {
namespace {

// Every top-level field the completions and chat parsers read (or refuse by name).
const std::vector<std::string>& known_fields() {
  static const std::vector<std::string> k = {
      "model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
      "min_p", "n", "stop", "stop_token_ids", "seed", "presence_penalty", "frequency_penalty",
      "repetition_penalty", "logprobs", "top_logprobs", "min_tokens", "ignore_eos", "stream", "stream_options",
      "user", "echo", "suffix", "best_of", "use_beam_search", "length_penalty", "logit_bias", "prompt_logprobs",
      "response_format", "guided_json", "guided_regex", "guided_grammar", "guided_choice", "tools", "tool_choice",
      "parallel_tool_calls", "return_token_ids", "priority", "chat_template_kwargs", "add_generation_prompt",
      "continue_final_message", "skip_special_tokens", "spaces_between_special_tokens", "documents",
      // OpenAI fields that are accepted and have no effect here.
      "metadata", "store", "service_tier", "modalities", "reasoning_effort", "prediction", "audio",
      "web_search_options", "functions", "function_call", "safety_identifier", "prompt_cache_key",
      "verbosity"};
  return k;
}

using base::edit_distance;

}  // namespace

void check_request_fields(const nlohmann::json& body) {
  if (!body.is_object()) return;
  const auto& known = known_fields();
  for (const auto& [key, value] : body.items()) {
    if (std::find(known.begin(), known.end(), key) != known.end()) continue;
    std::string near;
    size_t best = 3;  // at most two edits
    for (const auto& k : known) {
      const size_t d = edit_distance(key, k);
      if (d < best && key.size() >= 3) best = d, near = k;
    }
    if (!near.empty())
      bad_request(key, "unknown field '" + key + "'; did you mean '" + near + "'?", "unknown_field");
    static std::mutex m;
    static std::set<std::string> warned;
    std::lock_guard<std::mutex> lock(m);
    if (warned.size() < 256 && warned.insert(key).second)
      std::fprintf(stderr, "tessera serve: ignoring unknown request field '%s'\n", key.c_str());
  }
}

}  // namespace tessera::serve
