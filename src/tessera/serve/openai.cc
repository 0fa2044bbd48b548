// OpenAI request parsing and response building.
#include "tessera/serve/openai.h"

#include "tessera/serve/openai_echo.h"

#include <cmath>
#include <algorithm>
#include <cctype>

#include "tessera/infer/offline.h"
#include "tessera/io/json_file.h"
#include "tessera/io/pretokenize.h"

namespace tessera::serve {
namespace {

using nlohmann::json;

constexpr int kMaxBodyDepth = 64;  // OpenAI bodies nest < 10 deep (tools' JSON schemas a few more)

// Fields that change what a request means but that the engine cannot honour: refused
// rather than silently ignored. (Unknown fields are ignored, as OpenAI-compatible servers do.)
constexpr int64_t kMaxChoices = 512;  // prompts x n per request

// An integer field in [lo, hi], else a 400 naming it (integers beyond int64 included).
int64_t int_field(const json& b, const char* key, int64_t lo, int64_t hi) {
  const json& v = b[key];
  if (!io::json_int_in(v, lo, hi))
    bad_request(key, std::string(key) + " must be an integer in [" + std::to_string(lo) + ", " + std::to_string(hi) +
                         "], got " + io::json_brief(v));
  return v.get<int64_t>();
}

void refuse_unsupported(const json& b) {
  auto truthy = [&](const char* k) {
    auto it = b.find(k);
    if (it == b.end() || it->is_null()) return false;
    if (it->is_boolean()) return it->get<bool>();
    if (it->is_array() || it->is_object() || it->is_string()) return !it->empty();
    return true;
  };
  if (truthy("suffix")) bad_request("suffix", "suffix is not supported");
  // best_of > n is beam search's width (use_beam_search); SamplingParams refuses it otherwise.
  if (auto it = b.find("best_of"); it != b.end() && !it->is_null()) {
    int_field(b, "best_of", 1, kMaxChoices);
  }
}

std::vector<int32_t> token_list(const json& a, const std::string& param, int64_t vocab) {
  std::vector<int32_t> ids;
  for (const auto& t : a) {
    if (!t.is_number_integer()) bad_request(param, param + " must be a string or a list of token ids");
    if (!io::json_int_in(t, 0, vocab - 1))
      bad_request(param, param + " has token id " + t.dump() + " outside the vocabulary [0, " +
                             std::to_string(vocab) + ")");
    const int64_t v = t.get<int64_t>();
    ids.push_back(static_cast<int32_t>(v));
  }
  return ids;
}

std::vector<int32_t> encode_text(const std::string& text, const std::string& param, const ModelInfo& m,
                                 bool add_special) {
  if (!m.tokenizer) bad_request(param, "the served model has no tokenizer; send token ids");
  return m.tokenizer->encode(text, add_special);
}

// Completions' prompt: a string, a list of strings, a list of ids, or a list of id lists.
std::vector<std::vector<int32_t>> completion_prompts(const json& b, const ModelInfo& m) {
  auto it = b.find("prompt");
  if (it == b.end() || it->is_null()) bad_request("prompt", "prompt is required");
  const json& p = *it;
  std::vector<std::vector<int32_t>> out;
  if (p.is_string()) {
    out.push_back(encode_text(p.get<std::string>(), "prompt", m, true));
  } else if (p.is_array()) {
    if (p.empty()) bad_request("prompt", "prompt must not be empty");
    if (p[0].is_number_integer()) {
      out.push_back(token_list(p, "prompt", m.vocab_size));
    } else {
      if (p.size() > 256) bad_request("prompt", "at most 256 prompts per request");
      for (const auto& e : p) {
        if (e.is_string()) out.push_back(encode_text(e.get<std::string>(), "prompt", m, true));
        else if (e.is_array()) out.push_back(token_list(e, "prompt", m.vocab_size));
        else bad_request("prompt", "prompt must be a string, a list of strings or a list of token ids");
      }
    }
  } else {
    bad_request("prompt", "prompt must be a string, a list of strings or a list of token ids");
  }
  for (const auto& ids : out)
    if (ids.empty()) bad_request("prompt", "prompt must not be empty");
  return out;
}

// Chat messages, checked and normalised (content parts joined into one string).
jinja::Value chat_messages(const nlohmann::ordered_json& b) {
  auto it = b.find("messages");
  if (it == b.end() || it->is_null()) bad_request("messages", "messages is required");
  if (!it->is_array()) bad_request("messages", "messages must be a list of {role, content} objects");
  if (it->empty()) bad_request("messages", "messages must not be empty");
  static const char* kRoles[] = {"system", "developer", "user", "assistant", "tool"};
  jinja::Value out = jinja::Value::array();
  for (size_t i = 0; i < it->size(); ++i) {
    const auto& m = (*it)[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) bad_request(where, where + " must be an object with role and content");
    auto role = m.find("role");
    if (role == m.end() || !role->is_string()) bad_request(where + ".role", where + ".role must be a string");
    const std::string r = role->get<std::string>();
    if (std::find(std::begin(kRoles), std::end(kRoles), r) == std::end(kRoles))
      bad_request(where + ".role", where + ".role '" + r + "' is not one of system, developer, user, assistant, tool");
    auto content = m.find("content");
    std::string text;
    const bool calls = r == "assistant" && m.contains("tool_calls") && m["tool_calls"].is_array() &&
                       !m["tool_calls"].empty();
    if ((content == m.end() || content->is_null()) && calls) {
      // An assistant turn that only calls tools: the template gets "" (as vLLM hands it over).
    } else if (content == m.end() || content->is_null()) {
      bad_request(where + ".content", where + ".content is required");
    } else if (content->is_string()) {
      text = content->get<std::string>();
    } else if (content->is_array()) {
      for (size_t k = 0; k < content->size(); ++k) {
        const auto& part = (*content)[k];
        const std::string pw = where + ".content[" + std::to_string(k) + "]";
        if (!part.is_object() || !part.contains("type") || part["type"] != "text" || !part.contains("text") ||
            !part["text"].is_string())
          bad_request(pw, pw + " must be {\"type\": \"text\", \"text\": ...}; other content parts are not supported");
        text += part["text"].get<std::string>();
      }
    } else {
      bad_request(where + ".content", where + ".content must be a string or a list of text parts");
    }
    jinja::Value msg = {{"role", r}, {"content", text}};
    if (m.contains("name") && m["name"].is_string()) msg["name"] = m["name"];
    add_message_tool_fields(m, where, msg);
    out.push_back(std::move(msg));
  }
  return out;
}

// The last object key ("name" followed by ':') in text[0, end), when it is a plain
// identifier of at most 64 bytes. A linear scan (std::regex recurses per character and a
// megabyte key would overflow the stack).
std::string last_key_before(const std::string& text, size_t end) {
  std::string key;
  size_t i = 0;
  while (i < end) {
    if (text[i] != '"') {
      ++i;
      continue;
    }
    size_t j = i + 1;
    while (j < end && text[j] != '"') j += text[j] == '\\' ? 2 : 1;
    if (j >= end) break;
    size_t k = j + 1;
    while (k < end && (text[k] == ' ' || text[k] == '\t' || text[k] == '\n' || text[k] == '\r')) ++k;
    if (k < end && text[k] == ':') {
      const std::string name = text.substr(i + 1, j - i - 1);
      const bool ident = !name.empty() && name.size() <= 64 && !std::isdigit(static_cast<unsigned char>(name[0])) &&
                         std::all_of(name.begin(), name.end(), [](char c) {
                           return std::isalnum(static_cast<unsigned char>(c)) || c == '_';
                         });
      if (ident) key = name;
    }
    i = j + 1;
  }
  return key;
}

bool get_bool(const json& b, const char* key, bool dflt) {
  auto it = b.find(key);
  if (it == b.end() || it->is_null()) return dflt;
  if (!it->is_boolean()) bad_request(key, std::string(key) + " must be true or false");
  return it->get<bool>();
}

}  // namespace

void bad_request(const std::string& param, const std::string& message, const std::string& code) {
  throw ApiError(400, "invalid_request_error", param, code, message);
}

json error_body(const std::string& message, const std::string& type, const std::string& param,
                const std::string& code) {
  return {{"error",
           {{"message", message},
            {"type", type},
            {"param", param.empty() ? json(nullptr) : json(param)},
            {"code", code.empty() ? json(nullptr) : json(code)}}}};
}

json parse_body(const std::string& text) {
  // Nesting is bounded before the DOM exists: a body nested 10^6 deep would parse (nlohmann
  // is iterative) and then overflow the stack when copied, compared or dumped.
  if (const size_t at = io::find_json_nesting_over(text, kMaxBodyDepth); at != std::string::npos)
    throw ApiError(400, "invalid_request_error", "", "invalid_json",
                   "the request body nests arrays/objects deeper than " + std::to_string(kMaxBodyDepth) +
                       " levels (at byte " + std::to_string(at) + ")");
  try {
    return json::parse(text);
  } catch (const json::parse_error& e) {
    std::string param;
    const std::string what = e.what();
    if (what.find("UTF-8") != std::string::npos) {
      // Name the field whose value holds the bad bytes: the last "key": before the error.
      param = last_key_before(text, std::min<size_t>(e.byte, text.size()));
      throw ApiError(400, "invalid_request_error", param, "invalid_utf8",
                     "the request body is not valid UTF-8" + (param.empty() ? "" : " (in '" + param + "')"));
    }
    throw ApiError(400, "invalid_request_error", "", "invalid_json",
                   "the request body is not valid JSON: " + io::json_error_text(e));
  } catch (const json::exception& e) {  // out_of_range.406: a number such as 1e999
    throw ApiError(400, "invalid_request_error", "", "invalid_json",
                   "the request body is not valid JSON: " + io::json_error_text(e));
  }
}

std::string resolve_model(const json& b, const ModelInfo& m, int32_t* adapter) {
  *adapter = -1;
  auto it = b.find("model");
  if (it == b.end() || it->is_null()) return m.name;
  if (!it->is_string()) bad_request("model", "model must be a string");
  std::string model = it->get<std::string>();
  const auto a = std::find(m.adapters.begin(), m.adapters.end(), model);
  if (a != m.adapters.end()) {
    *adapter = static_cast<int32_t>(a - m.adapters.begin());
  } else if (model != m.name) {
    std::string served = "'" + m.name + "'";
    for (const auto& name : m.adapters) served += ", '" + name + "'";
    // 404, as OpenAI and vLLM answer (the openai clients raise NotFoundError).
    throw ApiError(404, "invalid_request_error", "model", "model_not_found",
                   "the model '" + model + "' does not exist; this server serves " + served);
  }
  return model;
}

static ApiRequest parse_request_checked(const json& b, Endpoint endpoint, const ModelInfo& m,
                                        const std::string& raw_body) {
  if (!b.is_object()) bad_request("", "the request body must be a JSON object");
  ApiRequest r;
  r.endpoint = endpoint;
  r.model = resolve_model(b, m, &r.adapter);
  check_request_fields(b);
  refuse_unsupported(b);
  if (auto it = b.find("user"); it != b.end() && !it->is_null()) {
    if (!it->is_string()) bad_request("user", "user must be a string");
    r.user = it->get<std::string>();
  }
  r.stream = get_bool(b, "stream", false);
  if (auto it = b.find("stream_options"); it != b.end() && !it->is_null()) {
    if (!it->is_object()) bad_request("stream_options", "stream_options must be an object");
    if (!r.stream) bad_request("stream_options", "stream_options is only allowed with stream: true");
    r.include_usage = get_bool(*it, "include_usage", false);
    r.continuous_usage = get_bool(*it, "continuous_usage_stats", false);
  }
  r.return_token_ids = get_bool(b, "return_token_ids", true);

  // Sampling: OpenAI's defaults (temperature 1), the engine's names and checks.
  infer::SamplingParams defaults;
  defaults.temperature = 1.f;
  // Chat without max_tokens gets the rest of the context, set once the prompt length is known.
  defaults.max_tokens = endpoint == Endpoint::kCompletions ? m.default_max_tokens : 1;
  // max_tokens beyond the context can never be honoured: refused here by name, so nothing
  // downstream adds it to a length (2^63 - 1 would overflow the context check).
  for (const char* k : {"max_tokens", "max_completion_tokens"}) {
    auto it = b.find(k);
    if (it == b.end() || !it->is_number_integer()) continue;
    if (!io::json_int_in(*it, INT64_MIN, m.streaming ? ModelInfo::kMaxStreamLen : m.max_model_len))
      bad_request(k, std::string(k) + " " + it->dump() + " exceeds this model's context length of " +
                         std::to_string(m.max_model_len) + " tokens", "context_length_exceeded");
    // echo with max_tokens 0: the prompt alone, scored (OpenAI's legacy idiom, vLLM too).
    const bool echo_only = endpoint == Endpoint::kCompletions && b.contains("echo") && b["echo"] == true &&
                           it->get<int64_t>() == 0;
    if (it->get<int64_t>() < 1 && !echo_only)
      bad_request(k, std::string(k) + " must be >= 1" +
                         (endpoint == Endpoint::kCompletions ? " (0 only with echo)" : ""));
    if (echo_only) r.echo_only = true;
  }
  if (endpoint == Endpoint::kChat) {
    // Chat: logprobs is a boolean and top_logprobs the count.
    if (auto it = b.find("logprobs"); it != b.end() && !it->is_null() && !it->is_boolean())
      bad_request("logprobs", "logprobs must be true or false for chat completions");
    r.chat_logprobs = get_bool(b, "logprobs", false);
    if (auto it = b.find("top_logprobs"); it != b.end() && !it->is_null()) {
      if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > 20)
        bad_request("top_logprobs", "top_logprobs must be an integer in [0, 20]");
      if (!r.chat_logprobs) bad_request("top_logprobs", "top_logprobs needs logprobs: true");
    }
  } else if (auto it = b.find("logprobs"); it != b.end() && it->is_boolean()) {
    bad_request("logprobs", "logprobs must be an integer in [0, 20] for completions");
  }
  json sj = b;
  if (r.echo_only)  // the engine runs the prefill and one token, which the response leaves out
    for (const char* k : {"max_tokens", "max_completion_tokens"})
      if (sj.contains(k) && sj[k] == 0) sj[k] = 1;
  if (endpoint == Endpoint::kChat && !r.chat_logprobs) sj.erase("logprobs");
  try {
    r.params = infer::sampling_params_from_json(sj, "request", defaults);
  } catch (const FieldError& e) {
    std::string msg = e.what();
    if (msg.rfind("request: ", 0) == 0) msg.erase(0, 9);
    bad_request(e.field(), msg);
  } catch (const Error& e) {
    bad_request("", e.what());
  }
  const bool max_given = (b.contains("max_tokens") && !b["max_tokens"].is_null()) ||
                         (b.contains("max_completion_tokens") && !b["max_completion_tokens"].is_null());
  if (r.params.stop.size() > 16) bad_request("stop", "at most 16 stop strings");
  for (const auto& s : r.params.stop)
    if (s.size() > 1024) bad_request("stop", "a stop string is longer than 1024 bytes");
  if (auto e = r.params.find_error(m.vocab_size)) bad_request(e->field, e->message);

