// Offline batch generation: a JSON-lines file of requests through the engine, all in
// flight at once (`tessera generate --input prompts.jsonl --output out.jsonl`).
#pragma once
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/infer/engine.h"
#include "tessera/infer/sampling_json.h"  // sampling_params_from_json
#include "tessera/io/tokenizer.h"

namespace tessera::infer {

struct OfflineRequest {
  nlohmann::json id;                // the line's "id" (or its line number)
  std::vector<int32_t> prompt;      // token ids
  std::string prompt_text;          // "" when the line gave ids
  SamplingParams params;
  int priority = 0;
};

// One request per non-empty line: {"prompt": TEXT} or {"prompt_ids": [..]}, optional
// "id", "priority" and the sampling fields above. Errors name the file, line and field.
std::vector<OfflineRequest> read_offline_requests(const std::string& path, const io::Tokenizer* tok,
                                                  int64_t default_max_tokens);

// Runs every request (all submitted at once; the engine batches them) and returns one
// result object per request, in input order: {"id", "prompt", "outputs": [{"index",
// "text", "token_ids", "finish_reason"}], "usage": {"prompt_tokens", "completion_tokens",
// "cached_tokens"}}. A progress bar on stderr when `progress`.
std::vector<nlohmann::json> run_offline(Engine& engine, const io::Tokenizer* tok,
                                        const std::vector<OfflineRequest>& requests, bool progress);

}  // namespace tessera::infer
