// Structured outputs at the token level: a grammar's pushdown automaton over bytes,
// determinized lazily (each state is an interned set of grammar stacks, each transition
// computed once and remembered), and the mask of tokens allowed in a state, found by one
// preorder walk over a trie of the vocabulary's byte strings that skips every subtree whose
// prefix the grammar rejects. Masks are cached per state.
#pragma once
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tessera/infer/structured/grammar.h"

namespace tessera::io {
class Tokenizer;
}

namespace tessera::infer::structured {

using TokenMask = std::vector<uint64_t>;  // (vocab + 63) / 64 words; bit t set: token t allowed

// The vocabulary's byte strings as a trie in preorder. Special tokens and tokens with no
// bytes are left out: they are never allowed by a grammar (EOS is added where it can end).
class VocabTrie {
 public:
  // token_bytes[id]: the bytes token id adds to the text ("" = never allowed); vocab: the
  // mask's size (the model's vocabulary, >= token_bytes.size()).
  VocabTrie(std::vector<std::string> token_bytes, int64_t vocab);
  // Every token's Tokenizer::decode_token bytes (special tokens left out).
  static std::shared_ptr<const VocabTrie> from_tokenizer(const io::Tokenizer& tok, int64_t vocab);

  int64_t vocab() const { return vocab_; }
  const std::string& bytes(int32_t id) const;  // "" when not allowed or out of range
  size_t num_nodes() const { return byte_.size(); }
  int64_t num_tokens() const { return static_cast<int64_t>(toks_.size()); }

 private:
  friend class TokenGrammar;
  int64_t vocab_ = 0;
  std::vector<std::string> bytes_;
  std::vector<uint8_t> byte_;         // per node: the byte on the edge into it
  std::vector<uint16_t> depth_;       // per node: 1 for the root's children
  std::vector<uint32_t> end_;         // per node: one past its subtree
  std::vector<uint32_t> tok_begin_;   // per node + 1: tokens ending at node i are toks_[b[i], b[i+1])
  std::vector<int32_t> toks_;
  int max_depth_ = 0;
};

// One grammar over one vocabulary. Thread-safe (one lock: the mask worker and the engine
// thread share it, and requests with the same constraint share one object).
class TokenGrammar {
 public:
  static constexpr int32_t kDead = 0;  // the state no input leads out of, and not accepting

  // vocab may be null (byte-level use only: advance / accepting).
  TokenGrammar(Grammar g, std::shared_ptr<const VocabTrie> vocab);

  int32_t initial() const { return initial_; }
  int32_t advance(int32_t state, std::string_view bytes);
  int32_t advance_token(int32_t state, int32_t token);  // by the token's bytes
  bool accepting(int32_t state);
  // Accepting and nothing may follow: the output is complete.
  bool finished(int32_t state);
  // Tokens whose bytes the grammar accepts from `state` (EOS not included). *computed is
  // set to whether the walk ran (false: a cached mask).
  std::shared_ptr<const TokenMask> mask(int32_t state, bool* computed = nullptr);

  size_t num_states();
  const VocabTrie* vocab() const { return vocab_.get(); }

 private:
  struct Node {
    uint32_t pos;    // the next grammar element
    int32_t parent;  // the stack below (-1: bottom)
  };
  struct State {
    std::vector<int32_t> nodes;  // stacks whose top is a byte set, sorted
    bool accept = false;         // some stack is empty: the input so far is a sentence
  };
  int32_t node(uint32_t pos, int32_t parent);
  void expand(uint32_t pos, int32_t parent);
  int32_t intern(std::vector<int32_t> nodes, bool accept);
  int32_t step(int32_t state, uint8_t byte);  // lock held
  int32_t compute_step(int32_t state, uint8_t byte);

  Grammar g_;
  std::shared_ptr<const VocabTrie> vocab_;
  std::mutex mu_;
  std::vector<Node> nodes_;
  std::unordered_map<uint64_t, int32_t> node_ids_;
  std::vector<State> states_;
  std::unordered_map<std::string, int32_t> state_ids_;
  std::vector<int32_t> trans_;  // states x 256: next state, -1 not computed yet
  int32_t initial_ = kDead;
  // expand()'s scratch
  std::vector<int32_t> out_;
  bool out_accept_ = false;
  std::unordered_set<uint64_t> seen_;
  std::unordered_map<int32_t, std::shared_ptr<const TokenMask>> masks_;
  size_t max_masks_ = 0;
};

// Whether `bytes` is a sentence of the grammar (for tests and the request checks).
bool grammar_accepts(const Grammar& g, std::string_view bytes);

}  // namespace tessera::infer::structured
