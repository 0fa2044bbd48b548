// The OpenAI API's request and response schemas (completions and chat completions): parsing
// a JSON body into engine requests with every error naming its field, and building the
// response objects, stream chunks and logprobs in OpenAI's shapes.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/infer/engine.h"
#include "tessera/io/tokenizer.h"
#include "tessera/serve/chat_template.h"
#include "tessera/serve/tool_calls.h"

namespace tessera::serve {

// An error answered with `status` and {"error": {"message", "type", "param", "code"}}.
class ApiError : public Error {
 public:
  ApiError(int status, std::string type, std::string param, std::string code, const std::string& msg)
      : Error(msg), status(status), type(std::move(type)), param(std::move(param)), code(std::move(code)) {}
  int status;
  std::string type;   // "invalid_request_error", "authentication_error", ...
  std::string param;  // the field at fault ("" = null)
  std::string code;   // "" = null
};
// A 400 invalid_request_error naming `param`.
[[noreturn]] void bad_request(const std::string& param, const std::string& message,
                              const std::string& code = "");
nlohmann::json error_body(const std::string& message, const std::string& type,
                          const std::string& param, const std::string& code);

enum class Endpoint { kCompletions, kChat, kEmbeddings };

// What the parser needs to know about the served model.
struct ModelInfo {
  std::string name;                    // the served model id
  std::vector<std::string> adapters;   // LoRA adapter ids, in the model's lora_bank() order
  const io::Tokenizer* tokenizer = nullptr;  // null: token-id prompts only
  const ChatTemplate* chat_template = nullptr;
  int64_t max_model_len = 0;
  // Attention sinks (serve --attention-sinks S --window W): requests stream past the
  // context, so prompt and max_tokens are not held to max_model_len (at most kMaxStreamLen).
  bool streaming = false;
  static constexpr int64_t kMaxStreamLen = int64_t{1} << 40;
  int64_t vocab_size = 0;
  int64_t default_max_tokens = 16;     // completions without max_tokens
  ToolParser tool_parser = ToolParser::kNone;  // how tool calls are read (--tool-call-parser)
};

struct ApiRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  std::string model;  // the id the request named (the base model's when none)
  int32_t adapter = -1;  // its LoRA adapter's index in ModelInfo::adapters (-1: the base model)
  std::vector<std::vector<int32_t>> prompts;  // completions may batch prompts; chat has one
  infer::SamplingParams params;
  bool stream = false;
  bool include_usage = false;      // stream_options.include_usage
  bool continuous_usage = false;   // stream_options.continuous_usage_stats (vLLM)
  bool chat_logprobs = false;      // chat: logprobs true (top_logprobs in params.logprobs)
  bool return_token_ids = true;    // stream chunks carry "token_ids" (extension)
  bool echo = false;               // completions: each choice's text starts with its prompt
  bool echo_only = false;          // echo with max_tokens 0: the prompt alone, nothing generated
  std::vector<std::string> echo_texts;  // echo: per prompt, its text (as sent, or detokenized)
  bool prompt_logprobs = false;    // vLLM's prompt_logprobs field was given: the response has it
  std::string user;
  ToolRequest tools;               // chat: tools, tool_choice, parallel_tool_calls
  int64_t choices() const { return static_cast<int64_t>(prompts.size()) * params.n; }
};

// The request's "model" (absent or null: the base model's id), checked against the served
// ids; *adapter = its LoRA adapter's index (-1: the base model). Unknown: 404 model_not_found.
std::string resolve_model(const nlohmann::json& body, const ModelInfo& model, int32_t* adapter);

// Parses and validates a request body: types, ranges, model name, messages, prompt length
// plus max_tokens against the context. Throws ApiError (400 naming the param). `raw_body`, when
// given, is the body's text: chat reads `messages` and `tools` from it again with their key
// order kept, since templates print tools' JSON schemas and tool-call arguments in that order.
ApiRequest parse_request(const nlohmann::json& body, Endpoint endpoint, const ModelInfo& model,
                         const std::string& raw_body = "");
// Unknown top-level fields of a completions / chat body: one within two edits of a field we
// read is a 400 naming it with the suggestion ("max_token": did you mean "max_tokens"?);
// others are ignored (OpenAI's and vLLM's default) and named once on stderr.
void check_request_fields(const nlohmann::json& body);
// Parses JSON text; bad JSON (or invalid UTF-8) is a 400 naming the field when it can be found.
nlohmann::json parse_body(const std::string& text);

// Builders. `id` is the response id ("cmpl-..." / "chatcmpl-..."), `created` Unix seconds.
nlohmann::json usage_json(int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens);
// Logprobs of new tokens: completions' {"tokens", "token_logprobs", "top_logprobs",
// "text_offset"} (text_offset starting at `offset`), or chat's {"content": [...]}.
nlohmann::json completion_logprobs(const std::vector<infer::SampleResult>& lps,
                                   const io::Tokenizer* tok, int64_t offset);
// A token as logprobs show it: its text when whole UTF-8, else vLLM's "bytes:\xNN" form.
std::string logprob_token_text(const io::Tokenizer* tok, int32_t id);
nlohmann::json chat_logprobs(const std::vector<infer::SampleResult>& lps, const io::Tokenizer* tok);

}  // namespace tessera::serve
