// Engine: requests that read their prompt positions. Prompt log-probabilities (vLLM's
// prompt_logprobs) come from extra logits rows of the prefill steps; embedding requests
// (add_embedding_request) sum the prefill's final hidden states and finish with their mean.
// Both skip prefix-cache reads (a cached position is never computed, so there is nothing to
// read), as vLLM does for prompt logprobs; a recomputation after preemption skips the
// positions already read.
#include <algorithm>
#include <cmath>

#include "tessera/base/error.h"
#include "tessera/base/thread_pool.h"
#include "tessera/infer/engine.h"
#include "tessera/kernels/cross_entropy.h"

namespace tessera::infer {

PromptLogprob prompt_logprob(const float* x, int64_t vocab, int32_t token, int top) {
  TESSERA_CHECK(token >= 0 && token < vocab, "prompt_logprob: token ", token, " outside [0, ", vocab, ")");
  const double lse = kernels::log_sum_exp(x, vocab);
  TESSERA_CHECK(std::isfinite(lse), "prompt_logprob: the logits are not finite");
  // Higher logit first; equal logits by lower id (the order of the sampler's top_logprobs).
  auto before = [x](int64_t a, int64_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
  PromptLogprob r;
  r.token = token;
  r.logprob = static_cast<float>(x[token] - lse);
  r.rank = 1;
  for (int64_t i = 0; i < vocab; ++i) r.rank += before(i, token) ? 1 : 0;
  const int64_t want = std::min<int64_t>(top, vocab);
  std::vector<int32_t> best;  // kept sorted, at most `want`: O(V log want)
  best.reserve(static_cast<size_t>(want) + 1);
  for (int64_t i = 0; i < vocab && want > 0; ++i) {
    if (static_cast<int64_t>(best.size()) == want && !before(i, best.back())) continue;
    best.insert(std::upper_bound(best.begin(), best.end(), static_cast<int32_t>(i), before), static_cast<int32_t>(i));
    if (static_cast<int64_t>(best.size()) > want) best.pop_back();
  }
  for (int32_t id : best) r.top.push_back({id, static_cast<float>(x[id] - lse)});
  return r;
}

RequestId Engine::add_embedding_request(const std::vector<int32_t>& prompt, int32_t adapter, int priority) {
  SamplingParams params;  // nothing is sampled; greedy, one token, no stop strings
  params.max_tokens = 1;
  return add_sequence(prompt, params, priority, adapter, true);
}

void Engine::track_prompt(RequestId id, const std::vector<int32_t>& prompt, const SamplingParams& params,
                          bool pooling) {
  PromptWork w;
  w.prompt = prompt;
  w.pooling = pooling;
  w.top = pooling || !params.prompt_logprobs ? -1 : *params.prompt_logprobs;
  w.n = params.n;
  w.sent.assign(static_cast<size_t>(params.n), 0);
  if (pooling) w.sum.assign(static_cast<size_t>(model_.config().hidden_size), 0.0);
  prompt_work_[id] = std::move(w);
}

void Engine::prune_prompt_work() {
  prompt_reads_.clear();  // a step that threw left its plan behind
  // Finished sequences leave seqs_ at the end of their last step, aborted ones at the start
  // of the next: a request none of whose sample ids is left is over.
  std::erase_if(prompt_work_, [this](const auto& kv) {
    for (int64_t k = 0; k < kv.second.n; ++k)
      if (seqs_.count(kv.first + k)) return false;
    return true;
  });
}

void Engine::plan_prompt_read(RequestId id, int64_t start, int64_t num_tokens, int64_t row) {
  auto it = prompt_work_.find(id);  // sample 0 only: forks never recompute an unread prompt
  if (it == prompt_work_.end()) return;
  const PromptWork& w = it->second;
  // Position p's logits give the log-probability of prompt token p + 1; pooling reads every
  // position's hidden state.
  const int64_t limit = static_cast<int64_t>(w.prompt.size()) - (w.pooling ? 0 : 1);
  const int64_t first = std::max(start, w.done), end = std::min(start + num_tokens, limit);
  if (end <= first) return;
  prompt_reads_.push_back({id, first, end - first, row + (first - start), -1});
}

bool Engine::add_prompt_rows(std::vector<int64_t>& rows) {
  bool hidden = false;
  for (PromptRead& r : prompt_reads_) {
    if (prompt_work_.at(r.id).pooling) {
      hidden = true;
      continue;
    }
    r.logit_row = static_cast<int64_t>(rows.size());
    for (int64_t i = 0; i < r.count; ++i) rows.push_back(r.hidden_row + i);
  }
  return hidden;
}

void Engine::read_prompt_rows(const Tensor& logits, const Tensor& hidden, std::vector<RequestOutput>& out) {
  if (prompt_reads_.empty()) return;
  std::vector<PromptRead> reads;
  reads.swap(prompt_reads_);
  const int64_t V = model_.config().vocab_size, H = model_.config().hidden_size;
  for (const PromptRead& r : reads) {
    PromptWork& w = prompt_work_.at(r.id);
    if (w.pooling) {
      const Tensor h = hidden.slice(0, r.hidden_row, r.hidden_row + r.count).contiguous();
      const float* x = h.data<float>();
      for (int64_t i = 0; i < r.count; ++i)
        for (int64_t j = 0; j < H; ++j) w.sum[j] += x[i * H + j];
    } else {
      const Tensor l = logits.slice(0, r.logit_row, r.logit_row + r.count).contiguous();
      const size_t at = w.logprobs.size();
      w.logprobs.resize(at + static_cast<size_t>(r.count));
      std::vector<std::string> errors(static_cast<size_t>(r.count));  // no exception leaves a worker
      base::parallel_for(r.count, 1, [&](int64_t b, int64_t e) {  // O(V) per position
        for (int64_t i = b; i < e; ++i) {
          try {
            w.logprobs[at + i] = prompt_logprob(l.data<float>() + i * V, V, w.prompt[r.first + i + 1], w.top);
          } catch (const std::exception& ex) {
            errors[i] = ex.what();
          }
        }
      });
      for (const auto& err : errors) TESSERA_CHECK(err.empty(), err);
    }
    w.done = r.first + r.count;
    const int64_t P = static_cast<int64_t>(w.prompt.size());
    if (w.pooling && w.done == P) {  // the whole prompt ran: the request is done
      Seq& s = *seqs_.at(r.id);
      RequestOutput& o = output_for(out, s);
      o.embedding.resize(static_cast<size_t>(H));
      for (int64_t j = 0; j < H; ++j) o.embedding[j] = static_cast<float>(w.sum[j] / static_cast<double>(P));
      finish(s, "stop", out);
    }
  }
}

void Engine::attach_prompt_logprobs(std::vector<RequestOutput>& out) {
  if (prompt_work_.empty()) return;
  for (RequestOutput& o : out) {
    auto it = prompt_work_.find(o.id);
    if (it == prompt_work_.end() || it->second.pooling) continue;
    PromptWork& w = it->second;
    // Every position is read once the prefill is through, before the first token (an
    // output may have none: the first token was a stop token).
    if (w.done < static_cast<int64_t>(w.prompt.size()) - 1 || (o.new_tokens.empty() && !o.finished)) continue;
    if (static_cast<size_t>(o.index) >= w.sent.size() || w.sent[o.index]) continue;
    w.sent[o.index] = 1;
    o.prompt_logprobs = w.logprobs;
  }
}

}  // namespace tessera::infer