  std::string prompt_param = "prompt";
  if (endpoint == Endpoint::kChat) {
    prompt_param = "messages";
    // Key order matters to templates (tool schemas are printed): read from the text again.
    const nlohmann::ordered_json ob = raw_body.empty() ? nlohmann::ordered_json(b) : nlohmann::ordered_json::parse(raw_body);
    const jinja::Value msgs = chat_messages(ob);
    r.tools = parse_tool_request(ob, m.tool_parser);
    if (const auto g = forced_tool_guided(r.tools); !g.empty()) {
      if (!r.params.guided.empty())
        bad_request("tool_choice", "tool_choice \"required\" or a named function cannot be combined with response_format");
      r.params.guided = g;
    }
    jinja::Value extra = jinja::Value::object();
    if (!r.tools.tools.is_null()) extra["tools"] = r.tools.tools;
    if (!m.tokenizer || !m.chat_template) bad_request("messages", "the served model has no tokenizer for chat");
    bool add_generation_prompt = get_bool(b, "add_generation_prompt", true);
    std::string text;
    try {
      text = m.chat_template->render(msgs, add_generation_prompt, extra);
    } catch (const Error& e) {
      bad_request("messages", std::string("the chat template rejected the messages: ") + e.what());
    }
    r.prompts.push_back(m.tokenizer->encode(text, false));
    if (r.prompts.back().empty()) bad_request("messages", "the messages render to an empty prompt");
  } else {
    if (auto it = b.find("tools"); it != b.end() && !it->is_null() && !(it->is_array() && it->empty()))
      bad_request("tools", "tools are only supported by /v1/chat/completions");
    r.prompts = completion_prompts(b, m);
  }
  parse_echo(b, m, r);  // echo, and the prompt_logprobs the response reports (openai_echo.cc)
  // Context: prompt + max_tokens must fit (chat without max_tokens gets the rest).
  for (const auto& p : r.prompts) {
    const int64_t len = static_cast<int64_t>(p.size());
    if (m.streaming) {  // attention sinks: only max_tokens bounds a stream; chat defaults to a context's worth
      if (!max_given && endpoint == Endpoint::kChat) r.params.max_tokens = m.max_model_len;
      continue;
    }
    if (len >= m.max_model_len)
      bad_request(prompt_param, "the prompt has " + std::to_string(len) + " tokens; this model's context length is " +
                                    std::to_string(m.max_model_len), "context_length_exceeded");
    if (!max_given && endpoint == Endpoint::kChat) {
      r.params.max_tokens = m.max_model_len - len;
    } else if (r.params.max_tokens > m.max_model_len - len) {
      bad_request(b.contains("max_completion_tokens") ? "max_completion_tokens" : "max_tokens",
                  "this model's context length is " + std::to_string(m.max_model_len) + " tokens, but " +
                      std::to_string(len) + " prompt tokens plus max_tokens " + std::to_string(r.params.max_tokens) +
                      " exceed it", "context_length_exceeded");
    }
  }
  if (r.choices() > kMaxChoices) bad_request("n", "prompts times n must be at most " + std::to_string(kMaxChoices));
  return r;
}

