// Engine::Seq, one scheduled sequence's state: private to the engine's .cc files
// (engine.cc, engine_speculative.cc), not part of the engine's interface.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "tessera/infer/engine.h"
#include "tessera/infer/sampler.h"
#include "tessera/infer/structured/guided_runner.h"

namespace tessera::infer {

struct Engine::Seq {
  RequestId id = 0;     // scheduler id of this sequence
  RequestId group = 0;  // the request's id (= id of sample 0)
  int64_t index = 0;    // sample index
  int64_t n = 1;        // samples of the request (sample 0 forks the others)
  int32_t adapter = -1; // index into the model's lora_bank() (-1: the base model)
  std::vector<int32_t> prompt, output;
  SamplingParams params;
  std::unique_ptr<Sampler> sampler;
  std::unique_ptr<StopChecker> stop;
  std::shared_ptr<structured::GuidedSeq> guided;  // structured outputs: the automaton's state
  std::string pending;       // decoded bytes of an incomplete UTF-8 character
  int64_t cached_tokens = -1;  // prefix-cache hit of the first admission (-1 unknown)
  bool forked = false;         // sample 0 has created its siblings
  bool scheduled = true;       // known to the scheduler (false: a fork that ended at once)
  bool finished = false;
  bool pooling = false;        // an embedding request: nothing is sampled (engine_prompt.cc)
  std::vector<int32_t> spec;   // proposals handed to the scheduler for this step
  std::unique_ptr<model::KVCache> draft_cache;  // the draft model's view of this sequence
  int64_t draft_valid = 0;                      // its tokens that are still the sequence's
  // --speculative mtp: the module's latent rows; those of positions before mtp_valid came
  // from the main model's hidden states (rows past it, from chaining the module on its own
  // output, are rewritten by the next advance_mtp). mtp_next: its proposals for the tokens
  // at mtp_valid + 1, + 2, ... (empty: none).
  std::unique_ptr<model::KVCache> mtp_cache;
  int64_t mtp_valid = 0;
  std::vector<int32_t> mtp_next;
};

}  // namespace tessera::infer
