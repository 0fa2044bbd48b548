// Beam search bookkeeping for one request (SamplingParams::use_beam_search), apart from the
// engine: which beams live on, which hypotheses are finished, when the search ends. The
// engine feeds it each live beam's top log-probabilities and forks / drops sequences as
// step() says. No tensor or scheduler code. See docs/inference.md, "Beam search".
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/infer/sampler.h"

namespace tessera::infer {

// The algorithm is transformers' BeamSearchScorer (generate(num_beams=W, length_penalty=lp,
// early_stopping=False, num_return_sequences=n)), in its generated-length form:
//  - W = best_of (0: n) beams; the search starts from one beam, the prompt, with score 0.
//  - Each step, every live beam's raw log-probabilities (log_softmax of the logits) are
//    added to its cumulative log-probability; the best K = max(2, 1 + E) * W candidates
//    over all beams are taken (E: the distinct end tokens, i.e. EOS unless ignore_eos plus
//    stop_token_ids; ties: lower beam rank, then lower token id).
//  - In that order: a candidate whose token ends the sequence becomes a finished
//    hypothesis if its rank is below W (else it is skipped); any other candidate becomes a
//    live beam of the next step, until W are taken. Live beams are thus the best W
//    continuations by cumulative log-probability.
//  - A finished hypothesis scores cum_logprob / t^lp, t = its generated tokens counting the
//    end token (which is not part of its output); the best W hypotheses are kept.
//  - The search is done once W hypotheses are kept and the worst of them scores at least
//    best_candidate_cum / t^lp (t: tokens generated after this step): transformers'
//    early_stopping=False heuristic. After max_new tokens (max_tokens, or the context
//    length) every live beam becomes a hypothesis ("length") scored cum / max_new^lp.
//  - The n best hypotheses are returned, best first.
struct BeamHypothesis {
  std::vector<int32_t> tokens;  // generated ids, the end token excluded
  double cum_logprob = 0.0;     // sum of the raw log-probabilities, the end token's included
  double score = 0.0;           // cum_logprob / length^length_penalty
  std::string finish_reason;    // "stop" (an end token) or "length"
};

class BeamSearch {
 public:
  struct Beam {
    std::vector<int32_t> tokens;  // generated so far
    double cum_logprob = 0.0;
  };
  struct Next {  // a live beam of the next step: live beam `parent` followed by `token`
    int64_t parent = 0;
    int32_t token = 0;
  };

  // params: use_beam_search set and valid. end_tokens: the model's EOS ids (ignored when
  // params.ignore_eos). max_new: tokens a beam may generate (>= 1).
  BeamSearch(const SamplingParams& params, const std::vector<int32_t>& end_tokens, int64_t max_new);

  int64_t width() const { return width_; }
  // K: how many top log-probabilities step() needs from each live beam.
  int64_t candidates_per_beam() const { return num_candidates_; }
  const std::vector<Beam>& beams() const { return beams_; }  // live beams, best first
  bool done() const { return done_; }

  // One step. candidates[i]: live beam i's top candidates_per_beam() (token, raw logprob)
  // pairs (top_logprobs()). Returns the next live beams, best first (empty once done()).
  std::vector<Next> step(const std::vector<std::vector<TokenLogprob>>& candidates);

  // The n best hypotheses, best first (call once done()).
  std::vector<BeamHypothesis> results() const;

  // The hypotheses' length-penalised score.
  static double score(double cum_logprob, int64_t length, double length_penalty);

 private:
  bool is_end(int32_t token) const;
  void add_hypothesis(BeamHypothesis h);

  int64_t width_ = 1, n_ = 1, num_candidates_ = 2, max_new_ = 1, generated_ = 0;
  double length_penalty_ = 1.0;
  std::vector<int32_t> end_;
  std::vector<Beam> beams_;
  std::vector<BeamHypothesis> finished_;  // at most width_, in insertion order
  bool done_ = false;
};

// The k highest raw log-probabilities (log_softmax in double) of one row of logits, highest
// first, ties by lower id. k is clamped to vocab.
std::vector<TokenLogprob> top_logprobs(const float* logits, int64_t vocab, int64_t k);

}  // namespace tessera::infer
