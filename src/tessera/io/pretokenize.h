// The text side of BPE, shared by the tokenizer and its trainer: UTF-8 checks, GPT-2's
// byte <-> unicode table, normalizers and the regex / Metaspace pre-tokenizers (PCRE2).
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

// How a Split pre-tokenizer treats the matches of its pattern (Hugging Face's
// SplitDelimiterBehavior): dropped, kept alone, glued to the piece before / after, or
// runs of matches kept together.
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

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
  // Hugging Face's split for any behavior; `invert` swaps matches and gaps first.
  void split(std::string_view s, SplitBehavior behavior, bool invert, std::vector<std::string_view>* out) const;

 private:
  template <typename F>
  void for_each_match(std::string_view s, F&& f) const;  // f(start, end) per non-empty match
  std::shared_ptr<void> code_;  // pcre2_code_8
  std::string where_;
};

// Normalizer from tokenizer.json: null, NFC, NFD, NFKC, NFKD, Prepend, Replace (a String
// pattern) or a Sequence of them (Llama 2's is Sequence[Prepend("▁"), Replace(" ", "▁")]).
class Normalizer {
 public:
  static Normalizer from_json(const nlohmann::json& j, const std::string& where);
  bool empty() const { return steps_.empty(); }
  std::string apply(std::string_view s) const;

 private:
  struct Step {
    char kind = 'f';       // 'f': a Unicode normal form, 'p': Prepend, 'r': Replace
    int form = 0;          // utf8proc option set
    std::string text, to;  // Prepend: text; Replace: text -> to
  };
  std::vector<Step> steps_;  // applied in order
};

// Pre-tokenizer from tokenizer.json. Byte-level BPE: a ByteLevel step, Split steps with a
// regex or string pattern, or a Sequence of those, with a ByteLevel step last. SentencePiece-
// style BPE (byte_level false): null, Metaspace, Split or a Sequence of them, no ByteLevel.
class PreTokenizer {
 public:
  static PreTokenizer from_json(const nlohmann::json& j, const std::string& where, bool byte_level = true);
  // The trainer's: ByteLevel with `pattern` (empty = GPT-2's).
  static PreTokenizer byte_level(const std::string& pattern);
  // The tokenizer.json value for byte_level(pattern), in Hugging Face's shapes.
  static nlohmann::json byte_level_json(const std::string& pattern);

  // Splits normalized text into pre-tokens (bytes, before the byte-level mapping). Pieces
  // point into `text` or into strings kept in `arena` (a prefix space adds bytes).
  // `at_start`: the text begins the input (Metaspace's prepend_scheme "first" prepends only there).
  void split(std::string_view text, std::vector<std::string_view>* pieces,
             std::deque<std::string>* arena, bool at_start = true) const;

 private:
  struct Step {
    std::shared_ptr<const SplitRegex> regex;  // null: no split
    SplitBehavior behavior = SplitBehavior::kIsolated;
    bool invert = false;
    bool add_prefix_space = false;  // ByteLevel's
    std::string metaspace;          // Metaspace's replacement char; "" for other steps
    char prepend = 'a';             // Metaspace's prepend_scheme: 'a'lways, 'f'irst, 'n'ever
    bool metaspace_split = true;
  };
  void metaspace_step(const Step& st, std::string_view piece, bool at_start, std::vector<std::string_view>* out,
                      std::vector<uint8_t>* out_start, std::deque<std::string>* arena) const;
  std::vector<Step> steps_;
  bool track_start_ = false;  // some step has prepend_scheme "first"
};

}  // namespace tessera::io
