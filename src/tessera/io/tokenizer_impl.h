// Internals of Tokenizer shared by tokenizer.cc (encode / decode) and tokenizer_load.cc
// (building it from tokenizer.json). Not part of the public API.
#pragma once
#include <array>
#include <atomic>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tessera/io/pretokenize.h"
#include "tessera/io/tokenizer.h"

namespace tessera::io {
namespace detail {
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <typename V>
using StringMap = std::unordered_map<std::string, V, StringHash, std::equal_to<>>;

inline uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

// Decodes the code point at s[i] (valid UTF-8) and its length.
inline uint32_t code_point_at(std::string_view s, size_t i, int* len) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data()) + i;
  if (p[0] < 0x80) return *len = 1, p[0];
  if (p[0] < 0xE0) return *len = 2, ((p[0] & 0x1F) << 6) | (p[1] & 0x3F);
  if (p[0] < 0xF0) return *len = 3, ((p[0] & 0x0F) << 12) | ((p[1] & 0x3F) << 6) | (p[2] & 0x3F);
  return *len = 4, ((p[0] & 0x07) << 18) | ((p[1] & 0x3F) << 12) | ((p[2] & 0x3F) << 6) | (p[3] & 0x3F);
}

// Unicode White_Space (Rust's char::is_whitespace, used for lstrip / rstrip).
inline bool is_white_space(uint32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

struct AddedToken {
  std::string content;  // what is matched (normalized for normalized tokens)
  int32_t id = -1;
  bool lstrip = false, rstrip = false;
};

// A piece of text: an added token (id >= 0) or text to pre-tokenize (id == -1).
struct Segment {
  std::string_view text;
  int32_t id;
};

// Splits text on added tokens, leftmost match first and the longest of those (the rule of
// Hugging Face's aho-corasick LeftmostLongest), with lstrip / rstrip eating whitespace. A
// byte trie finds the longest token at a position in one walk: Gemma has 6415 added
// tokens, 6300 of them starting with '<'.
class AddedMatcher {
 public:
  void add(AddedToken t) {
    if (t.content.empty()) return;
    tokens_.push_back(std::move(t));
  }
  void finish() {
    nodes_.assign(1, Node{});
    root_.fill(-1);
    for (size_t i = 0; i < tokens_.size(); ++i) {
      int32_t n = 0;
      for (unsigned char c : tokens_[i].content) n = walk_or_add(n, c);
      if (nodes_[n].token < 0) nodes_[n].token = static_cast<int32_t>(i);  // the first of equal contents wins
    }
  }
  bool empty() const { return tokens_.empty(); }

  void split(std::string_view s, std::vector<Segment>* out) const {
    size_t done = 0;  // end of the previous segment
    for (size_t i = 0; i < s.size(); ++i) {
      int32_t n = root_[static_cast<uint8_t>(s[i])];
      if (n < 0) continue;
      const AddedToken* hit = nullptr;
      size_t hit_end = 0;
      for (size_t j = i + 1;; ++j) {
        if (nodes_[n].token >= 0) {
          hit = &tokens_[nodes_[n].token];
          hit_end = j;
        }
        if (j == s.size() || (n = walk(n, static_cast<uint8_t>(s[j]))) < 0) break;
      }
      if (!hit) continue;
      size_t start = i, stop = hit_end;
      if (hit->lstrip) {
        while (start > done) {
          size_t prev = start - 1;
          while (prev > done && (static_cast<uint8_t>(s[prev]) & 0xC0) == 0x80) --prev;
          int len;
          if (!is_white_space(code_point_at(s, prev, &len))) break;
          start = prev;
        }
      }
      if (hit->rstrip) {
        int len;
        while (stop < s.size() && is_white_space(code_point_at(s, stop, &len))) stop += len;
      }
      if (start > done) out->push_back({s.substr(done, start - done), -1});
      out->push_back({s.substr(start, stop - start), hit->id});
      done = stop;
      i = stop - 1;
    }
    if (done < s.size()) out->push_back({s.substr(done), -1});
  }

 private:
  struct Node {
    int32_t token = -1;                              // index into tokens_ ending here
    std::vector<std::pair<uint8_t, int32_t>> next;  // byte -> node
  };
  int32_t walk(int32_t n, uint8_t c) const {  // the node after `n` on byte c; -1 when none
    if (n == 0) return root_[c];
    for (const auto& [b, m] : nodes_[n].next)
      if (b == c) return m;
    return -1;
  }
  int32_t walk_or_add(int32_t n, uint8_t c) {
    if (const int32_t m = walk(n, c); m >= 0) return m;
    nodes_.push_back(Node{});
    const int32_t m = static_cast<int32_t>(nodes_.size() - 1);
    nodes_[n].next.push_back({c, m});
    if (n == 0) root_[c] = m;
    return m;
  }
  std::vector<AddedToken> tokens_;
  std::vector<Node> nodes_ = std::vector<Node>(1);  // [0] is the root
  std::array<int32_t, 256> root_ = filled(-1);  // node of each first byte; -1 when no token starts with it
  static std::array<int32_t, 256> filled(int32_t v) {
    std::array<int32_t, 256> a;
    a.fill(v);
    return a;
  }
};

// (left id, right id) -> (rank, merged id), open addressing: one probe is one cache line,
// which matters because BPE looks a pair up for every merge it considers.
class MergeTable {
 public:
  struct Entry {
    uint64_t key = kEmpty;
    int32_t rank = 0, id = 0;
  };
  // A key given twice keeps its last value (as a map built from the merges list does).
  void assign(const std::vector<Entry>& entries) {
    size_t cap = 16;
    while (cap < entries.size() * 2) cap *= 2;
    table_.assign(cap, Entry{});
    mask_ = cap - 1;
    for (const Entry& e : entries) *slot(e.key) = e;
  }
  const Entry* find(int32_t a, int32_t b) const {
    if (table_.empty()) return nullptr;
    const Entry* e = slot(pair_key(a, b));
    return e->key == kEmpty ? nullptr : e;
  }

 private:
  static constexpr uint64_t kEmpty = ~0ull;
  Entry* slot(uint64_t key) const {
    size_t i = (key * 0x9E3779B97F4A7C15ull) >> 20 & mask_;
    while (table_[i].key != kEmpty && table_[i].key != key) i = (i + 1) & mask_;
    return const_cast<Entry*>(&table_[i]);
  }
  std::vector<Entry> table_;
  size_t mask_ = 0;
};

inline std::atomic<uint64_t> next_serial{1};

// One step of a SentencePiece-style decoder (Hugging Face's decoders, each applied in turn
// to the list of token strings; the result is their concatenation).
struct DecodeStep {
  char kind = 'f';             // 'r' Replace, 'b' ByteFallback, 'f' Fuse, 's' Strip, 'm' Metaspace
  std::string from, to;        // Replace: pattern -> content; Strip, Metaspace: their char in `from`
  size_t start = 0, stop = 0;  // Strip: at most this many chars off the front / back
  bool prepend = true;         // Metaspace: prepend_scheme is not "never"
};

// tokenizer_spm.cc. Whether `decoder` (tokenizer.json's) makes the tokenizer SentencePiece-
// style: false for ByteLevel and null, true for Metaspace, Replace, ByteFallback, Fuse, Strip
// and Sequences of these; other types are errors naming the key at `where`.
bool is_sentencepiece_decoder(const nlohmann::json& decoder, const std::string& where);
std::vector<DecodeStep> read_decoder(const nlohmann::json& decoder, const std::string& where);
// The decoder on a whole sequence of token strings.
std::string run_decoder(const std::vector<DecodeStep>& steps, std::vector<std::string> tokens);
// The bytes one token adds in the middle of a sequence (streaming): the decoder's per-token
// rules, a byte-fallback token as its raw byte, nothing stripped.
std::string stream_bytes(const std::vector<DecodeStep>& steps, std::string_view token);
// The byte of a "<0xNN>" token (as ByteFallback reads it), or -1.
int byte_fallback_value(std::string_view token);

}  // namespace detail

