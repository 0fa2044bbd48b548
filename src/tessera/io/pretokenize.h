// The text side of byte-level BPE, shared by the tokenizer and its trainer: UTF-8 checks,
// GPT-2's byte <-> unicode table, Unicode normalizers and the regex pre-tokenizer (PCRE2).
#pragma once
#include <array>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace tessera::io {

// GPT-2's split pattern, implied by a ByteLevel pre-tokenizer with use_regex = true.
inline constexpr const char* kGpt2SplitPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Byte offset of the first invalid UTF-8 sequence in s (overlong forms, surrogates and
// code points past U+10FFFF are invalid), or std::string_view::npos when s is valid.
size_t find_invalid_utf8(std::string_view s);

// s with each invalid sequence replaced by U+FFFD, one per maximal subpart (the rule of
// Rust's String::from_utf8_lossy, which Hugging Face's decode uses, and Python's "replace").
std::string utf8_lossy(std::string_view s);

// GPT-2's bytes_to_unicode(): each byte maps to one printable code point, so any byte
// string becomes a printable token string. byte_level_char(b) is that char as UTF-8.
const std::string& byte_level_char(uint8_t b);
// The bytes in the order of GPT-2's `bs` list (printable ASCII, then Latin-1, then the
// rest); a trained vocabulary gives byte byte_level_order()[i] the id i, as GPT-2 does.
const std::array<uint8_t, 256>& byte_level_order();
std::string bytes_to_byte_level(std::string_view bytes);
// The inverse; false when some char of `token` is not in the byte-level alphabet.
bool byte_level_to_bytes(std::string_view token, std::string* bytes);

// A PCRE2 pattern compiled with UTF, UCP and JIT. \s and \S are rewritten to Unicode's
// White_Space set (what Oniguruma, used by Hugging Face, and Python's `regex` match):
// PCRE2's own \s also matches U+180E.
class SplitRegex {
 public:
  // `where` names the pattern's origin in errors ("pre_tokenizer.pretokenizers[0].pattern").
  SplitRegex(const std::string& pattern, bool literal, const std::string& where);
  // Appends the non-empty pieces of s: the matches and the gaps between them ("Isolated"),
  // or only the gaps ("Removed"). s must be valid UTF-8 (checked once by the caller).
  void split(std::string_view s, bool keep_matches, std::vector<std::string_view>* out) const;

 private:
  std::shared_ptr<void> code_;  // pcre2_code_8
  std::string where_;
};

// Unicode normalizer from tokenizer.json: null, NFC, NFD, NFKC, NFKD or a Sequence of them.
class Normalizer {
 public:
  static Normalizer from_json(const nlohmann::json& j, const std::string& where);
  bool empty() const { return forms_.empty(); }
  std::string apply(std::string_view s) const;

 private:
  std::vector<int> forms_;  // utf8proc option sets, applied in order
};

// Pre-tokenizer from tokenizer.json: a ByteLevel step, Split steps with a regex or string
// pattern, or a Sequence of those. It must contain a ByteLevel step (this is byte-level BPE).
class PreTokenizer {
 public:
  static PreTokenizer from_json(const nlohmann::json& j, const std::string& where);
  // The trainer's: ByteLevel with `pattern` (empty = GPT-2's).
  static PreTokenizer byte_level(const std::string& pattern);
  // The tokenizer.json value for byte_level(pattern), in Hugging Face's shapes.
  static nlohmann::json byte_level_json(const std::string& pattern);

  // Splits normalized text into pre-tokens (bytes, before the byte-level mapping). Pieces
  // point into `text` or into strings kept in `arena` (a prefix space adds bytes).
  void split(std::string_view text, std::vector<std::string_view>* pieces,
             std::deque<std::string>* arena) const;

 private:
  struct Step {
    std::shared_ptr<const SplitRegex> regex;  // null: no split
    bool keep_matches = true;                 // Isolated (true) or Removed (false)
    bool add_prefix_space = false;            // ByteLevel's
  };
  std::vector<Step> steps_;
};

}  // namespace tessera::io
