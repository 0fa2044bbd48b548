// DataLoader: seeded per-epoch window permutations over a split's token stream, and
// in-order evaluation batches.
#include "tessera/base/mix64.h"
#include "tessera/train/data_loader.h"

#include <algorithm>

#include "tessera/base/error.h"

namespace tessera::train {
namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;

using base::mix64;

class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t state) : state_(state) {}
  uint64_t next() { return mix64(state_ += kGolden); }
  // Uniform in [0, bound) without modulo bias: reject the lowest 2^64 mod bound values.
  uint64_t below(uint64_t bound) {
    const uint64_t threshold = (0 - bound) % bound;
    for (;;) {
      const uint64_t r = next();
      if (r >= threshold) return r % bound;
    }
  }

 private:
  uint64_t state_;
};

int64_t count_windows(int64_t tokens, int64_t seq_len, const std::string& data_dir,
                      const std::string& split) {
  TESSERA_CHECK(seq_len >= 1, "seq_len ", seq_len, " must be at least 1");
  TESSERA_CHECK(tokens >= seq_len + 1, "split \"", split, "\" of ", data_dir, ": corpus of ",
                tokens, " tokens is smaller than one sequence of ", seq_len + 1, " (seq_len ",
                seq_len, " + 1)");
  return (tokens - 1) / seq_len;
}

void ensure_i32(Tensor& t, int64_t rows, int64_t cols) {
  if (!t.defined() || t.dtype() != DType::kI32 || t.shape() != Shape{rows, cols} ||
      !t.is_contiguous())
    t = Tensor::empty({rows, cols}, DType::kI32);
}

}  // namespace

void to_json(nlohmann::json& j, const LoaderState& s) {
  j = nlohmann::json{{"sequences_drawn", s.sequences_drawn}};
}

void from_json(const nlohmann::json& j, LoaderState& s) {
  TESSERA_CHECK(j.is_object() && j.contains("sequences_drawn"),
                "loader state: missing key \"sequences_drawn\" in ", j.dump());
  const auto& v = j.at("sequences_drawn");
  TESSERA_CHECK(v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0),
                "loader state: key \"sequences_drawn\" must be a non-negative integer, got ",
                v.dump());
  s.sequences_drawn = v.get<uint64_t>();
}

std::vector<int64_t> epoch_permutation(uint64_t seed, int64_t epoch, int64_t n) {
  TESSERA_CHECK(epoch >= 0 && n >= 0, "epoch_permutation: epoch ", epoch, ", n ", n);
  std::vector<int64_t> p(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) p[i] = i;
  SplitMix64 rng(seed ^ mix64(static_cast<uint64_t>(epoch) + 1));
  for (int64_t i = n - 1; i > 0; --i) {
    const int64_t j = static_cast<int64_t>(rng.below(static_cast<uint64_t>(i) + 1));
    std::swap(p[i], p[j]);
  }
  return p;
}

DataLoader::DataLoader(const std::string& data_dir, const std::string& split, int64_t seq_len,
                       uint64_t seed)
    : seq_len_(seq_len), seed_(seed), window_buf_(static_cast<size_t>(seq_len + 1)) {
  if (is_chat_data(data_dir)) {
    TESSERA_CHECK(seq_len >= 2, "seq_len ", seq_len, " must be at least 2");
    const ChatDataMeta meta = read_chat_meta(data_dir);
    packed_ = pack_documents(read_chat_split(data_dir, split), seq_len, meta.pad_id);
    TESSERA_CHECK(packed_->rows >= 1, "split \"", split, "\" of ", data_dir, ": no conversation with an "
                  "assistant token to train on");
    vocab_size_ = meta.vocab_size;
    num_tokens_ = packed_->slots_used;
    windows_ = packed_->rows;
    return;
  }
  stream_.emplace(data_dir, split);
  vocab_size_ = stream_->meta().vocab_size;
  num_tokens_ = stream_->size();
  windows_ = count_windows(stream_->size(), seq_len, data_dir, split);
}

int64_t DataLoader::window_of(uint64_t k) {
  const uint64_t w = static_cast<uint64_t>(windows_);
  const int64_t e = static_cast<int64_t>(k / w);
  if (e != perm_epoch_) {
    perm_ = epoch_permutation(seed_, e, windows_);
    perm_epoch_ = e;
  }
  return perm_[k % w];
}

