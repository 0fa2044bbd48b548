// `tessera data prepare`: text files -> token shards + meta.json, written to a temporary
// directory and swapped into place only when complete.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tessera::train {

struct PrepareOptions {
  std::string tokenizer_dir, out_dir;
  // Text files (each one document, or several split at `separator`) and JSON-lines files
  // (*.jsonl, or input_format "jsonl": one {"text": "..."} document per line).
  std::vector<std::string> inputs;
  std::string separator;            // "" = a text file is one document
  std::string input_format = "auto";  // "auto" (by extension) | "text" | "jsonl"
  // Validation: whole documents, drawn by a seeded hash of their index, until about
  // floor(tokens * val_fraction) tokens (within 10%); with too few documents for that,
  // the stream's last floor(tokens * val_fraction) tokens (PrepareResult::val_split says which).
  double val_fraction = 0.01;
  uint64_t split_seed = 0;
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
  int64_t documents = 0, val_documents = 0;
  std::string val_split;  // "documents" | "stream tail" | "none"
  std::vector<std::string> warnings;  // e.g. a vocabulary large for the corpus
};

// Errors (one line naming the file or value): no inputs, a missing / empty / non-UTF-8
// input, a bad val_fraction or shard_tokens, an --out that exists but is not a data
// directory. On any error the existing --out is left as it was.
PrepareResult prepare_data(const PrepareOptions& options);

// Where a file may be cut for piecewise encoding: just after a '\n' whose neighbours are
// both visible ASCII characters ("x\ny"). Returns the first such cut at or after `from`
// (the index after the '\n'), or text.size() when there is none.
size_t next_safe_cut(std::string_view text, size_t from);

}  // namespace tessera::train
