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
#include "tessera/infer/sampler.h"
#include "tessera/infer/scheduler.h"
#include "tessera/io/tokenizer.h"
#include "tessera/model/model.h"

namespace tessera::infer {

class TpGroup;  // tp_serving.h

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
  void validate() const;                 // throws naming the field
};

// What one sequence produced in one step.
struct RequestOutput {
  RequestId id = 0;        // the id add_request returned
  int64_t index = 0;       // which of the n samples
  std::vector<int32_t> new_tokens;
  std::string new_text;    // detokenized, safe to stream (stop strings held back); needs a tokenizer
  std::vector<SampleResult> logprobs;  // per new token, when the request asked for logprobs
  bool finished = false;
  std::string finish_reason;  // "stop" | "length" | "abort" when finished
  int64_t num_prompt_tokens = 0;
  int64_t num_cached_tokens = 0;  // prompt tokens served from the prefix cache (first admission)
  int64_t num_output_tokens = 0;  // so far
};

// KV slots held by the running sequences at one moment (bench serve's fragmentation figure).
struct KvUsage {
  int64_t sequences = 0;  // running sequences
  int64_t blocks = 0;     // distinct physical blocks in their block tables
  int64_t tokens = 0;     // slots of those blocks holding computed K/V (a shared block once)
  int64_t seq_tokens = 0; // computed tokens summed per sequence (shared prefixes counted each time)
};

struct EngineStats {
  int64_t steps = 0;
  int64_t prompt_tokens = 0, generation_tokens = 0;  // computed prompt tokens, sampled tokens
  int64_t prefix_queries = 0, prefix_hit_blocks = 0, prefix_miss_blocks = 0;
  int64_t preemptions = 0;
  int64_t spec_proposed = 0, spec_accepted = 0, spec_steps = 0;  // speculative decoding
  int64_t running = 0, waiting = 0;
  int64_t kv_blocks_total = 0, kv_blocks_used = 0;
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
  const EngineConfig& config() const { return config_; }
  // "KV cache bf16: 812 blocks of 16 tokens (53.2 MB, 4096 bytes per token), 6 requests of
  // 2048 tokens at once": what the pool holds, for start-up logs.
  std::string kv_cache_summary() const;
  const model::Model& model() const { return model_; }
  int64_t max_model_len() const { return max_len_; }

 private:
  struct Seq;
  RequestId add_request_impl(const std::vector<int32_t>& prompt, const std::vector<int32_t>& generated,
                             const SamplingParams& params, int priority, int32_t adapter, RequestOutput* primed);
  void resume_seq(Seq& s, const std::vector<int32_t>& generated, RequestOutput* primed);
  void sample_row(Seq& s, const float* logits, std::vector<RequestOutput>& out,
                  std::vector<std::pair<RequestId, int32_t>>& sampled);
  bool append_token(Seq& s, int32_t token, const SampleResult& r, RequestOutput& o);
  RequestOutput& output_for(std::vector<RequestOutput>& out, const Seq& s);
  void finish(Seq& s, const std::string& reason, std::vector<RequestOutput>& out);
  std::vector<int32_t> propose(Seq& s);  // speculative proposals for a decode
  std::vector<int32_t> propose_draft(Seq& s);
  // --speculative mtp: runs the multi-token prediction module over a sequence's positions
  // [start, ...) of this step, from their final hidden states (rows from row0), so that its
  // last position proposes the next token.
  void advance_mtp(Seq& s, int64_t start, int64_t num_tokens, const Tensor& hidden, int64_t row0);

  const model::Model& model_;
  EngineConfig config_;
  const io::Tokenizer* tokenizer_;
  const model::Model* draft_;
  int64_t max_len_ = 0;
  std::unique_ptr<BlockManager> blocks_;
  std::unique_ptr<Scheduler> scheduler_;
  KvPool pool_;
  TpGroup* tp_ = nullptr;
  std::unordered_map<RequestId, std::unique_ptr<Seq>> seqs_;  // by sequence id
  std::vector<RequestId> aborted_;                            // reported at the next step
  std::vector<RequestId> started_;                            // see started_last_step()
  RequestId next_id_ = 1;
  RequestId next_holder_ = -1;  // KV transfer holders: negative ids, apart from requests
  EngineStats stats_;
  std::vector<int32_t> eos_;
};

}  // namespace tessera::infer
