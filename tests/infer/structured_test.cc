// Structured outputs: the GBNF parser, regex and JSON-schema conversion checked against
// independent references (Python's re.fullmatch, python3-jsonschema, Python's UTF-8
// encoder; tests/infer/structured_oracle.py), and the engine constrained by 200 random
// schemas with a random model: every output parses and validates.
#include <gtest/gtest.h>

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "tessera/infer/engine.h"
#include "tessera/infer/sampling_json.h"
#include "tessera/infer/structured/convert.h"
#include "tessera/infer/structured/guided_runner.h"
#include "tessera/infer/structured/guided.h"
#include "tessera/infer/structured/token_grammar.h"
#include "tessera/io/tokenizer.h"
#include "tessera/model/model.h"
#include "test_util/run_command.h"
#include "test_util/scratch_dir.h"

namespace tessera::infer::structured {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

// This test's scratch directory, removed at exit (test_util/scratch_dir.h).
fs::path temp_dir() {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return testing::scratch_dir("tessera_structured_" + std::string(info->name()) + "_");
}

// Runs the Python oracle; its stdout.
std::string oracle(const std::string& args) {
  const std::string cmd = std::string(TESSERA_PYTHON) + " " + TESSERA_SOURCE_DIR +
                          "/tests/infer/structured_oracle.py " + args;
  const auto r = testing::run_command(cmd, false);
  EXPECT_EQ(r.code, 0) << cmd << "\n" << r.out;
  return r.out;
}

std::string write(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary) << text;
  return p.string();
}

bool accepts(const std::string& gbnf, std::string_view s) { return grammar_accepts(parse_gbnf(gbnf), s); }

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

#define EXPECT_HAS(hay, needle) EXPECT_NE(std::string(hay).find(needle), std::string::npos) << (hay)

TEST(Gbnf, LiteralsClassesGroupsAndRepetitions) {
  const std::string g = R"(# a comment
root ::= "ab" [0-9]+ ("x" | "y"){2,3} tail?   # trailing comment
tail ::= [^a-z\n] "."
)";
  for (const char* s : {"ab1xy", "ab12xyx", "ab0yyy!.", "ab9xxZ."}) EXPECT_TRUE(accepts(g, s)) << s;
  for (const char* s : {"", "ab", "abxy", "ab1x", "ab1xyxy", "ab1xya.", "ab1xy\n.", "ab1xy!"})
    EXPECT_FALSE(accepts(g, s)) << s;
  const std::string rep = "root ::= \"a\"{2} \"b\"{1,} \"c\"{0,2} \"d\"*\n";
  for (const char* s : {"aab", "aabbbc", "aabcc", "aabccddd"}) EXPECT_TRUE(accepts(rep, s)) << s;
  for (const char* s : {"ab", "aaab", "aa", "aabccc", "aabdc"}) EXPECT_FALSE(accepts(rep, s)) << s;
}

TEST(Gbnf, MultiLineRulesEscapesAndUnicode) {
  const std::string g = "root ::=\n  (\n    item\n    (\",\" item)*\n  )\n  | \"\\u00e9\" [\\u4e00-\\u9fff] \"\\x41\\n\\\"\"\n"
                        "item ::= [a-c] | \"\xc3\xa9\" | .\n";
  for (const char* s : {"a", "a,b,c", "\xc3\xa9,a", "\xf0\x9f\x98\x80", "\xc3\xa9\xe6\x97\xa5" "A\n\""})
    EXPECT_TRUE(accepts(g, s)) << s;
  for (const char* s : {"", "a,", ",a", "\xc3\xa9\xe6\x97\xa5" "A\n", "\xe6\x97", "ab"}) EXPECT_FALSE(accepts(g, s)) << s;
}

