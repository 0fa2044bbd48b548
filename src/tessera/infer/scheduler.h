// Continuous-batching scheduler: each step hands out a token budget to running decodes and
// prefill chunks, allocating KV blocks through BlockManager and preempting when the pool is full.
// One rule drives prefill, chunked prefill and decode: num_computed_tokens catches up with
// tokens.size(). Plain CPU bookkeeping; the output is a plain struct the model runner consumes.
#pragma once
#include <cstdint>
#include <set>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "tessera/infer/block_manager.h"

namespace tessera::infer {

struct SchedulerConfig {
  int64_t max_num_batched_tokens = 2048;  // token budget per step
  int64_t max_num_seqs = 256;             // running requests at most (admission limit)
  int64_t max_model_len = 2048;           // context length
  bool chunked_prefill = true;
  // Every layer attends to a sliding window of this many positions (0: none): blocks wholly
  // before the window of a request's next token are released after each step.
  int64_t sliding_window = 0;
  // StreamingLLM attention sinks (stream_window > 0; docs/serving.md, "Long streams"): a
  // request's cache holds its first attention_sinks tokens and a window of at most
  // stream_window recent ones, so a stream runs past max_model_len in constant memory (only
  // the engine's max_tokens ends it). A step never takes a cache past sinks + window: a full
  // cache first drops the window's oldest block_size tokens (a KvShift), so every token
  // attends to the sinks and the last stream_window - block_size + 1 to stream_window tokens
  // (itself included), however the tokens are chunked. Needs chunked prefill and prefix
  // caching off (shifted blocks no longer hold their tokens' prefix K/V).
  int64_t attention_sinks = 0;
  int64_t stream_window = 0;
  bool streaming() const { return stream_window > 0; }
  // Preemption by swap (--preemption swap): the victim's computed K/V is copied out through
  // BlockManager::swap_out and back in on resumption instead of recomputed; a victim the
  // lower tier has no room for is recomputed. false: always recompute.
  bool preemption_swap = false;
};

enum class RequestStatus { kWaiting, kRunning, kPreempted, kFinished };

struct SchedRequest {  // what the scheduler tracks (the engine owns sampling etc.)
  RequestId id = 0;
  std::vector<int32_t> tokens;  // prompt + generated so far
  int64_t num_prompt_tokens = 0;  // 1 <= num_prompt_tokens <= tokens.size() at add_request
  int64_t num_computed_tokens = 0;  // tokens whose K/V is in the cache; 0 at add_request
  int64_t max_tokens = 0;  // informational: the engine decides when a request is done
  int priority = 0;        // lower value = more important (vLLM's convention), ties by arrival
  int64_t arrival = 0;     // set by add_request (monotonic counter)
  RequestStatus status = RequestStatus::kWaiting;
  int64_t num_preemptions = 0;
  // Speculative decoding: tokens proposed to follow `tokens` (set_spec_tokens, cleared by
  // every schedule()). A decode with proposals runs its last token plus them in one step.
  std::vector<int32_t> spec_tokens;
  // Prefix-cache namespace (BlockManager::allocate_cached_prefix): requests whose K/V differs
  // for the same tokens (a LoRA adapter) never share cached blocks. 0: the base model's.
  uint64_t cache_salt = 0;
  // Never read the prefix cache (its positions would not be computed): requests that read
  // every prompt position's logits or hidden states. Its blocks are still committed.
  bool skip_prefix_cache = false;
  // Attention sinks: tokens dropped from the window so far. Computed token i sits at cache
  // position i (a sink, i < attention_sinks) or i - shift (the window, i >= sinks + shift).
  int64_t shift = 0;
};

struct ScheduledRequest {
  RequestId id = 0;
  int64_t start = 0;       // num_computed_tokens before this step: positions [start, start+num_tokens)
  int64_t num_tokens = 0;  // tokens to run this step (1 for a decode, a chunk for prefill)
  bool samples = false;    // this step reaches the end of the known tokens: the runner produces
                           // logits for its last position and the engine samples a token
  // Speculative decoding: the last num_spec of the num_tokens are proposals
  // (spec_tokens[0, num_spec)); the runner produces logits for every position from the last
  // known token on, and update() takes 1 to num_spec + 1 tokens for the request.
  int64_t num_spec = 0;
  // Attention sinks: this step's tokens run at cache positions (and RoPE positions)
  // start - shift + i; context_len in the cache is start + num_tokens - shift.
  int64_t shift = 0;
};

// Attention sinks: before the step, drop cache rows [sinks, sinks + delta) of the request
// (its `length` rows then become length - delta); kernels::shift_kv_window does it.
struct KvShift {
  RequestId id = 0;
  int64_t sinks = 0, length = 0, delta = 0;
};

struct SchedulerOutput {  // the plain struct the model runner consumes
  // Single-token entries (decodes) first, then multi-token prefill chunks; each group in
  // scheduling order (running requests in admission order, then newly admitted ones).
  // Block tables: BlockManager::block_table(id), valid until the next schedule().
  std::vector<ScheduledRequest> requests;
  // Copy-on-write copies {src, dst} to apply, in order, before the step writes any K/V.
  std::vector<std::pair<BlockId, BlockId>> copies;
  std::vector<RequestId> preempted;  // requests preempted in this step (now waiting again)
  // Attention sinks: window shifts to apply after the copies and before the step writes K/V
  // (each request's block table as it is after this schedule()).
  std::vector<KvShift> shifts;
  int64_t num_batched_tokens = 0;    // sum of requests[i].num_tokens
};

class Scheduler {
 public:
  // Throws on a bad config, and when one request of max_model_len tokens could not fit in the
  // pool or (without chunked prefill) in one step's budget.
  Scheduler(SchedulerConfig c, BlockManager& blocks);

