// GEMM through oneDNN's matmul primitive (Debian libdnnl 2.6, OpenMP runtime).
// Primitives are created once per problem and cached: creation costs ~0.1-1 ms
// (it JIT-compiles brgemm kernels), execution of a decode-sized GEMM a few µs.
#include <algorithm>
#include <cstdlib>
#include <list>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <oneapi/dnnl/dnnl.hpp>
#include <tuple>
#include <vector>

#include "tessera/base/cpu_features.h"
#include "tessera/base/error.h"
#include "tessera/base/thread_pool.h"
#include "tessera/tensor/tensor.h"
#include "tessera/kernels/cpu/matmul_cpu.h"

namespace tessera::kernels::cpu {
namespace {

using dnnl::memory;

// Every field that changes the primitive. alpha/beta are baked into the primitive
// (static output scale / sum post-op scale) because runtime scales push oneDNN 2.6
// onto slower reference paths for some shapes.
using PrimitiveKey = std::tuple<int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, bool,
                                int, int, float, float, bool, int, bool>;

// Serving varies M every step, so the cache would grow without bound (each primitive holds
// JIT code, ~10 KB of heap): it keeps the most recently used entries (~1 ms to re-create
// one), 512 unless TESSERA_GEMM_CACHE_ENTRIES says otherwise.
size_t max_cached_primitives() {
  static const size_t n = [] {
    const char* text = std::getenv("TESSERA_GEMM_CACHE_ENTRIES");
    if (!text || !*text) return size_t{512};
    char* end = nullptr;
    const long long v = std::strtoll(text, &end, 10);
    TESSERA_CHECK(*end == '\0' && v >= 1 && v <= (1 << 20), "TESSERA_GEMM_CACHE_ENTRIES: '", text,
                  "' is not a whole number of primitives in [1, 1048576]");
    return static_cast<size_t>(v);
  }();
  return n;
}

dnnl::engine& global_engine() {
  static dnnl::engine engine = [] {
    // Our cache below holds the primitives we reuse; oneDNN's own global cache (1024 entries
    // by default) would keep a second copy of each, growing a server's RSS as M varies.
    // ONEDNN_PRIMITIVE_CACHE_CAPACITY, when set, still wins.
    if (!std::getenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY") && !std::getenv("DNNL_PRIMITIVE_CACHE_CAPACITY"))
      dnnl::set_primitive_cache_capacity(0);
    // TESSERA_ISA caps oneDNN too (unless its own DNNL/ONEDNN_MAX_CPU_ISA says otherwise),
    // so a capped run on an AMX machine takes the path a CPU without AMX would.
    if (!std::getenv("DNNL_MAX_CPU_ISA") && !std::getenv("ONEDNN_MAX_CPU_ISA")) {
      switch (base::isa_cap()) {
        case base::IsaCap::kAvx512: dnnl::set_max_cpu_isa(dnnl::cpu_isa::avx512_core_bf16); break;
        case base::IsaCap::kAvx2: dnnl::set_max_cpu_isa(dnnl::cpu_isa::avx2); break;
        case base::IsaCap::kScalar: dnnl::set_max_cpu_isa(dnnl::cpu_isa::sse41); break;
        case base::IsaCap::kNone: break;
      }
    }
    return dnnl::engine(dnnl::engine::kind::cpu, 0);
  }();
  return engine;
}

// One stream per calling thread: a CPU stream is cheap and this keeps concurrent
// callers (serving worker threads) from sharing stream state.
dnnl::stream& thread_stream() {
  thread_local dnnl::stream stream(global_engine());
  return stream;
}

// Primitives use a caller-provided scratchpad: with oneDNN's default (library-owned,
// per primitive) scratchpad, one cached primitive executed from two threads at once
// (ranks as threads, serving workers) shares its scratch memory and computes garbage.
struct CachedPrimitive {
  dnnl::matmul prim;
  memory::desc scratchpad;
};

struct Cache {
  struct Entry {
    CachedPrimitive prim;
    std::list<PrimitiveKey>::iterator lru_pos;
  };
  std::mutex mu;
  std::map<PrimitiveKey, Entry> prims;
  std::list<PrimitiveKey> lru;  // most recently used first

  // Under mu.
  bool find(const PrimitiveKey& key, CachedPrimitive& out) {
    auto it = prims.find(key);
    if (it == prims.end()) return false;
    lru.splice(lru.begin(), lru, it->second.lru_pos);
    out = it->second.prim;
    return true;
  }
  void insert(const PrimitiveKey& key, const CachedPrimitive& prim) {
    if (prims.count(key)) return;
    while (prims.size() >= max_cached_primitives()) {
      prims.erase(lru.back());
      lru.pop_back();
    }
    lru.push_front(key);
    prims.emplace(key, Entry{prim, lru.begin()});
  }
};

Cache& cache() {
  static Cache c;
  return c;
}

memory::data_type to_dnnl(DType dt) {
  switch (dt) {
    case DType::kF32: return memory::data_type::f32;
    case DType::kBF16: return memory::data_type::bf16;
    case DType::kI8: return memory::data_type::s8;  // int32 sums, written to f32 c
    default: fail("matmul (oneDNN): unsupported dtype ", dtype_name(dt));
  }
}

// Row-major (rows, cols) with row stride ld, seen as op(x): transposed views are
// expressed with swapped strides, so oneDNN never needs a copy.
memory::desc strided_desc(int64_t rows, int64_t cols, int64_t ld, bool trans, DType dt) {
  if (!trans) return memory::desc({rows, cols}, to_dnnl(dt), {ld, 1});
  return memory::desc({rows, cols}, to_dnnl(dt), {1, ld});
}

// b as the product reads it: strided, or kept in the primitive's own blocked layout.
memory::desc b_desc(const GemmArgs& g) {
  if (g.b_packed) return memory::desc({g.k, g.n}, memory::data_type::bf16, memory::format_tag::BA16a64b2a);
  return strided_desc(g.k, g.n, g.ldb, g.trans_b, g.b_dtype);
}

memory::desc bias_desc(int64_t n) { return memory::desc({1, n}, memory::data_type::f32, {n, 1}); }

// With g.any_shape the primitive is created for DNNL_RUNTIME_DIM_VAL dimensions and row
// strides (every field of the key that names a size is -1) and each call passes its own.
GemmArgs runtime_shape(GemmArgs g) {
  const int64_t rt = DNNL_RUNTIME_DIM_VAL;
  g.m = g.n = g.k = g.lda = g.ldb = g.ldc = rt;
  return g;
}

// g: the product's sizes, or runtime_shape's for a primitive that takes any.
CachedPrimitive create_primitive(const GemmArgs& g) {
  const memory::desc a_md = strided_desc(g.m, g.k, g.lda, g.trans_a, g.a_dtype);
  const memory::desc b_md = b_desc(g);
  const memory::desc c_md({g.m, g.n}, to_dnnl(g.c_dtype), {g.ldc, 1});
  dnnl::primitive_attr attr;
  attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
  // oneDNN 2.x: dst = oscale * (a @ b) + sum_scale * dst, i.e. scales apply before post-ops.
  if (g.alpha != 1.f) attr.set_output_scales(0, {g.alpha});
  if (g.beta != 0.f) {
    dnnl::post_ops ops;
    ops.append_sum(g.beta);
    attr.set_post_ops(ops);
  }
  // The bias in the primitive's epilogue: dst = oscale * (a @ b) + bias (+ sum).
  const dnnl::matmul::desc desc = g.bias ? dnnl::matmul::desc(a_md, b_md, bias_desc(g.n), c_md)
                                         : dnnl::matmul::desc(a_md, b_md, c_md);
  const dnnl::matmul::primitive_desc pd(desc, attr, global_engine());
  return {dnnl::matmul(pd), pd.scratchpad_desc()};
}

constexpr int64_t kBf16RowBlock = 256;  // oneDNN 2.6 bf16 brgemm matmul's rows per block

// Rows [r0, r1) of the product: op(a)'s rows and c's rows (and nothing of b).
GemmArgs row_range(const GemmArgs& g, int64_t r0, int64_t r1) {
  GemmArgs h = g;
  h.m = r1 - r0;
  const size_t a_elem = g.a_dtype == DType::kF32 ? 4 : 2;
  h.a = static_cast<const char*>(g.a) + static_cast<size_t>(g.trans_a ? r0 : r0 * g.lda) * a_elem;
  h.c = g.c_dtype == DType::kBF16 ? reinterpret_cast<float*>(reinterpret_cast<uint16_t*>(g.c) + r0 * g.ldc)
                                  : g.c + r0 * g.ldc;
  return h;
}

// oneDNN 2.6 runs f32 matmul primitives with its brgemm kernels, which are 1.5-2.6x
// slower than its BLAS-style sgemm (gemm:jit) when b is (K, N) row-major for some N
// (3072, 5632: GPT-2's c_fc forward, Llama's down-projection input gradient), and
// 1.0-1.4x slower on every other (K, N) shape of a training step; where b is (N, K),
// brgemm is 1.0-1.25x faster (docs/performance.md, "Choosing the GEMM library"). The
// choice is by layout, not by timing, so a product's rounding never depends on the run.
bool prefer_sgemm(const GemmArgs& g) {
  return g.a_dtype == DType::kF32 && g.b_dtype == DType::kF32 && !g.trans_b && !g.b_packed;
}

}  // namespace

void gemm_onednn(const GemmArgs& g) {
  TESSERA_CHECK(g.a_dtype == g.b_dtype, "matmul (oneDNN): a is ", dtype_name(g.a_dtype),
                " but b is ", dtype_name(g.b_dtype), "; unify dtypes first");
  base::num_threads();  // applies TESSERA_NUM_THREADS to the OpenMP team oneDNN uses
  if (prefer_sgemm(g) && g.c_dtype == DType::kF32) {
    // Row-major, as ours: op(a) is (M, K), op(b) (K, N); beta == 0 never reads c.
    const dnnl_status_t st =
        dnnl_sgemm(g.trans_a ? 'T' : 'N', 'N', g.m, g.n, g.k, g.alpha, static_cast<const float*>(g.a),
                   g.lda, static_cast<const float*>(g.b), g.ldb, g.beta, g.c, g.ldc);
    TESSERA_CHECK(st == dnnl_success, "matmul (oneDNN sgemm) failed for M=", g.m, " N=", g.n,
                  " K=", g.k, ": status ", static_cast<int>(st));
    if (g.bias) add_bias_rows(g);
    return;
  }
  if (g.a_dtype == DType::kBF16 && g.m > kBf16RowBlock && g.m < 2 * kBf16RowBlock && !g.any_shape) {
    // oneDNN 2.6's bf16 brgemm matmul cuts M into blocks of 256 rows and gives the blocks to
    // the threads: 257-511 rows become a full block and a short one, and the full one runs
    // on one thread while the other idles (2 cores, AMX: 257 x 5632 x 1024 took 2.70 ms,
    // 256 rows 1.40, 512 rows 2.60). Two calls of half the rows each split every block over
    // the threads instead (mixture-of-experts layers: each expert's ~N k / E rows).
    // A multiple of 16 rows splits on a multiple of 16 (mixture-of-experts blocks are padded
    // to one, so both halves keep shapes whose primitives are cached).
    const int64_t m0 = g.m % 16 == 0 ? (g.m / 2 + 15) / 16 * 16 : (g.m + 1) / 2;
    gemm_onednn(row_range(g, 0, m0));
    gemm_onednn(row_range(g, m0, g.m));
    return;
  }
  const GemmArgs keyed = g.any_shape ? runtime_shape(g) : g;
  const PrimitiveKey key{keyed.m, keyed.n, keyed.k, keyed.lda, keyed.ldb, keyed.ldc, g.trans_a, g.trans_b,
                         static_cast<int>(g.a_dtype), static_cast<int>(g.b_dtype), g.alpha,
                         g.beta, g.bias != nullptr, static_cast<int>(g.c_dtype), g.b_packed};
  CachedPrimitive prim;
  {
    std::lock_guard<std::mutex> lock(cache().mu);
    cache().find(key, prim);
  }
  try {
    if (!prim.prim) {
      // Created outside the lock: JIT compilation should not serialise other callers.
      prim = create_primitive(keyed);
      std::lock_guard<std::mutex> lock(cache().mu);
      cache().insert(key, prim);
    }
    const memory::desc a_md = strided_desc(g.m, g.k, g.lda, g.trans_a, g.a_dtype);
    const memory::desc b_md = b_desc(g);
    const memory::desc c_md({g.m, g.n}, to_dnnl(g.c_dtype), {g.ldc, 1});
    const dnnl::engine& eng = global_engine();
    memory a_mem(a_md, eng, const_cast<void*>(g.a));
    memory b_mem(b_md, eng, const_cast<void*>(g.b));
    memory c_mem(c_md, eng, g.c);
    thread_local std::vector<char> scratch;  // this thread's scratchpad, grown as needed
    const size_t scratch_bytes = prim.scratchpad.get_size();
    if (scratch.size() < scratch_bytes) scratch.resize(scratch_bytes);
    memory s_mem(prim.scratchpad, eng, scratch.data());
    std::unordered_map<int, memory> args{{DNNL_ARG_SRC, a_mem},
                                         {DNNL_ARG_WEIGHTS, b_mem},
                                         {DNNL_ARG_DST, c_mem},
                                         {DNNL_ARG_SCRATCHPAD, s_mem}};
    if (g.bias) args.emplace(DNNL_ARG_BIAS, memory(bias_desc(g.n), eng, const_cast<float*>(g.bias)));
    prim.prim.execute(thread_stream(), args);
    thread_stream().wait();
  } catch (const dnnl::error& e) {
    fail("matmul (oneDNN) failed for M=", g.m, " N=", g.n, " K=", g.k, " a ",
         dtype_name(g.a_dtype), " b ", dtype_name(g.b_dtype), ": ", e.what());
  }
}

void gemm_onednn_widened(const GemmArgs& g, int64_t max_b_floats) {
  TESSERA_CHECK(g.a_dtype == DType::kBF16 && g.b_dtype == DType::kBF16,
                "matmul (oneDNN widened): needs bf16 a and b, got ", dtype_name(g.a_dtype), " and ",
                dtype_name(g.b_dtype));
  // Rows x cols of a row-strided bf16 matrix into a contiguous f32 buffer.
  auto widen = [](const uint16_t* src, int64_t rows, int64_t cols, int64_t ld,
                  std::vector<float>& dst) {
    if (dst.size() < static_cast<size_t>(rows * cols)) dst.resize(rows * cols);
    if (ld == cols) {
      convert_elements(src, DType::kBF16, dst.data(), DType::kF32, rows * cols);
      return;
    }
    base::parallel_for(rows, std::max<int64_t>(1, (1 << 16) / std::max<int64_t>(cols, 1)),
                       [&](int64_t r0, int64_t r1) {
                         for (int64_t r = r0; r < r1; ++r)
                           for (int64_t j = 0; j < cols; ++j)
                             dst[r * cols + j] = bf16_to_f32(src[r * ld + j]);
                       });
  };
  // Per-thread buffers that only grow, so repeated calls do not allocate.
  thread_local std::vector<float> a32, b32;
  GemmArgs w = g;
  w.a_dtype = w.b_dtype = DType::kF32;
  const int64_t a_rows = g.trans_a ? g.k : g.m, a_cols = g.trans_a ? g.m : g.k;
  widen(static_cast<const uint16_t*>(g.a), a_rows, a_cols, g.lda, a32);
  w.a = a32.data(), w.lda = a_cols;
  const int64_t block = std::max<int64_t>(64, max_b_floats / g.k);
  const auto* b16 = static_cast<const uint16_t*>(g.b);
  for (int64_t n0 = 0; n0 < g.n; n0 += block) {
    const int64_t nb = std::min(block, g.n - n0);
    if (g.trans_b)  // b is (N, K): rows n0..n0+nb
      widen(b16 + n0 * g.ldb, nb, g.k, g.ldb, b32), w.ldb = g.k;
    else  // b is (K, N): columns n0..n0+nb of every row
      widen(b16 + n0, g.k, nb, g.ldb, b32), w.ldb = nb;
    w.b = b32.data(), w.n = nb, w.c = g.c + n0;
    if (g.bias) w.bias = g.bias + n0;
    gemm_onednn(w);
  }
}

void add_bias_rows(const GemmArgs& g) {
  base::parallel_for(g.m, std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(g.n, 1)), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      float* row = g.c + i * g.ldc;
      for (int64_t j = 0; j < g.n; ++j) row[j] += g.bias[j];
    }
  });
}

int64_t onednn_cache_size() {
  std::lock_guard<std::mutex> lock(cache().mu);
  return static_cast<int64_t>(cache().prims.size());
}

}  // namespace tessera::kernels::cpu
