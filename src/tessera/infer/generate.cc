// Single-request generation through the engine (the same path as batched serving).
#include "tessera/infer/generate.h"

#include <algorithm>

#include "tessera/base/timer.h"
#include "tessera/infer/engine.h"

namespace tessera::infer {

GenerateResult generate(const model::Model& model, const std::vector<int32_t>& prompt,
                        const GenerateOptions& options,
                        const std::function<void(int32_t)>& on_token) {
  const auto& c = model.config();
  TESSERA_CHECK(!prompt.empty(), "generate: the prompt is empty");
  TESSERA_CHECK(options.max_tokens >= 0, "generate: max tokens must be >= 0, got ",
                options.max_tokens);
  const int64_t total = static_cast<int64_t>(prompt.size()) + options.max_tokens;
  const bool streaming = options.engine.streaming();  // attention sinks: only max_tokens bounds it
  TESSERA_CHECK(streaming || total <= model::max_context(c), "generate: prompt (", prompt.size(),
                ") + max tokens (", options.max_tokens, ") exceeds the model's context of ",
                model::max_context(c), " tokens");
  GenerateResult r;
  r.finish_reason = "length";
  if (options.max_tokens == 0) return r;
  EngineConfig ec = options.engine;
  if (ec.max_model_len == 0 && !streaming) ec.max_model_len = total;
  // Beam search runs best_of sequences (sharing the prompt's blocks); sized as if they did not.
  const int64_t seqs = options.sampling.use_beam_search ? std::max<int64_t>(1, options.sampling.best_of) : 1;
  ec.max_num_seqs = seqs;
  const int64_t bs = ec.block_size;
  if (ec.kv_cache_memory == 0)
    ec.kv_cache_memory = seqs * (((streaming ? ec.attention_sinks + ec.stream_window : ec.max_model_len) + bs - 1) / bs + 1) *
                         KvPool::bytes_per_block(c, bs, model.dims().kv_heads, ec.kv_cache_dtype);
  Engine engine(model, ec, options.tokenizer, options.draft, options.tp);
  SamplingParams p = options.sampling;
  p.max_tokens = options.max_tokens;
  p.ignore_eos = !options.stop_at_eos;
  p.n = 1;
  engine.add_request(prompt, p);
  base::Timer timer;
  bool first = true;
  while (engine.has_unfinished()) {
    for (const RequestOutput& o : engine.step()) {
      for (int32_t t : o.new_tokens) {
        if (first) {
          r.prefill_seconds = timer.seconds();
          timer.reset();
          first = false;
        }
        r.tokens.push_back(t);
        if (on_token) on_token(t);
      }
      if (o.finished) r.finish_reason = o.finish_reason;
    }
  }
  r.decode_seconds = timer.seconds();
  const EngineStats st = engine.stats();
  r.spec_proposed = st.spec_proposed;
  r.spec_accepted = st.spec_accepted;
  return r;
}

}  // namespace tessera::infer
