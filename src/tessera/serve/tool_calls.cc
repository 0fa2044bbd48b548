// Tool calling, the request side: --tool-call-parser, the `tools` / `tool_choice` fields, the
// messages' tool fields, and the JSON schema that enforces a forced choice.
#include "tessera/serve/tool_calls.h"

#include <algorithm>
#include <random>

#include "tessera/base/error.h"
#include "tessera/infer/structured/convert.h"
#include "tessera/io/json_file.h"
#include "tessera/serve/openai.h"

namespace tessera::serve {
namespace {

using ojson = nlohmann::ordered_json;

constexpr size_t kMaxTools = 128;        // OpenAI's limit
constexpr int kMaxArgumentsDepth = 64;   // as a request body

// io::json_brief for ordered values, never copying a structured one.
std::string brief(const ojson& v) {
  if (v.is_array()) return "an array of " + std::to_string(v.size()) + " items";
  if (v.is_object()) return "an object";
  return io::json_brief(nlohmann::json(v));
}

// OpenAI's rule for function names: 1-64 of a-z, A-Z, 0-9, '_' and '-'.
bool valid_function_name(const std::string& s) {
  return !s.empty() && s.size() <= 64 && std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
  });
}

// A function's parameters schema: {"type": "object", "properties": {}} when it gives none.
ojson parameters_of(const ojson& tool) {
  const ojson& fn = tool["function"];
  auto p = fn.find("parameters");
  if (p == fn.end() || p->is_null()) return ojson{{"type", "object"}, {"properties", ojson::object()}};
  return *p;
}

const ojson* find_tool(const ToolRequest& t, const std::string& name) {
  for (const auto& tool : t.tools)
    if (tool["function"]["name"] == name) return &tool;
  return nullptr;
}

}  // namespace

ToolParser detect_tool_parser(const std::string& src) {
  if (src.find("<tool_call>") != std::string::npos) return ToolParser::kHermes;
  if (src.find("<|python_tag|>") != std::string::npos || src.find("ipython") != std::string::npos)
    return ToolParser::kLlama3Json;
  return ToolParser::kNone;
}

ToolParser select_tool_parser(const std::string& name, const std::string& template_source) {
  if (name == "auto") return detect_tool_parser(template_source);
  if (name == "hermes") return ToolParser::kHermes;
  if (name == "llama3_json") return ToolParser::kLlama3Json;
  if (name == "none") return ToolParser::kNone;
  fail("--tool-call-parser '", name, "' is not one of auto, hermes, llama3_json, none");
}

const char* tool_parser_name(ToolParser p) {
  switch (p) {
    case ToolParser::kHermes: return "hermes";
    case ToolParser::kLlama3Json: return "llama3_json";
    case ToolParser::kNone: break;
  }
  return "none";
}

std::string tool_parser_summary(const std::string& flag, ToolParser p) {
  if (p != ToolParser::kNone)
    return std::string("tool calls are read with the ") + tool_parser_name(p) + " parser" +
           (flag == "auto" ? " (detected in the chat template)" : "");
  if (flag == "none") return "tool calls are not parsed (--tool-call-parser none): tools are answered as plain text";
  return "the chat template shows no tool-call format, so tools are answered as plain text (choose one with "
         "--tool-call-parser hermes|llama3_json); tool_choice \"required\" or a named function still work";
}

std::string new_tool_call_id() {
  static const char kChars[] = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
  thread_local std::mt19937_64 rng{std::random_device{}()};
  std::string id = "call_";
  for (int i = 0; i < 24; ++i) id += kChars[rng() % (sizeof kChars - 1)];
  return id;
}