  // Joins at the next schedule(). Throws on a duplicate id, an empty or over-long token list
  // (tokens.size() > max_model_len), a bad num_prompt_tokens, or num_computed_tokens != 0.
  void add_request(SchedRequest r);
  // Removes the request wherever it is and frees its blocks at once. Unknown id: no-op.
  void abort_request(RequestId id);
  // The engine decided it is done (stop, length): frees its blocks at once; the request leaves
  // (find() returns nullptr). Throws for an unknown id.
  void finish_request(RequestId id);
  // n > 1 samples / beam search: a running `parent` that just sampled (exactly one uncomputed
  // token) gets a sibling `child` with the same tokens except the last one (= last_token),
  // sharing the parent's blocks (copy-on-write). The child runs from the next step.
  void fork_request(RequestId parent, RequestId child, int32_t last_token);
  // Beam search: a request that ran its last token without one being sampled (update got
  // none for it; the scheduler skips such a request meanwhile) now takes `token`.
  void append_token(RequestId id, int32_t token);

  // Proposals for the next decode of a running request (speculative decoding); ignored
  // unless the request is a decode (exactly one uncomputed token) at the next schedule().
  void set_spec_tokens(RequestId id, std::vector<int32_t> tokens);

  // Budgets tokens for one step: running requests first in admission order (a decode takes 1
  // token, a request still prefilling a chunk), then waiting / preempted requests in
  // priority-then-arrival order (prefix-cache lookup on admission; chunked prefill splits a
  // prompt across steps; without it a prompt that does not fit the remaining budget waits, as
  // does everything queued behind it). When a running request cannot get blocks, the running
  // request with the largest (priority, arrival) is preempted and the allocation retried; a
  // request can preempt itself (it is then not scheduled). No admissions in a step that preempted.
  // Throws if a running request would compute a position >= max_model_len (the engine must
  // finish requests at the context length).
  SchedulerOutput schedule();

  // After the runner ran the step: for each scheduled request still present,
  // num_computed_tokens += num_tokens and its full blocks are committed to the prefix cache;
  // then each sampled token is appended to its request (which must have had samples == true).
  // A speculative decode (num_spec > 0) takes its tokens in order: the accepted proposals,
  // then one sampled token (1 to num_spec + 1 entries); num_computed_tokens advances by
  // their count, so the K/V of rejected proposals is rolled back (overwritten later, never
  // committed to the prefix cache).
  void update(const SchedulerOutput& out,
              const std::vector<std::pair<RequestId, int32_t>>& sampled);

  const SchedRequest* find(RequestId id) const;
  size_t num_waiting() const { return waiting_.size(); }
  size_t num_running() const { return running_.size(); }
  int64_t num_preemptions() const { return num_preemptions_; }
  const SchedulerConfig& config() const { return cfg_; }
  int64_t num_swapped_preemptions() const { return num_swapped_; }  // of those, by swap
  const std::vector<RequestId>& running() const { return running_; }  // admission order
  std::vector<RequestId> waiting() const;  // admission order (priority, then arrival)

  // Invariant check for tests: queues and statuses agree, waiting requests hold no blocks,
  // running ones hold blocks covering their computed tokens; then the block manager's check.
  void check_invariants() const;

  // The most KV blocks one request holds at once: its whole max_model_len, or under a
  // sliding window its window plus one step's tokens, or with attention sinks
  // ceil((sinks + window) / block_size).
  static int64_t blocks_per_request(const SchedulerConfig& c, int64_t block_size);

 private:
  using WaitKey = std::tuple<int, int64_t, RequestId>;  // (priority, arrival, id)
  static WaitKey wait_key(const SchedRequest& r) { return {r.priority, r.arrival, r.id}; }

  // Blocks and copy-on-write for positions [start, start+n) of a running request, after
  // dropping `delta` window rows (attention sinks; the rows that move are written too).
  bool reserve(SchedRequest& r, int64_t n, int64_t delta = 0);
  // Attention sinks: the tokens of n a request may run this step and the rows to drop first.
  std::pair<int64_t, int64_t> stream_step(const SchedRequest& r, int64_t n) const;
  RequestId pick_victim() const;
  void check_length(const SchedRequest& r) const;
  void preempt(RequestId id, SchedulerOutput& out, int64_t& budget);
  void remove(RequestId id);
  void release_out_of_window(const SchedRequest& r);

  SchedulerConfig cfg_;
  BlockManager& blocks_;
  std::unordered_map<RequestId, SchedRequest> reqs_;
  std::vector<RequestId> running_;  // admission order
  std::set<WaitKey> waiting_;       // kWaiting and kPreempted requests, admission order
  std::vector<std::pair<RequestId, std::pair<BlockId, BlockId>>> step_copies_;
  int64_t next_arrival_ = 0;
  int64_t num_preemptions_ = 0;
  int64_t num_swapped_ = 0;
};

}  // namespace tessera::infer
