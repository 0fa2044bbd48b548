// Structured outputs in the engine: compiled constraints cached by their text, one
// automaton state per sequence, and a worker thread that advances a sequence by its
// accepted token and computes its next mask while the engine runs the next forward, so
// the sampler waits only for what is not done yet.
#pragma once
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "tessera/infer/sampler.h"
#include "tessera/infer/structured/token_grammar.h"

namespace tessera::io {
class Tokenizer;
}

namespace tessera::infer::structured {

struct GuidedStats {
  int64_t masks = 0;           // masks the sampler waited for (one per token sampled under a constraint)
  int64_t walks = 0;           // masks computed by a trie walk (the rest hit the per-state cache)
  double compute_us = 0;       // worker time: advancing by the token, the mask, adding EOS
  double exposed_us = 0;       // engine-thread time spent waiting for masks
  int64_t grammars = 0;        // constraints compiled (cache misses)
  double compile_us = 0;       // their compile time (engine thread, at add_request)
  double vocab_us = 0;         // building the vocabulary trie (once)
};

// One sequence's place in its constraint. Shared by the engine thread and the worker;
// a job in flight owns it until `ready`.
class GuidedSeq {
 public:
  bool complete() const { return complete_; }

 private:
  friend class GuidedRunner;
  std::shared_ptr<TokenGrammar> g_;
  std::vector<int32_t> enders_;   // EOS / stop ids, allowed where the grammar may end
  int32_t state_ = TokenGrammar::kDead;
  std::vector<uint64_t> allowed_;  // (vocab + 63) / 64 words: the mask for state_
  bool complete_ = false;          // nothing may follow (or nothing can: finished as "stop")
  std::mutex mu_;
  std::condition_variable cv_;
  bool ready_ = false;
};

class GuidedRunner {
 public:
  // vocab: the model's vocabulary (the logits' size); eos: its end-of-sequence ids.
  GuidedRunner(const io::Tokenizer* tokenizer, int64_t vocab, std::vector<int32_t> eos);
  ~GuidedRunner();
  GuidedRunner(const GuidedRunner&) = delete;
  GuidedRunner& operator=(const GuidedRunner&) = delete;

  // Compiles (or finds) the request's constraint and queues its first mask. Throws
  // FieldError naming the request field (response_format, guided_regex, ...).
  std::shared_ptr<GuidedSeq> start(const SamplingParams& params);
  // A new sequence of the same request at the start of the output (n > 1 samples).
  std::shared_ptr<GuidedSeq> restart(const GuidedSeq& like);
  // Queues: advance by the accepted token, then compute the next mask.
  void advance(const std::shared_ptr<GuidedSeq>& s, int32_t token);
  // Waits for s's mask: the allowed-token bits, or null when the output is complete.
  const uint64_t* wait(GuidedSeq& s);

  GuidedStats stats() const;

 private:
  struct Job {
    std::shared_ptr<GuidedSeq> seq;
    int32_t token;  // -1: compute the mask of the current state only
  };
  void submit(Job job);
  void run(Job& job);
  void loop();
  std::shared_ptr<TokenGrammar> grammar(const GuidedDecoding& g);

  const io::Tokenizer* tokenizer_;
  int64_t vocab_;
  std::vector<int32_t> eos_;
  std::shared_ptr<const VocabTrie> trie_;
  // Compiled constraints, most recently used first.
  std::list<std::pair<std::string, std::shared_ptr<TokenGrammar>>> cache_;

  mutable std::mutex mu_;  // guards jobs_, stop_ and stats_
  std::condition_variable cv_;
  std::deque<Job> jobs_;
  bool stop_ = false;
  GuidedStats stats_;
  std::thread worker_;
};

}  // namespace tessera::infer::structured
