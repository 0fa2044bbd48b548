// The prompts `tessera bench serve --url` sends, as vLLM's benchmark_serving builds them:
// token ids (the offline bench's), random ids decoded to text through a tokenizer, or
// windows of a plain-text file. Text prompts work on servers that take no token-id arrays.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "tessera/io/tokenizer.h"
#include "tessera/serve/bench_client.h"

namespace tessera::serve {

// One prompt and its output length. Exactly one of `ids` / `text` is what goes on the wire.
struct HttpPrompt {
  bool as_text = false;
  std::vector<int32_t> ids;  // as_text == false: sent as "prompt": [ids]
  std::string text;          // as_text == true: sent as "prompt": "text"
  int64_t tokens = 0;        // prompt tokens as the client counts them (no BOS)
  bool tokens_exact = true;  // false: words of a text file (no --tokenizer), an approximation
  int64_t max_tokens = 0;
};

// --tokenizer PATH: a Hugging Face directory with tokenizer.json (or that file). Errors are
// one line naming the flag and the path.
io::Tokenizer load_bench_tokenizer(const std::string& path);

// The requests for the resolved o.dataset, then the warm-up request in *warmup (one output
// token; it carries the shared prefix so the server has it cached before the clock starts).
//   random / shared-prefix, no tokenizer: infer::make_bench_requests's token ids from
//     [3, vocab), identical to the offline bench for one seed.
//   random / shared-prefix, tokenizer: the same ids mapped onto the tokenizer's non-special
//     tokens below `vocab`, decoded, re-encoded and topped up or cut until the text
//     re-encodes to the asked length (vLLM's random dataset does the same).
//   text: windows of o.dataset_path at seeded offsets, in tokens (tokenizer) or in
//     whitespace-separated words (no tokenizer; tokens_exact = false).
// Throws tessera::Error (one line) when a request exceeds max_len or the file is too short.
std::vector<HttpPrompt> make_http_prompts(const HttpBenchOptions& o, const io::Tokenizer* tok, int64_t vocab,
                                          int64_t max_len, HttpPrompt* warmup);

}  // namespace tessera::serve