ToolRequest parse_tool_request(const ojson& b, ToolParser server_parser) {
  ToolRequest t;
  t.parser = server_parser;
  if (auto it = b.find("tools"); it != b.end() && !it->is_null()) {
    if (!it->is_array())
      bad_request("tools", "tools must be a list of {\"type\": \"function\", \"function\": {...}} objects, got " +
                               brief(*it));
    if (it->size() > kMaxTools) bad_request("tools", "at most " + std::to_string(kMaxTools) + " tools");
    for (size_t i = 0; i < it->size(); ++i) {
      const ojson& tool = (*it)[i];
      const std::string where = "tools[" + std::to_string(i) + "]";
      if (!tool.is_object()) bad_request(where, where + " must be an object, got " + brief(tool));
      auto type = tool.find("type");
      if (type == tool.end() || *type != "function")
        bad_request(where + ".type", where + ".type must be \"function\"");
      auto fn = tool.find("function");
      if (fn == tool.end() || !fn->is_object())
        bad_request(where + ".function", where + ".function must be an object with name, description, parameters");
      auto name = fn->find("name");
      if (name == fn->end() || !name->is_string() || !valid_function_name(name->get<std::string>()))
        bad_request(where + ".function.name",
                    where + ".function.name must be 1-64 characters of a-z, A-Z, 0-9, '_' and '-'");
      const std::string n = name->get<std::string>();
      if (std::find(t.names.begin(), t.names.end(), n) != t.names.end())
        bad_request(where + ".function.name", "the function '" + n + "' is given twice in tools");
      if (auto d = fn->find("description"); d != fn->end() && !d->is_null() && !d->is_string())
        bad_request(where + ".function.description", where + ".function.description must be a string");
      if (auto p = fn->find("parameters"); p != fn->end() && !p->is_null() && !p->is_object())
        bad_request(where + ".function.parameters", where + ".function.parameters must be a JSON schema object");
      if (auto s = fn->find("strict"); s != fn->end() && !s->is_null() && !s->is_boolean())
        bad_request(where + ".function.strict", where + ".function.strict must be true or false");
      t.names.push_back(n);
    }
    if (!it->empty()) t.tools = *it;
  }
  const bool has_tools = !t.names.empty();
  t.choice = has_tools ? ToolChoice::kAuto : ToolChoice::kNone;
  if (auto it = b.find("tool_choice"); it != b.end() && !it->is_null()) {
    const char* kForms =
        "tool_choice must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}";
    std::string label;
    if (it->is_string()) {
      label = it->get<std::string>();
      if (label == "none") t.choice = ToolChoice::kNone;
      else if (label == "auto") t.choice = ToolChoice::kAuto;
      else if (label == "required") t.choice = ToolChoice::kRequired;
      else bad_request("tool_choice", std::string(kForms) + ", got " + brief(*it));
    } else if (it->is_object()) {
      auto type = it->find("type");
      auto fn = it->find("function");
      if (type == it->end() || *type != "function" || fn == it->end() || !fn->is_object() || !fn->contains("name") ||
          !(*fn)["name"].is_string())
        bad_request("tool_choice", std::string(kForms) + ", got " + brief(*it));
      t.choice = ToolChoice::kNamed;
      t.named = (*fn)["name"].get<std::string>();
      label = "function '" + t.named + "'";
    } else {
      bad_request("tool_choice", std::string(kForms) + ", got " + brief(*it));
    }
    if (t.choice != ToolChoice::kNone && !has_tools)
      bad_request("tool_choice", "tool_choice " + label + " needs a non-empty tools list");
    if (t.choice == ToolChoice::kNamed && !find_tool(t, t.named))
      bad_request("tool_choice", "tool_choice names the function '" + t.named + "', which is not in tools");
  }
  if (auto it = b.find("parallel_tool_calls"); it != b.end() && !it->is_null()) {
    if (!it->is_boolean()) bad_request("parallel_tool_calls", "parallel_tool_calls must be true or false");
    t.parallel = it->get<bool>();
  }
  return t;
}

namespace {

// Compiled once here, as response_format is, so a schema the engine cannot enforce is a 400
// naming the tool rather than a failure once the request reaches the engine.
infer::GuidedDecoding checked(infer::GuidedDecoding g, const std::string& param) {
  try {
    infer::structured::compile_guided(g);
  } catch (const Error& e) {
    bad_request(param, "tool_choice needs this schema enforced, and it cannot be: " + std::string(e.what()));
  }
  return g;
}

}  // namespace

