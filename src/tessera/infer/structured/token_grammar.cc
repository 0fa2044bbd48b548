// The lazily determinized byte automaton of a grammar and the vocabulary-trie mask walk.
// Grammar stacks are linked lists of interned nodes (so stacks share tails and a set of
// stacks is a sorted vector of ids); a rule called last in an alternative returns straight
// to its caller's caller (llama.cpp's tail call), so repetitions keep stacks flat and the
// automaton revisits the same states, which is what makes the transition and mask caches hit.
#include "tessera/infer/structured/token_grammar.h"

#include <algorithm>
#include <cstring>

#include "tessera/base/error.h"
#include "tessera/io/tokenizer.h"

namespace tessera::infer::structured {

VocabTrie::VocabTrie(std::vector<std::string> token_bytes, int64_t vocab)
    : vocab_(vocab), bytes_(std::move(token_bytes)) {
  TESSERA_CHECK(vocab >= static_cast<int64_t>(bytes_.size()), "structured outputs: the vocabulary (", vocab,
                ") is smaller than the tokenizer's (", bytes_.size(), ")");
  std::vector<int32_t> order;
  for (size_t i = 0; i < bytes_.size(); ++i)
    if (!bytes_[i].empty()) order.push_back(static_cast<int32_t>(i));
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return bytes_[a] != bytes_[b] ? bytes_[a] < bytes_[b] : a < b;
  });
  // Preorder: sorted strings visit their prefixes in order; `path` holds the open nodes.
  std::vector<uint32_t> path;
  std::vector<std::vector<int32_t>> node_toks;
  const std::string* prev = nullptr;
  for (int32_t id : order) {
    const std::string& s = bytes_[id];
    size_t common = 0;
    if (prev)
      while (common < prev->size() && common < s.size() && (*prev)[common] == s[common]) ++common;
    common = std::min(common, path.size());
    while (path.size() > common) {
      end_[path.back()] = static_cast<uint32_t>(byte_.size());
      path.pop_back();
    }
    for (size_t k = common; k < s.size(); ++k) {
      path.push_back(static_cast<uint32_t>(byte_.size()));
      byte_.push_back(static_cast<uint8_t>(s[k]));
      TESSERA_CHECK(k + 1 < 65536, "structured outputs: token ", id, " is longer than 65535 bytes");
      depth_.push_back(static_cast<uint16_t>(k + 1));
      end_.push_back(0);
      node_toks.emplace_back();
    }
    node_toks[path.back()].push_back(id);
    max_depth_ = std::max<int>(max_depth_, static_cast<int>(s.size()));
    prev = &s;
  }
  for (uint32_t n : path) end_[n] = static_cast<uint32_t>(byte_.size());
  tok_begin_.push_back(0);
  for (const auto& t : node_toks) {
    toks_.insert(toks_.end(), t.begin(), t.end());
    tok_begin_.push_back(static_cast<uint32_t>(toks_.size()));
  }
}

std::shared_ptr<const VocabTrie> VocabTrie::from_tokenizer(const io::Tokenizer& tok, int64_t vocab) {
  const int64_t n = std::min(tok.vocab_size(), vocab);
  std::vector<std::string> bytes(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const auto id = static_cast<int32_t>(i);
    if (tok.is_special(id) || tok.id_to_token(id).empty()) continue;  // unused ids decode to nothing
    bytes[i] = tok.decode_token(id);
  }
  return std::make_shared<VocabTrie>(std::move(bytes), vocab);
}

const std::string& VocabTrie::bytes(int32_t id) const {
  static const std::string kNone;
  return id >= 0 && static_cast<size_t>(id) < bytes_.size() ? bytes_[id] : kNone;
}

TokenGrammar::TokenGrammar(Grammar g, std::shared_ptr<const VocabTrie> vocab)
    : g_(std::move(g)), vocab_(std::move(vocab)) {
  intern({}, false);  // kDead
  out_.clear();
  out_accept_ = false;
  seen_.clear();
  for (uint32_t a : g_.rules[g_.root]) expand(a, -1);
  std::sort(out_.begin(), out_.end());
  out_.erase(std::unique(out_.begin(), out_.end()), out_.end());
  initial_ = intern(out_, out_accept_);
  // Masks in the cache at most ~256 MB.
  const size_t words = vocab_ ? static_cast<size_t>((vocab_->vocab() + 63) / 64) : 1;
  max_masks_ = std::max<size_t>(64, (256u << 20) / (words * 8));
}

int32_t TokenGrammar::node(uint32_t pos, int32_t parent) {
  const uint64_t key = (static_cast<uint64_t>(pos) << 32) | static_cast<uint32_t>(parent);
  auto [it, added] = node_ids_.emplace(key, static_cast<int32_t>(nodes_.size()));
  if (added) nodes_.push_back({pos, parent});
  return it->second;
}

