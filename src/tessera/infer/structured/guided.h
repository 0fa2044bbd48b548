// Structured outputs from a request's fields: OpenAI's response_format ({"type": "text"},
// {"type": "json_object"}, {"type": "json_schema", "json_schema": {"name", "schema", "strict"}})
// and vLLM's guided_json (object or JSON text), guided_regex, guided_grammar (GBNF) and
// guided_choice (list of strings). At most one may be given.
#pragma once
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "tessera/infer/sampler.h"

namespace tessera::infer::structured {

// The constraint, compiled once to check it (a bad schema, regex or grammar throws
// FieldError naming its field, message prefixed by `where`); nothing when none is given.
std::optional<GuidedDecoding> guided_from_json(const nlohmann::json& j, const std::string& where);

}  // namespace tessera::infer::structured