TEST(Gbnf, ErrorsNameWhatIsWrong) {
  EXPECT_HAS(error_of([] { parse_gbnf("start ::= \"a\"\n"); }), "no 'root' rule");
  EXPECT_HAS(error_of([] { parse_gbnf("root ::= a b\na ::= \"x\"\n"); }), "rule 'b' is used but never defined");
  EXPECT_HAS(error_of([] { parse_gbnf("root ::= root \"a\" | \"a\"\n"); }), "rule 'root' is left-recursive");
  EXPECT_HAS(error_of([] { parse_gbnf("root ::= x root \"a\" | \"b\"\nx ::= \"c\"?\n"); }), "left-recursive");
  EXPECT_HAS(error_of([] { parse_gbnf("root ::= (\"a\"?)*\n"); }), "left-recursive");
  EXPECT_HAS(error_of([] { parse_gbnf("root ::= \"abc\n"); }), "line 1: unterminated string literal");
  EXPECT_HAS(error_of([] { parse_gbnf("root ::= \"a\"\nroot ::= \"b\"\n"); }), "rule 'root' is defined twice");
  EXPECT_HAS(error_of([] { parse_gbnf("root ::= \"a\"{3,1}\n"); }), "n < m");
  EXPECT_HAS(error_of([] { parse_gbnf("root ::= [z-a]\n"); }), "out of order");
  EXPECT_HAS(error_of([] { parse_gbnf("root ::= \"a\" )\n"); }), "unexpected character ')'");
  EXPECT_HAS(error_of([] { parse_gbnf("\n\nroot ::= \"\\q\"\n"); }), "line 3: unknown escape");
  // Adversarial depth: nested groups, and rules nested at the left edge (the matcher's
  // expansion recursion), refused instead of overflowing the stack.
  EXPECT_HAS(error_of([] { parse_gbnf("root ::= " + std::string(300, '(') + "\"a\"" + std::string(300, ')') + "\n"); }),
             "groups nest deeper than 256");
  EXPECT_HAS(error_of([] { regex_to_gbnf(std::string(300, '(') + "a" + std::string(300, ')')); }), "nest deeper");
  std::string chain = "root ::= r0\n";
  for (int i = 0; i < 5000; ++i) chain += "r" + std::to_string(i) + " ::= r" + std::to_string(i + 1) + " \"x\"\n";
  chain += "r5000 ::= \"y\"\n";
  EXPECT_HAS(error_of([&] { grammar_accepts(parse_gbnf(chain), "y"); }), "nest more than 4096 deep");
  json deep = json::object();
  for (int i = 0; i < 100; ++i) deep = json{{"type", "array"}, {"items", deep}};
  EXPECT_HAS(error_of([&] { json_schema_to_gbnf(deep); }), "nests deeper than 64");
}

// Every code point's UTF-8 (Python's encoder) is one "character" of `.` and of the full
// class; a negated class leaves out exactly its members; invalid UTF-8 is never accepted.
TEST(Gbnf, CharacterClassesMatchPythonUtf8) {
  const Grammar any = parse_gbnf("root ::= .\n");
  const Grammar neg = parse_gbnf("root ::= [^a\\u00e9\\u4e00-\\u4e0f\\U0001F600]\n");
  const std::vector<std::pair<uint32_t, uint32_t>> spans = {
      {0, 0x900}, {0xD700, 0xE100}, {0x4DF0, 0x4E20}, {0xFFF0, 0x10100}, {0x1F5F0, 0x1F610}, {0x10FFF0, 0x10FFFF}};
  int checked = 0;
  for (auto [lo, hi] : spans) {
    const std::string out = oracle("utf8 " + std::to_string(lo) + " " + std::to_string(hi));
    std::istringstream in(out);
    std::string hex;
    for (uint32_t cp = lo; std::getline(in, hex); ++cp) {
      if (cp >= 0xD800 && cp <= 0xDFFF) cp = 0xE000;  // the oracle skips surrogates
      std::string bytes;
      for (size_t k = 0; k < hex.size(); k += 2) bytes += static_cast<char>(std::stoi(hex.substr(k, 2), nullptr, 16));
      ASSERT_TRUE(grammar_accepts(any, bytes)) << std::hex << cp;
      const bool member = cp == 'a' || cp == 0xE9 || (cp >= 0x4E00 && cp <= 0x4E0F) || cp == 0x1F600;
      ASSERT_EQ(grammar_accepts(neg, bytes), !member) << std::hex << cp;
      ++checked;
    }
  }
  EXPECT_GT(checked, 3000);
  for (const char* bad : {"\x80", "\xC0\x80", "\xC1\xBF", "\xE0\x80\x80", "\xED\xA0\x80", "\xF4\x90\x80\x80",
                          "\xF8\x88\x80\x80\x80", "\xC3", "\xE6\x97"})
    EXPECT_FALSE(grammar_accepts(any, bad)) << bad;
}

