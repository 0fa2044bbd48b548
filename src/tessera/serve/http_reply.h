// JSON replies of the HTTP servers (the OpenAI server, its disaggregation worker routes and
// the router): bodies as valid UTF-8 JSON, OpenAI error bodies, and what a route threw
// mapped to the error it answers with.
#pragma once
#include <httplib.h>

#include <exception>
#include <string>

#include <nlohmann/json.hpp>

#include "tessera/serve/openai.h"

namespace tessera::serve {

// j as JSON text; bytes that are not UTF-8 (whatever a tokenizer decoded) are replaced.
std::string dump(const nlohmann::json& j);
void send_json(httplib::Response& res, int status, const nlohmann::json& body);
// e's status and {"error": ...} body; 429 and 503 also say Retry-After: 1.
void send_error(httplib::Response& res, const ApiError& e);
// The error a route answers for the exception `e` it threw: an ApiError as it is; a
// FieldError a 400 invalid_request_error naming its field; any other tessera::Error a 400;
// anything else a 500 internal_error ("internal error: ...").
ApiError api_error_of(const std::exception_ptr& e);

}  // namespace tessera::serve