ApiRequest parse_request(const json& b, Endpoint endpoint, const ModelInfo& m, const std::string& raw_body) {
  // Every field is type-checked above; this is the backstop that keeps a JSON-library type
  // error about the client's body a 400, never a 500.
  try {
    return parse_request_checked(b, endpoint, m, raw_body);
  } catch (const json::exception& e) {
    bad_request("", "invalid request: " + io::json_error_text(e));
  }
}

json usage_json(int64_t prompt_tokens, int64_t completion_tokens, int64_t cached_tokens) {
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens},
          {"prompt_tokens_details", {{"cached_tokens", cached_tokens}}}};
}

namespace {

// A token's text for logprobs: its bytes when they are whole UTF-8, else vLLM's
// "bytes:\xNN..." form (JSON strings must be valid UTF-8).
std::string token_text(const io::Tokenizer* tok, int32_t id, std::string* raw = nullptr) {
  std::string bytes;
  if (tok && id >= 0 && id < tok->vocab_size()) {
    try {
      bytes = tok->decode_token(id);
    } catch (const Error&) {
      bytes.clear();
    }
  }
  if (!tok) bytes = "<|" + std::to_string(id) + "|>";
  if (raw) *raw = bytes;
  if (io::find_invalid_utf8(bytes) == std::string::npos) return bytes;
  std::string out = "bytes:";
  char buf[8];
  for (unsigned char c : bytes) {
    std::snprintf(buf, sizeof buf, "\\x%02x", c);
    out += buf;
  }
  return out;
}

json byte_list(const std::string& s) {
  json a = json::array();
  for (unsigned char c : s) a.push_back(static_cast<int>(c));
  return a;
}

// -inf (a token the sampler excluded) cannot be JSON; OpenAI clients expect numbers.
double finite(float x) { return std::isfinite(x) ? x : -9999.0; }

}  // namespace

