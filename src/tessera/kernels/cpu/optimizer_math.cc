// The optimizer's element passes (optimizer_math.h).
#include "tessera/kernels/cpu/stream_copy.h"
#include "tessera/kernels/dispatch.h"
#include "tessera/kernels/optimizer_math.h"

#include <algorithm>
#include <atomic>
#include <vector>
#include <cstdint>
#include <cmath>

#include "tessera/base/cpu_features.h"
#include "tessera/base/error.h"
#include "tessera/kernels/cpu/avx2_math.h"
#include "tessera/kernels/cpu/avx512_math.h"
#include "tessera/kernels/cpu/pointwise_common.h"
#include "tessera/tensor/bf16_avx512.h"
#include "tessera/tensor/dtype.h"

namespace tessera::kernels {
namespace {

namespace av = cpu::avx512;

// These passes stream hundreds of MB through two cores, each of which alone keeps too few
// cache misses in flight to reach the memory's bandwidth: asking for the lines some KB
// ahead (software prefetch; never faults past the end) brings a 124M-parameter AdamW pass
// from ~85 to ~65 ms and the gradient norm from ~25 to ~16 ms (bench/optimizer_bench).
constexpr int64_t kPrefetchUpdate = 2048;  // floats ahead in each of the update's 4 streams
constexpr int64_t kPrefetchRead = 4096;    // in a single read stream (the norm, unscale)

inline void prefetch(const float* p) { _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0); }

// extras' copies of n values p, one element at a time.
void write_copies_portable(const float* p, int64_t n, const UpdateExtras& x) {
  for (int64_t i = 0; i < n; ++i) {
    if (x.rounded)
      x.rounded[i] = x.round_f16 ? f16_to_f32(f32_to_f16(p[i])) : bf16_to_f32(f32_to_bf16(p[i]));
    if (x.bf16) x.bf16[i] = f32_to_bf16(p[i]);
  }
}

// torch 1.13's _single_tensor_adamw, op by op, with the roundings torch's CPU kernels
// use (checked element by element against torch on 1M random values):
//   param.mul_(1 - lr*wd)                          p * decay
//   exp_avg.mul_(b1).add_(g, alpha=1-b1)           fma(g, 1-b1, m*b1)   (add_ with alpha fuses)
//   exp_avg_sq.mul_(b2).addcmul_(g, g, value=1-b2) fma((1-b2)*g, g, v*b2)
//   denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)
//   param.addcdiv_(exp_avg, denom, value=-step)    (-step*m) / denom + p
// The portable loop relies on the baseline x86-64 build having no FMA to contract
// p * decay into the final add; std::fma marks the two places torch does fuse.
void adamw_portable(float* p, const float* g, float* m, float* v, int64_t n,
                    const AdamWScalars& s, const UpdateExtras& x) {
  for (int64_t i = 0; i < n; ++i) {
    const float pi = p[i] * s.decay;
    const float gi = x.grad_scale == 1.f ? g[i] : g[i] * x.grad_scale;
    const float mi = std::fma(gi, s.one_minus_beta1, m[i] * s.beta1);
    const float vi = std::fma(s.one_minus_beta2 * gi, gi, v[i] * s.beta2);
    const float denom = std::sqrt(vi) / s.bias_correction2_sqrt + s.eps;
    p[i] = (s.neg_step_size * mi) / denom + pi;
    m[i] = mi;
    v[i] = vi;
  }
  if (x.copies()) write_copies_portable(p, n, x);
}

// A product rounded on its own. GCC contracts _mm512_mul_ps followed by _mm512_add_ps
// into an FMA (the intrinsics are plain vector arithmetic to it), which would skip the
// rounding torch does after p * (1 - lr*wd); the explicit-rounding form is never fused.
TESSERA_AVX512 inline __m512 mul_rn(__m512 a, __m512 b) {
  return _mm512_mul_round_ps(a, b, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}

// Elements [i, i + 16) of extras' copies from the new values pv (lanes k when partial).
// stream_r / stream_b: that copy's address is aligned (64 / 32 bytes) and the store goes
// around the cache: nothing reads the copies before the next forward, long after the
// pass, and a plain store would first read each line it writes (half again the traffic).
TESSERA_AVX512 inline void copies_vec(__m512 pv, int64_t i, __mmask16 k, bool full,
                                      const UpdateExtras& x, bool stream_r = false,
                                      bool stream_b = false) {
  if (x.round_f16) {  // (no bf16 copy of f16 weights: compute copies exist in native bf16 only)
    const __m512 r = _mm512_cvtph_ps(_mm512_cvtps_ph(pv, _MM_FROUND_TO_NEAREST_INT));
    if (stream_r) _mm512_stream_ps(x.rounded + i, r);
    else full ? av::store(x.rounded + i, r) : av::store(x.rounded + i, r, k);
    return;
  }
  const __m512i r = bf16_round_bits(pv);
  if (stream_r) _mm512_stream_ps(x.rounded + i, _mm512_castsi512_ps(r));
  else if (x.rounded) full ? av::store(x.rounded + i, _mm512_castsi512_ps(r))
                           : av::store(x.rounded + i, _mm512_castsi512_ps(r), k);
  if (stream_b)
    _mm256_stream_si256(reinterpret_cast<__m256i*>(x.bf16 + i), _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16)));
  else if (x.bf16) _mm512_mask_cvtepi32_storeu_epi16(x.bf16 + i, full ? __mmask16(0xffff) : k,
                                                     _mm512_srli_epi32(r, 16));
}

