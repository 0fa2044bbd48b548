// Token shard files (`DIR/{train,val}_NNNNN.bin`: 32-byte header + uint16/uint32 tokens),
// the dataset's meta.json, and a split's shards read as one token stream.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tessera/base/mapped_file.h"

namespace tessera::train {

// Header layout, all little-endian (docs/data.md has the table):
//   0  char[8]  magic "TSRTOKS\0"
//   8  uint32   version (1)
//  12  uint32   token_bytes (2 = uint16, 4 = uint32)
//  16  uint64   count (tokens after the header)
//  24  uint64   xxh64 (seed 0) of the payload bytes
inline constexpr char kShardMagic[8] = {'T', 'S', 'R', 'T', 'O', 'K', 'S', '\0'};
inline constexpr uint32_t kShardVersion = 1;
inline constexpr int64_t kShardHeaderBytes = 32;

// 2 when every id of a vocabulary this size fits in uint16 (vocab_size <= 65536), else 4.
int token_bytes_for_vocab(int64_t vocab_size);

// Writes one shard to path + ".tmp" then renames it over `path` (readers never see a
// torn file). Every token must be in [0, vocab_size); errors name the index and value.
void write_token_shard(const std::string& path, const int32_t* tokens, int64_t count,
                       int64_t vocab_size);

// Splits `tokens` into shards of at most shard_tokens and writes them as
// out_dir/{split}_00000.bin, {split}_00001.bin, ... Returns the file names (no directory),
// in stream order; an empty `tokens` writes no file and returns {}.
std::vector<std::string> write_token_shards(const std::string& out_dir, const std::string& split,
                                            const std::vector<int32_t>& tokens,
                                            int64_t vocab_size, int64_t shard_tokens);

// One mmap'd, validated shard (magic, version, token_bytes, size, checksum on open).
class TokenShard {
 public:
  static std::shared_ptr<TokenShard> open(const std::string& path);
  TokenShard(const TokenShard&) = delete;
  TokenShard& operator=(const TokenShard&) = delete;

  const std::string& path() const { return path_; }
  int64_t count() const { return count_; }
  int token_bytes() const { return token_bytes_; }
  uint64_t checksum() const { return checksum_; }
  // Copies tokens [begin, begin + n) as int32 into out.
  void read(int64_t begin, int64_t n, int32_t* out) const;

 private:
  TokenShard() = default;
  std::string path_;
  base::MappedFile map_;
  const uint8_t* payload_ = nullptr;
  int64_t count_ = 0;
  int token_bytes_ = 0;
  uint64_t checksum_ = 0;
};

// DIR/meta.json: what the shards hold and how they were made.
struct DataMeta {
  int64_t vocab_size = 0;
  int32_t eos_id = -1;  // -1 when the tokenizer has none
  int token_bytes = 0;
  int64_t train_tokens = 0, val_tokens = 0;
  std::vector<std::string> train_shards, val_shards;  // file names in stream order
  std::string tokenizer;                              // tokenizer directory, as given
  std::vector<std::string> inputs;                    // corpus files, as given
  // A chat data directory (train/chat_data.h): read_data_meta fills vocab_size, eos_id,
  // the split token counts and the tokenizer from its meta.json; it has no shards.
  bool chat = false;
};
void write_data_meta(const std::string& dir, const DataMeta& meta);
DataMeta read_data_meta(const std::string& dir);  // errors name DIR/meta.json and the key

// All shards of one split of a data directory, concatenated into one stream. Checks the
// shards against meta.json (token_bytes, token counts).
class TokenStream {
 public:
  TokenStream(const std::string& data_dir, const std::string& split);
  int64_t size() const { return total_; }
  const DataMeta& meta() const { return meta_; }
  // Copies stream tokens [begin, begin + n) into out; may span shard boundaries.
  void read(int64_t begin, int64_t n, int32_t* out) const;

 private:
  DataMeta meta_;
  std::vector<std::shared_ptr<TokenShard>> shards_;
  std::vector<int64_t> starts_;  // stream offset of each shard's first token
  int64_t total_ = 0;
};

}  // namespace tessera::train