void DataLoader::read_sequence(uint64_t k, int32_t* ids, int32_t* targets, int32_t* positions) {
  const int64_t w = window_of(k);
  if (packed_) {
    const size_t at = static_cast<size_t>(w * seq_len_);
    std::copy_n(packed_->ids.begin() + at, seq_len_, ids);
    std::copy_n(packed_->targets.begin() + at, seq_len_, targets);
    if (positions) std::copy_n(packed_->positions.begin() + at, seq_len_, positions);
    return;
  }
  stream_->read(w * seq_len_, seq_len_ + 1, window_buf_.data());
  std::copy(window_buf_.begin(), window_buf_.end() - 1, ids);
  std::copy(window_buf_.begin() + 1, window_buf_.end(), targets);
}

void DataLoader::next_batch(int64_t batch, Tensor& ids, Tensor& targets) {
  model::TokenBatch b{ids, targets, Tensor()};
  next_batch(batch, b);
  ids = b.ids;
  targets = b.targets;
}

void DataLoader::next_batch(int64_t batch, model::TokenBatch& out) {
  TESSERA_CHECK(batch >= 1, "next_batch: batch ", batch, " must be at least 1");
  ensure_i32(out.ids, batch, seq_len_);
  ensure_i32(out.targets, batch, seq_len_);
  if (packed_)
    ensure_i32(out.positions, batch, seq_len_);
  else
    out.positions = Tensor();
  int32_t* pi = out.ids.data<int32_t>();
  int32_t* pt = out.targets.data<int32_t>();
  int32_t* pp = packed_ ? out.positions.data<int32_t>() : nullptr;
  for (int64_t b = 0; b < batch; ++b)
    read_sequence(state_.sequences_drawn + static_cast<uint64_t>(b), pi + b * seq_len_,
                  pt + b * seq_len_, pp ? pp + b * seq_len_ : nullptr);
  state_.sequences_drawn += static_cast<uint64_t>(batch);
}

std::vector<model::TokenBatch> eval_batches(const std::string& data_dir, const std::string& split,
                                            int64_t seq_len, int64_t batch, int64_t max_batches) {
  TESSERA_CHECK(batch >= 1, "eval_batches: batch ", batch, " must be at least 1");
  std::optional<PackedRows> packed;
  std::optional<TokenStream> stream;
  int64_t windows;
  if (is_chat_data(data_dir)) {
    packed = pack_documents(read_chat_split(data_dir, split), seq_len, read_chat_meta(data_dir).pad_id);
    windows = packed->rows;
  } else {
    stream.emplace(data_dir, split);
    windows = count_windows(stream->size(), seq_len, data_dir, split);
  }
  int64_t n = (windows + batch - 1) / batch;
  if (max_batches > 0) n = std::min(n, max_batches);
  std::vector<model::TokenBatch> out;
  std::vector<int32_t> buf(static_cast<size_t>(seq_len + 1));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t rows = std::min(batch, windows - i * batch);
    model::TokenBatch b;
    b.ids = Tensor::empty({rows, seq_len}, DType::kI32);      // (rows, T)
    b.targets = Tensor::empty({rows, seq_len}, DType::kI32);  // (rows, T)
    if (packed) {
      b.positions = Tensor::empty({rows, seq_len}, DType::kI32);
      const size_t at = static_cast<size_t>(i * batch * seq_len), len = static_cast<size_t>(rows * seq_len);
      std::copy_n(packed->ids.begin() + at, len, b.ids.data<int32_t>());
      std::copy_n(packed->targets.begin() + at, len, b.targets.data<int32_t>());
      std::copy_n(packed->positions.begin() + at, len, b.positions.data<int32_t>());
    } else {
      for (int64_t r = 0; r < rows; ++r) {
        stream->read((i * batch + r) * seq_len, seq_len + 1, buf.data());
        std::copy(buf.begin(), buf.end() - 1, b.ids.data<int32_t>() + r * seq_len);
        std::copy(buf.begin() + 1, buf.end(), b.targets.data<int32_t>() + r * seq_len);
      }
    }
    out.push_back(std::move(b));
  }
  return out;
}

}  // namespace tessera::train
