// Engine: beam search requests (SamplingParams::use_beam_search). Each live beam is one
// scheduler sequence; BeamSearch (beam_search.h) decides each step which continue. A beam's
// first surviving continuation goes on in its own sequence, further ones fork it (the
// children share its KV blocks, copy-on-write), and beams without a survivor are dropped
// (blocks freed at once). The n best hypotheses are reported together when the search ends.
#include <algorithm>

#include "tessera/base/error.h"
#include "tessera/infer/beam_search.h"
#include "tessera/infer/engine.h"

namespace tessera::infer {

// Invariant: live[i] is the sequence of search.beams()[i]; cand[i] is empty until that beam's
// logits for the current step were seen. A step of the search runs once every live beam has
// its candidates: beams whose logits came earlier (the others were preempted, or did not fit
// the step) wait with all their tokens computed, which the scheduler skips.
struct Engine::BeamGroup {
  BeamSearch search;
  std::vector<RequestId> live;
  std::vector<std::vector<TokenLogprob>> cand;
  int64_t prompt_len = 0;
  int64_t cached_tokens = -1;  // the prefix-cache hit of the first admission
};

void Engine::start_beam_search(RequestId id, const std::vector<int32_t>& prompt, const SamplingParams& params) {
  if (config_.num_speculative_tokens > 0)
    fail_field("use_beam_search", "use_beam_search is not supported with speculative decoding (--speculative ",
               config_.speculative_method, ")");
  const int64_t P = static_cast<int64_t>(prompt.size());
  BeamSearch search(params, eos_, std::min(params.max_tokens, max_len_ - P));
  const int64_t V = model_.config().vocab_size;
  if (search.candidates_per_beam() > V)
    fail_field("best_of", "best_of: beam width ", search.width(), " needs ", search.candidates_per_beam(),
               " candidates per beam, more than the vocabulary of ", V);
  auto g = std::make_shared<BeamGroup>(BeamGroup{std::move(search), {id}, {{}}, P, -1});
  beam_groups_[id] = std::move(g);
}

bool Engine::collect_beam(RequestId group, RequestId id, int64_t cached_tokens, const float* logits) {
  auto it = beam_groups_.find(group);
  if (it == beam_groups_.end()) return false;
  BeamGroup& g = *it->second;
  const auto pos = std::find(g.live.begin(), g.live.end(), id);
  if (pos == g.live.end()) return true;
  if (g.cached_tokens < 0) g.cached_tokens = cached_tokens;
  g.cand[static_cast<size_t>(pos - g.live.begin())] =
      top_logprobs(logits, model_.config().vocab_size, g.search.candidates_per_beam());
  return true;
}

void Engine::drop_beam(RequestId id) {
  if (!seq_live(id)) return;
  scheduler_->abort_request(id);  // frees its blocks now (shared ones lose a reference)
  end_seq(id);                    // erased at the end of the step, reported nowhere
}

void Engine::finish_beams(RequestId gid, BeamGroup& g, std::vector<RequestOutput>& out) {
  const std::vector<BeamHypothesis> hyps = g.search.results();
  for (size_t r = 0; r < hyps.size(); ++r) {
    const BeamHypothesis& h = hyps[r];
    RequestOutput o;
    o.id = gid;
    o.index = static_cast<int64_t>(r);
    o.new_tokens = h.tokens;
    if (tokenizer_) {  // as the streaming path decodes: special tokens skipped, whole characters
      for (int32_t t : h.tokens)
        if (!tokenizer_->is_special(t)) o.new_text += tokenizer_->decode_token(t);
      o.new_text.resize(io::complete_utf8_prefix(o.new_text));
    }
    o.finished = true;
    o.finish_reason = h.finish_reason;
    o.num_prompt_tokens = g.prompt_len;
    o.num_cached_tokens = std::max<int64_t>(0, g.cached_tokens);
    o.num_output_tokens = static_cast<int64_t>(h.tokens.size());
    o.cumulative_logprob = h.cum_logprob;
    o.beam_score = h.score;
    stats_.finished[h.finish_reason]++;
    out.push_back(std::move(o));
  }
  for (RequestId id : g.live) drop_beam(id);
}

// A step scheduled nothing: every running sequence is a beam parked until its siblings have
// run, and a sibling waits for blocks that the parked beams hold. The parked beams go back to
// the queue (their blocks freed, as a preemption would) keeping the candidates they already
// produced; queued after the sibling, they come back once it has run.
void Engine::requeue_parked_beams() {
  for (auto it = beam_groups_.begin(); it != beam_groups_.end();) {
    BeamGroup& g = *it->second;
    if (std::any_of(g.live.begin(), g.live.end(), [&](RequestId id) { return !seq_live(id); })) {
      for (RequestId id : g.live) drop_beam(id);  // aborted (reported by step())
      it = beam_groups_.erase(it);
      continue;
    }
    ++it;
    if (std::all_of(g.cand.begin(), g.cand.end(), [](const auto& c) { return !c.empty(); })) continue;
    for (size_t i = 0; i < g.live.size(); ++i) {
      const SchedRequest* r = scheduler_->find(g.live[i]);
      if (g.cand[i].empty() || !r || r->status != RequestStatus::kRunning) continue;
      SchedRequest q;
      q.id = r->id;
      q.tokens = r->tokens;
      q.num_prompt_tokens = r->num_prompt_tokens;
      q.max_tokens = r->max_tokens;
      q.priority = r->priority;
      q.cache_salt = r->cache_salt;
      scheduler_->abort_request(q.id);
      scheduler_->add_request(std::move(q));
      ++beams_requeued_;
    }
  }
}

void Engine::advance_beams(std::vector<RequestOutput>& out) {
  for (auto it = beam_groups_.begin(); it != beam_groups_.end();) {
    const RequestId gid = it->first;
    BeamGroup& g = *it->second;
    const bool aborted = std::any_of(g.live.begin(), g.live.end(), [&](RequestId id) { return !seq_live(id); });
    if (aborted) {  // abort_request: the engine reported it already
      for (RequestId id : g.live) drop_beam(id);
      it = beam_groups_.erase(it);
      continue;
    }
    if (std::any_of(g.cand.begin(), g.cand.end(), [](const auto& c) { return c.empty(); })) {
      ++it;
      continue;
    }
    const std::vector<BeamSearch::Next> next = g.search.step(g.cand);
    if (g.search.done()) {
      finish_beams(gid, g, out);
      it = beam_groups_.erase(it);
      continue;
    }
    // A parent's first child continues in the parent's sequence (appended first, so that
    // forks copy a parent with exactly its new token uncomputed); later children fork it.
    std::vector<RequestId> ids(next.size(), -1);
    std::vector<char> kept(g.live.size(), 0);
    for (size_t i = 0; i < next.size(); ++i) {
      const auto p = static_cast<size_t>(next[i].parent);
      if (kept[p]) continue;
      kept[p] = 1;
      ids[i] = g.live[p];
      extend_seq(ids[i], next[i].token);
      scheduler_->append_token(ids[i], next[i].token);
    }
    for (size_t i = 0; i < next.size(); ++i) {
      if (ids[i] >= 0) continue;
      const RequestId parent = g.live[static_cast<size_t>(next[i].parent)];
      const RequestId child = next_id_++;
      fork_seq(parent, child, next[i].token);
      const SchedRequest* pr = scheduler_->find(parent);
      if (pr->status == RequestStatus::kRunning &&
          static_cast<int64_t>(pr->tokens.size()) == pr->num_computed_tokens + 1) {
        scheduler_->fork_request(parent, child, next[i].token);
      } else {  // the parent was preempted: the child queues on its own (prefix-cache hits)
        SchedRequest r;
        r.id = child;
        r.tokens = pr->tokens;
        r.tokens.back() = next[i].token;
        r.num_prompt_tokens = pr->num_prompt_tokens;
        r.max_tokens = pr->max_tokens;
        r.priority = pr->priority;
        r.cache_salt = pr->cache_salt;
        scheduler_->add_request(std::move(r));
      }
      ids[i] = child;
    }
    for (size_t p = 0; p < g.live.size(); ++p)
      if (!kept[p]) drop_beam(g.live[p]);
    stats_.generation_tokens += static_cast<int64_t>(ids.size());
    g.live = std::move(ids);
    g.cand.assign(g.live.size(), {});
    ++it;
  }
}

}  // namespace tessera::infer
