// Paged attention entry points: validate tensors, sequences and block tables, then run
// the CPU kernels (kernels/cpu/paged_attention_cpu.cc).
#include "tessera/kernels/paged_attention.h"
#include "tessera/kernels/dispatch.h"

#include <algorithm>
#include <cmath>

#include "tessera/kernels/cpu/paged_attention_cpu.h"

namespace tessera::kernels {
namespace {

using cpu::AttnView;
using cpu::PagedDims;

// (N, H, D) f32 CPU rows: contiguous head dim, head stride D, any token stride.
void check_rows(const Tensor& t, const char* op, const char* name) {
  TESSERA_CHECK(t.defined(), op, ": ", name, " is undefined");
  TESSERA_CHECK(t.dim() == 3, op, ": ", name, " must be (Ntok, H, D), got ", shape_str(t.shape()));
  TESSERA_CHECK(t.dtype() == DType::kF32, op, ": ", name, " must be f32, got ",
                dtype_name(t.dtype()));
  TESSERA_CHECK(t.device() == Device::kCPU, op, ": ", name, " must be on the CPU");
  const int64_t H = t.size(1), D = t.size(2);
  TESSERA_CHECK(D <= 1 || t.stride(2) == 1, op, ": ", name, " ", shape_str(t.shape()),
                " needs a contiguous last dim, stride is ", t.stride(2));
  TESSERA_CHECK(H <= 1 || t.stride(1) == D, op, ": ", name, " ", shape_str(t.shape()),
                " needs head stride == D (", D, "), got ", t.stride(1));
}

// v_optional: an undefined v_cache is a cache of one tensor (latent attention's rows).
PagedDims check_caches(const Tensor& k_cache, const Tensor& v_cache, const char* op, bool v_optional = false) {
  for (const auto& [t, name] : {std::pair<const Tensor*, const char*>{&k_cache, "k_cache"},
                                {&v_cache, "v_cache"}}) {
    if (t == &v_cache && v_optional && !v_cache.defined()) continue;
    TESSERA_CHECK(t->defined(), op, ": ", name, " is undefined");
    TESSERA_CHECK(t->dim() == 4, op, ": ", name, " must be (num_blocks, block_size, Hkv, D), got ",
                  shape_str(t->shape()));
    TESSERA_CHECK(t->dtype() == DType::kF32 || t->dtype() == DType::kBF16 || t->dtype() == DType::kI8 ||
                      t->dtype() == DType::kU8,
                  op, ": ", name, " must be f32, bf16, i8 (int8) or u8 (fp8), got ",
                  dtype_name(t->dtype()));
    TESSERA_CHECK(t->device() == Device::kCPU, op, ": ", name, " must be on the CPU");
    TESSERA_CHECK(t->is_contiguous(), op, ": ", name, " ", shape_str(t->shape()),
                  " must be contiguous");
  }
  TESSERA_CHECK(!v_cache.defined() || (k_cache.shape() == v_cache.shape() && k_cache.dtype() == v_cache.dtype()), op,
                ": v_cache ", v_cache.describe(), " must have the shape and dtype of k_cache ",
                k_cache.describe());
  PagedDims d;
  d.num_blocks = k_cache.size(0), d.block_size = k_cache.size(1);
  d.Hkv = k_cache.size(2), d.D = kv_cache_head_dim(k_cache);
  TESSERA_CHECK(d.block_size > 0 && d.Hkv > 0 && d.D > 0, op, ": k_cache ",
                shape_str(k_cache.shape()), " needs block_size, Hkv and D > 0");
  return d;
}

AttnView rows_view(const Tensor& t) { return AttnView{t.data<float>(), 0, t.stride(0)}; }

// Query ranges inside [0, ntok) and pairwise disjoint; context_len >= q_len; the block
// table entries for keys [first_key, context_len) name real blocks. first_key is 0 for
// attention (it reads every key) and context_len - q_len for cache writes.
void check_sequences(const std::vector<PagedSequence>& seqs, int64_t ntok, const PagedDims& d,
                     const char* op, bool reads_all_keys) {
  std::vector<size_t> order;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const PagedSequence& s = seqs[i];
    TESSERA_CHECK(s.q_len >= 0 && s.q_begin >= 0 && s.q_begin + s.q_len <= ntok, op, ": seqs[", i,
                  "] rows [", s.q_begin, ", ", s.q_begin + s.q_len, ") fall outside the ", ntok,
                  " token rows");
    TESSERA_CHECK(s.context_len >= s.q_len, op, ": seqs[", i, "] context_len ", s.context_len,
                  " is less than q_len ", s.q_len, " (this step's tokens count as context)");
    if (s.q_len == 0) continue;
    order.push_back(i);
    const int64_t first = (reads_all_keys ? 0 : s.context_len - s.q_len) / d.block_size;
    const int64_t last = (s.context_len - 1) / d.block_size;
    TESSERA_CHECK(s.block_table != nullptr, op, ": seqs[", i, "] has no block_table");
    for (int64_t b = first; b <= last; ++b)
      TESSERA_CHECK(s.block_table[b] >= 0 && s.block_table[b] < d.num_blocks, op, ": seqs[", i,
                    "] block_table[", b, "] = ", s.block_table[b], " is outside the cache's ",
                    d.num_blocks, " blocks");
  }
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return seqs[a].q_begin < seqs[b].q_begin; });
  for (size_t j = 1; j < order.size(); ++j) {
    const PagedSequence &a = seqs[order[j - 1]], &b = seqs[order[j]];
    TESSERA_CHECK(a.q_begin + a.q_len <= b.q_begin, op, ": seqs[", order[j - 1], "] rows [",
                  a.q_begin, ", ", a.q_begin + a.q_len, ") overlap seqs[", order[j], "] rows [",
                  b.q_begin, ", ", b.q_begin + b.q_len, ")");
  }
}

}  // namespace

