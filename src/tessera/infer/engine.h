// The inference engine: requests in, tokens out, one step at a time. Each step the
// scheduler picks running decodes and prefill chunks under a token budget (continuous
// batching), the model runs them as one flattened batch over the paged KV cache, and
// the sampler picks each sequence's next token. `tessera generate`, `bench serve` and the
// server all drive it. See docs/inference.md.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "tessera/infer/block_manager.h"
#include "tessera/infer/kv_pool.h"
#include "tessera/infer/prompt_work.h"
#include "tessera/infer/sampler.h"
#include "tessera/infer/scheduler.h"
#include "tessera/io/tokenizer.h"
#include "tessera/model/model.h"

namespace tessera::infer {

class TpGroup;  // tp_serving.h
class KvTiers;  // kv_tiers.h
namespace structured {  // structured/guided_runner.h
class GuidedRunner;
struct GuidedStats;
}  // namespace structured

struct EngineConfig {
  int64_t block_size = 16;               // tokens per KV block
  int64_t kv_cache_memory = 0;           // bytes for the KV pool; 0 = kv_cache_fraction of free memory
  double kv_cache_fraction = 0.5;        // of MemAvailable, when kv_cache_memory is 0
  // What the paged KV cache stores: bf16 (default), int8 or fp8 (per-token per-head scales),
  // or f32 (exact; what Model::forward's own cache holds).
  kernels::KvCacheDtype kv_cache_dtype = kernels::KvCacheDtype::kBF16;
  int64_t max_num_batched_tokens = 2048; // token budget per step
  int64_t max_num_seqs = 64;             // running sequences at most
  int64_t max_model_len = 0;             // context length; 0 = the model's (model::max_context)
  bool prefix_caching = true;
  bool chunked_prefill = true;
  bool batch_invariant = false;          // logits independent of the rest of the batch (slower)
  // Speculative decoding: "ngram" (prompt lookup) or "draft" (needs a draft model); "" off.
  std::string speculative_method;
  int64_t num_speculative_tokens = 0;
  int64_t ngram_max = 3, ngram_min = 1;  // n-gram sizes prompt lookup tries (longest first)
  // StreamingLLM attention sinks (--attention-sinks S --window W; docs/serving.md, "Long
  // streams"): each sequence's cache keeps its first S tokens and at most the last W,
  // positions re-assigned within the cache, so a stream runs past max_model_len in constant
  // memory (max_tokens alone ends it). Off while stream_window is 0; S + W must fit the
  // context. Turns prefix caching off.
  int64_t attention_sinks = -1;          // S (-1: off; 0: a window without sinks)
  int64_t stream_window = 0;             // W
  bool streaming() const { return stream_window > 0; }
  // Tiered KV cache (kv_tiers.h): committed blocks evicted from the pool are kept in a host
  // tier of kv_host_memory bytes (0: none) and, write-through, in block files under
  // kv_offload_dir ("": none) of kv_offload_size bytes at most; prefix lookups continue there.
  int64_t kv_host_memory = 0;
  std::string kv_offload_dir;
  int64_t kv_offload_size = 0;
  // Extra identity of the weights for the disk tier's fingerprint (the CLI passes the model
  // files' names, sizes and times); the weights' own digest is always part of it.
  std::string kv_offload_model_id;
  std::string preemption = "recompute";  // or "swap": preempted requests' K/V to the host tier
  void validate() const;                 // throws naming the field
};

// What one sequence produced in one step.
struct RequestOutput {
  RequestId id = 0;        // the id add_request returned
  int64_t index = 0;       // which of the n samples
  std::vector<int32_t> new_tokens;
  std::string new_text;    // detokenized, safe to stream (stop strings held back); needs a tokenizer
  std::vector<SampleResult> logprobs;  // per new token, when the request asked for logprobs
  // params.prompt_logprobs: prompt tokens 1 .. P-1 (token 0 has none), with each sample's
  // first output.
  std::vector<PromptLogprob> prompt_logprobs;
  std::vector<float> embedding;  // add_embedding_request: (H) the pooled hidden state, when finished
  bool finished = false;
  std::string finish_reason;  // "stop" | "length" | "abort" when finished
  int64_t num_prompt_tokens = 0;
  int64_t num_cached_tokens = 0;  // prompt tokens served from the prefix cache (first admission)
  int64_t num_output_tokens = 0;  // so far
  // Beam search: the whole hypothesis arrives at once (index = rank, best first) with its
  // cumulative raw log-probability and score (cumulative_logprob / length^length_penalty).
  double cumulative_logprob = 0.0, beam_score = 0.0;
};

// KV slots held by the running sequences at one moment (bench serve's fragmentation figure).
struct KvUsage {
  int64_t sequences = 0;  // running sequences
  int64_t blocks = 0;     // distinct physical blocks in their block tables
  int64_t tokens = 0;     // slots of those blocks holding computed K/V (a shared block once)
  int64_t seq_tokens = 0; // computed tokens summed per sequence (shared prefixes counted each time;
                          // with attention sinks the rows each cache holds)
};

struct EngineStats {
  int64_t steps = 0;
  int64_t prompt_tokens = 0, generation_tokens = 0;  // computed prompt tokens, sampled tokens
  int64_t batched_tokens = 0;  // every token run through the model (prefill, recompute, decode, proposals)
  int64_t prefix_queries = 0, prefix_hit_blocks = 0, prefix_miss_blocks = 0;  // hits: pool and lower tiers
  int64_t preemptions = 0;
  int64_t spec_proposed = 0, spec_accepted = 0, spec_steps = 0;  // speculative decoding
  int64_t running = 0, waiting = 0;
  int64_t kv_blocks_total = 0, kv_blocks_used = 0;
  // Tiered KV cache: prefix blocks copied back from the host / disk tier (not recomputed),
  // evicted blocks copied down, preemptions by swap and the blocks they moved, bytes moved
  // between the pool and the tiers, and what the tiers hold.
  int64_t kv_host_hit_blocks = 0, kv_disk_hit_blocks = 0, kv_offloaded_blocks = 0, kv_disk_written_blocks = 0;
  int64_t swapped_preemptions = 0, kv_swap_out_blocks = 0, kv_swap_in_blocks = 0;
  int64_t kv_bytes_to_tiers = 0, kv_bytes_from_tiers = 0;
  int64_t kv_host_blocks_total = 0, kv_host_blocks_used = 0, kv_disk_files = 0;
  std::vector<int64_t> expert_tokens;  // MoE models: slots routed to each expert (every layer)
  std::unordered_map<std::string, int64_t> finished;  // by finish reason
};

class Engine {
 public:
  // draft: the proposer model for speculative_method "draft" (same tokenizer); tokenizer:
  // for stop strings and text output (may be null: token ids only).
  // tp: the tensor-parallel group when `model` is rank 0's shard of it (tp_serving.h):
  // each step's forward is broadcast to the workers; the destructor stops them.
  Engine(const model::Model& model, EngineConfig config, const io::Tokenizer* tokenizer = nullptr,
         const model::Model* draft = nullptr, TpGroup* tp = nullptr);
  ~Engine();

