// `tessera data prepare`: text files -> token shards + meta.json, written to a temporary
// directory and swapped into place only when complete.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace tessera::train {

struct PrepareOptions {
  std::string tokenizer_dir, out_dir;
  std::vector<std::string> inputs;  // each file is one document
  double val_fraction = 0.01;       // the last floor(tokens * val_fraction) tokens go to val
  int64_t shard_tokens = 100'000'000;
  bool progress = true;
  // Files are encoded in pieces of about this many bytes, cut only where the cut cannot
  // change the tokens (docs/data.md, "Encoding in pieces").
  int64_t chunk_bytes = 1 << 20;
};

struct PrepareResult {
  int64_t train_tokens = 0, val_tokens = 0, vocab_size = 0;
  double seconds = 0;
  int64_t input_bytes = 0;
  int token_bytes = 0;
  int64_t train_shards = 0, val_shards = 0;
};

// Errors (one line naming the file or value): no inputs, a missing / empty / non-UTF-8
// input, a bad val_fraction or shard_tokens, an --out that exists but is not a data
// directory. On any error the existing --out is left as it was.
PrepareResult prepare_data(const PrepareOptions& options);

// Where a file may be cut for piecewise encoding: just after a '\n' whose neighbours are
// both visible ASCII characters ("x\ny"). Returns the first such cut at or after `from`
// (the index after the '\n'), or text.size() when there is none.
size_t next_safe_cut(const std::string& text, size_t from);

}  // namespace tessera::train