std::string logprob_token_text(const io::Tokenizer* tok, int32_t id) { return token_text(tok, id); }

json completion_logprobs(const std::vector<infer::SampleResult>& lps, const io::Tokenizer* tok, int64_t offset) {
  json tokens = json::array(), token_lps = json::array(), tops = json::array(), offsets = json::array();
  for (const auto& r : lps) {
    const std::string t = token_text(tok, r.token);
    tokens.push_back(t);
    token_lps.push_back(finite(r.logprob));
    json top = json::object();
    for (const auto& a : r.top_logprobs) top[token_text(tok, a.token)] = finite(a.logprob);
    tops.push_back(std::move(top));
    offsets.push_back(offset);
    offset += static_cast<int64_t>(t.size());
  }
  return {{"tokens", tokens}, {"token_logprobs", token_lps}, {"top_logprobs", tops}, {"text_offset", offsets}};
}

json chat_logprobs(const std::vector<infer::SampleResult>& lps, const io::Tokenizer* tok) {
  json content = json::array();
  for (const auto& r : lps) {
    std::string raw;
    const std::string t = token_text(tok, r.token, &raw);
    json top = json::array();
    for (const auto& a : r.top_logprobs) {
      std::string araw;
      const std::string at = token_text(tok, a.token, &araw);
      top.push_back({{"token", at}, {"logprob", finite(a.logprob)}, {"bytes", byte_list(araw)}});
    }
    content.push_back({{"token", t}, {"logprob", finite(r.logprob)}, {"bytes", byte_list(raw)}, {"top_logprobs", top}});
  }
  return {{"content", content}};
}

}  // namespace tessera::serve
