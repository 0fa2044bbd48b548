// KvPool sizing and allocation.
#include "tessera/infer/kv_pool.h"

#include <cstring>
#include <fstream>
#include <sstream>
#include <string>

#include "tessera/base/error.h"

namespace tessera::infer {

int64_t KvPool::bytes_per_block(const model::ModelConfig& c, int64_t block_size, int64_t kv_heads,
                                kernels::KvCacheDtype dtype) {
  if (c.uses_mla())  // one row per token: the latent and the rope key (model/mla.h)
    return c.num_layers * block_size * kernels::kv_cache_row_bytes(dtype, c.kv_lora_rank + c.qk_rope_head_dim);
  return 2 * c.num_layers * block_size * (kv_heads > 0 ? kv_heads : c.num_kv_heads) *
         kernels::kv_cache_row_bytes(dtype, c.head_dim);
}

int64_t KvPool::mha_bytes_per_token(const model::ModelConfig& c, kernels::KvCacheDtype dtype) {
  if (!c.uses_mla()) return bytes_per_block(c, 1, 0, dtype);
  return c.num_layers * c.num_heads *
         (kernels::kv_cache_row_bytes(dtype, c.head_dim) + kernels::kv_cache_row_bytes(dtype, c.v_head_dim));
}

KvPool KvPool::create(const model::ModelConfig& c, int64_t num_blocks, int64_t block_size,
                      int64_t kv_heads, kernels::KvCacheDtype dtype) {
  if (kv_heads <= 0) kv_heads = c.num_kv_heads;
  TESSERA_CHECK(num_blocks >= 1 && block_size >= 1, "KV cache: need at least one block of at least one token, got ",
                num_blocks, " blocks of ", block_size);
  KvPool p;
  p.num_blocks = num_blocks;
  p.block_size = block_size;
  p.dtype = dtype;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    if (c.uses_mla()) {  // the latent rows, one tensor (no values apart)
      p.k.push_back(kernels::make_kv_cache(num_blocks, block_size, 1, c.kv_lora_rank + c.qk_rope_head_dim, dtype));
      p.v.emplace_back();
      continue;
    }
    // Pages are touched as blocks are first written, so a large pool costs nothing upfront.
    p.k.push_back(kernels::make_kv_cache(num_blocks, block_size, kv_heads, c.head_dim, dtype));
    p.v.push_back(kernels::make_kv_cache(num_blocks, block_size, kv_heads, c.head_dim, dtype));
  }
  return p;
}

namespace {
// Bytes of one block in one layer's K or V cache (0 for an undefined tensor).
int64_t cache_block_bytes(const Tensor& cache, int64_t num_blocks) {
  return cache.defined() ? static_cast<int64_t>(cache.nbytes()) / num_blocks : 0;
}
}  // namespace

int64_t KvPool::layer_block_bytes(int64_t layer) const {
  return cache_block_bytes(k.at(layer), num_blocks) + cache_block_bytes(v.at(layer), num_blocks);
}

int64_t KvPool::block_bytes() const {
  int64_t n = 0;
  for (int64_t l = 0; l < num_layers(); ++l) n += layer_block_bytes(l);
  return n;
}

void KvPool::read_block_layer(int32_t b, int64_t layer, uint8_t* dst) const {
  TESSERA_CHECK(b >= 0 && b < num_blocks, "KV block ", b, " out of range [0, ", num_blocks, ")");
  for (const Tensor* t : {&k.at(layer), &v.at(layer)}) {
    const int64_t n = cache_block_bytes(*t, num_blocks);
    if (n == 0) continue;
    std::memcpy(dst, static_cast<const uint8_t*>(t->raw_data()) + b * n, static_cast<size_t>(n));
    dst += n;
  }
}

void KvPool::write_block_layer(int32_t b, int64_t layer, const uint8_t* src) {
  TESSERA_CHECK(b >= 0 && b < num_blocks, "KV block ", b, " out of range [0, ", num_blocks, ")");
  for (Tensor* t : {&k.at(layer), &v.at(layer)}) {
    const int64_t n = cache_block_bytes(*t, num_blocks);
    if (n == 0) continue;
    std::memcpy(static_cast<uint8_t*>(t->raw_data()) + b * n, src, static_cast<size_t>(n));
    src += n;
  }
}

void KvPool::read_block(int32_t b, uint8_t* dst) const {
  for (int64_t l = 0; l < num_layers(); ++l) {
    read_block_layer(b, l, dst);
    dst += layer_block_bytes(l);
  }
}

void KvPool::write_block(int32_t b, const uint8_t* src) {
  for (int64_t l = 0; l < num_layers(); ++l) {
    write_block_layer(b, l, src);
    src += layer_block_bytes(l);
  }
}

void PagedKvAttention::attend_latent(int64_t layer, const Tensor& rows, const LatentFn& fn) {
  const Tensor r = rows.contiguous();
  const int64_t N = r.size(0), D = r.size(1);
  Tensor none;
  kernels::write_kv_cache(r.view({N, 1, D}), Tensor(), seqs_, pool_.k[layer], none);
  for (const auto& s : seqs_) {
    if (s.q_len == 0) continue;
    Tensor cached = Tensor::empty({s.context_len, 1, D}, DType::kF32);
    kernels::read_kv_rows(pool_.k[layer], s, cached);
    fn(s.q_begin, s.q_len, cached.view({s.context_len, D}));
  }
}

int64_t kv_blocks_for_memory(const model::ModelConfig& c, int64_t block_size, int64_t bytes,
                             int64_t kv_heads, kernels::KvCacheDtype dtype) {
  const int64_t per = KvPool::bytes_per_block(c, block_size, kv_heads, dtype);
  TESSERA_CHECK(bytes >= per, "--kv-cache-memory ", bytes, " bytes does not hold one KV block (",
                per, " bytes for ", block_size, " tokens of this model in ",
                kernels::kv_cache_dtype_name(dtype), ")");
  return bytes / per;
}

int64_t available_memory_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("MemAvailable:", 0) != 0) continue;
    std::istringstream in(line.substr(13));
    int64_t kb = 0;
    in >> kb;
    return kb * 1024;
  }
  return 0;
}

}  // namespace tessera::infer
