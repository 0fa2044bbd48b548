// Tool calling: the Hermes / Llama 3.1 / "required" output parsers on real model output formats
// (whole and streamed at every byte boundary), request validation, the forced-choice JSON
// schema checked by python3-jsonschema, and tool-calling chat templates (Qwen3, Llama 3.1)
// rendered against jinja2 through the whole request path.
#include "tessera/serve/tool_calls.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>

#include "tessera/io/gguf_tokenizer.h"
#include "tessera/serve/openai.h"
#include "test_util/chat_templates.h"
#include "test_util/jinja2_reference.h"
#include "test_util/run_command.h"

namespace tessera::serve {
namespace {

using nlohmann::json;
using ojson = nlohmann::ordered_json;

const std::vector<std::string> kNames = {"get_current_temperature", "get_temperature_date", "get_weather",
                                         "get_time", "run_sql"};

ToolRequest request(ToolChoice choice, ToolParser parser, bool parallel = true) {
  ToolRequest t;
  t.choice = choice;
  t.parser = parser;
  t.parallel = parallel;
  t.names = kNames;
  t.tools = jinja::Value::array();
  for (const auto& n : kNames) t.tools.push_back({{"type", "function"}, {"function", {{"name", n}}}});
  return t;
}

// What a client assembles from the stream: content, and calls by index (id and name from the
// first entry of an index, arguments appended).
struct Assembled {
  std::string content;
  std::vector<ToolCall> calls;
};

Assembled stream(const ToolRequest& t, const std::vector<std::string>& chunks) {
  ToolStreamParser p(t);
  Assembled a;
  auto take = [&](ToolStreamParser::Delta d) {
    a.content += d.content;
    for (const auto& e : d.tool_calls) {
      const size_t i = e.at("index").get<size_t>();
      if (e.contains("id")) {  // a call's first entry: OpenAI's shape
        EXPECT_EQ(i, a.calls.size());
        EXPECT_EQ(e.at("type"), "function");
        EXPECT_EQ(e.at("function").at("arguments"), "");
        a.calls.push_back({e["id"].get<std::string>(), e["function"]["name"].get<std::string>(), ""});
      } else {
        EXPECT_FALSE(e.contains("type"));
        EXPECT_FALSE(e["function"].contains("name"));
        EXPECT_GT(e["function"]["arguments"].get<std::string>().size(), 0u);
      }
      ASSERT_LT(i, a.calls.size());
      if (e["function"].contains("arguments")) a.calls[i].arguments += e["function"]["arguments"].get<std::string>();
    }
  };
  for (const auto& c : chunks) take(p.feed(c));
  take(p.finish());
  EXPECT_EQ(p.calls(), static_cast<int64_t>(a.calls.size()));
  return a;
}

// The streamed result, for every way of cutting `text` in two and cut into single bytes, equals
// the whole-text result.
void expect_stream_matches(const ToolRequest& t, const std::string& text) {
  const ParsedToolOutput whole = parse_tool_output(t, text);
  auto check = [&](const std::vector<std::string>& chunks, const std::string& how) {
    const Assembled a = stream(t, chunks);
    EXPECT_EQ(a.content, whole.content.value_or("")) << how << " of: " << text;
    ASSERT_EQ(a.calls.size(), whole.calls.size()) << how << " of: " << text;
    for (size_t i = 0; i < a.calls.size(); ++i) {
      EXPECT_EQ(a.calls[i].name, whole.calls[i].name) << how;
      EXPECT_EQ(a.calls[i].arguments, whole.calls[i].arguments) << how << " of: " << text;
    }
  };
  check({text}, "one chunk");
  for (size_t k = 0; k <= text.size(); ++k) check({text.substr(0, k), text.substr(k)}, "split at " + std::to_string(k));
  std::vector<std::string> bytes;
  for (char c : text) bytes.push_back(std::string(1, c));
  check(bytes, "byte by byte");
}

void expect_call(const ToolCall& c, const std::string& name, const json& args) {
  EXPECT_EQ(c.name, name);
  EXPECT_EQ(json::parse(c.arguments), args) << c.arguments;
  EXPECT_EQ(c.id.rfind("call_", 0), 0u) << c.id;
  EXPECT_EQ(c.id.size(), 29u);
}

// ---- parser choice ----------------------------------------------------------------------

TEST(ToolParserChoice, DetectedFromRealTemplates) {
  EXPECT_EQ(detect_tool_parser(testing::kQwen3), ToolParser::kHermes);
  EXPECT_EQ(detect_tool_parser(testing::kLlama31), ToolParser::kLlama3Json);
  EXPECT_EQ(detect_tool_parser(testing::kLlama3), ToolParser::kNone);  // Llama 3.0: no tools
  EXPECT_EQ(detect_tool_parser(testing::kQwen2), ToolParser::kNone);
  EXPECT_EQ(select_tool_parser("auto", testing::kQwen3), ToolParser::kHermes);
  EXPECT_EQ(select_tool_parser("hermes", testing::kLlama3), ToolParser::kHermes);
  EXPECT_EQ(select_tool_parser("llama3_json", ""), ToolParser::kLlama3Json);
  EXPECT_EQ(select_tool_parser("none", testing::kQwen3), ToolParser::kNone);
  try {
    select_tool_parser("mistral", "");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--tool-call-parser 'mistral'"), std::string::npos) << e.what();
  }
  EXPECT_NE(tool_parser_summary("auto", ToolParser::kNone).find("plain text"), std::string::npos);
}

// ---- Hermes -----------------------------------------------------------------------------

// Qwen2.5's documented parallel call output (two functions, one turn).
const std::string kQwenTwoCalls =
    "<tool_call>\n{\"name\": \"get_current_temperature\", \"arguments\": {\"location\": \"San Francisco, CA, USA\"}}\n"
    "</tool_call>\n<tool_call>\n{\"name\": \"get_temperature_date\", \"arguments\": {\"location\": \"San Francisco, "
    "CA, USA\", \"date\": \"2024-10-01\"}}\n</tool_call>";
// Braces, quotes, escapes and tag-like text inside argument strings; nested objects and arrays.
const std::string kTrickyArgs =
    R"({"query": "SELECT '}' AS a, \"{x}\" FROM t WHERE s = '</tool' OR s = '<tool_call>'", )"
    R"("options": {"limit": 5, "tags": ["a}", "{b", "\\", "\"]"], "deep": {"x": [[1, 2], {"y": null}]}}, )"
    R"("note": "caf\u00e9 é \n tab\t"})";

