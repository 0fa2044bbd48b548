// Checks of the attention-sinks flags (attention_sinks.h).
#include "tessera/infer/attention_sinks.h"

#include "tessera/base/error.h"
#include "tessera/infer/engine.h"
#include "tessera/model/attention_sinks.h"

namespace tessera::infer {

void validate_attention_sinks(const EngineConfig& e) {
  const bool sinks = e.attention_sinks >= 0, window = e.stream_window != 0;
  if (!sinks && !window) {
    TESSERA_CHECK(e.attention_sinks == -1, "--attention-sinks must be >= 0, got ", e.attention_sinks);
    return;
  }
  TESSERA_CHECK(e.attention_sinks >= -1, "--attention-sinks must be >= 0, got ", e.attention_sinks);
  TESSERA_CHECK(sinks, "--window needs --attention-sinks S (the first tokens kept; 0 for a window without sinks)");
  TESSERA_CHECK(window, "--attention-sinks needs --window W (the recent tokens kept)");
  TESSERA_CHECK(e.stream_window >= e.block_size, "--window must be at least --block-size (", e.block_size,
                "): a full cache drops a block of its window at a time; got ", e.stream_window);
  TESSERA_CHECK(e.speculative_method.empty(), "--attention-sinks does not combine with --speculative");
  TESSERA_CHECK(e.chunked_prefill, "--attention-sinks needs chunked prefill (long prompts stream through the cache)");
}

void check_attention_sinks(const EngineConfig& e, const model::ModelConfig& c, int64_t max_len, bool tp) {
  const int64_t cache = e.attention_sinks + e.stream_window;
  TESSERA_CHECK(cache <= max_len, "--attention-sinks ", e.attention_sinks, " + --window ", e.stream_window, " = ",
                cache, " exceeds the context length ", max_len, " (cache positions must stay within it)");
  const std::string why = model::attention_sinks_unsupported(c, cache);
  TESSERA_CHECK(why.empty(), "--attention-sinks: ", why);
  TESSERA_CHECK(!tp, "--attention-sinks is not served with tensor parallelism (--tp)");
}

}  // namespace tessera::infer
