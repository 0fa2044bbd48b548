// DataLoader: fixed-length training sequences drawn from token shards in a seeded,
// per-epoch shuffled order. The k-th sequence ever drawn depends only on (seed, k), so the
// whole position is one counter and resuming replays exactly what an uninterrupted run reads.
// A chat data directory (train/chat_data.h) gives packed rows instead of stream windows:
// the same order and counter over its rows, with each token's position in its document.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/model/model.h"
#include "tessera/tensor/tensor.h"
#include "tessera/train/chat_data.h"
#include "tessera/train/token_shard.h"

namespace tessera::train {

struct LoaderState {
  uint64_t sequences_drawn = 0;  // all the position there is
  bool operator==(const LoaderState&) const = default;
};
// nlohmann ADL hooks: {"sequences_drawn": N}; from_json errors name the key.
void to_json(nlohmann::json& j, const LoaderState& s);
void from_json(const nlohmann::json& j, LoaderState& s);

// The window order of one epoch: a permutation of [0, n) by Fisher-Yates over a splitmix64
// stream seeded from (seed, epoch). Written out (not std::shuffle) so every platform and
// standard library gives the same order; docs/data.md states the exact algorithm.
std::vector<int64_t> epoch_permutation(uint64_t seed, int64_t epoch, int64_t n);

class DataLoader {
 public:
  // Window w covers stream tokens [w*T, w*T + T + 1); windows_per_epoch = (tokens - 1) / T.
  // Errors naming the split and directory when that is < 1. A chat data directory: its
  // split's documents packed into rows of T (pack_documents); windows are those rows.
  DataLoader(const std::string& data_dir, const std::string& split, int64_t seq_len,
             uint64_t seed);

  // Next `batch` sequences: ids (B, T) i32 and targets (B, T) i32 (ids shifted by one;
  // packed rows: -100 where a token is not trained on). The tensors are reused when already
  // i32 of that shape, else reallocated. A batch that crosses an epoch boundary continues
  // into the next epoch's order.
  void next_batch(int64_t batch, Tensor& ids, Tensor& targets);
  // The same into a TokenBatch, with positions (B, T) for packed rows (undefined otherwise).
  void next_batch(int64_t batch, model::TokenBatch& out);

  // The k-th sequence ever drawn (k counts across epochs) into ids[T] and targets[T] (and,
  // packed rows only, positions[T]); does not move the position.
  void read_sequence(uint64_t k, int32_t* ids, int32_t* targets, int32_t* positions = nullptr);
  bool packed() const { return packed_.has_value(); }
  const PackedRows* packed_rows() const { return packed_ ? &*packed_ : nullptr; }

  LoaderState state() const { return state_; }
  void set_state(const LoaderState& s) { state_ = s; }

  int64_t windows_per_epoch() const { return windows_; }
  int64_t epoch() const { return static_cast<int64_t>(state_.sequences_drawn / windows_); }
  int64_t seq_len() const { return seq_len_; }
  int64_t vocab_size() const { return vocab_size_; }
  int64_t num_tokens() const { return num_tokens_; }

 private:
  int64_t window_of(uint64_t k);  // window index of the k-th sequence drawn

  std::optional<TokenStream> stream_;  // token shards ...
  std::optional<PackedRows> packed_;   // ... or a chat directory's packed rows
  int64_t vocab_size_ = 0, num_tokens_ = 0;
  int64_t seq_len_;
  uint64_t seed_;
  int64_t windows_;
  LoaderState state_;
  int64_t perm_epoch_ = -1;    // epoch whose permutation perm_ holds
  std::vector<int64_t> perm_;  // (windows_)
  std::vector<int32_t> window_buf_;  // (T + 1)
};

// The split's windows in stream order (no shuffle), `batch` per batch (the last may have
// fewer rows), at most max_batches batches (<= 0: all). Each is ids (B, T), targets (B, T),
// and for a chat directory the packed rows' positions (B, T).
std::vector<model::TokenBatch> eval_batches(const std::string& data_dir, const std::string& split,
                                            int64_t seq_len, int64_t batch, int64_t max_batches);

}  // namespace tessera::train
