// Structured outputs' front ends: a regular expression, a JSON schema or "any JSON object"
// written as GBNF text for parse_gbnf (one IR, and a grammar a person can read), and the
// request-level compile of a GuidedDecoding.
#pragma once
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "tessera/infer/sampler.h"
#include "tessera/infer/structured/grammar.h"

namespace tessera::infer::structured {

// A regex (the common subset of Python re / ECMAScript: literals, escapes, classes with
// ranges and negation, \d \w \s and their negations (ASCII), `.` (not \n), groups (?:...),
// |, * + ? {m} {m,} {m,n} and their lazy forms) as GBNF with rule `root` matching the whole
// text (a leading ^ and a trailing $ are allowed and implied). Lookaround, backreferences,
// anchors elsewhere and \b are errors naming them. `json_string`: the grammar generates the
// body of a JSON string literal whose decoded value matches (", \ and control characters escaped).
std::string regex_to_gbnf(std::string_view regex, bool json_string = false, const std::string& rule = "root");
// Appends the regex's rules (named rule, rule-1, ...) to `out` instead of a whole grammar.
void regex_rules(std::string_view regex, bool json_string, const std::string& rule, std::string& out);

// Any JSON object (OpenAI's json_object mode): root ::= object, whitespace bounded.
std::string json_object_gbnf();
// A JSON schema as GBNF (see docs/serving.md for the keywords). Unsupported keywords are
// errors "JSON schema at #/path: the keyword 'K' is not supported". Properties are
// generated in the object's order (ordered_json keeps the schema text's).
std::string json_schema_to_gbnf(const nlohmann::ordered_json& schema);

// A string as a GBNF literal ("..." with escapes).
std::string gbnf_literal(std::string_view bytes);

// The constraint as GBNF text / compiled grammar. Errors are tessera::Error.
std::string guided_gbnf(const GuidedDecoding& g);
Grammar compile_guided(const GuidedDecoding& g);
// The API field a GuidedDecoding came from, for errors: "response_format", "guided_regex", ...
std::string guided_field(const GuidedDecoding& g);

}  // namespace tessera::infer::structured