TESSERA_AVX512 void write_copies_avx512(const float* p, int64_t n, const UpdateExtras& x) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) copies_vec(av::load(p + i), i, 0, true, x);
  if (i < n) {
    const __mmask16 k = av::tail_mask(n - i);
    copies_vec(av::load(p + i, k), i, k, false, x);
  }
}

TESSERA_AVX512 inline void adamw_vec(float* p, const float* g, float* m, float* v, int64_t i,
                                     __mmask16 k, bool full, __m512 decay, __m512 b1, __m512 omb1,
                                     __m512 b2, __m512 omb2, __m512 bc2s, __m512 nss, __m512 eps,
                                     const UpdateExtras& x, bool stream_r = false,
                                     bool stream_b = false) {
  p += i, g += i, m += i, v += i;
  const __m512 pv = full ? av::load(p) : av::load(p, k);
  __m512 gv = full ? av::load(g) : av::load(g, k);
  if (x.grad_scale != 1.f) gv = mul_rn(gv, _mm512_set1_ps(x.grad_scale));
  const __m512 mv = full ? av::load(m) : av::load(m, k);
  const __m512 vv = full ? av::load(v) : av::load(v, k);
  const __m512 pd = mul_rn(pv, decay);
  const __m512 m1 = _mm512_fmadd_ps(gv, omb1, mul_rn(mv, b1));
  const __m512 v1 = _mm512_fmadd_ps(mul_rn(omb2, gv), gv, mul_rn(vv, b2));
  const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v1), bc2s), eps);
  const __m512 p1 = _mm512_add_ps(_mm512_div_ps(mul_rn(nss, m1), denom), pd);
  if (full) {
    av::store(p, p1), av::store(m, m1), av::store(v, v1);
  } else {
    av::store(p, p1, k), av::store(m, m1, k), av::store(v, v1, k);
  }
  if (x.copies()) copies_vec(p1, i, k, full, x, stream_r, stream_b);
}

bool aligned(const void* p, uintptr_t to) { return reinterpret_cast<uintptr_t>(p) % to == 0; }

TESSERA_AVX512 void adamw_avx512(float* p, const float* g, float* m, float* v, int64_t n,
                                 const AdamWScalars& s, const UpdateExtras& x) {
  const __m512 decay = _mm512_set1_ps(s.decay), b1 = _mm512_set1_ps(s.beta1),
               omb1 = _mm512_set1_ps(s.one_minus_beta1), b2 = _mm512_set1_ps(s.beta2),
               omb2 = _mm512_set1_ps(s.one_minus_beta2),
               bc2s = _mm512_set1_ps(s.bias_correction2_sqrt),
               nss = _mm512_set1_ps(s.neg_step_size), eps = _mm512_set1_ps(s.eps);
  int64_t i = 0;
  // The copies' streaming stores need aligned addresses: the first few elements go
  // plainly, up to the rounded copy's first 64-byte boundary (or the bf16 copy's 32-byte
  // one when it is alone); a copy still unaligned there is stored plainly throughout.
  bool stream_r = false, stream_b = false;
  if (x.copies() && n >= 256) {
    const int64_t head = x.rounded ? (16 - int64_t(reinterpret_cast<uintptr_t>(x.rounded) % 64 / 4)) % 16
                                   : (16 - int64_t(reinterpret_cast<uintptr_t>(x.bf16) % 32 / 2)) % 16;
    if (aligned(x.rounded, 4) && aligned(x.bf16, 2)) {
      stream_r = x.rounded && aligned(x.rounded + head, 64);
      stream_b = x.bf16 && !x.cache_bf16 && aligned(x.bf16 + head, 32);
    }
    if (head > 0)
      adamw_vec(p, g, m, v, 0, av::tail_mask(head), false, decay, b1, omb1, b2, omb2, bc2s, nss, eps, x);
    i = head;
  }
  for (; i + 16 <= n; i += 16) {
    prefetch(p + i + kPrefetchUpdate), prefetch(g + i + kPrefetchUpdate);
    prefetch(m + i + kPrefetchUpdate), prefetch(v + i + kPrefetchUpdate);
    adamw_vec(p, g, m, v, i, 0, true, decay, b1, omb1, b2, omb2, bc2s, nss, eps, x, stream_r, stream_b);
  }
  if (i < n)
    adamw_vec(p, g, m, v, i, av::tail_mask(n - i), false, decay, b1, omb1, b2, omb2, bc2s, nss,
              eps, x);
  if (stream_r || stream_b) _mm_sfence();  // the streamed lines before anyone reads them
}

