// Loads chat templates from Hugging Face model directories and renders them.
#include "tessera/serve/chat_template.h"

#include <algorithm>
#include <filesystem>
#include <vector>

#include "tessera/base/error.h"
#include "tessera/io/json_file.h"
#include "tessera/serve/jinja.h"

namespace tessera::serve {
namespace {

const char* kChatML =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
    "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

// tokenizer_config.json stores special tokens as strings or as {"content": ..., "__type": "AddedToken"}.
std::string token_string(const nlohmann::json& cfg, const char* key, const std::string& path) {
  auto it = cfg.find(key);
  if (it == cfg.end() || it->is_null()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string())
    return (*it)["content"].get<std::string>();
  fail(path, ": key '", key, "' must be a string or an object with \"content\"");
}

// Nesting depth of a request value, iteratively, stopping once past `cap`.
template <typename Json>
int json_depth(const Json& v, int cap) {
  int depth = 0;
  std::vector<std::pair<const Json*, int>> stack{{&v, 1}};
  while (!stack.empty() && depth <= cap) {
    const auto [x, d] = stack.back();
    stack.pop_back();
    if (!x->is_structured()) continue;
    depth = std::max(depth, d);
    for (const auto& y : *x) stack.emplace_back(&y, d + 1);
  }
  return depth;
}

}  // namespace

template <typename Json>
void ChatTemplate::check_depth(const Json& messages, const Json& extra) const {
  for (const Json* v : {&messages, &extra})
    TESSERA_CHECK(json_depth(*v, limits_.max_depth) <= limits_.max_depth,
                  "chat template: messages or variables nested deeper than ", limits_.max_depth,
                  " levels (--chat-template-limits depth=...)");
}

ChatTemplate::ChatTemplate(std::string source, std::string bos_token, std::string eos_token, jinja::Limits limits)
    : source_(std::move(source)),
      bos_token_(std::move(bos_token)),
      eos_token_(std::move(eos_token)),
      limits_(limits),
      template_(std::make_shared<const jinja::Template>(source_)) {}

ChatTemplate ChatTemplate::chatml() {
  ChatTemplate t(kChatML);
  t.fallback_ = true;
  return t;
}

ChatTemplate ChatTemplate::from_tokenizer_config(const std::string& model_dir) {
  namespace fs = std::filesystem;
  const std::string path = (fs::path(model_dir) / "tokenizer_config.json").string();
  nlohmann::json cfg = nlohmann::json::object();
  if (fs::exists(path)) cfg = io::read_json_file(path);
  TESSERA_CHECK(cfg.is_object(), path, ": expected a JSON object");
  const bool in_config = cfg.contains("chat_template") && !cfg["chat_template"].is_null();
  return from_config(cfg, io::chat_template_source(cfg, path, model_dir),
                     in_config ? path : (fs::path(model_dir) / "chat_template.jinja").string());
}

ChatTemplate ChatTemplate::from_tokenizer(const io::Tokenizer& tok) {
  return from_config(tok.config_json(), tok.chat_template(), tok.chat_template_origin());
}

ChatTemplate ChatTemplate::from_config(const nlohmann::json& cfg, const std::string& source,
                                       const std::string& where) {
  const std::string bos = token_string(cfg, "bos_token", where), eos = token_string(cfg, "eos_token", where);
  try {
    ChatTemplate t(source.empty() ? std::string(kChatML) : source, bos, eos);
    t.fallback_ = source.empty();
    return t;
  } catch (const Error& e) {
    fail(where, ": ", e.what());
  }
}

std::string ChatTemplate::render(const nlohmann::json& messages, bool add_generation_prompt,
                                 const nlohmann::json& extra) const {
  TESSERA_CHECK(extra.is_null() || extra.is_object(), "chat template: extra variables must be a JSON object");
  check_depth(messages, extra);  // before dump(), which recurses
  return render(jinja::Value::parse(messages.dump()), add_generation_prompt,
                extra.is_null() ? jinja::Value::object() : jinja::Value::parse(extra.dump()));
}

std::string ChatTemplate::render(const jinja::Value& messages, bool add_generation_prompt,
                                 const jinja::Value& extra) const {
  TESSERA_CHECK(messages.is_array(), "chat template: messages must be a JSON array");
  TESSERA_CHECK(extra.is_null() || extra.is_object(), "chat template: extra variables must be a JSON object");
  check_depth(messages, extra);  // copies below recurse through the request's nesting
  jinja::Value globals = jinja::Value::object();
  globals["bos_token"] = bos_token_;
  globals["eos_token"] = eos_token_;
  if (extra.is_object())
    for (auto e = extra.begin(); e != extra.end(); ++e) globals[e.key()] = e.value();
  globals["messages"] = messages;
  globals["add_generation_prompt"] = add_generation_prompt;
  return template_->render(globals, limits_);
}

}  // namespace tessera::serve
