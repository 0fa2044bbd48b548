// DataLoader: fixed-length training sequences drawn from token shards in a seeded,
// per-epoch shuffled order. The k-th sequence ever drawn depends only on (seed, k), so the
// whole position is one counter and resuming replays exactly what an uninterrupted run reads.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/tensor/tensor.h"
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
  // Errors naming the split and directory when that is < 1.
  DataLoader(const std::string& data_dir, const std::string& split, int64_t seq_len,
             uint64_t seed);

  // Next `batch` sequences: ids (B, T) i32 and targets (B, T) i32 (ids shifted by one).
  // The tensors are reused when already i32 of that shape, else reallocated. A batch that
  // crosses an epoch boundary continues into the next epoch's order.
  void next_batch(int64_t batch, Tensor& ids, Tensor& targets);

  // The k-th sequence ever drawn (k counts across epochs) into ids[T] and targets[T];
  // does not move the position.
  void read_sequence(uint64_t k, int32_t* ids, int32_t* targets);

  LoaderState state() const { return state_; }
  void set_state(const LoaderState& s) { state_ = s; }

  int64_t windows_per_epoch() const { return windows_; }
  int64_t epoch() const { return static_cast<int64_t>(state_.sequences_drawn / windows_); }
  int64_t seq_len() const { return seq_len_; }
  int64_t vocab_size() const { return stream_.meta().vocab_size; }
  int64_t num_tokens() const { return stream_.size(); }

 private:
  int64_t window_of(uint64_t k);  // window index of the k-th sequence drawn

  TokenStream stream_;
  int64_t seq_len_;
  uint64_t seed_;
  int64_t windows_;
  LoaderState state_;
  int64_t perm_epoch_ = -1;    // epoch whose permutation perm_ holds
  std::vector<int64_t> perm_;  // (windows_)
  std::vector<int32_t> window_buf_;  // (T + 1)
};

// The split's windows in stream order (no shuffle), `batch` per pair (the last pair may have
// fewer rows), at most max_batches pairs (<= 0: all). Each pair is ids (B, T), targets (B, T).
std::vector<std::pair<Tensor, Tensor>> eval_batches(const std::string& data_dir,
                                                    const std::string& split, int64_t seq_len,
                                                    int64_t batch, int64_t max_batches);

}  // namespace tessera::train
