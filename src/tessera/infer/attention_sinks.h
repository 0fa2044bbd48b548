// StreamingLLM attention sinks in the engine (EngineConfig::attention_sinks, stream_window):
// the checks of the flags and of the model. The mechanics live in the scheduler (when a
// cache drops window rows: Scheduler::stream_step) and kernels/kv_shift.h (moving and
// re-rotating the kept keys); docs/serving.md, "Long streams".
#pragma once
#include <cstdint>

#include "tessera/model/config.h"

namespace tessera::infer {

struct EngineConfig;

// The flags alone (EngineConfig::validate): --attention-sinks and --window together,
// S >= 0, W >= --block-size, no speculative decoding, chunked prefill on. Throws one line.
void validate_attention_sinks(const EngineConfig& e);
// Against the model: S + W within the context (max_len), a model whose keys can be
// re-rotated (model::attention_sinks_unsupported), one tensor-parallel rank.
void check_attention_sinks(const EngineConfig& e, const model::ModelConfig& c, int64_t max_len, bool tp);

}  // namespace tessera::infer
