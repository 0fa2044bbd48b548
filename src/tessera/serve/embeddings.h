// POST /v1/embeddings (OpenAI's schema): request parsing and the response. The embedding of
// an input is the mean over its tokens of the model's final hidden states, after the final
// norm (vLLM's pooling type MEAN; Engine::add_embedding_request).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/serve/openai.h"

namespace tessera::serve {

constexpr int64_t kMaxEmbeddingInputs = 2048;  // OpenAI's limit on inputs per request

// Parses and validates an embeddings body into an ApiRequest (endpoint kEmbeddings, one
// prompt per input, n = 1): `input` a string, a list of strings, a list of token ids or a
// list of id lists (each non-empty, at most max_model_len tokens); `model`;
// `encoding_format` "float" (default) or "base64" (into *base64); `dimensions` only equal
// to `hidden_size` (the model's; no truncation); `user`. Throws ApiError (400 naming the param).
ApiRequest parse_embedding_request(const nlohmann::json& body, const ModelInfo& model, int64_t hidden_size,
                                   bool* base64);

// The little-endian f32 bytes of `v`, base64-encoded (OpenAI's encoding_format "base64").
std::string base64_f32(const std::vector<float>& v);

// {"object": "list", "data": [{"object": "embedding", "index", "embedding"}...], "model",
// "usage": {"prompt_tokens", "total_tokens"}}.
nlohmann::json embedding_response(const std::string& model, const std::vector<std::vector<float>>& embeddings,
                                  bool base64, int64_t prompt_tokens);

}  // namespace tessera::serve