TEST(HermesToolParser, RealOutputs) {
  const ToolRequest t = request(ToolChoice::kAuto, ToolParser::kHermes);
  {
    const auto r = parse_tool_output(t, kQwenTwoCalls);
    EXPECT_FALSE(r.content.has_value());
    ASSERT_EQ(r.calls.size(), 2u);
    expect_call(r.calls[0], "get_current_temperature", {{"location", "San Francisco, CA, USA"}});
    expect_call(r.calls[1], "get_temperature_date", {{"location", "San Francisco, CA, USA"}, {"date", "2024-10-01"}});
    EXPECT_NE(r.calls[0].id, r.calls[1].id);
    // The arguments are the model's own JSON text.
    EXPECT_EQ(r.calls[0].arguments, R"({"location": "San Francisco, CA, USA"})");
  }
  {  // text around the call; Qwen3's thinking block stays content
    const auto r = parse_tool_output(t, "<think>\nThe user wants SQL.\n</think>\n\n<tool_call>\n{\"name\": \"run_sql\", "
                                        "\"arguments\": " + kTrickyArgs + "}\n</tool_call>\nDone.  ");
    ASSERT_EQ(r.calls.size(), 1u);
    expect_call(r.calls[0], "run_sql", json::parse(kTrickyArgs));
    EXPECT_EQ(r.calls[0].arguments, kTrickyArgs);
    EXPECT_EQ(r.content.value_or("<null>"), "<think>\nThe user wants SQL.\n</think>Done.  ");
  }
  {  // "arguments" before "name"; a call without a closing tag (the model stopped there)
    const auto r = parse_tool_output(
        t, "<tool_call>{\"arguments\": {\"city\": \"Paris\"}, \"name\": \"get_weather\"}</tool_call><tool_call>\n"
           "{\"name\": \"get_time\", \"arguments\": {}}\n</tool_");
    ASSERT_EQ(r.calls.size(), 2u);
    expect_call(r.calls[0], "get_weather", {{"city", "Paris"}});
    expect_call(r.calls[1], "get_time", json::object());
    EXPECT_FALSE(r.content.has_value());
  }
  {  // parallel_tool_calls false: the first call only
    const auto r = parse_tool_output(request(ToolChoice::kAuto, ToolParser::kHermes, false), kQwenTwoCalls);
    ASSERT_EQ(r.calls.size(), 1u);
    EXPECT_EQ(r.calls[0].name, "get_current_temperature");
  }
}

