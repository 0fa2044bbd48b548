// Beam search bookkeeping (transformers' BeamSearchScorer rules; see beam_search.h).
#include "tessera/infer/beam_search.h"

#include <algorithm>
#include <cmath>
#include <tuple>

#include "tessera/base/error.h"
#include "tessera/kernels/cross_entropy.h"

namespace tessera::infer {

BeamSearch::BeamSearch(const SamplingParams& params, const std::vector<int32_t>& end_tokens,
                       int64_t max_new)
    : width_(params.best_of > 0 ? params.best_of : params.n),
      n_(params.n),
      max_new_(max_new),
      length_penalty_(params.length_penalty) {
  TESSERA_CHECK(params.use_beam_search, "BeamSearch needs use_beam_search");
  TESSERA_CHECK(width_ >= n_ && n_ >= 1 && max_new_ >= 1, "BeamSearch: bad width ", width_, ", n ", n_,
                " or max_new ", max_new_);
  if (!params.ignore_eos)
    for (int32_t t : end_tokens)
      if (t >= 0) end_.push_back(t);
  end_.insert(end_.end(), params.stop_token_ids.begin(), params.stop_token_ids.end());
  std::sort(end_.begin(), end_.end());
  end_.erase(std::unique(end_.begin(), end_.end()), end_.end());
  num_candidates_ = std::max<int64_t>(2, 1 + static_cast<int64_t>(end_.size())) * width_;
  beams_.push_back({});
}

double BeamSearch::score(double cum_logprob, int64_t length, double length_penalty) {
  return cum_logprob / std::pow(static_cast<double>(length), length_penalty);
}

bool BeamSearch::is_end(int32_t token) const { return std::binary_search(end_.begin(), end_.end(), token); }

// BeamHypotheses.add: kept when fewer than W are kept or it beats the worst; then the worst
// (the earliest among equals) goes.
void BeamSearch::add_hypothesis(BeamHypothesis h) {
  auto worst = [&] {
    return std::min_element(finished_.begin(), finished_.end(),
                            [](const BeamHypothesis& a, const BeamHypothesis& b) { return a.score < b.score; });
  };
  if (static_cast<int64_t>(finished_.size()) >= width_ && !(h.score > worst()->score)) return;
  finished_.push_back(std::move(h));
  if (static_cast<int64_t>(finished_.size()) > width_) finished_.erase(worst());
}

std::vector<BeamSearch::Next> BeamSearch::step(const std::vector<std::vector<TokenLogprob>>& candidates) {
  TESSERA_CHECK(!done_, "BeamSearch::step after the search ended");
  TESSERA_CHECK(candidates.size() == beams_.size(), "BeamSearch::step: ", candidates.size(),
                " candidate lists for ", beams_.size(), " live beams");
  struct Cand {
    double cum;
    int64_t beam;
    int32_t token;
  };
  std::vector<Cand> all;
  for (size_t b = 0; b < beams_.size(); ++b)
    for (const TokenLogprob& c : candidates[b])
      all.push_back({beams_[b].cum_logprob + static_cast<double>(c.logprob), static_cast<int64_t>(b), c.token});
  const auto order = [](const Cand& a, const Cand& b) {
    return std::tuple(-a.cum, a.beam, a.token) < std::tuple(-b.cum, b.beam, b.token);
  };
  const size_t k = std::min(all.size(), static_cast<size_t>(num_candidates_));
  std::partial_sort(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(k), all.end(), order);
  all.resize(k);
  ++generated_;

  std::vector<Beam> next_beams;
  std::vector<Next> next;
  for (size_t rank = 0; rank < all.size() && static_cast<int64_t>(next.size()) < width_; ++rank) {
    const Cand& c = all[rank];
    if (is_end(c.token)) {
      if (static_cast<int64_t>(rank) >= width_) continue;  // not among the top W: not eligible
      add_hypothesis({beams_[c.beam].tokens, c.cum, score(c.cum, generated_, length_penalty_), "stop"});
      continue;
    }
    Beam nb{beams_[c.beam].tokens, c.cum};
    nb.tokens.push_back(c.token);
    next_beams.push_back(std::move(nb));
    next.push_back({c.beam, c.token});
  }
  // transformers' is_done (early_stopping=False): no live beam is expected to beat the worst
  // kept hypothesis, judged at the current length.
  if (static_cast<int64_t>(finished_.size()) >= width_ && !all.empty()) {
    double worst = finished_.front().score;
    for (const auto& h : finished_) worst = std::min(worst, h.score);
    if (worst >= score(all.front().cum, generated_, length_penalty_)) done_ = true;
  }
  if (!done_ && (generated_ >= max_new_ || next_beams.empty())) {  // finalize: the live beams end
    for (const Beam& b : next_beams)
      add_hypothesis({b.tokens, b.cum_logprob, score(b.cum_logprob, generated_, length_penalty_), "length"});
    done_ = true;
  }
  if (done_) {
    beams_.clear();
    return {};
  }
  beams_ = std::move(next_beams);
  return next;
}

std::vector<BeamHypothesis> BeamSearch::results() const {
  std::vector<BeamHypothesis> r = finished_;
  std::stable_sort(r.begin(), r.end(), [](const BeamHypothesis& a, const BeamHypothesis& b) { return a.score > b.score; });
  if (static_cast<int64_t>(r.size()) > n_) r.resize(static_cast<size_t>(n_));
  return r;
}

std::vector<TokenLogprob> top_logprobs(const float* logits, int64_t vocab, int64_t k) {
  k = std::min(k, vocab);
  const double lse = kernels::log_sum_exp(logits, vocab);
  std::vector<int32_t> idx(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i) idx[i] = static_cast<int32_t>(i);
  std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int32_t a, int32_t b) {
    return logits[a] != logits[b] ? logits[a] > logits[b] : a < b;
  });
  std::vector<TokenLogprob> out(static_cast<size_t>(k));
  for (int64_t i = 0; i < k; ++i)
    out[i] = {idx[i], static_cast<float>(static_cast<double>(logits[idx[i]]) - lse)};
  return out;
}

}  // namespace tessera::infer
