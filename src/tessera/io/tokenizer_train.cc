// Byte-level BPE training: pre-token counts, then merges of the most frequent pair with
// incremental pair-count updates (only the words that contain the merged pair are touched).
#include <algorithm>
#include <deque>
#include <optional>
#include <queue>
#include <unordered_map>
#include <unordered_set>

#include "tessera/base/error.h"
#include "tessera/base/timer.h"
#include "tessera/io/json_file.h"
#include "tessera/io/pretokenize.h"
#include "tessera/io/tokenizer.h"
#include "tessera/io/tokenizer_impl.h"

namespace tessera::io {

namespace {

struct Word {
  std::vector<int32_t> syms;
  int64_t count;
};

uint64_t key(int32_t a, int32_t b) { return detail::pair_key(a, b); }
int32_t left_of(uint64_t k) { return static_cast<int32_t>(k >> 32); }
int32_t right_of(uint64_t k) { return static_cast<int32_t>(k & 0xFFFFFFFFu); }

// Counts pre-tokens over all files, with the special tokens split out of the text first.
detail::StringMap<int64_t> count_pretokens(const std::vector<std::string>& files, const BpeTrainOptions& o) {
  const PreTokenizer pre = PreTokenizer::byte_level(o.pattern);
  detail::AddedMatcher specials;
  for (const auto& s : o.special_tokens) specials.add({s, 0, false, false});
  specials.finish();
  detail::StringMap<int64_t> counts;
  std::vector<detail::Segment> segments;
  std::vector<std::string_view> pieces;
  std::deque<std::string> arena;
  for (const auto& file : files) {
    const std::string text = read_file_bytes(file);
    const size_t bad = find_invalid_utf8(text);
    TESSERA_CHECK(bad == std::string_view::npos, file, ": not valid UTF-8 at byte ", bad);
    segments.clear();
    specials.split(text, &segments);
    for (const auto& seg : segments) {
      if (seg.id >= 0) continue;
      pieces.clear();
      arena.clear();
      pre.split(seg.text, &pieces, &arena);
      for (auto p : pieces) {
        auto it = counts.find(p);
        if (it == counts.end()) {
          counts.emplace(std::string(p), 1);
        } else {
          ++it->second;
        }
      }
    }
  }
  return counts;
}

}  // namespace

Tokenizer train_bpe(const std::vector<std::string>& files, const BpeTrainOptions& o) {
  const int64_t n_special = static_cast<int64_t>(o.special_tokens.size());
  TESSERA_CHECK(!files.empty(), "tokenizer train: no input files");
  TESSERA_CHECK(o.vocab_size >= 256 + n_special, "tokenizer train: vocab size ", o.vocab_size,
                " is less than the minimum ", 256 + n_special, " (256 bytes + ", n_special, " special tokens)");
  TESSERA_CHECK(o.min_frequency >= 1, "tokenizer train: min frequency ", o.min_frequency, " must be at least 1");
  std::unordered_set<std::string> seen;
  for (const auto& s : o.special_tokens) {
    TESSERA_CHECK(!s.empty(), "tokenizer train: a special token is empty");
    TESSERA_CHECK(seen.insert(s).second, "tokenizer train: special token '", s, "' is given twice");
    TESSERA_CHECK(find_invalid_utf8(s) == std::string_view::npos, "tokenizer train: special token '", s,
                  "' is not valid UTF-8");
  }

  const auto counts = count_pretokens(files, o);
  TESSERA_CHECK(!counts.empty(), "tokenizer train: the corpus is empty (", files.size(),
                " file(s) with no text outside special tokens)");

  // Ids 0..255 are the bytes in GPT-2's order; merges append new tokens after them.
  std::vector<std::string> tokens(256);  // token id -> bytes
  std::array<int32_t, 256> byte_id{};
  for (int i = 0; i < 256; ++i) {
    const uint8_t b = byte_level_order()[i];
    tokens[i] = std::string(1, static_cast<char>(b));
    byte_id[b] = i;
  }
  std::vector<Word> words;
  words.reserve(counts.size());
  for (const auto& [piece, c] : counts) {
    Word w{{}, c};
    for (unsigned char b : piece) w.syms.push_back(byte_id[b]);
    words.push_back(std::move(w));
  }
  // Sort for a run that does not depend on hash-map order (it would not change the
  // merges, but keeps the where-lists and progress identical across runs).
  std::sort(words.begin(), words.end(), [](const Word& a, const Word& b) { return a.syms < b.syms; });

  // Each merge removes at least one symbol from some word, so this bounds the merges.
  int64_t symbols_bound = 0;
  for (const auto& w : words) symbols_bound += static_cast<int64_t>(w.syms.size()) - 1;
  const int64_t target_new = o.vocab_size - 256 - n_special;
  TESSERA_CHECK(target_new <= symbols_bound, "tokenizer train: vocab size ", o.vocab_size,
                " is more than this corpus allows: at most ", symbols_bound, " merges are possible, so the vocab ",
                "size can be at most ", 256 + symbols_bound + n_special, " (256 bytes + merges + ", n_special,
                " special tokens)");

  std::unordered_map<uint64_t, int64_t> pair_count;
  std::unordered_map<uint64_t, std::vector<int32_t>> where;  // pair -> words that may contain it
  for (int32_t wi = 0; wi < static_cast<int32_t>(words.size()); ++wi) {
    const auto& s = words[wi].syms;
    for (size_t i = 0; i + 1 < s.size(); ++i) {
      const uint64_t k = key(s[i], s[i + 1]);
      pair_count[k] += words[wi].count;
      auto& v = where[k];
      if (v.empty() || v.back() != wi) v.push_back(wi);
    }
  }

  // Max-heap on (count, then the bytewise-smallest (left, right)); entries go stale when a
  // count drops and are re-pushed with the current count when popped.
  struct Entry {
    int64_t count;
    uint64_t pair;
  };
  auto before = [&tokens](const Entry& x, const Entry& y) {  // true when x ranks below y
    if (x.count != y.count) return x.count < y.count;
    const auto& xl = tokens[left_of(x.pair)];
    const auto& yl = tokens[left_of(y.pair)];
    if (xl != yl) return xl > yl;
    return tokens[right_of(x.pair)] > tokens[right_of(y.pair)];
  };
  std::priority_queue<Entry, std::vector<Entry>, decltype(before)> heap(before);
  for (const auto& [k, c] : pair_count) heap.push({c, k});

  detail::StringMap<int32_t> token_id;
  for (int32_t i = 0; i < 256; ++i) token_id[tokens[i]] = i;
  std::vector<std::pair<int32_t, int32_t>> merges;
  std::vector<int32_t> stamp(words.size(), -1);
  std::unordered_map<uint64_t, int64_t> delta;
  std::vector<std::pair<uint64_t, int>> local;  // one word's pair-count changes
  std::optional<base::ProgressBar> bar;
  if (o.progress) bar.emplace("tokenizer train: merges", target_new);
  int64_t new_tokens = 0;
  bool starved = false;
  while (new_tokens < target_new) {
    if (heap.empty()) {
      starved = true;
      break;
    }
    const Entry top = heap.top();
    heap.pop();
    const auto it = pair_count.find(top.pair);
    const int64_t current = it == pair_count.end() ? 0 : it->second;
    if (current != top.count) {
      if (current > 0) heap.push({current, top.pair});
      continue;
    }
    if (current < o.min_frequency) {
      starved = true;
      break;
    }
    const int32_t a = left_of(top.pair), b = right_of(top.pair);
    const std::string merged = tokens[a] + tokens[b];
    int32_t id;
    if (auto t = token_id.find(merged); t != token_id.end()) {
      id = t->second;  // the same bytes were already made by another pair of tokens
    } else {
      id = static_cast<int32_t>(tokens.size());
      tokens.push_back(merged);
      token_id.emplace(merged, id);
      ++new_tokens;
    }
    merges.emplace_back(a, b);
    const int32_t merge_index = static_cast<int32_t>(merges.size());
    delta.clear();
    std::vector<int32_t> word_list = std::move(where[top.pair]);
    where.erase(top.pair);
    for (int32_t wi : word_list) {
      if (stamp[wi] == merge_index) continue;
      stamp[wi] = merge_index;
      auto& s = words[wi].syms;
      local.clear();
      auto note = [&local](uint64_t k, int d) {
        for (auto& [lk, ld] : local)
          if (lk == k) return void(ld += d);
        local.emplace_back(k, d);
      };
      bool found = false;
      for (size_t i = 0; i + 1 < s.size(); ++i) found |= s[i] == a && s[i + 1] == b;
      if (!found) continue;
      for (size_t i = 0; i + 1 < s.size(); ++i) note(key(s[i], s[i + 1]), -1);
      size_t out = 0;
      for (size_t i = 0; i < s.size();) {  // left to right, non-overlapping
        if (i + 1 < s.size() && s[i] == a && s[i + 1] == b) {
          s[out++] = id;
          i += 2;
        } else {
          s[out++] = s[i++];
        }
      }
      s.resize(out);
      for (size_t i = 0; i + 1 < s.size(); ++i) note(key(s[i], s[i + 1]), +1);
      for (const auto& [k, d] : local) {
        if (d == 0) continue;
        delta[k] += d * words[wi].count;
        if (d > 0) where[k].push_back(wi);
      }
    }
    for (const auto& [k, d] : delta) {
      int64_t& c = pair_count[k];
      c += d;
      if (d > 0) heap.push({c, k});
      if (c == 0) pair_count.erase(k);
    }
    if (bar && new_tokens < target_new) bar->update(new_tokens);
  }
  if (starved) {
    fail("tokenizer train: vocab size ", o.vocab_size, " is more than this corpus allows: after ", new_tokens,
         " new tokens no pair occurs at least ", o.min_frequency,
         " times (min frequency), so the vocab size can be at most ", 256 + new_tokens + n_special,
         " (256 bytes + merges + ", n_special, " special tokens)");
  }
  if (bar) bar->finish();

  // The tokenizer.json, in the shape Hugging Face's trainer writes for byte-level BPE.
  nlohmann::json vocab = nlohmann::json::object();
  for (size_t i = 0; i < tokens.size(); ++i) vocab[bytes_to_byte_level(tokens[i])] = i;
  nlohmann::json merge_list = nlohmann::json::array();
  for (const auto& [l, r] : merges) merge_list.push_back(bytes_to_byte_level(tokens[l]) + " " + bytes_to_byte_level(tokens[r]));
  nlohmann::json added = nlohmann::json::array();
  for (int64_t i = 0; i < n_special; ++i) {
    added.push_back({{"id", static_cast<int64_t>(tokens.size()) + i},
                     {"content", o.special_tokens[i]},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  }
  const nlohmann::json byte_level = {
      {"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", true}};
  nlohmann::json j = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer", PreTokenizer::byte_level_json(o.pattern)},
      {"post_processor", byte_level},
      {"decoder", byte_level},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr},
        {"fuse_unk", false},
        {"byte_fallback", false},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", merge_list}}}};
  const nlohmann::json config = {
      {"add_bos_token", false},
      {"add_eos_token", false},
      {"bos_token", nullptr},
      {"eos_token", n_special > 0 ? nlohmann::json(o.special_tokens[0]) : nlohmann::json(nullptr)},
      {"clean_up_tokenization_spaces", false},
      {"model_max_length", o.model_max_length},
      {"tokenizer_class", "PreTrainedTokenizerFast"}};
  return Tokenizer::from_json(j, "trained tokenizer", config);
}

}  // namespace tessera::io
