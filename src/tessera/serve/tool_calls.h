// Tool calling (OpenAI `tools` / `tool_choice`, as vLLM serves it): the request's tools checked
// and handed to the chat template, forced choices turned into a JSON schema for structured
// output, and the model's tool-call text (Hermes `<tool_call>` blocks or Llama 3.1 JSON) parsed
// into OpenAI `tool_calls`, whole or as stream deltas. See docs/serving.md, "Tool calling".
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/infer/sampler.h"
#include "tessera/serve/jinja.h"

namespace tessera::serve {

// How the model writes a tool call (vLLM's --tool-call-parser names).
enum class ToolParser {
  kNone,       // tools are answered as plain text
  kHermes,     // <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, several allowed (Qwen 2.5/3, Hermes)
  kLlama3Json  // [<|python_tag|>]{"name": ..., "parameters": {...}}; {...} (Llama 3.1 / 3.2)
};

// The parser `--tool-call-parser NAME` selects: "hermes", "llama3_json", "none", or "auto" (read
// from the chat template, detect_tool_parser). Throws tessera::Error naming the flag otherwise.
ToolParser select_tool_parser(const std::string& name, const std::string& template_source);
// "<tool_call>" in the template: hermes; "<|python_tag|>" or "ipython": llama3_json; else none.
ToolParser detect_tool_parser(const std::string& template_source);
const char* tool_parser_name(ToolParser p);
// The start-up line saying how tool calls will be read.
std::string tool_parser_summary(const std::string& flag, ToolParser p);

enum class ToolChoice { kNone, kAuto, kRequired, kNamed };

// A chat request's tool fields, validated.
struct ToolRequest {
  jinja::Value tools;               // the request's `tools`, key order kept; null when none
  std::vector<std::string> names;   // their function names, in order
  ToolChoice choice = ToolChoice::kNone;
  std::string named;                // kNamed: the function's name
  bool parallel = true;             // parallel_tool_calls: false keeps the first call only
  ToolParser parser = ToolParser::kNone;  // how kAuto output is read (the server's parser)
  // The output is read for tool calls (auto with a parser, required, or a named function).
  bool active() const {
    return choice == ToolChoice::kRequired || choice == ToolChoice::kNamed ||
           (choice == ToolChoice::kAuto && parser != ToolParser::kNone);
  }
};

// `tools`, `tool_choice` and `parallel_tool_calls` of a chat body (key order kept). Throws
// ApiError (400 naming the field, e.g. tools[1].function.name).
ToolRequest parse_tool_request(const nlohmann::ordered_json& body, ToolParser server_parser);
// The structured-output constraint that enforces a forced choice, as vLLM builds it: a named
// function's parameters schema (the whole output is the arguments), or for "required" an
// array (minItems 1) of {"name": enum, "parameters": schema} objects, one anyOf branch per tool.
// Empty for none / auto.
infer::GuidedDecoding forced_tool_guided(const ToolRequest& t);
// Checks a chat message's tool fields and copies them into the template's message `out`:
// an assistant's `tool_calls` (each function's `arguments` JSON text parsed into an object, as
// vLLM hands them to templates) and a tool message's `tool_call_id`. `where`: "messages[3]".
void add_message_tool_fields(const nlohmann::ordered_json& m, const std::string& where, jinja::Value& out);

struct ToolCall {
  std::string id;         // "call_" + 24 random characters
  std::string name;
  std::string arguments;  // JSON text, as the model wrote it
};

// A finished output read for tool calls. content: the text outside the calls (null when that
// is empty and there are calls, or for forced choices).
struct ParsedToolOutput {
  std::optional<std::string> content;
  std::vector<ToolCall> calls;
};
ParsedToolOutput parse_tool_output(const ToolRequest& t, const std::string& text);

// OpenAI's message.tool_calls array.
nlohmann::json tool_calls_json(const std::vector<ToolCall>& calls);
// finish_reason once tool calls were read: "tool_calls" when calls were found in a stopped
// auto or required output (vLLM: a named function keeps "stop"); otherwise `finish`.
std::string tool_finish_reason(const ToolRequest& t, bool called, const std::string& finish);
std::string new_tool_call_id();

// Reads a streamed output for tool calls. Text that may begin a call is held back; a call is
// sent as {index, id, type, function: {name, arguments: ""}} once its name is known, then its
// arguments as they arrive. The deltas add up to parse_tool_output's result for well-formed
// calls; a call whose JSON breaks after its name was sent cannot be taken back (it ends there).
class ToolStreamParser {
 public:
  explicit ToolStreamParser(const ToolRequest& t);
  ~ToolStreamParser();
  ToolStreamParser(ToolStreamParser&&) noexcept;
  struct Delta {
    std::string content;
    nlohmann::json tool_calls = nlohmann::json::array();  // OpenAI delta.tool_calls entries
    bool empty() const { return content.empty() && tool_calls.empty(); }
  };
  Delta feed(std::string_view text);
  Delta finish();          // the end of the output: held-back text and an unclosed call
  int64_t calls() const;   // calls sent so far

 private:
  friend ParsedToolOutput parse_tool_output(const ToolRequest& t, const std::string& text);
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace tessera::serve
