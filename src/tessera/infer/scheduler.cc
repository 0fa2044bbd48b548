// Continuous-batching scheduler (see scheduler.h): token budget, admission, preemption.
#include "tessera/infer/scheduler.h"

#include <algorithm>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include "tessera/base/error.h"

namespace tessera::infer {

Scheduler::Scheduler(SchedulerConfig c, BlockManager& blocks) : cfg_(c), blocks_(blocks) {
  TESSERA_CHECK(c.max_num_batched_tokens > 0, "Scheduler: max_num_batched_tokens must be > 0, got ",
                c.max_num_batched_tokens);
  TESSERA_CHECK(c.max_num_seqs > 0, "Scheduler: max_num_seqs must be > 0, got ", c.max_num_seqs);
  TESSERA_CHECK(c.max_model_len > 0, "Scheduler: max_model_len must be > 0, got ",
                c.max_model_len);
  if (c.streaming()) {
    TESSERA_CHECK(c.attention_sinks >= 0, "Scheduler: attention_sinks must be >= 0, got ", c.attention_sinks);
    TESSERA_CHECK(c.stream_window >= blocks.block_size(), "Scheduler: the attention-sinks window (", c.stream_window,
                  ") must be at least a block (", blocks.block_size(), " tokens): a full cache drops a block at a time");
    TESSERA_CHECK(c.chunked_prefill, "Scheduler: attention sinks need chunked prefill (a prompt longer than the "
                  "cache streams through it in chunks)");
    TESSERA_CHECK(!blocks.prefix_caching(), "Scheduler: attention sinks need prefix caching off (shifted blocks no "
                  "longer hold their tokens' K/V)");
  }
  const int64_t need = blocks_per_request(c, blocks.block_size());
  TESSERA_CHECK(need <= blocks.num_blocks(), "Scheduler: max_model_len ", c.max_model_len,
                c.sliding_window > 0 ? " (sliding window " + std::to_string(c.sliding_window) + ")" : std::string(),
                " needs ", need, " KV blocks but the pool has only ", blocks.num_blocks(),
                " (raise the KV cache memory or lower max_model_len)");
  TESSERA_CHECK(c.chunked_prefill || c.max_num_batched_tokens >= c.max_model_len,
                "Scheduler: without chunked prefill max_num_batched_tokens (",
                c.max_num_batched_tokens, ") must be >= max_model_len (", c.max_model_len, ")");
}

void Scheduler::add_request(SchedRequest r) {
  TESSERA_CHECK(!reqs_.count(r.id), "Scheduler::add_request: request id ", r.id,
                " is already in use");
  const int64_t n = static_cast<int64_t>(r.tokens.size());
  TESSERA_CHECK(n > 0, "Scheduler::add_request: request ", r.id, " has no tokens");
  TESSERA_CHECK(n <= cfg_.max_model_len || cfg_.streaming(), "Scheduler::add_request: request ", r.id, " has ", n,
                " tokens, more than max_model_len ", cfg_.max_model_len);
  TESSERA_CHECK(r.num_prompt_tokens >= 1 && r.num_prompt_tokens <= n,
                "Scheduler::add_request: request ", r.id, ": num_prompt_tokens ",
                r.num_prompt_tokens, " outside [1, ", n, "]");
  TESSERA_CHECK(r.num_computed_tokens == 0, "Scheduler::add_request: request ", r.id,
                ": num_computed_tokens must be 0, got ", r.num_computed_tokens);
  r.arrival = next_arrival_++;
  r.status = RequestStatus::kWaiting;
  r.num_preemptions = 0;
  waiting_.insert(wait_key(r));
  reqs_.emplace(r.id, std::move(r));
}

void Scheduler::remove(RequestId id) {
  SchedRequest& r = reqs_.at(id);
  if (r.status == RequestStatus::kRunning)
    running_.erase(std::find(running_.begin(), running_.end(), id));
  else
    waiting_.erase(wait_key(r));
  blocks_.free(id);
  blocks_.drop_swap(id);
  reqs_.erase(id);
}

void Scheduler::abort_request(RequestId id) {
  if (reqs_.count(id)) remove(id);
}

void Scheduler::finish_request(RequestId id) {
  TESSERA_CHECK(reqs_.count(id), "Scheduler::finish_request: unknown request id ", id);
  remove(id);
}

void Scheduler::fork_request(RequestId parent, RequestId child, int32_t last_token) {
  auto it = reqs_.find(parent);
  TESSERA_CHECK(it != reqs_.end(), "Scheduler::fork_request: unknown parent request ", parent);
  const SchedRequest& p = it->second;
  TESSERA_CHECK(p.status == RequestStatus::kRunning &&
                    static_cast<int64_t>(p.tokens.size()) == p.num_computed_tokens + 1,
                "Scheduler::fork_request: parent ", parent,
                " must be running with exactly one sampled, uncomputed token");
  TESSERA_CHECK(!reqs_.count(child), "Scheduler::fork_request: child id ", child,
                " is already in use");
  SchedRequest c = p;
  c.id = child;
  c.tokens.back() = last_token;
  c.arrival = next_arrival_++;
  c.num_preemptions = 0;
  blocks_.fork(parent, child);
  running_.push_back(child);
  reqs_.emplace(child, std::move(c));
}

void Scheduler::append_token(RequestId id, int32_t token) {
  auto it = reqs_.find(id);
  TESSERA_CHECK(it != reqs_.end(), "Scheduler::append_token: unknown request ", id);
  SchedRequest& r = it->second;
  TESSERA_CHECK(r.status != RequestStatus::kRunning ||
                    r.num_computed_tokens == static_cast<int64_t>(r.tokens.size()),
                "Scheduler::append_token: running request ", id, " still has uncomputed tokens");
  r.tokens.push_back(token);
}

void Scheduler::set_spec_tokens(RequestId id, std::vector<int32_t> tokens) {
  auto it = reqs_.find(id);
  TESSERA_CHECK(it != reqs_.end(), "Scheduler::set_spec_tokens: unknown request ", id);
  it->second.spec_tokens = std::move(tokens);
}

const SchedRequest* Scheduler::find(RequestId id) const {
  auto it = reqs_.find(id);
  return it == reqs_.end() ? nullptr : &it->second;
}

std::vector<RequestId> Scheduler::waiting() const {
  std::vector<RequestId> ids;
  for (const WaitKey& k : waiting_) ids.push_back(std::get<2>(k));
  return ids;
}

bool Scheduler::reserve(SchedRequest& r, int64_t n, int64_t delta) {
  const int64_t start = r.num_computed_tokens - r.shift - delta;  // the cache row of the first token
  if (!blocks_.allocate_slots(r.id, start + n)) return false;
  // Only blocks this step writes into can need a private copy (a fork sibling shares them);
  // a window shift rewrites the rows from the sinks on.
  const int64_t bs = blocks_.block_size();
  const int64_t first = delta > 0 ? cfg_.attention_sinks : start;
  for (int64_t b = first / bs; b <= (start + n - 1) / bs; ++b) {
    CowResult c = blocks_.copy_on_write(r.id, std::max(first, b * bs));
    if (!c.ok) return false;
    if (c.copy) step_copies_.push_back({r.id, *c.copy});
  }
  return true;
}

RequestId Scheduler::pick_victim() const {
  // Least important first: largest priority value, then latest arrival.
  const SchedRequest* victim = nullptr;
  for (RequestId id : running_) {
    const SchedRequest& r = reqs_.at(id);
    if (!victim || std::pair(r.priority, r.arrival) > std::pair(victim->priority, victim->arrival))
      victim = &r;
  }
  return victim->id;
}

void Scheduler::preempt(RequestId id, SchedulerOutput& out, int64_t& budget) {
  SchedRequest& r = reqs_.at(id);
  // Already scheduled this step: take it back out and refund its tokens and copies.
  auto s = std::find_if(out.requests.begin(), out.requests.end(),
                        [&](const ScheduledRequest& q) { return q.id == id; });
  if (s != out.requests.end()) {
    budget += s->num_tokens;
    out.requests.erase(s);
  }
  std::erase_if(step_copies_, [&](const auto& c) { return c.first == id; });
  std::erase_if(out.shifts, [&](const KvShift& k) { return k.id == id; });
  r.shift = 0;
  running_.erase(std::find(running_.begin(), running_.end(), id));
  if (cfg_.preemption_swap &&
      blocks_.swap_out(id, std::min(r.num_computed_tokens, static_cast<int64_t>(r.tokens.size()) - 1)))
    ++num_swapped_;  // resumed from the copy (allocate_cached_prefix), not recomputed
  blocks_.free(id);  // committed full blocks stay cached, so recomputation often hits them
  r.num_computed_tokens = 0;
  r.status = RequestStatus::kPreempted;
  ++r.num_preemptions;
  ++num_preemptions_;
  waiting_.insert(wait_key(r));
  out.preempted.push_back(id);
}

void Scheduler::check_length(const SchedRequest& r) const {
  TESSERA_CHECK(cfg_.streaming() || static_cast<int64_t>(r.tokens.size()) <= cfg_.max_model_len,
                "Scheduler::schedule: request ", r.id, " has ", r.tokens.size(),
                " tokens, more than max_model_len ", cfg_.max_model_len,
                "; the engine must finish it at the context length");
}

SchedulerOutput Scheduler::schedule() {
  SchedulerOutput out;
  step_copies_.clear();
  int64_t budget = cfg_.max_num_batched_tokens;

  // Running requests, in admission order.
  size_t i = 0;
  while (i < running_.size() && budget > 0) {
    SchedRequest& r = reqs_.at(running_[i]);
    const int64_t remaining = static_cast<int64_t>(r.tokens.size()) - r.num_computed_tokens;
    if (remaining <= 0 || (!cfg_.chunked_prefill && remaining > budget)) {
      ++i;
      continue;
    }
    check_length(r);
    int64_t spec = 0;  // proposals run after a decode's token, within budget and context
    if (remaining == 1 && !r.spec_tokens.empty() && !cfg_.streaming())
      spec = std::max<int64_t>(0, std::min({static_cast<int64_t>(r.spec_tokens.size()), budget - 1,
                                            cfg_.max_model_len -
                                                static_cast<int64_t>(r.tokens.size())}));
    int64_t n = std::min(remaining, budget) + spec, delta = 0;
    if (cfg_.streaming()) std::tie(n, delta) = stream_step(r, n);
    bool self_preempted = false;
    while (!reserve(r, n, delta)) {
      const RequestId victim = pick_victim();
      const size_t vi = std::find(running_.begin(), running_.end(), victim) - running_.begin();
      preempt(victim, out, budget);
      if (victim == r.id) {
        self_preempted = true;
        break;
      }
      if (vi < i) --i;  // an already scheduled request left running_ before position i
    }
    if (self_preempted) continue;  // running_[i] is now the next request
    if (delta > 0) {
      out.shifts.push_back({r.id, cfg_.attention_sinks, r.num_computed_tokens - r.shift, delta});
      r.shift += delta;
    }
    out.requests.push_back({r.id, r.num_computed_tokens, n,
                            r.num_computed_tokens + n - spec == static_cast<int64_t>(r.tokens.size()),
                            spec, r.shift});
    budget -= n;
    ++i;
  }
  for (auto& [id, r] : reqs_) r.spec_tokens.clear();

  // Waiting and preempted requests, in priority-then-arrival order. A step that had to preempt
  // is short of memory: admitting now would only preempt again.
  while (out.preempted.empty() && !waiting_.empty() && budget > 0 &&
         static_cast<int64_t>(running_.size()) < cfg_.max_num_seqs) {
    const WaitKey key = *waiting_.begin();
    SchedRequest& r = reqs_.at(std::get<2>(key));
    check_length(r);
    const int64_t cached = blocks_.allocate_cached_prefix(
        r.id, r.skip_prefix_cache ? std::vector<int32_t>{} : r.tokens, r.cache_salt);  // no tokens: no hit
    const int64_t remaining = static_cast<int64_t>(r.tokens.size()) - cached;  // >= 1
    if (!cfg_.chunked_prefill && remaining > budget) {
      blocks_.free(r.id);
      break;
    }
    int64_t n = std::min(remaining, budget);
    if (cfg_.streaming()) n = stream_step(r, n).first;  // an empty cache: no shift
    if (!blocks_.allocate_slots(r.id, cached + n)) {
      blocks_.free(r.id);
      break;
    }
    waiting_.erase(waiting_.begin());
    r.num_computed_tokens = cached;
    r.status = RequestStatus::kRunning;
    running_.push_back(r.id);
    out.requests.push_back({r.id, cached, n, cached + n == static_cast<int64_t>(r.tokens.size()), 0});
    budget -= n;
  }

  std::stable_partition(out.requests.begin(), out.requests.end(),
                        [](const ScheduledRequest& s) { return s.num_tokens == 1; });
  for (const auto& c : step_copies_) out.copies.push_back(c.second);
  step_copies_.clear();
  for (const ScheduledRequest& s : out.requests) out.num_batched_tokens += s.num_tokens;
  return out;
}

void Scheduler::update(const SchedulerOutput& out,
                       const std::vector<std::pair<RequestId, int32_t>>& sampled) {
  std::unordered_map<RequestId, int64_t> may_sample;  // id -> tokens it may still take
  std::vector<RequestId> speculative;
  for (const ScheduledRequest& s : out.requests) {
    auto it = reqs_.find(s.id);
    if (it == reqs_.end()) continue;  // finished or aborted since schedule()
    SchedRequest& r = it->second;
    TESSERA_CHECK(r.status == RequestStatus::kRunning && r.num_computed_tokens == s.start,
                  "Scheduler::update: request ", s.id, " was scheduled from position ", s.start,
                  " but has ", r.num_computed_tokens,
                  " computed tokens (update applied twice, or an output of another step?)");
    if (s.num_spec > 0) {  // advanced by the tokens it takes below
      speculative.push_back(s.id);
    } else {
      r.num_computed_tokens += s.num_tokens;
      if (!cfg_.streaming()) blocks_.commit(r.id, r.tokens, r.num_computed_tokens);
      release_out_of_window(r);
    }
    if (s.samples) may_sample[s.id] = 1 + s.num_spec;
  }
  std::unordered_map<RequestId, int64_t> taken;
  for (const auto& [id, token] : sampled) {
    auto it = reqs_.find(id);
    if (it == reqs_.end()) continue;
    auto m = may_sample.find(id);
    TESSERA_CHECK(m != may_sample.end() && m->second > 0, "Scheduler::update: request ", id,
                  " got a sampled token but did not sample this step (or got too many)");
    --m->second;
    ++taken[id];
    it->second.tokens.push_back(token);
  }
  for (RequestId id : speculative) {
    SchedRequest& r = reqs_.at(id);
    // The last known token and the accepted proposals have valid K/V; the rest is
    // overwritten by later steps.
    r.num_computed_tokens += std::max<int64_t>(1, taken[id]);
    blocks_.commit(r.id, r.tokens, std::min<int64_t>(r.num_computed_tokens,
                                                     static_cast<int64_t>(r.tokens.size())));
    release_out_of_window(r);
  }
}

int64_t Scheduler::blocks_per_request(const SchedulerConfig& c, int64_t block_size) {
  if (c.streaming()) return (c.attention_sinks + c.stream_window + block_size - 1) / block_size;
  const int64_t whole = (c.max_model_len + block_size - 1) / block_size;
  if (c.sliding_window <= 0) return whole;
  // Held at once: from the window start of a step's first token to the end of its chunk.
  return std::min(whole, (c.sliding_window + c.max_num_batched_tokens) / block_size + 2);
}

// Later steps compute positions from num_computed_tokens on (a rejected proposal is never
// below it), whose windows start at num_computed_tokens - window + 1 or later.
void Scheduler::release_out_of_window(const SchedRequest& r) {
  const int64_t w = cfg_.sliding_window;
  if (w <= 0 || r.num_computed_tokens - w + 1 <= 0) return;
  blocks_.release_leading(r.id, (r.num_computed_tokens - w + 1) / blocks_.block_size());
}

// A cache below sinks + window takes tokens up to full; a full one first drops the window's
// oldest block, then takes at most a block. So the cache fills up exactly before each
// shift and the shifts fall at the same tokens whatever the chunking.
std::pair<int64_t, int64_t> Scheduler::stream_step(const SchedRequest& r, int64_t n) const {
  const int64_t cap = cfg_.attention_sinks + cfg_.stream_window;
  const int64_t rows = r.num_computed_tokens - r.shift;
  if (rows < cap) return {std::min(n, cap - rows), 0};
  const int64_t bs = blocks_.block_size();
  return {std::min(n, bs), bs};
}

void Scheduler::check_invariants() const {
  const char* where = "Scheduler invariant: ";
  std::unordered_set<RequestId> seen;
  for (RequestId id : running_) {
    TESSERA_CHECK(seen.insert(id).second, where, "request ", id, " is running twice");
    auto it = reqs_.find(id);
    TESSERA_CHECK(it != reqs_.end(), where, "running request ", id, " is unknown");
    const SchedRequest& r = it->second;
    TESSERA_CHECK(r.status == RequestStatus::kRunning, where, "request ", id,
                  " is in the running list with another status");
    TESSERA_CHECK(r.num_computed_tokens <= static_cast<int64_t>(r.tokens.size()), where,
                  "request ", id, " computed ", r.num_computed_tokens, " of ", r.tokens.size(),
                  " tokens");
    TESSERA_CHECK(blocks_.has_request(id), where, "running request ", id, " has no blocks");
    const int64_t covered =
        static_cast<int64_t>(blocks_.block_table(id).size()) * blocks_.block_size();
    TESSERA_CHECK(covered >= r.num_computed_tokens - r.shift, where, "request ", id, " blocks cover ",
                  covered, " tokens < ", r.num_computed_tokens - r.shift, " cached");
    TESSERA_CHECK(r.shift == 0 || (cfg_.streaming() && r.num_computed_tokens - r.shift <=
                                                           cfg_.attention_sinks + cfg_.stream_window),
                  where, "request ", id, " caches ", r.num_computed_tokens - r.shift, " rows (shift ", r.shift, ")");
  }
  for (const WaitKey& k : waiting_) {
    const RequestId id = std::get<2>(k);
    TESSERA_CHECK(seen.insert(id).second, where, "request ", id, " is queued twice");
    auto it = reqs_.find(id);
    TESSERA_CHECK(it != reqs_.end(), where, "waiting request ", id, " is unknown");
    const SchedRequest& r = it->second;
    TESSERA_CHECK(r.status == RequestStatus::kWaiting || r.status == RequestStatus::kPreempted,
                  where, "request ", id, " is queued with another status");
    TESSERA_CHECK(wait_key(r) == k, where, "request ", id, " is queued under a stale key");
    TESSERA_CHECK(r.num_computed_tokens == 0 && !blocks_.has_request(id), where,
                  "waiting request ", id, " holds computed tokens or blocks");
  }
  TESSERA_CHECK(seen.size() == reqs_.size(), where, reqs_.size() - seen.size(),
                " requests are neither running nor waiting");
  blocks_.check_invariants();
}

}  // namespace tessera::infer