// Regexes against Python's re.fullmatch (re.ASCII) on every string over a small alphabet up
// to length 4 plus hand-picked ones.
TEST(Regex, AgreesWithPythonRe) {
  const std::vector<std::string> regexes = {
      "a*b", "(ab|a)*", "a{2,3}b?", "[a-b0]+-?", "[^a]*", ".a.", "(a|b0){1,2}", "\\d+(-\\d)?", "\\w*",
      "\\W", "\\s?a", "a|", "(?:ab)+|0", "[ab-]{0,2}0", "^a+$", "a*?b+?", "[\\d-]*", "(?P<x>a)(b|)", "a{2,}",
      "[\\s\\S]{3}", "\\-\\.", "b{0}a", "(a*)(b*)", "[a-]", "[-a]+"};
  const std::string alphabet = "ab0-. \n";
  std::vector<std::string> strings = {""}, frontier = {""};
  for (int len = 1; len <= 4; ++len) {
    std::vector<std::string> next;
    for (const auto& s : frontier)
      for (char c : alphabet) next.push_back(s + c);
    strings.insert(strings.end(), next.begin(), next.end());
    frontier = std::move(next);
  }
  json cases = json::array();
  for (const auto& r : regexes) cases.push_back({{"regex", r}, {"strings", strings}});
  // Unicode and escapes.
  const std::vector<std::pair<std::string, std::vector<std::string>>> extra = {
      {"\xe6\x97\xa5\xe6\x9c\xac?", {"\xe6\x97\xa5", "\xe6\x97\xa5\xe6\x9c\xac", "\xe6\x9c\xac", "\xe6\x97\xa5\xe6\x9c\xac\xe6\x9c\xac"}},
      {"[^\\x00-\\x7f]+", {"\xc3\xa9", "a", "\xf0\x9f\x98\x80\xc3\xa9", ""}},
      {"\\u00e9|\\x41", {"\xc3\xa9", "A", "e"}},
      {"[\\u4e00-\\u9fff]{2}", {"\xe6\x97\xa5\xe6\x9c\xac", "\xe6\x97\xa5", "ab"}},
  };
  for (const auto& [r, s] : extra) cases.push_back({{"regex", r}, {"strings", s}});
  const fs::path d = temp_dir();
  const json want = json::parse(oracle("regex " + write(d / "cases.json", cases.dump())));
  ASSERT_EQ(want.size(), cases.size());
  int compared = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const std::string r = cases[i]["regex"];
    TokenGrammar g(parse_gbnf(regex_to_gbnf(r)), nullptr);
    for (size_t k = 0; k < cases[i]["strings"].size(); ++k) {
      const std::string s = cases[i]["strings"][k];
      ASSERT_EQ(g.accepting(g.advance(g.initial(), s)), want[i][k].get<bool>()) << "regex " << r << " on '" << s << "'";
      ++compared;
    }
  }
  EXPECT_GT(compared, 30000);
  for (const char* bad : {"(?=a)", "a\\1", "\\bfoo", "a^b", "a$b", "(a", "a)", "*a", "[a", "a{3,1}", "[[:alpha:]]"})
    EXPECT_HAS(error_of([&] { regex_to_gbnf(bad); }), "regex: ");
}

// Random sentences of a grammar: a walk over its bytes, each step uniform over the allowed
// bytes, stopping at accepting states with probability 1/4 (or when nothing may follow).
std::vector<std::string> random_sentences(const Grammar& g, int count, uint64_t seed) {
  std::vector<std::string> bytes(256);
  for (int b = 1; b < 256; ++b) bytes[b] = std::string(1, static_cast<char>(b));
  bytes[0] = std::string(1, '\0');
  TokenGrammar tg(g, std::make_shared<VocabTrie>(bytes, 256));
  std::mt19937_64 rng(seed);
  std::vector<std::string> out;
  for (int n = 0; n < count; ++n) {
    int32_t s = tg.initial();
    std::string text;
    while (text.size() < 4000) {
      const auto m = tg.mask(s);
      std::vector<int> allowed;
      for (int b = 0; b < 256; ++b)
        if (((*m)[b >> 6] >> (b & 63)) & 1) allowed.push_back(b);
      if (allowed.empty() || (tg.accepting(s) && rng() % 4 == 0)) break;
      const int b = allowed[rng() % allowed.size()];
      text += static_cast<char>(b);
      s = tg.advance(s, std::string(1, static_cast<char>(b)));
    }
    if (tg.accepting(s)) out.push_back(text);
  }
  return out;
}