TEST(HermesToolParser, MalformedCallsStayContent) {
  const ToolRequest t = request(ToolChoice::kAuto, ToolParser::kHermes);
  const std::string broken = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}\n</tool_call>";
  for (const std::string& text : {
           broken,                                                                           // a brace short
           std::string("<tool_call>\n{\"name\": \"rm_rf\", \"arguments\": {}}\n</tool_call>"),    // not a tool
           std::string("<tool_call>\n{\"name\": \"get_time\"}\n</tool_call>"),                   // no arguments
           std::string("<tool_call>\n{\"name\": \"get_time\", \"arguments\": \"{}\"}\n</tool_call>"),  // a string
           std::string("<tool_call>\nget_time()\n</tool_call>"),
           std::string("<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}} extra\n</tool_call>"),
       }) {
    const auto r = parse_tool_output(t, text);
    EXPECT_TRUE(r.calls.empty()) << text;
    EXPECT_EQ(r.content.value_or("<null>"), text);
  }
  // A good call after a broken one is still a call; the broken one is content.
  const auto r = parse_tool_output(t, "Checking.\n" + broken + "\n" + kQwenTwoCalls);
  ASSERT_EQ(r.calls.size(), 2u);
  EXPECT_EQ(r.content.value_or("<null>"), "Checking." + broken);
  // Plain text, tag-like text included, is untouched.
  for (const std::string& text : {std::string("The answer is 4."), std::string("use <tools> or <tool_call"),
                                  std::string("  spaced \n"), std::string("")}) {
    const auto p = parse_tool_output(t, text);
    EXPECT_TRUE(p.calls.empty());
    EXPECT_EQ(p.content.value_or("<null>"), text);
  }
}

TEST(HermesToolParser, StreamingAtEveryByteBoundaryMatchesWholeText) {
  const ToolRequest t = request(ToolChoice::kAuto, ToolParser::kHermes);
  for (const std::string& text : {
           kQwenTwoCalls,
           "Let me check.\n\n<tool_call>\n{\"name\": \"run_sql\", \"arguments\": " + kTrickyArgs + "}\n</tool_call>\n\nDone",
           std::string("<tool_call>{\"arguments\": {\"city\": \"Paris\"}, \"name\": \"get_weather\"}</tool_call>"),
           std::string("<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_"),
           std::string("<tool_call>\n{\"name\": \"rm_rf\", \"arguments\": {}}\n</tool_call> after"),
           std::string("<tool_call>\n{\"name\": \"get_time\"}\n</tool_call>"),
           std::string("<tool_call>\nget_time()\n</tool_call>\n") + kQwenTwoCalls,
           std::string("use <tools> or <tool_call"),
           std::string("  spaced \n"),
           std::string("<think>\n\n</think>\n\n") + kQwenTwoCalls + "\n",
       })
    expect_stream_matches(t, text);
  expect_stream_matches(request(ToolChoice::kAuto, ToolParser::kHermes, false), kQwenTwoCalls);
}

