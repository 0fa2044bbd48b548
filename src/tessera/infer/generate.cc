// The prefill-then-decode loop.
#include "tessera/infer/generate.h"

#include "tessera/base/timer.h"

namespace tessera::infer {

GenerateResult generate(const model::Model& model, const std::vector<int32_t>& prompt,
                        const GenerateOptions& options,
                        const std::function<void(int32_t)>& on_token) {
  const auto& c = model.config();
  TESSERA_CHECK(!prompt.empty(), "generate: the prompt is empty");
  TESSERA_CHECK(options.max_tokens >= 0, "generate: max tokens must be >= 0, got ",
                options.max_tokens);
  for (size_t i = 0; i < prompt.size(); ++i)
    TESSERA_CHECK(prompt[i] >= 0 && prompt[i] < c.vocab_size, "generate: prompt token ", i,
                  " has id ", prompt[i], " outside the vocabulary [0, ", c.vocab_size, ")");
  const int64_t total = static_cast<int64_t>(prompt.size()) + options.max_tokens;
  TESSERA_CHECK(total <= c.max_position_embeddings, "generate: prompt (", prompt.size(),
                ") + max tokens (", options.max_tokens, ") exceeds the model's context of ",
                c.max_position_embeddings, " tokens");
  Sampler sampler(options.sampling);
  model::KVCache cache = model::KVCache::create(c, std::max<int64_t>(total, 1));
  GenerateResult r;
  r.finish_reason = "length";
  if (options.max_tokens == 0) return r;
  base::Timer timer;
  Tensor logits = model.forward(prompt, cache);
  r.prefill_seconds = timer.seconds();
  timer.reset();
  for (int64_t i = 0; i < options.max_tokens; ++i) {
    const int32_t tok = sampler.sample(logits);
    r.tokens.push_back(tok);
    if (on_token) on_token(tok);
    if (options.stop_at_eos && tok == c.eos_token_id) {
      r.finish_reason = "stop";
      break;
    }
    if (i + 1 < options.max_tokens) logits = model.forward({tok}, cache);
  }
  r.decode_seconds = timer.seconds();
  return r;
}

}  // namespace tessera::infer
