// BPE tokenizer read from and written to Hugging Face's tokenizer.json: byte-level (GPT-2,
// Llama 3, Qwen2, GPT-4o) or SentencePiece-style with byte fallback (Llama 2, Mistral,
// Gemma); and a trainer that produces a byte-level one. See docs/tokenizer.md.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace tessera::io {

class Tokenizer {
 public:
  // A directory (DIR/tokenizer.json, plus DIR/tokenizer_config.json if present for
  // add_bos_token / bos_token / eos_token) or the path of a tokenizer.json (a
  // tokenizer_config.json next to it is read too).
  static Tokenizer load(const std::string& path);
  // `source` names the origin in errors. `config` is tokenizer_config.json or null.
  static Tokenizer from_json(const nlohmann::json& j, const std::string& source,
                             const nlohmann::json& config = nullptr);

  // Added / special tokens inside the text are matched first (leftmost, then longest);
  // the rest is normalized, pre-tokenized and merged. With add_special_tokens the
  // post-processor's template (or add_bos_token) adds BOS / EOS. Text must be valid UTF-8.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = true) const;
  // Invalid ids are an error naming the id; invalid UTF-8 in the joined bytes becomes U+FFFD
  // (SentencePiece-style: the decoder's rules, e.g. Llama 2's leading space stripped).
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens = false) const;
  // The bytes one token adds in the middle of a sequence, for streaming generated tokens
  // (which always follow a prompt): may be a partial UTF-8 sequence (complete_utf8_prefix);
  // "▁" is a space and nothing is stripped.
  std::string decode_token(int32_t id) const;

  int64_t vocab_size() const;  // max id + 1 over the vocabulary and the added tokens
  int32_t token_to_id(std::string_view token) const;  // token as written in tokenizer.json; -1 when absent
  std::string id_to_token(int32_t id) const;          // as written in tokenizer.json; "" when absent
  int32_t bos_id() const;  // -1 when none
  int32_t eos_id() const;  // -1 when none
  bool add_bos() const;    // encode(..., true) starts with bos_id()
  bool is_special(int32_t id) const;
  // Bounds the pre-token -> ids cache each thread keeps for this tokenizer (32 MiB by
  // default; 0 turns it off). Only speed depends on it, so it may change at any time: a
  // server with a hundred HTTP threads gives each a small share.
  void set_piece_cache_bytes(int64_t bytes) const;

  nlohmann::json to_json() const;  // Hugging Face tokenizer.json schema
  nlohmann::json config_json() const;  // tokenizer_config.json
  // The chat template the model ships (chat_template_source below); "" when none. Its
  // origin (the config's path, or chat_template.jinja's) names it in errors.
  const std::string& chat_template() const;
  const std::string& chat_template_origin() const;
  // Writes DIR/tokenizer.json and DIR/tokenizer_config.json, each atomically; creates DIR.
  void save(const std::string& dir) const;

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  // from_json with the config's name for errors, the chat template also looked for in
  // `dir` (load).
  static Tokenizer build(const nlohmann::json& j, const std::string& source, const nlohmann::json& config,
                         const std::string& config_source, const std::string& dir);
  std::shared_ptr<const Impl> impl_;  // immutable; copies share it
};

// The chat template of a Hugging Face tokenizer config: "chat_template" as a string, or HF's
// list of {"name", "template"} whose "default" entry is taken; else, when `dir` is given,
// DIR/chat_template.jinja (newer transformers save it there). "" when there is none. Errors
// (a list without "default", another type, an unreadable file) name `config_source`.
// `origin` (optional) is set to config_source or the .jinja file's path.
std::string chat_template_source(const nlohmann::json& config, const std::string& config_source,
                                 const std::string& dir = "", std::string* origin = nullptr);

struct BpeTrainOptions {
  int64_t vocab_size = 4096;  // 256 bytes + merges + special tokens
  // Get the last ids, after the merges (as GPT-2's, Llama 3's and Qwen2's do). The first
  // is also the EOS token. They are split out of the training text, never merged into.
  std::vector<std::string> special_tokens = {"<|endoftext|>"};
  int64_t min_frequency = 2;  // a pair seen fewer times is never merged
  std::string pattern;        // pre-tokenizer split regex; empty = GPT-2's
  bool progress = true;       // ProgressBar on stderr
  int64_t model_max_length = 2048;  // written to tokenizer_config.json
};

// Trains byte-level BPE on the files (UTF-8 text). The most frequent pair is merged
// first; equal counts go to the pair whose (left bytes, right bytes) is smallest
// (bytewise). Errors: no files, an empty corpus, invalid UTF-8 (names the file and
// byte), vocab_size below 256 + specials or above what the corpus allows.
Tokenizer train_bpe(const std::vector<std::string>& files, const BpeTrainOptions& options);

// Bytes of `bytes` up to the last complete UTF-8 character: byte-level BPE tokens may end
// inside a character, so streamed text holds the rest back until the next token.
size_t complete_utf8_prefix(std::string_view bytes);

}  // namespace tessera::io
