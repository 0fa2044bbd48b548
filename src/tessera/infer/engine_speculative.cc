// Engine: speculative decoding's proposers (EngineConfig::speculative_method): prompt
// lookup (ngram), a draft model, and the model's own multi-token prediction module (mtp),
// which advance_mtp keeps up with each sequence's accepted positions after every step.
#include <algorithm>

#include "tessera/infer/engine.h"
#include "tessera/infer/engine_seq.h"

namespace tessera::infer {

std::vector<int32_t> Engine::propose(Seq& s) {
  if (config_.speculative_method == "draft") return propose_draft(s);
  if (config_.speculative_method == "mtp") {  // the module's proposal from the last step, if current
    const int64_t len = static_cast<int64_t>(s.prompt.size() + s.output.size());
    if (!s.mtp_cache || s.mtp_next.empty() || s.mtp_valid != len - 1) return {};
    const int64_t k = std::min<int64_t>(static_cast<int64_t>(s.mtp_next.size()), max_len_ - len);
    return {s.mtp_next.begin(), s.mtp_next.begin() + std::max<int64_t>(k, 0)};
  }
  if (config_.speculative_method != "ngram") return {};
  // Prompt lookup: the longest suffix n-gram (ngram_max down to ngram_min) that occurred
  // earlier in prompt + output proposes the tokens that followed its latest occurrence.
  std::vector<int32_t> seq = s.prompt;
  seq.insert(seq.end(), s.output.begin(), s.output.end());
  const int64_t len = static_cast<int64_t>(seq.size());
  // Among the occurrences of the longest matching n-gram, the latest one that is followed
  // by a full num_speculative_tokens continuation wins (a latest match right before the end
  // would propose only a token or two); failing that, the longest continuation.
  for (int64_t n = std::min(config_.ngram_max, len - 1); n >= config_.ngram_min; --n) {
    int64_t best_from = -1, best_k = 0;
    for (int64_t start = len - n - 1; start >= 0; --start) {
      if (!std::equal(seq.begin() + start, seq.begin() + start + n, seq.end() - n)) continue;
      const int64_t from = start + n;
      const int64_t k = std::min(config_.num_speculative_tokens, len - from);
      if (k > best_k) {
        best_from = from;
        best_k = k;
      }
      if (k == config_.num_speculative_tokens) break;
    }
    if (best_k > 0) return {seq.begin() + best_from, seq.begin() + best_from + best_k};
  }
  return {};
}

// The draft model proposes greedily, continuing from what its own dense KV cache holds of
// the sequence. Greedy proposals are a point mass q, so the standard acceptance rule
// min(1, p/q) keeps a proposal with probability p(x): exactly what verification does.
std::vector<int32_t> Engine::propose_draft(Seq& s) {
  std::vector<int32_t> seq = s.prompt;
  seq.insert(seq.end(), s.output.begin(), s.output.end());
  const int64_t len = static_cast<int64_t>(seq.size());
  const int64_t k = std::min(config_.num_speculative_tokens, max_len_ - len);
  if (k <= 0) return {};
  if (!s.draft_cache)
    s.draft_cache = std::make_unique<model::KVCache>(model::KVCache::create(draft_->config(), max_len_));
  model::KVCache& cache = *s.draft_cache;
  cache.length = std::min(cache.length, s.draft_valid);  // drop rejected proposals
  std::vector<int32_t> feed(seq.begin() + cache.length, seq.end());
  std::vector<int32_t> out;
  for (int64_t i = 0; i < k; ++i) {
    const Tensor logits = draft_->forward(feed, cache);
    const float* x = logits.data<float>();
    const int32_t t = static_cast<int32_t>(std::max_element(x, x + logits.numel()) - x);
    out.push_back(t);
    feed = {t};
    if (cache.length + 1 >= cache.capacity) break;
  }
  s.draft_valid = len;  // raised by the accepted proposals after verification
  return out;
}

void Engine::advance_mtp(Seq& s, int64_t start, int64_t num_tokens, const Tensor& hidden, int64_t row0) {
  // Position i needs the main model's hidden state at i (a row of this step whose input
  // token was the sequence's: a rejected proposal's row is past total - 2) and token i + 1.
  const int64_t P = static_cast<int64_t>(s.prompt.size());
  const int64_t total = P + static_cast<int64_t>(s.output.size());
  const int64_t n = std::min(num_tokens, total - 1 - start);
  s.mtp_next.clear();
  if (!s.mtp_cache) s.mtp_cache = std::make_unique<model::KVCache>(model::KVCache::create_mtp(model_.config(), max_len_));
  model::KVCache& cache = *s.mtp_cache;
  if (n <= 0) return;
  // The module attends over the positions it has seen. When some before `start` were
  // never computed (a prefix-cache hit skipped them), it starts afresh at `start`: its
  // proposals then see less context, and the output stays exact. Positions from `start`
  // on are recomputed (preemption).
  if (s.mtp_valid < start || cache.first_position > start) {
    cache.first_position = start;
    cache.length = 0;
  }
  cache.length = start - cache.first_position;  // (also drops rows chained past mtp_valid)
  std::vector<int32_t> next(n);  // token i + 1 of each position i
  for (int64_t i = 0; i < n; ++i) {
    const int64_t t = start + 1 + i;
    next[i] = t < P ? s.prompt[t] : s.output[t - P];
  }
  Tensor h;
  Tensor logits = model_.mtp_forward(next, hidden.slice(0, row0, row0 + n), cache, &h);
  s.mtp_valid = cache.first_position + cache.length;
  // One proposal per call; for k > 1 the module runs again one position on, on its own
  // output and its last proposal (its rows there are rewritten once the main model has
  // been there).
  for (int64_t j = 0; j < config_.num_speculative_tokens; ++j) {
    const float* x = logits.data<float>();
    s.mtp_next.push_back(static_cast<int32_t>(std::max_element(x, x + logits.numel()) - x));
    if (j + 1 == config_.num_speculative_tokens || cache.length + 1 > cache.capacity) break;
    logits = model_.mtp_forward({s.mtp_next.back()}, h, cache, &h);
  }
}

}  // namespace tessera::infer