TEST(HermesToolParser, StreamSendsTheHeaderThenArgumentFragments) {
  const ToolRequest t = request(ToolChoice::kAuto, ToolParser::kHermes);
  ToolStreamParser p(t);
  EXPECT_TRUE(p.feed("Sure").content == "Sure");
  EXPECT_TRUE(p.feed(" <tool").empty());  // " " and a tag's start are held back
  EXPECT_TRUE(p.feed("_call>\n{\"name\": \"get_wea").empty());
  auto d = p.feed("ther\", \"arguments\": {\"ci");
  ASSERT_EQ(d.tool_calls.size(), 2u);  // the header (arguments ""), then the first fragment
  EXPECT_EQ(d.tool_calls[0]["function"]["name"], "get_weather");
  EXPECT_EQ(d.tool_calls[0]["function"]["arguments"], "");
  EXPECT_EQ(d.tool_calls[1], json({{"index", 0}, {"function", {{"arguments", "{\"ci"}}}}));
  d = p.feed("ty\": \"Paris\"}}\n</tool_call>");
  ASSERT_EQ(d.tool_calls.size(), 1u);
  EXPECT_EQ(d.tool_calls[0], json({{"index", 0}, {"function", {{"arguments", "ty\": \"Paris\"}"}}}}));
  EXPECT_TRUE(p.finish().empty());
}

// ---- Llama 3.1 JSON ---------------------------------------------------------------------

TEST(Llama3JsonToolParser, RealOutputs) {
  const ToolRequest t = request(ToolChoice::kAuto, ToolParser::kLlama3Json);
  {
    const auto r = parse_tool_output(t, "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}");
    ASSERT_EQ(r.calls.size(), 1u);
    expect_call(r.calls[0], "get_weather", {{"city", "Paris"}});
    EXPECT_FALSE(r.content.has_value());
  }
  {  // several calls separated by ';' (vLLM's llama3_json), no python tag
    const auto r = parse_tool_output(t, "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"a;b}{\"}}; "
                                        "{\"name\": \"run_sql\", \"parameters\": " + kTrickyArgs + "}");
    ASSERT_EQ(r.calls.size(), 2u);
    expect_call(r.calls[0], "get_weather", {{"city", "a;b}{"}});
    expect_call(r.calls[1], "run_sql", json::parse(kTrickyArgs));
  }
  {  // text, then the tag
    const auto r = parse_tool_output(t, "Sure.\n<|python_tag|>{\"name\": \"get_time\", \"parameters\": {}}");
    ASSERT_EQ(r.calls.size(), 1u);
    EXPECT_EQ(r.content.value_or("<null>"), "Sure.");
  }
  {  // what follows the calls and is not one is content
    const auto r = parse_tool_output(t, "{\"name\": \"get_time\", \"parameters\": {}} and then some");
    ASSERT_EQ(r.calls.size(), 1u);
    EXPECT_EQ(r.content.value_or("<null>"), "and then some");
  }
  for (const std::string& text : {std::string("The capital of France is Paris."), std::string("{\"answer\": 42}"),
                                  std::string("{\"name\": \"get_time\", \"parameters\": {}"),  // unclosed
                                  std::string("{\"name\": \"nope\", \"parameters\": {}}")}) {
    const auto r = parse_tool_output(t, text);
    EXPECT_TRUE(r.calls.empty()) << text;
    EXPECT_EQ(r.content.value_or("<null>"), text);
  }
}

TEST(Llama3JsonToolParser, StreamingAtEveryByteBoundaryMatchesWholeText) {
  const ToolRequest t = request(ToolChoice::kAuto, ToolParser::kLlama3Json);
  for (const std::string& text : {
           std::string("<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}"),
           "  {\"name\": \"get_weather\", \"parameters\": {\"city\": \"a;b}{\"}}; {\"name\": \"run_sql\", "
           "\"parameters\": " + kTrickyArgs + "};",
           std::string("Sure.\n<|python_tag|>{\"name\": \"get_time\", \"parameters\": {}}"),
           std::string("{\"name\": \"get_time\", \"parameters\": {}} and then some"),
           std::string("The capital of France is Paris. <|python"),
           std::string("{\"answer\": 42} is the JSON"),
           std::string("{\"name\": \"nope\", \"parameters\": {}}"),
           std::string("\n\n"),
       })
    expect_stream_matches(t, text);
}

TEST(ToolStreamParser, ATruncatedCallIsSentAsFarAsItGot) {
  // Documented: a call whose name was sent cannot be taken back; whole, it stays content.
  const ToolRequest t = request(ToolChoice::kAuto, ToolParser::kLlama3Json);
  const std::string text = "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Par";
  const Assembled a = stream(t, {text});
  ASSERT_EQ(a.calls.size(), 1u);
  EXPECT_EQ(a.calls[0].arguments, "{\"city\": \"Par");
  EXPECT_TRUE(parse_tool_output(t, text).calls.empty());
}