const char* kv_cache_dtype_name(KvCacheDtype d) {
  switch (d) {
    case KvCacheDtype::kF32: return "f32";
    case KvCacheDtype::kBF16: return "bf16";
    case KvCacheDtype::kInt8: return "int8";
    case KvCacheDtype::kFp8: return "fp8";
  }
  return "?";
}

KvCacheDtype parse_kv_cache_dtype(const std::string& name, const char* flag) {
  for (auto d : {KvCacheDtype::kF32, KvCacheDtype::kBF16, KvCacheDtype::kInt8, KvCacheDtype::kFp8})
    if (name == kv_cache_dtype_name(d)) return d;
  if (name == "fp8_e4m3") return KvCacheDtype::kFp8;
  fail(flag, " '", name, "' is not one of bf16, int8, fp8, f32");
}

int64_t kv_cache_row_bytes(KvCacheDtype d, int64_t D) {
  switch (d) {
    case KvCacheDtype::kF32: return 4 * D;
    case KvCacheDtype::kBF16: return 2 * D;
    default: return D + 4;  // codes, then the f32 scale
  }
}

Tensor make_kv_cache(int64_t num_blocks, int64_t block_size, int64_t heads, int64_t D, KvCacheDtype d) {
  switch (d) {
    case KvCacheDtype::kF32: return Tensor::empty({num_blocks, block_size, heads, D}, DType::kF32);
    case KvCacheDtype::kBF16: return Tensor::empty({num_blocks, block_size, heads, D}, DType::kBF16);
    case KvCacheDtype::kInt8: return Tensor::empty({num_blocks, block_size, heads, D + 4}, DType::kI8);
    case KvCacheDtype::kFp8: return Tensor::empty({num_blocks, block_size, heads, D + 4}, DType::kU8);
  }
  fail("make_kv_cache: unknown dtype");
}

KvCacheDtype kv_cache_dtype(const Tensor& cache) {
  switch (cache.dtype()) {
    case DType::kF32: return KvCacheDtype::kF32;
    case DType::kBF16: return KvCacheDtype::kBF16;
    case DType::kI8: return KvCacheDtype::kInt8;
    case DType::kU8: return KvCacheDtype::kFp8;
    default: fail("KV cache ", cache.describe(), ": not f32, bf16, i8 (int8) or u8 (fp8)");
  }
}

