// Which models can stream with attention sinks, and the RoPE frequencies of their keys.
#include "tessera/model/attention_sinks.h"

#include "tessera/base/strings.h"
#include "tessera/model/rope_scaling.h"

namespace tessera::model {

std::string attention_sinks_unsupported(const ModelConfig& c, int64_t cache_len) {
  if (!c.uses_rope())
    return c.model_type + " has learned absolute positions, not rotary embeddings: its cached keys "
           "cannot be moved to new positions (attention sinks need RoPE)";
  if (c.uses_mla()) return c.model_type + " uses latent attention; attention sinks cover per-head K/V caches only";
  for (int64_t l = 0; l < c.num_layers; ++l)
    if (c.layer_window(l) > 0)
      return base::strprintf("%s already attends to a sliding window of %lld tokens (layer %lld); attention "
                             "sinks are for full-attention models", c.model_type.c_str(),
                             (long long)c.sliding_window, (long long)l);
  if (c.rope_scaling && c.rope_scaling->type == "dynamic" && cache_len > c.max_position_embeddings)
    return base::strprintf("dynamic NTK scaling changes the frequencies past max_position_embeddings %lld; "
                           "sinks + window (%lld) must stay within it", (long long)c.max_position_embeddings,
                           (long long)cache_len);
  return {};
}

kernels::RopeFreqs key_rope_freqs(const ModelConfig& c) { return rope_freqs(c, 0); }

}  // namespace tessera::model