infer::GuidedDecoding forced_tool_guided(const ToolRequest& t) {
  if (t.choice == ToolChoice::kNamed) {
    const size_t i = std::find(t.names.begin(), t.names.end(), t.named) - t.names.begin();
    return checked({"json_schema", parameters_of(t.tools[i]).dump()},
                   "tools[" + std::to_string(i) + "].function.parameters");
  }
  if (t.choice != ToolChoice::kRequired) return {};
  // vLLM's schema; each tool's $defs move to the root so that "#/$defs/..." references resolve.
  ojson defs = ojson::object(), branches = ojson::array();
  for (size_t i = 0; i < t.tools.size(); ++i) {
    ojson params = parameters_of(t.tools[i]);
    if (auto d = params.find("$defs"); d != params.end() && d->is_object()) {
      for (auto e = d->begin(); e != d->end(); ++e) {
        if (defs.contains(e.key()) && defs[e.key()] != e.value())
          bad_request("tools[" + std::to_string(i) + "].function.parameters",
                      "tools define \"$defs\" '" + e.key() + "' differently; tool_choice \"required\" needs one meaning");
        defs[e.key()] = e.value();
      }
      params.erase("$defs");
    }
    branches.push_back({{"type", "object"},
                        {"properties",
                         {{"name", {{"type", "string"}, {"enum", {t.names[i]}}}}, {"parameters", std::move(params)}}},
                        {"required", {"name", "parameters"}}});
  }
  // vLLM puts "type": "object" beside the anyOf; inside each branch it means the same, and the
  // grammar compiler takes anyOf alone.
  ojson schema = {{"type", "array"}, {"minItems", 1}, {"items", {{"anyOf", std::move(branches)}}}};
  if (!t.parallel) schema["maxItems"] = 1;
  if (!defs.empty()) schema["$defs"] = std::move(defs);
  return checked({"json_schema", schema.dump()}, "tools");
}

void add_message_tool_fields(const ojson& m, const std::string& where, jinja::Value& out) {
  const std::string role = out["role"].get<std::string>();
  if (role == "assistant") {
    auto it = m.find("tool_calls");
    if (it == m.end() || it->is_null()) return;
    if (!it->is_array())
      bad_request(where + ".tool_calls", where + ".tool_calls must be a list of {id, type, function} objects");
    jinja::Value calls = jinja::Value::array();
    for (size_t k = 0; k < it->size(); ++k) {
      const ojson& c = (*it)[k];
      const std::string cw = where + ".tool_calls[" + std::to_string(k) + "]";
      if (!c.is_object()) bad_request(cw, cw + " must be an object with id, type and function");
      if (auto type = c.find("type"); type != c.end() && !type->is_null() && *type != "function")
        bad_request(cw + ".type", cw + ".type must be \"function\"");
      auto id = c.find("id");
      if (id != c.end() && !id->is_null() && !id->is_string()) bad_request(cw + ".id", cw + ".id must be a string");
      auto fn = c.find("function");
      if (fn == c.end() || !fn->is_object()) bad_request(cw + ".function", cw + ".function must be {name, arguments}");
      auto name = fn->find("name");
      if (name == fn->end() || !name->is_string()) bad_request(cw + ".function.name", cw + ".function.name must be a string");
      auto args = fn->find("arguments");
      jinja::Value parsed;
      if (args == fn->end() || args->is_null()) {
        bad_request(cw + ".function.arguments", cw + ".function.arguments is required (a JSON string)");
      } else if (args->is_string()) {
        // Templates `tojson` the arguments or walk them as a mapping: they get the object, as
        // vLLM hands them over (transformers' convention).
        const std::string text = args->get<std::string>();
        if (io::find_json_nesting_over(text, kMaxArgumentsDepth) != std::string::npos)
          bad_request(cw + ".function.arguments", cw + ".function.arguments nests deeper than " +
                                                      std::to_string(kMaxArgumentsDepth) + " levels");
        try {
          parsed = jinja::Value::parse(text);
        } catch (const nlohmann::json::exception& e) {
          bad_request(cw + ".function.arguments",
                      cw + ".function.arguments is not valid JSON: " + io::json_error_text(e));
        }
      } else {
        parsed = *args;  // an object given as is
      }
      jinja::Value call = jinja::Value::object();
      if (id != c.end() && id->is_string()) call["id"] = *id;
      call["type"] = "function";
      call["function"] = {{"name", *name}, {"arguments", std::move(parsed)}};
      calls.push_back(std::move(call));
    }
    if (!calls.empty()) out["tool_calls"] = std::move(calls);
  } else if (role == "tool") {
    auto id = m.find("tool_call_id");
    if (id == m.end() || id->is_null()) return;
    if (!id->is_string()) bad_request(where + ".tool_call_id", where + ".tool_call_id must be a string");
    out["tool_call_id"] = *id;
  }
}

nlohmann::json tool_calls_json(const std::vector<ToolCall>& calls) {
  nlohmann::json a = nlohmann::json::array();
  for (const auto& c : calls)
    a.push_back({{"id", c.id}, {"type", "function"}, {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
  return a;
}

std::string tool_finish_reason(const ToolRequest& t, bool called, const std::string& finish) {
  if (!called || t.choice == ToolChoice::kNamed) return finish;
  return finish == "stop" ? "tool_calls" : finish;
}

}  // namespace tessera::serve