std::string summary(const json& schema, const std::string& text, const json& why) {
  return "schema " + schema.dump() + "\noutput " + text + "\n" + why.dump();
}

// Random byte-level sentences of 200 random schemas' grammars all validate.
TEST(JsonSchema, RandomSentencesValidate) {
  const json schemas = json::parse(oracle("schemas 200 11"));
  ASSERT_EQ(schemas.size(), 200u);
  json cases = json::array();
  for (size_t i = 0; i < schemas.size(); ++i) {
    const Grammar g = parse_gbnf(json_schema_to_gbnf(schemas[i]));
    cases.push_back({{"schema", schemas[i]}, {"outputs", random_sentences(g, 5, i)}});
  }
  const fs::path d = temp_dir();
  const json verdicts = json::parse(oracle("validate " + write(d / "cases.json", cases.dump())));
  int64_t n = 0;
  for (size_t i = 0; i < cases.size(); ++i)
    for (size_t k = 0; k < cases[i]["outputs"].size(); ++k, ++n)
      EXPECT_TRUE(verdicts[i][k].is_null()) << summary(cases[i]["schema"], cases[i]["outputs"][k], verdicts[i][k]);
  EXPECT_GT(n, 800);
}

// Documents in the canonical shape (declared order, compact) are accepted; invalid ones not.
TEST(JsonSchema, AcceptsValidAndRejectsInvalidDocuments) {
  const auto schema = nlohmann::ordered_json::parse(R"({
    "type": "object",
    "properties": {
      "name": {"type": "string", "minLength": 1, "maxLength": 5},
      "age": {"type": "integer"},
      "tags": {"type": "array", "items": {"enum": ["a", "b", 3]}, "maxItems": 2},
      "kind": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/point"}]},
      "code": {"type": "string", "pattern": "^[A-Z]{2}\\d$"}
    },
    "required": ["name", "kind"],
    "$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}}
  })");
  const Grammar g = parse_gbnf(json_schema_to_gbnf(schema));
  for (const char* ok : {R"({"name":"ab","kind":null})", R"({"name":"a","age":-12,"kind":{"x":1.5e3}})",
                         R"({ "name": "\u00e9\n", "tags": ["a", 3], "kind": {"x": -0.25}, "code": "AB1" })",
                         "{\n  \"name\":\"x\",\n  \"kind\":null\n}"})
    EXPECT_TRUE(grammar_accepts(g, ok)) << ok;
  for (const char* bad : {R"({"kind":null})", R"({"name":"","kind":null})", R"({"name":"abcdef","kind":null})",
                          R"({"kind":null,"name":"a"})", R"({"name":"a","kind":null,"extra":1})",
                          R"({"name":"a","kind":{"x":"1"}})", R"({"name":"a","tags":["c"],"kind":null})",
                          R"({"name":"a","tags":["a","a","b"],"kind":null})", R"({"name":"a","kind":null,"code":"A1"})",
                          R"({"name":"a","age":1.5,"kind":null})", R"({"name":"a","age":01,"kind":null})",
                          R"({"name":"\ud800","kind":null})"})
    EXPECT_FALSE(grammar_accepts(g, bad)) << bad;
  const Grammar any = parse_gbnf(json_object_gbnf());
  EXPECT_TRUE(grammar_accepts(any, R"({"a":[1,{"b":null}],"c":"d"})"));
  EXPECT_FALSE(grammar_accepts(any, "[1]"));
  EXPECT_FALSE(grammar_accepts(any, "{\"a\":1} "));
}

