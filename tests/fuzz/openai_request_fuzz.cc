// libFuzzer target: an OpenAI API request body through parse_body and parse_request, as the
// server runs them. The first byte picks the endpoint (odd: chat completions; bit 1 set on
// an even byte: embeddings, parse_embedding_request; else completions); the rest is the body. ApiError (a tessera::Error) is the expected failure;
// any other exception, a sanitizer report or a broken invariant of an accepted request is a bug.
// An accepted request that reads tool calls also reads the body's text as if the model wrote
// it, whole and streamed in two pieces.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "tessera/serve/chat_template.h"
#include "tessera/serve/embeddings.h"
#include "tessera/serve/openai.h"

namespace {

using namespace tessera;

const serve::ModelInfo& model_info() {
  static const serve::ChatTemplate chat = serve::ChatTemplate::chatml();
  static const serve::ModelInfo info = [] {
    serve::ModelInfo m;
    m.name = "fuzz-model";
    m.tokenizer = &fuzz::tiny_tokenizer();
    m.chat_template = &chat;
    m.max_model_len = 512;
    m.vocab_size = m.tokenizer->vocab_size();
    m.default_max_tokens = 16;
    m.tool_parser = serve::ToolParser::kHermes;
    return m;
  }();
  return info;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const serve::ModelInfo& m = model_info();
  const serve::Endpoint endpoint = (data[0] & 1) ? serve::Endpoint::kChat : serve::Endpoint::kCompletions;
  const std::string text(reinterpret_cast<const char*>(data) + 1, size - 1);
  if ((data[0] & 3) == 2) {  // embeddings
    serve::ApiRequest r;
    bool base64 = false;
    try {
      r = serve::parse_embedding_request(serve::parse_body(text), m, 64, &base64);
    } catch (const Error&) {
      return 0;
    } catch (...) {
      fuzz::unexpected_exception();
    }
    if (r.prompts.empty() || static_cast<int64_t>(r.prompts.size()) > serve::kMaxEmbeddingInputs)
      fuzz::invariant_failed("embedding inputs out of [1, 2048]");
    for (const auto& p : r.prompts) {
      if (p.empty() || static_cast<int64_t>(p.size()) > m.max_model_len) fuzz::invariant_failed("input length");
      for (int32_t id : p)
        if (id < 0 || id >= m.vocab_size) fuzz::invariant_failed("input token id outside the vocabulary");
    }
    return 0;
  }
  serve::ApiRequest r;
  try {
    const nlohmann::json body = serve::parse_body(text);
    r = serve::parse_request(body, endpoint, m, text);
  } catch (const Error&) {
    return 0;
  } catch (...) {
    fuzz::unexpected_exception();
  }
  // Accepted: what the engine is promised.
  if (r.prompts.empty()) fuzz::invariant_failed("no prompts");
  if (endpoint == serve::Endpoint::kChat && r.prompts.size() != 1) fuzz::invariant_failed("chat with != 1 prompt");
  for (const auto& p : r.prompts) {
    if (p.empty()) fuzz::invariant_failed("empty prompt");
    for (int32_t id : p)
      if (id < 0 || id >= m.vocab_size) fuzz::invariant_failed("token id " + std::to_string(id) + " outside the vocabulary");
    if (static_cast<int64_t>(p.size()) + r.params.max_tokens > m.max_model_len)
      fuzz::invariant_failed("prompt + max_tokens exceeds max_model_len");
  }
  if (const auto e = r.params.find_error(m.vocab_size)) fuzz::invariant_failed("params accepted but " + e->message);
  if (r.choices() < 1 || r.choices() > 512) fuzz::invariant_failed("choices out of [1, 512]");
  if (r.echo && r.echo_texts.size() != r.prompts.size()) fuzz::invariant_failed("echo without a text per prompt");
  if (r.echo && endpoint == serve::Endpoint::kChat) fuzz::invariant_failed("echo accepted for chat");
  if (r.tools.active()) {
    try {
      const auto whole = serve::parse_tool_output(r.tools, text);
      serve::ToolStreamParser stream(r.tools);
      stream.feed(std::string_view(text).substr(0, text.size() / 2));
      stream.feed(std::string_view(text).substr(text.size() / 2));
      stream.finish();
      if (!r.tools.parallel && whole.calls.size() > 1) fuzz::invariant_failed("two calls without parallel_tool_calls");
      if (!r.tools.parallel && stream.calls() > 1) fuzz::invariant_failed("two streamed calls without parallel_tool_calls");
    } catch (...) {
      fuzz::unexpected_exception();
    }
  }
  return 0;
}
