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
// Hugging Face's aho-corasick LeftmostLongest), with lstrip / rstrip eating whitespace.
class AddedMatcher {
 public:
  void add(AddedToken t) {
    if (t.content.empty()) return;
    tokens_.push_back(std::move(t));
  }
  void finish() {
    for (auto& v : by_first_byte_) v.clear();
    for (size_t i = 0; i < tokens_.size(); ++i)
      by_first_byte_[static_cast<uint8_t>(tokens_[i].content[0])].push_back(static_cast<int>(i));
    for (auto& v : by_first_byte_)
      std::stable_sort(v.begin(), v.end(), [&](int a, int b) {
        return tokens_[a].content.size() > tokens_[b].content.size();
      });
  }
  bool empty() const { return tokens_.empty(); }

  void split(std::string_view s, std::vector<Segment>* out) const {
    size_t done = 0;  // end of the previous segment
    for (size_t i = 0; i < s.size(); ++i) {
      const auto& cands = by_first_byte_[static_cast<uint8_t>(s[i])];
      const AddedToken* hit = nullptr;
      for (int c : cands) {
        if (s.substr(i).starts_with(tokens_[c].content)) {
          hit = &tokens_[c];
          break;
        }
      }
      if (!hit) continue;
      size_t start = i, stop = i + hit->content.size();
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
  std::vector<AddedToken> tokens_;
  std::array<std::vector<int>, 256> by_first_byte_;  // token indices, longest first
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
  std::vector<std::string> id_bytes;  // bytes per id, by the ByteLevel decoder's rule
  std::vector<uint8_t> id_used, id_special;
  StringMap<int32_t> token_ids;       // tokenizer.json form -> id (added tokens win)
  StringMap<int32_t> bytes_ids;       // model vocabulary: bytes -> id
  std::array<int32_t, 256> byte_ids;  // single-byte tokens; -1 when missing
  int32_t unk_id = -1;
  bool fuse_unk = false;
  detail::MergeTable merges;
  bool ignore_merges = false;
  AddedMatcher raw_added, normalized_added;
  std::vector<int32_t> prefix, suffix;  // added around the text when add_special_tokens
  int32_t bos = -1, eos = -1;
  uint64_t serial = detail::next_serial++;

  void merge_word(std::string_view piece, std::vector<int32_t>* out) const;
  void merge_word_heap(const std::vector<int32_t>& ids, std::vector<int32_t>* out) const;
  void encode_piece(std::string_view piece, std::vector<int32_t>* out) const;
  void encode_text(std::string_view text, std::vector<int32_t>* out) const;
};


}  // namespace tessera::io
