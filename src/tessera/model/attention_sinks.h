// What StreamingLLM attention sinks (infer: --attention-sinks S --window W) need from a
// model: keys rotated by RoPE at their position, so that a cache that drops its oldest
// window tokens can rotate the kept keys back to their new cache positions
// (kernels/kv_shift.h), and full attention in every layer.
#pragma once
#include <cstdint>
#include <string>

#include "tessera/kernels/rope.h"
#include "tessera/model/config.h"

namespace tessera::model {

// "" when a cache of at most cache_len positions (sinks + window) can stream this model;
// else one line saying why not: learned absolute positions (gpt2), latent attention
// (deepseek), sliding-window layers (mistral, gemma2, qwen2 with use_sliding_window),
// dynamic NTK scaling past max_position_embeddings (its frequencies follow the length).
std::string attention_sinks_unsupported(const ModelConfig& c, int64_t cache_len);

// The frequencies (and attention factor) the model's keys are rotated with at positions
// below max_position_embeddings: what a cache shift rotates back by.
kernels::RopeFreqs key_rope_freqs(const ModelConfig& c);

}  // namespace tessera::model