// The same loop for CPUs with AVX2 + FMA but not AVX-512. AVX2 has no explicitly
// rounded multiply, so an empty asm makes each product opaque to GCC's contraction.
TESSERA_AVX2_FMA inline __m256 rounded(__m256 x) {
  __asm__("" : "+x"(x));
  return x;
}

TESSERA_AVX2_FMA void adamw_avx2(float* p, const float* g, float* m, float* v, int64_t n,
                                 const AdamWScalars& s, const UpdateExtras& x) {
  const __m256 decay = _mm256_set1_ps(s.decay), b1 = _mm256_set1_ps(s.beta1),
               omb1 = _mm256_set1_ps(s.one_minus_beta1), b2 = _mm256_set1_ps(s.beta2),
               omb2 = _mm256_set1_ps(s.one_minus_beta2),
               bc2s = _mm256_set1_ps(s.bias_correction2_sqrt),
               nss = _mm256_set1_ps(s.neg_step_size), eps = _mm256_set1_ps(s.eps);
  const __m256 gs = _mm256_set1_ps(x.grad_scale);
  const bool scale = x.grad_scale != 1.f;
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    if (i % 16 == 0) {  // one line of each stream per two vectors
      prefetch(p + i + kPrefetchUpdate), prefetch(g + i + kPrefetchUpdate);
      prefetch(m + i + kPrefetchUpdate), prefetch(v + i + kPrefetchUpdate);
    }
    const __m256 pd = rounded(_mm256_mul_ps(_mm256_loadu_ps(p + i), decay));
    const __m256 gv = scale ? rounded(_mm256_mul_ps(_mm256_loadu_ps(g + i), gs)) : _mm256_loadu_ps(g + i);
    const __m256 m1 = _mm256_fmadd_ps(gv, omb1, rounded(_mm256_mul_ps(_mm256_loadu_ps(m + i), b1)));
    const __m256 v1 = _mm256_fmadd_ps(rounded(_mm256_mul_ps(omb2, gv)), gv,
                                      rounded(_mm256_mul_ps(_mm256_loadu_ps(v + i), b2)));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v1), bc2s), eps);
    const __m256 step = rounded(_mm256_mul_ps(nss, m1));
    _mm256_storeu_ps(p + i, _mm256_add_ps(_mm256_div_ps(step, denom), pd));
    _mm256_storeu_ps(m + i, m1);
    _mm256_storeu_ps(v + i, v1);
  }
  UpdateExtras tail = x;  // the copies of the whole range follow, from the cache
  tail.rounded = nullptr, tail.bf16 = nullptr;
  if (i < n) adamw_portable(p + i, g + i, m + i, v + i, n - i, s, tail);
  if (x.copies()) write_copies_portable(p, n, x);
}

std::atomic<AdamWKernel> g_adamw_kernel{AdamWKernel::kAuto};

AdamWKernel pick_adamw_kernel() {
  const bool avx2 = cpu_has(IsaLevel::kAvx2);  // the kernels' one ISA level (dispatch.h)
  switch (g_adamw_kernel.load(std::memory_order_relaxed)) {
    case AdamWKernel::kAvx512:
      return cpu::use_avx512() ? AdamWKernel::kAvx512 : AdamWKernel::kPortable;
    case AdamWKernel::kAvx2:
      return avx2 ? AdamWKernel::kAvx2 : AdamWKernel::kPortable;
    case AdamWKernel::kPortable:
      return AdamWKernel::kPortable;
    case AdamWKernel::kAuto:
      break;
  }
  if (cpu::use_avx512()) return AdamWKernel::kAvx512;
  return avx2 ? AdamWKernel::kAvx2 : AdamWKernel::kPortable;
}

double sum_squares_portable(const float* x, int64_t n) {
  double s0 = 0, s1 = 0, s2 = 0, s3 = 0;  // four chains so the adds pipeline
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    s0 += double(x[i]) * x[i];
    s1 += double(x[i + 1]) * x[i + 1];
    s2 += double(x[i + 2]) * x[i + 2];
    s3 += double(x[i + 3]) * x[i + 3];
  }
  for (; i < n; ++i) s0 += double(x[i]) * x[i];
  return (s0 + s1) + (s2 + s3);
}