int64_t kv_cache_head_dim(const Tensor& cache) {
  const KvCacheDtype d = kv_cache_dtype(cache);
  return d == KvCacheDtype::kInt8 || d == KvCacheDtype::kFp8 ? cache.size(3) - 4 : cache.size(3);
}

void paged_attention(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                     const std::vector<PagedSequence>& seqs, Tensor& out,
                     const PagedAttentionParams& p) {
  const char* op = "paged_attention";
  PagedDims d = check_caches(k_cache, v_cache, op);
  check_rows(q, op, "q");
  check_rows(out, op, "out");
  TESSERA_CHECK(out.shape() == q.shape(), op, ": out ", shape_str(out.shape()),
                " must have the shape of q ", shape_str(q.shape()));
  d.Hq = q.size(1);
  TESSERA_CHECK(q.size(2) == d.D, op, ": q ", shape_str(q.shape()), " and k_cache ",
                shape_str(k_cache.shape()), " differ in head dim");
  TESSERA_CHECK(d.Hq > 0 && d.Hq % d.Hkv == 0, op, ": query heads (", d.Hq, ", q ",
                shape_str(q.shape()), ") must be a multiple of kv heads (", d.Hkv, ", k_cache ",
                shape_str(k_cache.shape()), ")");
  TESSERA_CHECK(q.size(0) <= 1 || out.stride(0) >= d.Hq * d.D, op, ": out ",
                shape_str(out.shape()), " token stride ", out.stride(0), " makes rows overlap");
  TESSERA_CHECK(std::isfinite(p.scale) && p.scale != 0.f, op,
                ": params.scale must be finite and non-zero (usually 1/sqrt(D) = ",
                1.0 / std::sqrt(static_cast<double>(d.D)), "), got ", p.scale);
  TESSERA_CHECK(std::isfinite(p.softcap) && p.softcap >= 0.f, op, ": params.softcap must be >= 0 (0 = none), got ",
                p.softcap);
  TESSERA_CHECK(p.window >= 0, op, ": params.window must be >= 0 (0 = no sliding window), got ", p.window);
  TESSERA_CHECK(p.decode_split >= 0, op, ": params.decode_split must be >= 0 (0 = auto), got ",
                p.decode_split);
  check_sequences(seqs, q.size(0), d, op, /*reads_all_keys=*/true);
  TESSERA_KERNEL(op,
                 cpu::paged_attention_cpu(d, rows_view(q), cpu::kv_cache_view(k_cache), cpu::kv_cache_view(v_cache),
                                          seqs, rows_view(out), p, cpu::best_attention_isa()),
                 q, k_cache, v_cache, out);
}

void write_kv_cache(const Tensor& k, const Tensor& v, const std::vector<PagedSequence>& seqs,
                    Tensor& k_cache, Tensor& v_cache) {
  const char* op = "write_kv_cache";
  const PagedDims d = check_caches(k_cache, v_cache, op, true);
  const bool has_v = v_cache.defined();
  check_rows(k, op, "k");
  TESSERA_CHECK(has_v == v.defined(), op, ": v and v_cache must both be given or both be undefined");
  if (has_v) {
    check_rows(v, op, "v");
    TESSERA_CHECK(v.shape() == k.shape(), op, ": v ", shape_str(v.shape()), " must have the shape of k ",
                  shape_str(k.shape()));
  }
  TESSERA_CHECK(k.size(1) == d.Hkv && k.size(2) == d.D, op, ": k ", shape_str(k.shape()),
                " must be (Ntok, Hkv, D) of k_cache ", shape_str(k_cache.shape()));
  check_sequences(seqs, k.size(0), d, op, /*reads_all_keys=*/false);
  std::vector<cpu::KvSlotWrite> writes;
  for (const PagedSequence& s : seqs)
    for (int64_t i = 0; i < s.q_len; ++i) {
      const int64_t pos = s.context_len - s.q_len + i;
      writes.push_back({s.q_begin + i, s.block_table[pos / d.block_size], pos % d.block_size});
    }
  // Two tokens writing one slot means two sequences share a block that should have been
  // copied first (copy-on-write); the result would depend on thread timing.
  std::vector<cpu::KvSlotWrite> sorted = writes;
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) {
    return a.block != b.block ? a.block < b.block : a.slot < b.slot;
  });
  for (size_t j = 1; j < sorted.size(); ++j)
    TESSERA_CHECK(sorted[j].block != sorted[j - 1].block || sorted[j].slot != sorted[j - 1].slot,
                  op, ": token rows ", sorted[j - 1].token, " and ", sorted[j].token,
                  " both write block ", sorted[j].block, " row ", sorted[j].slot,
                  " (a shared block must be copied before it is written)");
  if (!has_v) {
    TESSERA_KERNEL(op,
                   cpu::write_kv_cache_cpu(d, rows_view(k), cpu::AttnView{}, writes, cpu::kv_cache_view(k_cache),
                                           cpu::KvCacheView{}, cpu::best_attention_isa()),
                   k, k_cache);
    return;
  }
  TESSERA_KERNEL(op,
                 cpu::write_kv_cache_cpu(d, rows_view(k), rows_view(v), writes, cpu::kv_cache_view(k_cache),
                                         cpu::kv_cache_view(v_cache), cpu::best_attention_isa()),
                 k, v, k_cache, v_cache);
}