// ---- forced choices -----------------------------------------------------------------------

TEST(ForcedToolChoice, RequiredOutputIsAnArrayOfCalls) {
  const ToolRequest t = request(ToolChoice::kRequired, ToolParser::kNone);
  const std::string text =
      "[{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}},\n {\"name\": \"run_sql\", \"parameters\": " +
      kTrickyArgs + "}]";
  const auto r = parse_tool_output(t, text);
  ASSERT_EQ(r.calls.size(), 2u);
  expect_call(r.calls[0], "get_weather", {{"city", "Paris"}});
  expect_call(r.calls[1], "run_sql", json::parse(kTrickyArgs));
  EXPECT_FALSE(r.content.has_value());
  EXPECT_EQ(tool_finish_reason(t, true, "stop"), "tool_calls");
  EXPECT_EQ(tool_finish_reason(t, true, "length"), "length");
  expect_stream_matches(t, text);
  expect_stream_matches(t, "[]");
  const auto bad = parse_tool_output(t, "not json");
  EXPECT_TRUE(bad.calls.empty());
  EXPECT_EQ(bad.content.value_or("<null>"), "not json");
  expect_stream_matches(t, "not json");
}

TEST(ForcedToolChoice, NamedOutputIsTheArguments) {
  ToolRequest t = request(ToolChoice::kNamed, ToolParser::kNone);
  t.named = "get_weather";
  const auto r = parse_tool_output(t, "{\"city\": \"Paris\"}");
  ASSERT_EQ(r.calls.size(), 1u);
  expect_call(r.calls[0], "get_weather", {{"city", "Paris"}});
  EXPECT_FALSE(r.content.has_value());
  EXPECT_EQ(tool_finish_reason(t, true, "stop"), "stop");  // as vLLM and OpenAI answer a named function
  expect_stream_matches(t, "{\"city\": \"Paris\"}");
  const Assembled empty = stream(t, {});
  ASSERT_EQ(empty.calls.size(), 1u);  // even an empty output is the named call
}

// The schemas python3-jsonschema validates against: what vLLM would accept is valid.
TEST(ForcedToolChoice, SchemasAcceptExactlyWellFormedCalls) {
  const ojson body = ojson::parse(R"({"tools": [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
      "properties": {"city": {"type": "string"}, "unit": {"$ref": "#/$defs/unit"}}, "required": ["city"],
      "$defs": {"unit": {"enum": ["c", "f"]}}}}},
    {"type": "function", "function": {"name": "get_time"}}], "tool_choice": "required"})");
  const ToolRequest req = parse_tool_request(body, ToolParser::kNone);
  const auto g = forced_tool_guided(req);
  ASSERT_EQ(g.type, "json_schema");
  ojson named_body = body;
  named_body["tool_choice"] = {{"type", "function"}, {"function", {{"name", "get_weather"}}}};
  const auto named = forced_tool_guided(parse_tool_request(named_body, ToolParser::kNone));
  EXPECT_EQ(named.type, "json_schema");
  EXPECT_EQ(ojson::parse(named.spec), body["tools"][0]["function"]["parameters"]);
  const json instances = json::array({
      json::parse(R"([{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}])"),
      json::parse(R"([{"name": "get_time", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "X"}}])"),
      json::parse(R"([])"),
      json::parse(R"([{"name": "get_weather", "parameters": {"unit": "c"}}])"),
      json::parse(R"([{"name": "get_weather", "parameters": {"city": "Paris", "unit": "kelvin"}}])"),
      json::parse(R"([{"name": "rm_rf", "parameters": {}}])"),
      json::parse(R"({"name": "get_time", "parameters": {}})"),
  });
  const std::vector<bool> expected = {true, true, false, false, false, false, false};
  const std::string dir = std::filesystem::temp_directory_path() / ("tessera_tools_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/in.json") << json({{"schema", json::parse(g.spec)}, {"instances", instances}}).dump();
  const auto r = testing::run_command(std::string(TESSERA_PYTHON) +
                                      " -c 'import json, sys, jsonschema\n"
                                      "d = json.load(open(sys.argv[1]))\n"
                                      "jsonschema.Draft202012Validator.check_schema(d[\"schema\"])\n"
                                      "v = jsonschema.Draft202012Validator(d[\"schema\"])\n"
                                      "print(json.dumps([v.is_valid(i) for i in d[\"instances\"]]))' " +
                                      dir + "/in.json");
  std::filesystem::remove_all(dir);
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(json::parse(r.out), json(expected)) << g.spec;
}