TESSERA_AVX512 double sum_squares_avx512(const float* x, int64_t n) {
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    prefetch(x + i + kPrefetchRead);
    const __m512d lo = _mm512_cvtps_pd(_mm256_loadu_ps(x + i));
    const __m512d hi = _mm512_cvtps_pd(_mm256_loadu_ps(x + i + 8));
    a0 = _mm512_fmadd_pd(lo, lo, a0);
    a1 = _mm512_fmadd_pd(hi, hi, a1);
  }
  double s = _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
  for (; i < n; ++i) s += double(x[i]) * x[i];
  return s;
}

// x *= inv over n floats; returns true when every x was finite beforehand.
bool unscale_portable(float* x, int64_t n, float inv) {
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    finite &= std::isfinite(x[i]);
    x[i] *= inv;
  }
  return finite;
}

TESSERA_AVX512 bool unscale_avx512(float* x, int64_t n, float inv) {
  const __m512 iv = _mm512_set1_ps(inv);
  const __m512i exp_mask = _mm512_set1_epi32(0x7f800000);
  __mmask16 bad = 0;  // lanes that held inf or NaN: all exponent bits set
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    prefetch(x + i + kPrefetchRead);
    const __m512 v = av::load(x + i);
    bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), exp_mask), exp_mask);
    av::store(x + i, _mm512_mul_ps(v, iv));
  }
  if (i < n) {
    const __mmask16 m = av::tail_mask(n - i);
    const __m512 v = av::load(x + i, m);
    bad |= _mm512_mask_cmpeq_epi32_mask(m, _mm512_and_si512(_mm512_castps_si512(v), exp_mask),
                                        exp_mask);
    av::store(x + i, _mm512_mul_ps(v, iv), m);
  }
  return bad == 0;
}

}  // namespace

void set_adamw_kernel_for_testing(AdamWKernel k) {
  g_adamw_kernel.store(k, std::memory_order_relaxed);
}

void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, const AdamWScalars& s,
                  const UpdateExtras& extras) {
  TESSERA_CHECK(!(extras.round_f16 && extras.bf16), "adamw_update: a bf16 copy of values rounded to f16");
  switch (pick_adamw_kernel()) {
    case AdamWKernel::kAvx512:
      adamw_avx512(p, g, m, v, n, s, extras);
      break;
    case AdamWKernel::kAvx2:
      adamw_avx2(p, g, m, v, n, s, extras);
      break;
    default:
      adamw_portable(p, g, m, v, n, s, extras);
  }
}

UpdateExtras extras_of(const ParamCopies& c, int64_t begin) {
  UpdateExtras x;
  x.round_f16 = c.format == DType::kF16;
  if (c.rounded.defined()) x.rounded = c.rounded.data<float>() + begin;
  if (c.bf16.defined()) x.bf16 = reinterpret_cast<uint16_t*>(c.bf16.data<bf16>()) + begin;
  return x;
}

void publish_bf16(const ParamCopies& c, int64_t begin, const uint16_t* bits, int64_t n) {
  if (c.bf16.defined()) {
    TESSERA_CHECK(begin >= 0 && begin + n <= c.bf16.numel(), "publish_bf16: elements [", begin, ", ", begin + n,
                  ") of a ", c.bf16.numel(), "-element copy");
    cpu::stream_copy(c.bf16.data<bf16>() + begin, bits, sizeof(uint16_t) * static_cast<size_t>(n));
  }
  if (c.packed) publish_packed(*c.packed, c.packed_first + begin, bits, n);
}

void publish_values(const ParamCopies& c, const float* p, int64_t begin, int64_t n) {
  if (!c.packed) return write_copies(p, n, extras_of(c, begin));
  thread_local std::vector<uint16_t> scratch;
  constexpr int64_t kPiece = int64_t{1} << 16;
  if (scratch.size() < static_cast<size_t>(kPiece)) scratch.resize(kPiece);
  for (int64_t i = 0; i < n; i += kPiece) {
    const int64_t m = std::min(kPiece, n - i);
    UpdateExtras x = extras_of(c, begin + i);
    x.bf16 = scratch.data(), x.cache_bf16 = true;
    write_copies(p + i, m, x);
    publish_bf16(c, begin + i, scratch.data(), m);
  }
}

void write_copies(const float* p, int64_t n, const UpdateExtras& extras) {
  TESSERA_CHECK(!(extras.round_f16 && extras.bf16), "write_copies: a bf16 copy of values rounded to f16");
  if (cpu::use_avx512())
    write_copies_avx512(p, n, extras);
  else
    write_copies_portable(p, n, extras);
}

double sum_squares(const float* x, int64_t n) {
  return cpu::use_avx512() ? sum_squares_avx512(x, n) : sum_squares_portable(x, n);
}

bool unscale_check_finite(float* x, int64_t n, float inv) {
  return cpu::use_avx512() ? unscale_avx512(x, n, inv) : unscale_portable(x, n, inv);
}

}  // namespace tessera::kernels