struct Tokenizer::Impl {
  using AddedMatcher = detail::AddedMatcher;
  template <typename V>
  using StringMap = detail::StringMap<V>;
  std::string source;
  nlohmann::json json, config;
  std::string chat_template, chat_template_origin;  // chat_template_source() of the config (and directory)
  Normalizer normalizer;
  PreTokenizer pre_tokenizer;
  std::vector<std::string> id_token;  // tokenizer.json form per id; "" when the id is unused
  // Byte-level BPE (GPT-2's alphabet; `decoder` ByteLevel) or SentencePiece-style BPE (tokens
  // are text with "▁" for spaces, chars missing from the vocabulary become "<0xNN>" tokens).
  bool sentencepiece = false;
  std::vector<std::string> id_bytes;  // bytes per id: the ByteLevel decoder's rule, or stream_bytes()
  std::vector<uint8_t> id_used, id_special;
  StringMap<int32_t> token_ids;       // tokenizer.json form -> id (added tokens win)
  StringMap<int32_t> bytes_ids;       // model vocabulary: bytes (byte-level) or text (sentencepiece) -> id
  std::array<int32_t, 256> byte_ids;  // single-byte tokens; -1 when missing
  bool byte_fallback = false;
  std::array<int32_t, 256> byte_fallback_ids;  // "<0xNN>" tokens; -1 when missing
  std::vector<detail::DecodeStep> decoder;     // sentencepiece only
  int32_t unk_id = -1;
  bool fuse_unk = false;
  detail::MergeTable merges;
  bool ignore_merges = false;
  AddedMatcher raw_added, normalized_added;
  std::vector<int32_t> prefix, suffix;  // added around the text when add_special_tokens
  int32_t bos = -1, eos = -1;
  uint64_t serial = detail::next_serial++;
  // Per thread: each thread keeps its own pre-token -> ids cache of at most this many bytes.
  mutable std::atomic<int64_t> piece_cache_bytes{int64_t{32} << 20};

  void merge_word(std::string_view piece, std::vector<int32_t>* out) const;
  void merge_ids(std::vector<int32_t>& ids, std::vector<int32_t>* out) const;
  // SentencePiece-style: a piece's chars as ids before merging (byte fallback, unk).
  void spm_symbols(std::string_view piece, std::vector<int32_t>* ids) const;
  void merge_word_heap(const std::vector<int32_t>& ids, std::vector<int32_t>* out) const;
  void encode_piece(std::string_view piece, std::vector<int32_t>* out) const;
  void encode_text(std::string_view text, bool at_start, std::vector<int32_t>* out) const;
};


}  // namespace tessera::io
