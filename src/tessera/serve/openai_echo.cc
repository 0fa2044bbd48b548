// echo and prompt_logprobs for the OpenAI endpoints (see openai_echo.h).
#include "tessera/serve/openai_echo.h"

#include <cmath>

namespace tessera::serve {
namespace {

using nlohmann::json;

double finite(float x) { return std::isfinite(x) ? x : -9999.0; }  // as openai.cc: JSON has no -inf

// The prompt's entries by position (entry 0 and any the engine did not report: null).
const infer::PromptLogprob* entry(const std::vector<infer::PromptLogprob>& lps, size_t i) {
  return i >= 1 && i - 1 < lps.size() ? &lps[i - 1] : nullptr;
}

}  // namespace

void parse_echo(const json& b, const ModelInfo& m, ApiRequest& r) {
  r.prompt_logprobs = r.params.prompt_logprobs.has_value();
  auto it = b.find("echo");
  if (it == b.end() || it->is_null()) return;
  if (!it->is_boolean()) bad_request("echo", "echo must be true or false");
  if (!it->get<bool>()) return;
  if (r.endpoint != Endpoint::kCompletions) bad_request("echo", "echo is only supported by /v1/completions");
  r.echo = true;
  // Text prompts as sent; token-id prompts as the tokenizer decodes them (the prompts were
  // checked already: the shapes below are the ones completion_prompts accepted).
  auto text_of = [&](const json& p, size_t i) -> std::string {
    if (p.is_string()) return p.get<std::string>();
    if (!m.tokenizer) bad_request("echo", "echo of a token-id prompt needs the served model's tokenizer");
    try {
      return m.tokenizer->decode(r.prompts.at(i));
    } catch (const Error& e) {
      bad_request("prompt", std::string("prompt cannot be detokenized for echo: ") + e.what());
    }
  };
  const json& p = b["prompt"];
  if (p.is_string() || (p.is_array() && !p.empty() && p[0].is_number_integer())) {
    r.echo_texts.push_back(text_of(p, 0));
  } else {
    for (size_t i = 0; i < p.size(); ++i) r.echo_texts.push_back(text_of(p[i], i));
  }
  // With logprobs the prompt tokens' logprobs come too (vLLM: prompt_logprobs = logprobs).
  if (r.params.logprobs && !r.params.prompt_logprobs) r.params.prompt_logprobs = *r.params.logprobs;
}

json prompt_logprobs_json(const std::vector<int32_t>& prompt, const std::vector<infer::PromptLogprob>& lps,
                          const io::Tokenizer* tok) {
  json out = json::array();
  for (size_t i = 0; i < prompt.size(); ++i) {
    const infer::PromptLogprob* e = entry(lps, i);
    if (!e) {
      out.push_back(nullptr);
      continue;
    }
    json d = json::object();
    int64_t rank = 1;
    for (const auto& t : e->top)
      d[std::to_string(t.token)] = {{"logprob", finite(t.logprob)}, {"rank", rank++},
                                    {"decoded_token", logprob_token_text(tok, t.token)}};
    d[std::to_string(e->token)] = {{"logprob", finite(e->logprob)}, {"rank", e->rank},
                                   {"decoded_token", logprob_token_text(tok, e->token)}};
    out.push_back(std::move(d));
  }
  return out;
}

json echo_prompt_logprobs(const std::vector<int32_t>& prompt, const std::vector<infer::PromptLogprob>& lps,
                          const io::Tokenizer* tok) {
  json tokens = json::array(), token_lps = json::array(), tops = json::array(), offsets = json::array();
  int64_t offset = 0;
  for (size_t i = 0; i < prompt.size(); ++i) {
    const std::string t = logprob_token_text(tok, prompt[i]);
    tokens.push_back(t);
    offsets.push_back(offset);
    offset += static_cast<int64_t>(t.size());
    const infer::PromptLogprob* e = entry(lps, i);
    if (!e) {
      token_lps.push_back(nullptr);
      tops.push_back(nullptr);
      continue;
    }
    token_lps.push_back(finite(e->logprob));
    json top = json::object();
    for (const auto& a : e->top) top[logprob_token_text(tok, a.token)] = finite(a.logprob);
    tops.push_back(std::move(top));
  }
  return {{"tokens", tokens}, {"token_logprobs", token_lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

void append_completion_logprobs(json& a, const json& b) {
  for (const char* k : {"tokens", "token_logprobs", "top_logprobs", "text_offset"})
    for (const auto& v : b[k]) a[k].push_back(v);
}

}  // namespace tessera::serve
