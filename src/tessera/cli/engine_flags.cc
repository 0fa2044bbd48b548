// Inference-engine flags shared by `tessera generate` and `tessera serve`.
#include "tessera/cli/commands.h"

namespace tessera::cli {

void add_engine_flags(CLI::App* cmd, infer::EngineConfig& e, bool& no_prefix_caching) {
  cmd->add_option("--kv-cache-memory", e.kv_cache_memory, "KV cache bytes (0 = half the free memory)");
  cmd->add_option_function<std::string>(
         "--kv-cache-dtype", [&e](const std::string& s) { e.kv_cache_dtype = kernels::parse_kv_cache_dtype(s); },
         "KV cache storage: bf16 (default), int8, fp8 (e4m3, per-token scales) or f32")
      ->type_name("DTYPE");
  cmd->add_option("--kv-host-memory", e.kv_host_memory,
                  "Host KV tier bytes: blocks evicted from the pool are kept there and copied back on a prefix hit "
                  "(0 = none)");
  cmd->add_option("--kv-offload-dir", e.kv_offload_dir,
                  "Disk KV tier: evicted blocks are also written here as files (kept across restarts)");
  cmd->add_option("--kv-offload-size", e.kv_offload_size, "Disk KV tier limit in bytes (LRU files beyond it go)");
  cmd->add_option("--preemption", e.preemption,
                  "Preempted requests: recompute (default) or swap (their KV to the host tier, back on resumption)")
      ->capture_default_str();
  cmd->add_option("--block-size", e.block_size, "Tokens per KV block")->capture_default_str();
  cmd->add_option("--max-num-seqs", e.max_num_seqs, "Running sequences at most")->capture_default_str();
  cmd->add_option("--max-num-batched-tokens", e.max_num_batched_tokens, "Token budget per engine step")
      ->capture_default_str();
  cmd->add_option("--max-model-len", e.max_model_len, "Context length (0 = the model's)");
  cmd->add_flag("--no-prefix-caching", no_prefix_caching, "Do not reuse cached prompt prefixes");
  cmd->add_flag("--batch-invariant", e.batch_invariant,
                "Logits independent of the rest of the batch (bit for bit; slower)");
  cmd->add_option("--speculative", e.speculative_method, "Speculative decoding: ngram, draft or mtp (the model's multi-token prediction module)");
  cmd->add_option("--num-speculative-tokens", e.num_speculative_tokens, "Tokens proposed per step");
}

}  // namespace tessera::cli
