// Inference-engine flags shared by `tessera generate` and `tessera serve`.
#include "tessera/cli/commands.h"
#include "tessera/kernels/quant.h"

namespace tessera::cli {

void add_engine_flags(CLI::App* cmd, infer::EngineConfig& e, bool& no_prefix_caching) {
  add_size_option(cmd, "--kv-cache-memory", e.kv_cache_memory, "KV cache size (0 = half the free memory)");
  cmd->add_option_function<std::string>(
         "--kv-cache-dtype", [&e](const std::string& s) { e.kv_cache_dtype = kernels::parse_kv_cache_dtype(s); },
         "KV cache storage: bf16 (default), int8, fp8 (e4m3, per-token scales) or f32")
      ->type_name("DTYPE");
  add_size_option(cmd, "--kv-host-memory", e.kv_host_memory,
                  "Host KV tier size: blocks evicted from the pool are kept there and copied back on a prefix hit "
                  "(0 = none)");
  cmd->add_option("--kv-offload-dir", e.kv_offload_dir,
                  "Disk KV tier: evicted blocks are also written here as files (kept across restarts)");
  add_size_option(cmd, "--kv-offload-size", e.kv_offload_size, "Disk KV tier limit (LRU files beyond it go)");
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
  // --speculative alone proposes 4 tokens per step (mtp: 1, its one module's own token;
  // more chain the module on its own output); an explicit
  // --num-speculative-tokens wins (it is processed after this flag, and this one never
  // overrides a value already set).
  cmd->add_option_function<std::string>(
         "--speculative",
         [&e](const std::string& m) {
           e.speculative_method = m;
           if (e.num_speculative_tokens == 0) e.num_speculative_tokens = m == "mtp" ? 1 : 4;
         },
         "Speculative decoding: ngram, draft or mtp (the model's multi-token prediction module)")
      ->type_name("METHOD");
  cmd->add_option("--num-speculative-tokens", e.num_speculative_tokens,
                  "Tokens proposed per step (default with --speculative: 4; mtp: 1)");
  cmd->add_option("--attention-sinks", e.attention_sinks,
                  "StreamingLLM: keep the first S tokens besides the --window (0: a window without sinks)")
      ->type_name("S");
  cmd->add_option("--window", e.stream_window,
                  "StreamingLLM: keep the last W tokens (with --attention-sinks); streams run past the context")
      ->type_name("W");
}

CLI::Validator quant_scheme_validator() {
  return CLI::Validator(
      [](const std::string& s) {
        if (model::LoadQuantization(s).none()) return std::string();
        try {
          kernels::parse_quant_scheme(s);
        } catch (const std::exception& e) {
          return std::string(e.what());
        }
        return std::string();
      },
      "SCHEME");
}

void add_quantization_flags(CLI::App* cmd, model::LoadQuantization& q) {
  cmd->add_option("--quantization", q.scheme,
                  "Quantize the block linears on load (round-to-nearest): int8, int4 (g128), fp8, w8a8; a "
                  "quantized checkpoint (tessera quantize, AutoGPTQ, AutoAWQ, GGUF) runs as stored")
      ->check(quant_scheme_validator());
  cmd->add_flag("--quantize-lm-head", q.lm_head,
                "With --quantization int8 or int4: the head too, int8 per output channel (as llama.cpp "
                "quantizes its output tensor; faster decode, see docs/quantization.md)");
}

}  // namespace tessera::cli
