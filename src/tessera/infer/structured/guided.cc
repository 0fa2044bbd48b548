// GuidedDecoding from request fields (OpenAI response_format, vLLM guided_*), and its
// compile to a grammar. Every error names the field it came from.
#include "tessera/infer/structured/guided.h"

#include "tessera/base/error.h"
#include "tessera/infer/structured/convert.h"

namespace tessera::infer::structured {

using nlohmann::json;

std::string guided_gbnf(const GuidedDecoding& g) {
  if (g.type == "json_object") return json_object_gbnf();
  if (g.type == "json_schema") {
    nlohmann::ordered_json schema;
    try {
      schema = nlohmann::ordered_json::parse(g.spec);
    } catch (const json::exception&) {
      fail("the JSON schema is not valid JSON");
    }
    return json_schema_to_gbnf(schema);
  }
  if (g.type == "regex") return regex_to_gbnf(g.spec);
  if (g.type == "grammar") return g.spec;
  fail("unknown structured output type '", g.type, "' (json_object, json_schema, regex or grammar)");
}

Grammar compile_guided(const GuidedDecoding& g) { return parse_gbnf(guided_gbnf(g)); }

std::string guided_field(const GuidedDecoding& g) {
  if (g.type == "regex") return "guided_regex";
  if (g.type == "grammar") return "guided_grammar";
  return "response_format";
}

namespace {

std::string choice_grammar(const json& list, const std::string& where) {
  if (!list.is_array() || list.empty())
    fail_field("guided_choice", where, ": 'guided_choice' must be a non-empty list of strings");
  std::string g = "root ::= ";
  for (size_t i = 0; i < list.size(); ++i) {
    if (!list[i].is_string() || list[i].get<std::string>().empty())
      fail_field("guided_choice", where, ": 'guided_choice' must be a non-empty list of non-empty strings");
    g += (i ? " | " : "") + gbnf_literal(list[i].get<std::string>());
  }
  return g + "\n";
}

}  // namespace

std::optional<GuidedDecoding> guided_from_json(const json& j, const std::string& where) {
  std::optional<GuidedDecoding> out;
  std::string from;
  auto set = [&](const char* field, GuidedDecoding g) {
    if (out)
      fail_field(field, where, ": '", field, "' and '", from, "' both constrain the output; give one");
    out = std::move(g);
    from = field;
  };
  if (auto it = j.find("response_format"); it != j.end() && !it->is_null()) {
    const json& rf = *it;
    auto bad = [&](const std::string& msg) { fail_field("response_format", where, ": 'response_format' ", msg); };
    if (!rf.is_object() || !rf.contains("type") || !rf["type"].is_string())
      bad("must be an object with a 'type' (text, json_object or json_schema)");
    const std::string type = rf["type"].get<std::string>();
    if (type == "json_object") {
      set("response_format", {"json_object", ""});
    } else if (type == "json_schema") {
      auto js = rf.find("json_schema");
      if (js == rf.end() || !js->is_object()) bad("of type json_schema needs a 'json_schema' object");
      auto schema = js->find("schema");
      if (schema == js->end() || !(schema->is_object() || schema->is_boolean()))
        bad("needs json_schema.schema, a JSON schema object");
      if (auto strict = js->find("strict"); strict != js->end() && !strict->is_null() && !strict->is_boolean())
        bad("json_schema.strict must be true or false");
      set("response_format", {"json_schema", schema->dump()});
    } else if (type != "text") {
      bad("type '" + type + "' is not one of text, json_object, json_schema");
    }
  }
  if (auto it = j.find("guided_json"); it != j.end() && !it->is_null()) {
    json schema = *it;
    if (it->is_string()) {
      try {
        schema = json::parse(it->get<std::string>());
      } catch (const json::exception&) {
        fail_field("guided_json", where, ": 'guided_json' is a string that is not valid JSON");
      }
    }
    if (!schema.is_object() && !schema.is_boolean())
      fail_field("guided_json", where, ": 'guided_json' must be a JSON schema (an object or its JSON text)");
    // JSON text keeps its key order (the properties' order in the output); a parsed body's
    // objects have sorted keys.
    set("guided_json", {"json_schema", it->is_string() ? it->get<std::string>() : schema.dump()});
  }
  if (auto it = j.find("guided_regex"); it != j.end() && !it->is_null()) {
    if (!it->is_string()) fail_field("guided_regex", where, ": 'guided_regex' must be a string");
    set("guided_regex", {"regex", it->get<std::string>()});
  }
  if (auto it = j.find("guided_grammar"); it != j.end() && !it->is_null()) {
    if (!it->is_string()) fail_field("guided_grammar", where, ": 'guided_grammar' must be a GBNF string");
    set("guided_grammar", {"grammar", it->get<std::string>()});
  }
  if (auto it = j.find("guided_choice"); it != j.end() && !it->is_null())
    set("guided_choice", {"grammar", choice_grammar(*it, where)});
  if (auto it = j.find("guided_whitespace_pattern"); it != j.end() && !it->is_null())
    fail_field("guided_whitespace_pattern", where, ": 'guided_whitespace_pattern' is not supported");
  if (out) {
    try {
      compile_guided(*out);
    } catch (const FieldError&) {
      throw;
    } catch (const Error& e) {
      fail_field(from, where, ": '", from, "': ", e.what());
    }
  }
  return out;
}

}  // namespace tessera::infer::structured