  // Validates everything (params, token ids, length) and queues the request; throws
  // tessera::Error naming what is wrong. Returns its id.
  // adapter: multi-LoRA serving, the index of the request's adapter in the model's
  // lora_bank() (-1: the base model). Requests of different adapters share steps; their
  // prefix-cache blocks are kept apart (the adapter changes K and V).
  RequestId add_request(const std::vector<int32_t>& prompt, const SamplingParams& params,
                        int priority = 0, int32_t adapter = -1);
  // An embedding request: the prompt runs as a prefill (batched with the other requests,
  // chunked, never reading the prefix cache), nothing is sampled, and its one output
  // (finish_reason "stop") carries `embedding`: the mean over the prompt's positions of
  // the final hidden states, after the final norm (vLLM's pooling type MEAN). The prompt
  // may fill the whole context (max_model_len tokens). Throws naming the field.
  RequestId add_embedding_request(const std::vector<int32_t>& prompt, int32_t adapter = -1, int priority = 0);
  // Prefill/decode disaggregation (docs/serving.md): continues a request whose first tokens
  // `generated` were sampled by another engine (a prefill worker) from the same prompt. The
  // output so far is `generated` (max_tokens, penalties and min_tokens count them), the
  // detokenizer and stop strings are primed with them, and a seeded sampler skips their
  // draws, so the rest equals what one engine would have produced. One sample (n = 1).
  // primed (optional): receives their output (tokens and text, as if just sampled).
  RequestId add_resumed_request(const std::vector<int32_t>& prompt, const std::vector<int32_t>& generated,
                                const SamplingParams& params, int32_t adapter = -1,
                                RequestOutput* primed = nullptr);
  // KV transfer between engines (engine_kv.cc); engine thread only. A holder pins blocks
  // (BlockManager table of a negative id) until release_kv.
  struct KvChain {
    RequestId holder = 0;
    int64_t have = 0;                // leading blocks already cached here (import) or held (export)
    std::vector<BlockId> blocks;     // the chain's blocks in this pool, in order
    std::vector<uint64_t> hashes;    // their chain hashes
  };
  // Export: pins the cached full blocks of `tokens` (under the adapter's salt); have = their count.
  KvChain hold_kv_prefix(const std::vector<int32_t>& tokens, int32_t adapter);
  // Import of a chain of hashes.size() full blocks of `tokens`: throws when the hashes differ
  // from this engine's chain of the tokens; pins what is cached here already (have), takes
  // blocks for the rest; nullopt when the pool cannot provide them.
  std::optional<KvChain> reserve_kv_import(const std::vector<int32_t>& tokens, int32_t adapter,
                                           const std::vector<uint64_t>& hashes);
  // The blocks [have, n) now hold their K/V: they enter the prefix cache (still pinned).
  void commit_kv_import(const KvChain& chain, const std::vector<int32_t>& tokens);
  void release_kv(RequestId holder);
  KvPool& kv_pool() { return pool_; }  // KV transfer writes and reads blocks it holds
  // Cancels a request (all its samples): blocks freed at once; the next step() reports it
  // finished with reason "abort". Unknown ids are ignored.
  void abort_request(RequestId id);
  // One engine step; outputs of every sequence that produced tokens or finished.
  std::vector<RequestOutput> step();
  bool has_unfinished() const;
  // Requests (add_request ids) whose first tokens ran in the last step(): the end of their
  // time in the queue.
  const std::vector<RequestId>& started_last_step() const { return started_; }
  EngineStats stats() const;
  KvUsage kv_usage() const;  // O(blocks held); for benchmarks, not every step of a server
  // Tests: the scheduler's and block manager's invariants (ref counts = tables holding each
  // block, free / cached / used lists); throws describing the first violation.
  void check_invariants() const { scheduler_->check_invariants(); }
  const EngineConfig& config() const { return config_; }
  // "KV cache bf16: 812 blocks of 16 tokens (53.2 MB, 4096 bytes per token), 6 requests of
  // 2048 tokens at once": what the pool holds, for start-up logs.
  std::string kv_cache_summary() const;
  const model::Model& model() const { return model_; }
  int64_t max_model_len() const { return max_len_; }
  KvTiers* kv_tiers() const { return tiers_.get(); }  // nullptr without host / disk tiers
  const BlockManager& block_manager() const { return *blocks_; }
  // Structured outputs: masks handed to the sampler and their cost (computed on a worker
  // thread while the forward runs; exposed_us is what the engine thread waited).
  structured::GuidedStats guided_stats() const;

