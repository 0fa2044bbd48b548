// Per-rank sizes under tensor parallelism (shard.h).
#include "tessera/model/shard.h"

#include <algorithm>

#include "tessera/base/error.h"

namespace tessera::model {

LocalDims local_dims(const ModelConfig& c, TpShard s) {
  TESSERA_CHECK(s.size >= 1 && s.rank >= 0 && s.rank < s.size, "tensor-parallel rank ", s.rank,
                " is outside a group of ", s.size);
  const int64_t tp = s.size;
  auto split = [&](int64_t n, const char* what) {
    TESSERA_CHECK(n % tp == 0, "tp = ", tp, " does not divide ", what, " = ", n);
    return n / tp;
  };
  LocalDims d;
  d.heads = split(c.num_heads, "num_attention_heads");
  if (tp > c.num_kv_heads && c.num_kv_heads > 0 && tp % c.num_kv_heads == 0) {
    d.kv_heads = 1;
    d.kv_replicas = tp / c.num_kv_heads;
    d.kv_index = s.rank / d.kv_replicas;
  } else {
    TESSERA_CHECK(c.num_kv_heads % tp == 0, "tp = ", tp, " and num_key_value_heads = ",
                  c.num_kv_heads, ": one must divide the other");
    d.kv_heads = c.num_kv_heads / tp;
    d.kv_index = s.rank;
  }
  d.head_dim = c.head_dim;
  d.q = d.heads * d.head_dim;
  d.kv = d.kv_heads * d.head_dim;
  d.qkv = d.q + 2 * d.kv;
  d.ffn = split(c.intermediate_size, "intermediate_size");
  TESSERA_CHECK(c.vocab_size >= tp, "tp = ", tp, " exceeds vocab_size = ", c.vocab_size);
  const int64_t per = (c.vocab_size + tp - 1) / tp;
  d.vocab_begin = std::min<int64_t>(c.vocab_size, per * s.rank);
  d.vocab = std::min<int64_t>(c.vocab_size, d.vocab_begin + per) - d.vocab_begin;
  TESSERA_CHECK(d.vocab > 0, "tp = ", tp, " leaves rank ", s.rank, " no vocabulary rows of ",
                c.vocab_size);
  return d;
}

}  // namespace tessera::model