// Adds to out_ every stack reachable from "continue at pos with `parent` below" without
// consuming a byte: stops at byte sets, descends into rules, returns at ends.
void TokenGrammar::expand(uint32_t pos, int32_t parent) {
  const uint64_t key = (static_cast<uint64_t>(pos) << 32) | static_cast<uint32_t>(parent);
  if (!seen_.insert(key).second) return;
  const Grammar::Elem e = g_.elems[pos];
  switch (e.kind) {
    case Grammar::kBytes:
      out_.push_back(node(pos, parent));
      return;
    case Grammar::kRule: {
      const int32_t ret = g_.elems[pos + 1].kind == Grammar::kEnd ? parent : node(pos + 1, parent);
      for (uint32_t a : g_.rules[e.arg]) expand(a, ret);
      return;
    }
    case Grammar::kEnd:
      if (parent < 0) {
        out_accept_ = true;
      } else {
        const Node p = nodes_[parent];
        expand(p.pos, p.parent);
      }
      return;
  }
}

int32_t TokenGrammar::intern(std::vector<int32_t> nodes, bool accept) {
  std::string key(reinterpret_cast<const char*>(nodes.data()), nodes.size() * sizeof(int32_t));
  key += accept ? '1' : '0';
  auto [it, added] = state_ids_.emplace(std::move(key), static_cast<int32_t>(states_.size()));
  if (added) {
    states_.push_back({std::move(nodes), accept});
    trans_.resize(states_.size() * 256, -1);
  }
  return it->second;
}

int32_t TokenGrammar::compute_step(int32_t state, uint8_t byte) {
  out_.clear();
  out_accept_ = false;
  seen_.clear();
  const std::vector<int32_t> from = states_[state].nodes;  // copy: interning may grow states_
  for (int32_t n : from) {
    const Node nd = nodes_[n];
    if (byte_in(g_.sets[g_.elems[nd.pos].arg], byte)) expand(nd.pos + 1, nd.parent);
  }
  std::sort(out_.begin(), out_.end());
  out_.erase(std::unique(out_.begin(), out_.end()), out_.end());
  const int32_t next = out_.empty() && !out_accept_ ? kDead : intern(out_, out_accept_);
  trans_[static_cast<size_t>(state) * 256 + byte] = next;
  return next;
}

inline int32_t TokenGrammar::step(int32_t state, uint8_t byte) {
  const int32_t t = trans_[static_cast<size_t>(state) * 256 + byte];
  return t >= 0 ? t : compute_step(state, byte);
}

int32_t TokenGrammar::advance(int32_t state, std::string_view bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  for (char c : bytes) {
    if (state == kDead) break;
    state = step(state, static_cast<uint8_t>(c));
  }
  return state;
}

int32_t TokenGrammar::advance_token(int32_t state, int32_t token) {
  TESSERA_CHECK(vocab_, "structured outputs: no vocabulary");
  const std::string& b = vocab_->bytes(token);
  return b.empty() ? kDead : advance(state, b);
}

bool TokenGrammar::accepting(int32_t state) {
  std::lock_guard<std::mutex> lock(mu_);
  return states_[state].accept;
}

bool TokenGrammar::finished(int32_t state) {
  std::lock_guard<std::mutex> lock(mu_);
  return states_[state].accept && states_[state].nodes.empty();
}

size_t TokenGrammar::num_states() {
  std::lock_guard<std::mutex> lock(mu_);
  return states_.size();
}

std::shared_ptr<const TokenMask> TokenGrammar::mask(int32_t state, bool* computed) {
  TESSERA_CHECK(vocab_, "structured outputs: no vocabulary");
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = masks_.find(state); it != masks_.end()) {
    if (computed) *computed = false;
    return it->second;
  }
  if (computed) *computed = true;
  const VocabTrie& v = *vocab_;
  auto m = std::make_shared<TokenMask>(static_cast<size_t>((v.vocab_ + 63) / 64), 0);
  uint64_t* bits = m->data();
  if (!states_[state].nodes.empty()) {
    std::vector<int32_t> at(static_cast<size_t>(v.max_depth_) + 1);
    at[0] = state;
    const uint32_t n = static_cast<uint32_t>(v.byte_.size());
    for (uint32_t i = 0; i < n;) {
      const int32_t s = step(at[v.depth_[i] - 1], v.byte_[i]);
      if (s == kDead) {
        i = v.end_[i];  // no token below this prefix can match
        continue;
      }
      at[v.depth_[i]] = s;
      for (uint32_t k = v.tok_begin_[i]; k < v.tok_begin_[i + 1]; ++k) {
        const int32_t t = v.toks_[k];
        bits[t >> 6] |= uint64_t{1} << (t & 63);
      }
      ++i;
    }
  }
  if (masks_.size() >= max_masks_) masks_.clear();
  masks_.emplace(state, m);
  return m;
}

bool grammar_accepts(const Grammar& g, std::string_view bytes) {
  TokenGrammar tg(g, nullptr);
  return tg.accepting(tg.advance(tg.initial(), bytes));
}

}  // namespace tessera::infer::structured