 private:
  struct Seq;
  RequestId add_request_impl(const std::vector<int32_t>& prompt, const std::vector<int32_t>& generated,
                             const SamplingParams& params, int priority, int32_t adapter, bool pooling,
                             RequestOutput* primed);
  void resume_seq(Seq& s, const std::vector<int32_t>& generated, RequestOutput* primed);
  void sample_row(Seq& s, const float* logits, std::vector<RequestOutput>& out,
                  std::vector<std::pair<RequestId, int32_t>>& sampled);
  bool append_token(Seq& s, int32_t token, const SampleResult& r, RequestOutput& o);
  RequestOutput& output_for(std::vector<RequestOutput>& out, const Seq& s);
  void finish(Seq& s, const std::string& reason, std::vector<RequestOutput>& out);
  RequestId add_sequence(const std::vector<int32_t>& prompt, const SamplingParams& params, int priority,
                         int32_t adapter, bool pooling);
  // Prompt log-probabilities and pooling (engine_prompt.cc): state kept per request,
  // positions planned per step, read from the step's logits / hidden states.
  void track_prompt(RequestId id, const std::vector<int32_t>& prompt, const SamplingParams& params, bool pooling);
  void prune_prompt_work();  // drops requests whose sequences are all gone
  void plan_prompt_read(RequestId id, int64_t start, int64_t num_tokens, int64_t row);
  bool add_prompt_rows(std::vector<int64_t>& rows);  // true: the step needs hidden states
  void read_prompt_rows(const Tensor& logits, const Tensor& hidden, std::vector<RequestOutput>& out);
  void attach_prompt_logprobs(std::vector<RequestOutput>& out);
  std::vector<int32_t> propose(Seq& s);  // speculative proposals for a decode
  std::vector<int32_t> propose_draft(Seq& s);
  // --speculative mtp: runs the multi-token prediction module over a sequence's positions
  // [start, ...) of this step, from their final hidden states (rows from row0), so that its
  // last position proposes the next token.
  void advance_mtp(Seq& s, int64_t start, int64_t num_tokens, const Tensor& hidden, int64_t row0);

