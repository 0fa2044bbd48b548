// Completions' `echo` (the prompt before the completion, in the text and, with logprobs, in
// the logprobs: OpenAI's legacy scoring idiom) and vLLM's `prompt_logprobs` field: request
// parsing and the response parts built from the engine's prompt log-probabilities.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/infer/engine.h"
#include "tessera/serve/openai.h"

namespace tessera::serve {

// Reads `echo` (completions only; a 400 for chat) into r.echo and r.echo_texts (a string
// prompt as sent, a token-id prompt detokenized), and notes whether prompt_logprobs was
// asked for. Echo with logprobs N asks the engine for the prompt's logprobs (N
// alternatives) unless prompt_logprobs says otherwise, as vLLM does. Runs after the prompts
// are parsed.
void parse_echo(const nlohmann::json& body, const ModelInfo& model, ApiRequest& r);

// vLLM's prompt_logprobs: [null, {"<id>": {"logprob", "rank", "decoded_token"}, ...}, ...],
// one entry per prompt token (the first has none); each dict holds the prompt token and its
// top alternatives.
nlohmann::json prompt_logprobs_json(const std::vector<int32_t>& prompt,
                                    const std::vector<infer::PromptLogprob>& lps, const io::Tokenizer* tok);

// OpenAI completions logprobs of the echoed prompt: {"tokens", "token_logprobs",
// "top_logprobs", "text_offset"} with null for the first token (nothing precedes it);
// text_offset from 0.
nlohmann::json echo_prompt_logprobs(const std::vector<int32_t>& prompt,
                                    const std::vector<infer::PromptLogprob>& lps, const io::Tokenizer* tok);

// Appends the four lists of completions logprobs `b` to `a`.
void append_completion_logprobs(nlohmann::json& a, const nlohmann::json& b);

}  // namespace tessera::serve