// ---- request validation ------------------------------------------------------------------

TEST(ToolRequestFields, BadFieldsAre400sNamingTheField) {
  const std::string tool = R"({"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}})";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"tools": {}})", "tools"},
      {R"({"tools": [3]})", "tools[0]"},
      {R"({"tools": [{"type": "retrieval", "function": {"name": "f"}}]})", "tools[0].type"},
      {R"({"tools": [{"type": "function"}]})", "tools[0].function"},
      {R"({"tools": [{"type": "function", "function": {"name": "bad name"}}]})", "tools[0].function.name"},
      {R"({"tools": [{"type": "function", "function": {}}]})", "tools[0].function.name"},
      {"{\"tools\": [" + tool + ", " + tool + "]}", "tools[1].function.name"},
      {R"({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]})", "tools[0].function.parameters"},
      {R"({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]})", "tools[0].function.description"},
      {"{\"tools\": [" + tool + "], \"tool_choice\": \"sometimes\"}", "tool_choice"},
      {"{\"tools\": [" + tool + "], \"tool_choice\": {\"type\": \"function\", \"function\": {\"name\": \"g\"}}}", "tool_choice"},
      {"{\"tools\": [" + tool + "], \"tool_choice\": {\"type\": \"function\"}}", "tool_choice"},
      {R"({"tool_choice": "required"})", "tool_choice"},
      {"{\"tools\": [" + tool + "], \"parallel_tool_calls\": \"yes\"}", "parallel_tool_calls"},
  };
  for (const auto& [body, param] : cases) {
    try {
      parse_tool_request(ojson::parse(body), ToolParser::kHermes);
      ADD_FAILURE() << "accepted: " << body;
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status, 400);
      EXPECT_EQ(e.param, param) << body << " -> " << e.what();
    }
  }
  // A schema the structured-output grammar cannot take is refused up front, naming the tool.
  for (const auto& [choice, param] : std::vector<std::pair<ojson, std::string>>{
           {{{"type", "function"}, {"function", {{"name", "g"}}}}, "tools[1].function.parameters"}, {"required", "tools"}}) {
    ojson body = ojson::parse("{\"tools\": [" + tool + R"(, {"type": "function", "function": {"name": "g",
        "parameters": {"type": "object", "not": {"required": ["x"]}}}}]})");
    body["tool_choice"] = choice;
    try {
      forced_tool_guided(parse_tool_request(body, ToolParser::kHermes));
      ADD_FAILURE() << "accepted " << choice.dump();
    } catch (const ApiError& e) {
      EXPECT_EQ(e.param, param) << e.what();
      EXPECT_NE(std::string(e.what()).find("'not'"), std::string::npos) << e.what();
    }
  }
  const auto ok = parse_tool_request(ojson::parse("{\"tools\": [" + tool + "]}"), ToolParser::kHermes);
  EXPECT_EQ(ok.choice, ToolChoice::kAuto);
  EXPECT_TRUE(ok.active());
  EXPECT_FALSE(parse_tool_request(ojson::parse("{\"tools\": [" + tool + "]}"), ToolParser::kNone).active());
  EXPECT_EQ(parse_tool_request(ojson::parse("{}"), ToolParser::kHermes).choice, ToolChoice::kNone);
  EXPECT_EQ(parse_tool_request(ojson::parse(R"({"tool_choice": "none"})"), ToolParser::kHermes).choice, ToolChoice::kNone);
}

