// A model's chat template (Hugging Face tokenizer_config.json "chat_template") rendered with the
// Jinja interpreter, turning OpenAI-style messages into the prompt text the model was tuned on.
#pragma once
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "tessera/io/tokenizer.h"
#include "tessera/serve/jinja.h"

namespace tessera::serve {

class ChatTemplate {
 public:
  // The template in DIR/tokenizer_config.json ("chat_template": a string, or HF's list of
  // {"name", "template"} from which "default" is taken), else DIR/chat_template.jinja, else
  // ChatML. bos/eos come from the same config (strings or AddedToken objects).
  static ChatTemplate from_tokenizer_config(const std::string& model_dir);
  // The template a loaded tokenizer carries (io::Tokenizer::chat_template: from its model
  // directory or GGUF file), else ChatML; bos/eos from its config.
  static ChatTemplate from_tokenizer(const io::Tokenizer& tok);
  // The ChatML template transformers used as its default.
  static ChatTemplate chatml();
  // Throws tessera::Error on a template syntax error. `limits` bound every render (the
  // templates are untrusted); see jinja::Limits for the defaults and parse_template_limits.
  explicit ChatTemplate(std::string source, std::string bos_token = "", std::string eos_token = "",
                        jinja::Limits limits = {});

  // messages: [{"role": ..., "content": ...}, ...]; `extra` adds template variables (tools,
  // documents, ...). Errors (bad template, raise_exception, a broken limit) throw tessera::Error,
  // one line.
  std::string render(const nlohmann::json& messages, bool add_generation_prompt,
                     const nlohmann::json& extra = {}) const;
  // The same with ordered values (key order kept: tools' schemas print as the client sent them).
  std::string render(const jinja::Value& messages, bool add_generation_prompt, const jinja::Value& extra) const;

  const std::string& source() const { return source_; }
  const std::string& bos_token() const { return bos_token_; }
  const std::string& eos_token() const { return eos_token_; }
  const jinja::Limits& limits() const { return limits_; }
  // True when the model has no template and ChatML stands in (a base model, most likely:
  // chat replies may be poor). Said at start-up and in /v1/models.
  bool is_fallback() const { return fallback_; }
  void set_limits(const jinja::Limits& limits) { limits_ = limits; }

 private:
  // `source` ("" = ChatML) with bos/eos from `cfg`; errors name `where`.
  template <typename Json>
  void check_depth(const Json& messages, const Json& extra) const;  // throws past limits_.max_depth
  static ChatTemplate from_config(const nlohmann::json& cfg, const std::string& source, const std::string& where);
  std::string source_, bos_token_, eos_token_;
  bool fallback_ = false;
  jinja::Limits limits_;
  std::shared_ptr<const jinja::Template> template_;  // parsed once, shared by copies
};

}  // namespace tessera::serve