TEST(JsonSchema, UnsupportedKeywordsAreErrors) {
  EXPECT_HAS(error_of([] { json_schema_to_gbnf(json::parse(R"({"type":"integer","minimum":0})")); }),
             "the keyword 'minimum' is not supported");
  EXPECT_HAS(error_of([] { json_schema_to_gbnf(json::parse(R"({"type":"object","properties":{"a":{"uniqueItems":true}}})")); }),
             "at #/properties/a: the keyword 'uniqueItems'");
  EXPECT_HAS(error_of([] { json_schema_to_gbnf(json::parse(R"({"$ref":"http://x/y"})")); }), "only local $ref");
  EXPECT_HAS(error_of([] { json_schema_to_gbnf(json::parse(R"({"type":"object","properties":{"a":{}},"additionalProperties":true})")); }),
             "additionalProperties");
  EXPECT_HAS(error_of([] { json_schema_to_gbnf(json::parse(R"({"type":"strin"})")); }), "is not a JSON type");
}

// The request fields: each error names its field; one constraint at a time.
TEST(GuidedRequest, FieldsAndErrors) {
  auto parse = [](const char* body) { return sampling_params_from_json(json::parse(body), "request"); };
  auto field_of = [&](const char* body) {
    try {
      parse(body);
    } catch (const FieldError& e) {
      return e.field() + ": " + e.what();
    }
    return std::string("(no error)");
  };
  EXPECT_EQ(parse(R"({"response_format":{"type":"json_object"}})").guided.type, "json_object");
  EXPECT_TRUE(parse(R"({"response_format":{"type":"text"}})").guided.empty());
  const auto js = parse(R"({"response_format":{"type":"json_schema","json_schema":{"name":"x","schema":{"type":"integer"},"strict":true}}})");
  EXPECT_EQ(js.guided.type, "json_schema");
  EXPECT_EQ(json::parse(js.guided.spec), json::parse(R"({"type":"integer"})"));
  EXPECT_EQ(parse(R"({"guided_json":"{\"type\":\"null\"}"})").guided.spec, "{\"type\":\"null\"}");
  EXPECT_EQ(parse(R"({"guided_regex":"a+"})").guided.type, "regex");
  const auto choice = parse(R"({"guided_choice":["yes","no \"way\""]})");
  EXPECT_EQ(choice.guided.type, "grammar");
  EXPECT_TRUE(accepts(choice.guided.spec, "no \"way\""));
  EXPECT_FALSE(accepts(choice.guided.spec, "maybe"));
  EXPECT_HAS(field_of(R"({"response_format":{"type":"xml"}})"), "response_format: request: 'response_format' type 'xml'");
  EXPECT_HAS(field_of(R"({"response_format":{"type":"json_schema"}})"), "response_format: ");
  EXPECT_HAS(field_of(R"({"response_format":{"type":"json_schema","json_schema":{"schema":{"type":"integer","maximum":3}}}})"),
             "response_format: request: 'response_format': JSON schema at #: the keyword 'maximum' is not supported");
  EXPECT_HAS(field_of(R"({"guided_regex":"(a"})"), "guided_regex: request: 'guided_regex': regex: ");
  EXPECT_HAS(field_of(R"({"guided_grammar":"root ::= x"})"), "guided_grammar: ");
  EXPECT_HAS(field_of(R"({"guided_json":"{nope"})"), "guided_json: ");
  EXPECT_HAS(field_of(R"({"guided_choice":[]})"), "guided_choice: ");
  EXPECT_HAS(field_of(R"({"guided_regex":"a","guided_choice":["a"]})"), "guided_choice: request: 'guided_choice' and 'guided_regex'");
}

// A byte-level BPE tokenizer trained on JSON-like text and a random tiny model over it.
struct TinyModel {
  io::Tokenizer tok;
  model::Model model;
};

const TinyModel& tiny_model() {
  static const TinyModel* m = [] {
    const fs::path d = fs::temp_directory_path() / ("tessera_structured_tok_" + std::to_string(::getpid()));
    fs::create_directories(d);
    {
      std::ofstream f(d / "corpus.txt");
      for (int i = 0; i < 30; ++i)
        f << "{\"name\": \"Ada\", \"id\": 12, \"tags\": [\"x\", \"y\"], \"ok\": true, \"v\": null, \"n\": -3.5e2}\n"
             "The quick brown fox jumps over the lazy dog. yes no maybe 2026-12-05 \xc3\xa9t\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac\n";
    }
    io::BpeTrainOptions bo;
    bo.vocab_size = 340;
    bo.special_tokens = {"<|endoftext|>"};
    bo.progress = false;
    io::Tokenizer tok = io::train_bpe({(d / "corpus.txt").string()}, bo);
    fs::remove_all(d);
    model::ModelConfig c = model::ModelConfig::named_shape("tiny");
    c.vocab_size = tok.vocab_size();
    c.max_position_embeddings = 4096;
    c.eos_token_id = tok.token_to_id("<|endoftext|>");
    c.bos_token_id = -1;
    return new TinyModel{tok, model::Model::random(c, DType::kF32, 5)};
  }();
  return *m;
}

struct EngineRun {
  std::vector<std::string> texts;
  std::vector<std::string> reasons;
  GuidedStats stats;
};

// Runs every request to the end; text per (request, sample).
EngineRun run_all(const std::vector<SamplingParams>& reqs, EngineConfig ec = {}) {
  const TinyModel& m = tiny_model();
  ec.kv_cache_memory = 64 << 20;
  ec.max_num_seqs = 64;
  Engine e(m.model, ec, &m.tok);
  std::map<std::pair<RequestId, int64_t>, size_t> slot;
  EngineRun run;
  const auto prompt = m.tok.encode("Answer in JSON:", false);
  for (const auto& p : reqs) {
    const RequestId id = e.add_request(prompt, p);
    for (int64_t k = 0; k < p.n; ++k) {
      slot[{id, k}] = run.texts.size();
      run.texts.emplace_back();
      run.reasons.emplace_back();
    }
  }
  while (e.has_unfinished())
    for (const auto& o : e.step()) {
      const size_t i = slot.at({o.id, o.index});
      run.texts[i] += o.new_text;
      if (o.finished) run.reasons[i] = o.finish_reason;
    }
  run.stats = e.guided_stats();
  return run;
}

SamplingParams sampled(uint64_t seed, GuidedDecoding g) {
  SamplingParams p;
  p.temperature = 1.f;
  p.seed = seed;
  p.max_tokens = 3000;
  p.guided = std::move(g);
  return p;
}

// 200 random schemas, a random model sampling at temperature 1 under each: every output
// ends by the grammar (finish "stop") and validates with python3-jsonschema.
TEST(StructuredEngine, RandomSchemasAllValidate) {
  const json schemas = json::parse(oracle("schemas 200 2026"));
  std::vector<SamplingParams> reqs;
  for (size_t i = 0; i < schemas.size(); ++i) reqs.push_back(sampled(i, {"json_schema", schemas[i].dump()}));
  const EngineRun run = run_all(reqs);
  json cases = json::array();
  for (size_t i = 0; i < schemas.size(); ++i) {
    EXPECT_EQ(run.reasons[i], "stop") << schemas[i].dump() << "\n" << run.texts[i];
    cases.push_back({{"schema", schemas[i]}, {"outputs", {run.texts[i]}}});
  }
  const fs::path d = temp_dir();
  const json verdicts = json::parse(oracle("validate " + write(d / "cases.json", cases.dump())));
  std::set<std::string> distinct;
  for (size_t i = 0; i < schemas.size(); ++i) {
    EXPECT_TRUE(verdicts[i][0].is_null()) << summary(schemas[i], run.texts[i], verdicts[i][0]);
    distinct.insert(run.texts[i]);
  }
  EXPECT_GT(distinct.size(), 120u);  // sampled, not one fixed answer (const and enum schemas repeat)
  EXPECT_GT(run.stats.masks, 1000);
  EXPECT_GT(run.stats.walks, 0);
}

// n > 1 samples keep their own automaton; speculative decoding (n-gram proposals) is
// verified against the automaton; regexes and choices end where they must.
TEST(StructuredEngine, SamplesSpeculationRegexAndChoice) {
  const std::string schema = R"({"type":"object","properties":{"a":{"type":"array","items":{"type":"integer"},"maxItems":4},"b":{"enum":["x","y",null]}},"required":["a","b"]})";
  SamplingParams p = sampled(7, {"json_schema", schema});
  p.n = 4;
  std::vector<SamplingParams> reqs = {p, sampled(8, {"regex", "(ab|c){2,4}-[0-9]{1,3}"}),
                                      sampled(9, {"grammar", "root ::= \"yes\" | \"no\" | \"maybe\"\n"}),
                                      sampled(10, {"json_object", ""})};
  for (const EngineConfig& ec : {EngineConfig{}, [] {
         EngineConfig c;
         c.speculative_method = "ngram";
         c.num_speculative_tokens = 3;
         return c;
       }()}) {
    const EngineRun run = run_all(reqs, ec);
    ASSERT_EQ(run.texts.size(), 7u);
    json cases = json::array();
    cases.push_back({{"schema", json::parse(schema)}, {"outputs", json(std::vector<std::string>(run.texts.begin(), run.texts.begin() + 4))}});
    cases.push_back({{"schema", json::parse(R"({"type":"object"})")}, {"outputs", {run.texts[6]}}});
    const fs::path d = temp_dir();
    const json v = json::parse(oracle("validate " + write(d / "cases.json", cases.dump())));
    for (int k = 0; k < 4; ++k) EXPECT_TRUE(v[0][k].is_null()) << run.texts[k] << " " << v[0][k];
    if (run.reasons[6] == "stop") {
      EXPECT_TRUE(v[1][0].is_null()) << run.texts[6] << " " << v[1][0];
    }
    const json rcase = json::array({{{"regex", "(ab|c){2,4}-[0-9]{1,3}"}, {"strings", {run.texts[4]}}}});
    EXPECT_TRUE(json::parse(oracle("regex " + write(d / "r.json", rcase.dump())))[0][0].get<bool>()) << run.texts[4];
    EXPECT_TRUE(run.texts[5] == "yes" || run.texts[5] == "no" || run.texts[5] == "maybe") << run.texts[5];
    for (int k = 0; k < 6; ++k) EXPECT_EQ(run.reasons[k], "stop") << k;
  }
}

// The mask comes first: a constrained greedy choice is the best allowed token, and EOS only
// where the grammar may end.
TEST(StructuredSampler, MaskAppliesBeforeEverythingAndEosOnlyAtTheEnd) {
  const std::vector<std::string> bytes = {"a", "b", "ab", "c", ""};  // token 4: EOS (no bytes)
  const auto trie = std::make_shared<VocabTrie>(bytes, 5);
  TokenGrammar g(parse_gbnf("root ::= \"a\" \"b\"? \"c\"*\n"), trie);
  const auto m0 = g.mask(g.initial());
  EXPECT_EQ((*m0)[0], 0b00101u);  // a, ab
  const int32_t s1 = g.advance_token(g.initial(), 0);
  EXPECT_EQ((*g.mask(s1))[0], 0b01010u);  // b, c
  EXPECT_TRUE(g.accepting(s1));
  EXPECT_FALSE(g.finished(s1));
  EXPECT_EQ(g.advance_token(s1, 2), TokenGrammar::kDead);
  SamplingParams p;
  p.repetition_penalty = 2.f;
  Sampler smp(p, {4});
  const std::vector<float> logits = {1.f, 9.f, 2.f, 3.f, 8.f};
  uint64_t allowed = 0b00101;
  smp.set_token_mask(&allowed);
  EXPECT_EQ(smp.sample(logits.data(), 5, {1}, {}).token, 2);
  EXPECT_EQ(smp.sample(logits.data(), 5, {}, {}).token, 1);  // the mask held for one call only
}

// The trie walk (with its pruned and bulk-allowed subtrees) gives exactly the tokens whose
// bytes, stepped one by one, the automaton does not reject: along random paths through a
// JSON grammar and a schema's, on a real BPE vocabulary.
TEST(StructuredVocab, MaskEqualsTokenByTokenCheck) {
  const TinyModel& m = tiny_model();
  const auto trie = VocabTrie::from_tokenizer(m.tok, m.tok.vocab_size());
  const std::string schema = R"({"type":"object","properties":{"s":{"type":"string","maxLength":9},"n":{"type":"number"},"e":{"enum":["\u00e9t\u00e9",1]}},"required":["s","n","e"]})";
  std::mt19937_64 rng(3);
  int64_t compared = 0;
  for (const std::string& gbnf : {json_object_gbnf(), json_schema_to_gbnf(nlohmann::ordered_json::parse(schema))}) {
    TokenGrammar g(parse_gbnf(gbnf), trie);
    for (int walk = 0; walk < 4; ++walk) {
      int32_t s = g.initial();
      for (int step = 0; step < 60 && !g.finished(s); ++step) {
        const auto mask = g.mask(s);
        std::vector<int32_t> allowed;
        for (int32_t t = 0; t < trie->vocab(); ++t) {
          const bool want = !trie->bytes(t).empty() && g.advance(s, trie->bytes(t)) != TokenGrammar::kDead;
          ASSERT_EQ(((*mask)[t >> 6] >> (t & 63)) & 1, want ? 1u : 0u) << "token " << t << " '" << trie->bytes(t) << "'";
          if (want) allowed.push_back(t);
          ++compared;
        }
        if (allowed.empty()) break;
        s = g.advance_token(s, allowed[rng() % allowed.size()]);
      }
    }
  }
  EXPECT_GT(compared, 50000);
}

// A SentencePiece-style tokenizer (Llama 2's shape: "▁" for spaces, <0xNN> byte fallback):
// tokens are stepped by the bytes they add to the text, so a byte token may start a
// character that another byte token finishes.
TEST(StructuredVocab, SentencePieceBytesAndPartialUtf8) {
  json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  static const char kHex[] = "0123456789ABCDEF";
  for (int b = 0; b < 256; ++b) vocab[std::string("<0x") + kHex[b >> 4] + kHex[b & 15] + ">"] = 3 + b;
  const char* pieces[] = {"\xe2\x96\x81", "h", "e", "l", "o", "\xc3\xa9", "\xe2\x96\x81h", "el", "\xe2\x96\x81hel", "lo",
                          "\xe2\x96\x81hello"};
  for (int i = 0; i < 11; ++i) vocab[pieces[i]] = 259 + i;
  json added = json::array();
  for (int id = 0; id < 3; ++id)
    added.push_back({{"id", id}, {"content", id == 0 ? "<unk>" : id == 1 ? "<s>" : "</s>"}, {"special", true}});
  const json j = {
      {"version", "1.0"}, {"added_tokens", added},
      {"normalizer", {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\xe2\x96\x81"}}},
      {"pre_tokenizer", nullptr}, {"post_processor", nullptr},
      {"decoder", {{"type", "Sequence"}, {"decoders", {{{"type", "Replace"}, {"pattern", {{"String", "\xe2\x96\x81"}}}, {"content", " "}},
                                                       {{"type", "ByteFallback"}}, {{"type", "Fuse"}}}}}},
      {"model", {{"type", "BPE"}, {"unk_token", "<unk>"}, {"byte_fallback", true}, {"fuse_unk", true}, {"vocab", vocab},
                 {"merges", {"\xe2\x96\x81 h", "e l", "\xe2\x96\x81h el", "l o", "\xe2\x96\x81hel lo"}}}}};
  const io::Tokenizer tok = io::Tokenizer::from_json(j, "spm.json");
  const auto trie = VocabTrie::from_tokenizer(tok, 280);  // the model's vocabulary may be larger
  EXPECT_EQ(trie->bytes(269), " hello");
  EXPECT_EQ(trie->bytes(3 + 0x41), "A");
  EXPECT_EQ(trie->bytes(2), "");  // special: never allowed
  TokenGrammar g(parse_gbnf(regex_to_gbnf("( hello|\xc3\xa9)+")), trie);
  auto allowed = [&](int32_t state) {
    std::set<int32_t> out;
    const auto m = g.mask(state);
    for (int32_t t = 0; t < 280; ++t)
      if (((*m)[t >> 6] >> (t & 63)) & 1) out.insert(t);
    return out;
  };
  // " ", " h", " hel", " hello", "é", and the byte tokens for ' ' and 0xC3.
  EXPECT_EQ(allowed(g.initial()), (std::set<int32_t>{259, 264, 265, 267, 269, 3 + 0x20, 3 + 0xC3}));
  const int32_t lead = g.advance_token(g.initial(), 3 + 0xC3);  // half of "é"
  EXPECT_EQ(allowed(lead), (std::set<int32_t>{3 + 0xA9}));
  const int32_t e = g.advance_token(lead, 3 + 0xA9);
  EXPECT_TRUE(g.accepting(e));
  EXPECT_EQ(g.advance_token(g.advance_token(g.initial(), 265), 266), g.advance_token(g.initial(), 267));  // " h"+"el" = " hel"
}

}  // namespace
}  // namespace tessera::infer::structured