TEST(ToolRequestFields, MessageToolFields) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"role": "assistant", "content": null, "tool_calls": 3})", "messages[0].tool_calls"},
      {R"({"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]})", "messages[0].tool_calls[0].function.name"},
      {R"({"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]})", "messages[0].tool_calls[0].function.arguments"},
      {R"({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]})",
       "messages[0].tool_calls[0].function.arguments"},
      {R"({"role": "assistant", "tool_calls": [{"type": "code", "function": {"name": "f", "arguments": "{}"}}]})",
       "messages[0].tool_calls[0].type"},
      {R"({"role": "tool", "content": "x", "tool_call_id": 5})", "messages[0].tool_call_id"},
  };
  for (const auto& [m, param] : cases) {
    jinja::Value out = {{"role", ojson::parse(m)["role"]}, {"content", ""}};
    try {
      add_message_tool_fields(ojson::parse(m), "messages[0]", out);
      ADD_FAILURE() << "accepted: " << m;
    } catch (const ApiError& e) {
      EXPECT_EQ(e.param, param) << m << " -> " << e.what();
    }
  }
  // Arguments arrive as JSON text and reach the template as an object, key order kept.
  jinja::Value out = {{"role", "assistant"}, {"content", ""}};
  add_message_tool_fields(ojson::parse(R"({"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function",
      "function": {"name": "f", "arguments": "{\"z\": 1, \"a\": [true]}"}}]})"), "messages[0]", out);
  EXPECT_EQ(out["tool_calls"][0]["function"]["arguments"].dump(), R"({"z":1,"a":[true]})");
  EXPECT_EQ(out["tool_calls"][0]["id"], "call_1");
}

// ---- templates ---------------------------------------------------------------------------

// A tool-calling conversation as vLLM hands it to a template: tools as the client sent them,
// assistant tool calls with their arguments as objects (content "" when it was null), tool
// results. Key order is not alphabetical, so an implementation that sorted keys would differ.
ojson weather_tools() {
  return ojson::parse(R"([
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city.",
     "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "City, \"quoted\" é"},
       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Local time.",
     "parameters": {"type": "object", "properties": {"tz": {"type": "string"}}}}}])");
}

ojson conversation(bool two_calls) {
  ojson calls = ojson::array();
  calls.push_back({{"id", "call_abc"}, {"type", "function"},
                   {"function", {{"name", "get_weather"}, {"arguments", {{"unit", "celsius"}, {"city", "Paris"}}}}}});
  if (two_calls)
    calls.push_back({{"id", "call_def"}, {"type", "function"},
                     {"function", {{"name", "get_time"}, {"arguments", {{"tz", "Europe/Paris"}}}}}});
  ojson msgs = ojson::array();
  msgs.push_back({{"role", "system"}, {"content", "You are a weather bot."}});
  msgs.push_back({{"role", "user"}, {"content", "Weather in Paris? {\"not\": \"a call\"}"}});
  msgs.push_back({{"role", "assistant"}, {"content", ""}, {"tool_calls", calls}});
  msgs.push_back({{"role", "tool"}, {"content", "{\"temperature\": 21}"}, {"tool_call_id", "call_abc"}});
  if (two_calls) msgs.push_back({{"role", "tool"}, {"content", "14:05"}, {"tool_call_id", "call_def"}});
  return msgs;
}

int expect_matches_jinja2(const char* source, const ojson& cases) {
  const std::string dir = std::filesystem::temp_directory_path() /
                          ("tessera_tools_tpl_" + std::to_string(::getpid()) + "_" +
                           ::testing::UnitTest::GetInstance()->current_test_info()->name());
  std::filesystem::create_directories(dir);
  std::string log;
  const json expected = testing::render_with_jinja2(source, cases.dump(), dir, &log);
  std::filesystem::remove_all(dir);
  EXPECT_FALSE(expected.is_null()) << log;
  if (expected.is_null()) return 0;
  int ok = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const ojson& c = cases[i];
    const ChatTemplate t(source, c["bos_token"].get<std::string>(), c["eos_token"].get<std::string>());
    jinja::Value extra = jinja::Value::object();
    if (c.contains("tools")) extra["tools"] = c["tools"];
    if (expected[i].contains("ok")) {
      ++ok;
      try {
        EXPECT_EQ(t.render(c["messages"], c["add_generation_prompt"].get<bool>(), extra),
                  expected[i]["ok"].get<std::string>())
            << "case " << i;
      } catch (const Error& e) {
        ADD_FAILURE() << "case " << i << " threw: " << e.what();
      }
    } else {
      try {
        t.render(c["messages"], c["add_generation_prompt"].get<bool>(), extra);
        ADD_FAILURE() << "case " << i << " rendered; jinja2 raised " << expected[i]["error"];
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(expected[i]["error"].get<std::string>()), std::string::npos)
            << e.what();
      }
    }
  }
  return ok;
}

