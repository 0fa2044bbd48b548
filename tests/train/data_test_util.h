// Helpers shared by the data tests: error expectations and small token datasets.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include "tessera/base/error.h"
#include "tessera/train/token_shard.h"

namespace tessera::train::testing {

template <typename Fn>
void expect_error(Fn fn, std::initializer_list<std::string> parts) {
  try {
    fn();
    ADD_FAILURE() << "no error thrown";
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const auto& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << msg << "\n  lacks: " << p;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << "not one line: " << msg;
  }
}

inline std::vector<int32_t> iota_tokens(int64_t n) {
  std::vector<int32_t> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), 0);
  return v;
}

// A data directory holding the given splits.
inline void make_dataset(const std::string& dir, const std::vector<int32_t>& train,
                         const std::vector<int32_t>& val, int64_t vocab, int64_t shard_tokens) {
  DataMeta m;
  m.vocab_size = vocab;
  m.token_bytes = token_bytes_for_vocab(vocab);
  m.train_tokens = static_cast<int64_t>(train.size());
  m.val_tokens = static_cast<int64_t>(val.size());
  m.train_shards = write_token_shards(dir, "train", train, vocab, shard_tokens);
  m.val_shards = write_token_shards(dir, "val", val, vocab, shard_tokens);
  write_data_meta(dir, m);
}

}  // namespace tessera::train::testing
