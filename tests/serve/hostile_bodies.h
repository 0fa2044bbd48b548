// Request bodies an attacker or a broken client sends, one per class of the hostile-input
// audit: each must get a 4xx with the OpenAI error shape and leave the server serving.
#pragma once
#include <string>
#include <vector>

namespace tessera::testing {

struct HostileBody {
  std::string name, path, body;
};

inline std::string nested_brackets(int depth, const std::string& inner) {
  return std::string(depth, '[') + inner + std::string(depth, ']');
}

inline std::vector<HostileBody> hostile_bodies() {
  const std::string C = "/v1/completions", H = "/v1/chat/completions";
  const std::string msg = R"("messages": [{"role": "user", "content": "hi"}])";
  return {
      // Nesting: an unused field 10^6 deep (2 MB); deep but under the body limit in objects.
      {"unused field nested 10^6 deep", C, "{\"prompt\": \"hi\", \"x\": " + nested_brackets(1000000, "") + "}"},
      {"objects nested 100000 deep", H,
       "{" + msg + ", \"y\": " + [] {
         std::string s;
         for (int i = 0; i < 100000; ++i) s += "{\"a\":";
         return s + "1" + std::string(100000, '}');
       }() + "}"},
      {"messages content nested", H, R"({"messages": [{"role": "user", "content": )" + nested_brackets(60, "\"x\"") + "}]}"},
      // Integers beyond every range.
      {"max_tokens 2^63-1", C, R"({"prompt": "hi", "max_tokens": 9223372036854775807})"},
      {"max_tokens 2^64-1", C, R"({"prompt": "hi", "max_tokens": 18446744073709551615})"},
      {"max_completion_tokens 2^63-1", H, "{" + msg + R"(, "max_completion_tokens": 9223372036854775807})"},
      {"n 2^63-1", C, R"({"prompt": "hi", "n": 9223372036854775807, "temperature": 1})"},
      {"best_of huge", C, R"({"prompt": "hi", "best_of": 18446744073709551615})"},
      {"logprobs 2^64-1", C, R"({"prompt": "hi", "logprobs": 18446744073709551615})"},
      {"top_logprobs 2^63", H, "{" + msg + R"(, "logprobs": true, "top_logprobs": 9223372036854775808})"},
      {"top_k 2^64-1", C, R"({"prompt": "hi", "top_k": 18446744073709551615})"},
      {"min_tokens 2^63-1", C, R"({"prompt": "hi", "min_tokens": 9223372036854775807})"},
      {"token id 2^40", C, R"({"prompt": [1, 1099511627776]})"},
      {"token id 2^64-1", C, R"({"prompt": [18446744073709551615]})"},
      {"stop_token_ids 2^40", C, R"({"prompt": "hi", "stop_token_ids": [1099511627776]})"},
      {"seed 2^64 (a float)", C, R"({"prompt": "hi", "seed": 18446744073709551616})"},
      // Floats beyond float's range (a plain cast would be undefined behaviour).
      {"temperature 1e300", C, R"({"prompt": "hi", "temperature": 1e300})"},
      {"top_p -1e300", C, R"({"prompt": "hi", "top_p": -1e300})"},
      {"presence_penalty 1e39", C, R"({"prompt": "hi", "presence_penalty": 1e39})"},
      // Wrongly typed fields in places parsed with defaults.
      {"n a string with best_of", C, R"({"prompt": "hi", "best_of": 2, "n": "3"})"},
      {"content part type a number", H, R"({"messages": [{"role": "user", "content": [{"type": 5, "text": "x"}]}]})"},
      {"content part not an object", H, R"({"messages": [{"role": "user", "content": [7]}]})"},
      {"response_format type a list", C, R"({"prompt": "hi", "response_format": {"type": [1]}})"},
      {"stream_options a list", C, R"({"prompt": "hi", "stream": true, "stream_options": [1]})"},
      {"stream_options.include_usage a string", C,
       R"({"prompt": "hi", "stream": true, "stream_options": {"include_usage": "yes"}})"},
      // Bodies of the wrong shape.
      {"body a string", C, R"("prompt")"},
      {"body null", H, "null"},
      {"body a number", C, "1e999"},
      // Invalid UTF-8 after a 1 MB key (a regex over the key would recurse per byte).
      {"bad UTF-8 after a 1 MB key", C, "{\"" + std::string(1 << 20, 'k') + "\": \"\xff\"}"},
      // Many prompts / stop strings.
      {"600 prompts", C, [] {
         std::string s = "{\"prompt\": [";
         for (int i = 0; i < 600; ++i) s += std::string(i ? "," : "") + "\"p\"";
         return s + "]}";
       }()},
      {"1000 stop strings", C, [] {
         std::string s = "{\"prompt\": \"hi\", \"stop\": [";
         for (int i = 0; i < 1000; ++i) s += std::string(i ? "," : "") + "\"s" + std::to_string(i) + "\"";
         return s + "]}";
       }()},
  };
}

}  // namespace tessera::testing