ojson tool_cases(const std::string& bos, const std::string& eos) {
  ojson cases = ojson::array();
  for (bool two : {false, true})
    for (bool gen : {true, false})
      cases.push_back({{"messages", conversation(two)}, {"tools", weather_tools()}, {"add_generation_prompt", gen},
                       {"bos_token", bos}, {"eos_token", eos}});
  ojson first_turn = ojson::array({conversation(false)[0], conversation(false)[1]});
  cases.push_back({{"messages", first_turn}, {"tools", weather_tools()}, {"add_generation_prompt", true},
                   {"bos_token", bos}, {"eos_token", eos}});
  cases.push_back({{"messages", first_turn}, {"add_generation_prompt", true}, {"bos_token", bos}, {"eos_token", eos}});
  return cases;
}

TEST(ToolTemplates, Qwen3MatchesJinja2) {
  EXPECT_EQ(expect_matches_jinja2(testing::kQwen3, tool_cases("", "<|im_end|>")), 6);
}

TEST(ToolTemplates, Llama31MatchesJinja2) {
  // Llama 3.1 takes one call per assistant turn: the two-call cases raise, in both renderers.
  EXPECT_EQ(expect_matches_jinja2(testing::kLlama31, tool_cases("<|begin_of_text|>", "<|eot_id|>")), 4);
}

// The whole request path: an OpenAI body (arguments as JSON text, content null, keys in the
// client's order) through parse_request gives the prompt jinja2 renders from vLLM's context.
TEST(ToolTemplates, RequestPathRendersWhatJinja2Renders) {
  auto tok = io::load_model_tokenizer(TESSERA_SERVE_MODEL);
  ASSERT_TRUE(tok.has_value());
  for (const char* source : {testing::kQwen3, testing::kLlama31}) {
    const ChatTemplate tmpl(source, "<|begin_of_text|>", "<|eot_id|>");
    ModelInfo m;
    m.name = "m";
    m.tokenizer = &*tok;
    m.chat_template = &tmpl;
    m.max_model_len = 1 << 20;
    m.vocab_size = tok->vocab_size();
    m.tool_parser = detect_tool_parser(source);
    ojson body = {{"model", "m"}, {"max_tokens", 4}, {"tools", weather_tools()},
                  {"tool_choice", {{"type", "function"}, {"function", {{"name", "get_weather"}}}}}};
    ojson msgs = conversation(false);
    msgs[2]["content"] = nullptr;
    msgs[2]["tool_calls"][0]["function"]["arguments"] = R"({"unit": "celsius", "city": "Paris"})";
    body["messages"] = msgs;
    const std::string raw = body.dump();
    const ApiRequest r = parse_request(json::parse(raw), Endpoint::kChat, m, raw);
    EXPECT_EQ(r.tools.choice, ToolChoice::kNamed);
    EXPECT_EQ(r.params.guided.type, "json_schema");
    EXPECT_EQ(ojson::parse(r.params.guided.spec), weather_tools()[0]["function"]["parameters"]);
    ojson cases = ojson::array({{{"messages", conversation(false)}, {"tools", weather_tools()},
                                 {"add_generation_prompt", true}, {"bos_token", "<|begin_of_text|>"},
                                 {"eos_token", "<|eot_id|>"}}});
    const std::string dir = std::filesystem::temp_directory_path() / ("tessera_tools_req_" + std::to_string(::getpid()));
    std::filesystem::create_directories(dir);
    std::string log;
    const json expected = testing::render_with_jinja2(source, cases.dump(), dir, &log);
    std::filesystem::remove_all(dir);
    ASSERT_FALSE(expected.is_null()) << log;
    ASSERT_TRUE(expected[0].contains("ok")) << expected.dump();
    EXPECT_EQ(tok->decode(r.prompts.at(0)), expected[0]["ok"].get<std::string>());
  }
}

}  // namespace
}  // namespace tessera::serve