  // Beam search (engine_beam.cc; Seq's part is in engine.cc).
  struct BeamGroup;
  void start_beam_search(RequestId id, const std::vector<int32_t>& prompt, const SamplingParams& params);
  // A beam's logits of this step; false when the sequence is not a beam.
  bool collect_beam(RequestId group, RequestId id, int64_t cached_tokens, const float* logits);
  void advance_beams(std::vector<RequestOutput>& out);  // after the scheduler's update
  void requeue_parked_beams();  // when a step scheduled nothing
  void finish_beams(RequestId group, BeamGroup& g, std::vector<RequestOutput>& out);
  void drop_beam(RequestId id);
  bool seq_live(RequestId id) const;  // known and not finished
  void extend_seq(RequestId id, int32_t token);
  void fork_seq(RequestId parent, RequestId child, int32_t token);  // parent's last token replaced
  void end_seq(RequestId id);

  const model::Model& model_;
  EngineConfig config_;
  const io::Tokenizer* tokenizer_;
  const model::Model* draft_;
  int64_t max_len_ = 0;
  std::unique_ptr<BlockManager> blocks_;
  std::unique_ptr<Scheduler> scheduler_;
  KvPool pool_;
  std::unique_ptr<KvTiers> tiers_;  // after pool_: it copies blocks in and out of it
  TpGroup* tp_ = nullptr;
  std::unordered_map<RequestId, std::unique_ptr<Seq>> seqs_;  // by sequence id
  std::vector<RequestId> aborted_;                            // reported at the next step
  std::vector<RequestId> started_;                            // see started_last_step()
  std::unordered_map<RequestId, PromptWork> prompt_work_;     // prompt logprobs / pooling requests
  std::vector<PromptRead> prompt_reads_;                      // this step's
  RequestId next_id_ = 1;
  RequestId next_holder_ = -1;  // KV transfer holders: negative ids, apart from requests
  EngineStats stats_;
  std::vector<int32_t> eos_;
  std::unordered_map<RequestId, std::shared_ptr<BeamGroup>> beam_groups_;  // by request id
  int64_t beams_requeued_ = 0;
  std::unique_ptr<structured::GuidedRunner> guided_;  // created by the first constrained request
};

}  // namespace tessera::infer
