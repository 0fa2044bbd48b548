// /v1/embeddings: request parsing and the response (see embeddings.h).
#include "tessera/serve/embeddings.h"

#include <bit>
#include <cstring>

#include "tessera/io/json_file.h"

namespace tessera::serve {
namespace {

using nlohmann::json;

std::vector<int32_t> input_ids(const json& a, const std::string& param, const ModelInfo& m) {
  std::vector<int32_t> ids;
  ids.reserve(a.size());
  for (const auto& t : a) {
    if (!t.is_number_integer())
      bad_request(param, param + " must be a string, a list of strings, a list of token ids or a list of "
                                 "token-id lists");
    if (!io::json_int_in(t, 0, m.vocab_size - 1))
      bad_request(param, param + " has token id " + io::json_brief(t) + " outside the vocabulary [0, " +
                             std::to_string(m.vocab_size) + ")");
    ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
  }
  return ids;
}

std::vector<int32_t> input_text(const json& s, const std::string& param, const ModelInfo& m) {
  if (!m.tokenizer) bad_request(param, "the served model has no tokenizer; send token ids");
  return m.tokenizer->encode(s.get<std::string>(), true);
}

ApiRequest parse_checked(const json& b, const ModelInfo& m, int64_t hidden_size, bool* base64) {
  if (!b.is_object()) bad_request("", "the request body must be a JSON object");
  ApiRequest r;
  r.endpoint = Endpoint::kEmbeddings;
  r.model = resolve_model(b, m, &r.adapter);
  auto it = b.find("input");
  if (it == b.end() || it->is_null()) bad_request("input", "input is required");
  const json& in = *it;
  const char* kShape = "input must be a string, a list of strings, a list of token ids or a list of token-id lists";
  if (in.is_string()) {
    r.prompts.push_back(input_text(in, "input", m));
  } else if (in.is_array()) {
    if (in.empty()) bad_request("input", "input must not be empty");
    if (in[0].is_number_integer()) {
      r.prompts.push_back(input_ids(in, "input", m));
    } else {
      if (static_cast<int64_t>(in.size()) > kMaxEmbeddingInputs)
        bad_request("input", "at most " + std::to_string(kMaxEmbeddingInputs) + " inputs per request, got " +
                                 std::to_string(in.size()));
      for (size_t i = 0; i < in.size(); ++i) {
        const std::string where = "input[" + std::to_string(i) + "]";
        if (in[i].is_string()) r.prompts.push_back(input_text(in[i], where, m));
        else if (in[i].is_array()) r.prompts.push_back(input_ids(in[i], where, m));
        else bad_request("input", kShape);
      }
    }
  } else {
    bad_request("input", kShape);
  }
  for (size_t i = 0; i < r.prompts.size(); ++i) {
    const int64_t len = static_cast<int64_t>(r.prompts[i].size());
    const std::string which = r.prompts.size() > 1 ? "input[" + std::to_string(i) + "]" : "input";
    if (len == 0) bad_request("input", which + " is empty (no tokens)");
    if (len > m.max_model_len)
      bad_request("input", which + " has " + std::to_string(len) + " tokens; this model's context length is " +
                               std::to_string(m.max_model_len), "context_length_exceeded");
  }
  *base64 = false;
  if (auto f = b.find("encoding_format"); f != b.end() && !f->is_null()) {
    if (!f->is_string() || (*f != "float" && *f != "base64"))
      bad_request("encoding_format", "encoding_format must be \"float\" or \"base64\", got " + io::json_brief(*f));
    *base64 = *f == "base64";
  }
  if (auto d = b.find("dimensions"); d != b.end() && !d->is_null()) {
    if (!io::json_int_in(*d, 1, INT32_MAX))
      bad_request("dimensions", "dimensions must be a positive integer, got " + io::json_brief(*d));
    if (d->get<int64_t>() != hidden_size)
      bad_request("dimensions", "dimensions " + d->dump() + " is not supported: this model's embeddings have " +
                                    std::to_string(hidden_size) + " dimensions (the hidden size) and are not "
                                    "truncated");
  }
  if (auto u = b.find("user"); u != b.end() && !u->is_null()) {
    if (!u->is_string()) bad_request("user", "user must be a string");
    r.user = u->get<std::string>();
  }
  r.params.max_tokens = 1;  // nothing is generated
  return r;
}

}  // namespace

ApiRequest parse_embedding_request(const json& body, const ModelInfo& model, int64_t hidden_size, bool* base64) {
  try {
    return parse_checked(body, model, hidden_size, base64);
  } catch (const json::exception& e) {  // the backstop, as parse_request's
    bad_request("", "invalid request: " + io::json_error_text(e));
  }
}

std::string base64_f32(const std::vector<float>& v) {
  static const char kAlphabet[] = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string bytes(v.size() * 4, '\0');
  for (size_t i = 0; i < v.size(); ++i) {
    const uint32_t u = std::bit_cast<uint32_t>(v[i]);
    for (int k = 0; k < 4; ++k) bytes[i * 4 + k] = static_cast<char>((u >> (8 * k)) & 0xff);  // little-endian
  }
  std::string out;
  out.reserve((bytes.size() + 2) / 3 * 4);
  size_t i = 0;
  for (; i + 3 <= bytes.size(); i += 3) {
    const uint32_t n = (static_cast<uint8_t>(bytes[i]) << 16) | (static_cast<uint8_t>(bytes[i + 1]) << 8) |
                       static_cast<uint8_t>(bytes[i + 2]);
    for (int s = 18; s >= 0; s -= 6) out += kAlphabet[(n >> s) & 63];
  }
  if (const size_t rest = bytes.size() - i; rest > 0) {
    uint32_t n = static_cast<uint8_t>(bytes[i]) << 16;
    if (rest == 2) n |= static_cast<uint8_t>(bytes[i + 1]) << 8;
    out += kAlphabet[(n >> 18) & 63];
    out += kAlphabet[(n >> 12) & 63];
    out += rest == 2 ? kAlphabet[(n >> 6) & 63] : '=';
    out += '=';
  }
  return out;
}

json embedding_response(const std::string& model, const std::vector<std::vector<float>>& embeddings, bool base64,
                        int64_t prompt_tokens) {
  json data = json::array();
  for (size_t i = 0; i < embeddings.size(); ++i)
    data.push_back({{"object", "embedding"},
                    {"index", i},
                    {"embedding", base64 ? json(base64_f32(embeddings[i])) : json(embeddings[i])}});
  return {{"object", "list"},
          {"data", std::move(data)},
          {"model", model},
          {"usage", {{"prompt_tokens", prompt_tokens}, {"total_tokens", prompt_tokens}}}};
}

}  // namespace tessera::serve