void read_kv_rows(const Tensor& cache, const PagedSequence& s, Tensor& out) {
  const char* op = "read_kv_rows";
  const PagedDims d = check_caches(cache, Tensor(), op, true);
  TESSERA_CHECK(out.dim() == 3 && out.size(0) == s.context_len && out.size(1) == d.Hkv && out.size(2) == d.D &&
                    out.dtype() == DType::kF32 && out.is_contiguous(),
                op, ": out ", out.describe(), " must be contiguous f32 (", s.context_len, ", ", d.Hkv, ", ", d.D, ")");
  TESSERA_CHECK(s.context_len == 0 || s.block_table != nullptr, op, ": the sequence has no block_table");
  for (int64_t b = 0; b * d.block_size < s.context_len; ++b)
    TESSERA_CHECK(s.block_table[b] >= 0 && s.block_table[b] < d.num_blocks, op, ": block_table[", b, "] = ",
                  s.block_table[b], " is outside the cache's ", d.num_blocks, " blocks");
  TESSERA_KERNEL(op, cpu::read_kv_rows_cpu(d, cpu::kv_cache_view(cache), s, out.data<float>(), cpu::best_attention_isa()),
                 cache, out);
}

void copy_kv_blocks(Tensor& k_cache, Tensor& v_cache,
                    const std::vector<std::pair<int32_t, int32_t>>& copies) {
  const char* op = "copy_kv_blocks";
  const PagedDims d = check_caches(k_cache, v_cache, op, true);
  std::vector<int32_t> dsts;
  for (size_t i = 0; i < copies.size(); ++i) {
    const auto [src, dst] = copies[i];
    TESSERA_CHECK(src >= 0 && src < d.num_blocks && dst >= 0 && dst < d.num_blocks, op,
                  ": copies[", i, "] = (", src, ", ", dst, ") names a block outside the cache's ",
                  d.num_blocks, " blocks");
    dsts.push_back(dst);
  }
  std::sort(dsts.begin(), dsts.end());
  const auto dup = std::adjacent_find(dsts.begin(), dsts.end());
  TESSERA_CHECK(dup == dsts.end(), op, ": block ", dup == dsts.end() ? 0 : *dup,
                " is the destination of more than one copy");
  if (!v_cache.defined()) {
    TESSERA_KERNEL(op, cpu::copy_kv_blocks_cpu(cpu::kv_cache_view(k_cache), cpu::KvCacheView{}, copies), k_cache);
    return;
  }
  TESSERA_KERNEL(op, cpu::copy_kv_blocks_cpu(cpu::kv_cache_view(k_cache), cpu::kv_cache_view(v_cache), copies),
                 k_cache, v_cache);
}

}  // namespace tessera::kernels
