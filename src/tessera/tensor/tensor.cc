// Tensor views, copies and dtype conversion.
#include "tessera/tensor/tensor.h"

// GCC 12 warns about its own AVX-512 intrinsic headers (GCC PR 105593).
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <sstream>

#include "tessera/base/aligned_alloc.h"
#include "tessera/base/cpu_features.h"
#include "tessera/base/thread_pool.h"
#include "tessera/base/trace.h"
#include "tessera/tensor/bf16_avx512.h"

namespace tessera {

std::string shape_str(const Shape& s) {
  std::ostringstream os;
  os << '(';
  for (size_t i = 0; i < s.size(); ++i) os << (i ? ", " : "") << s[i];
  if (s.size() == 1) os << ',';
  os << ')';
  return os.str();
}

int64_t shape_numel(const Shape& s) {
  int64_t n = 1;
  for (int64_t d : s) n *= d;
  return n;
}

Storage::~Storage() {
  if (!owner && data) base::release_cached(data, bytes);
}

namespace {
Shape contiguous_strides(const Shape& shape) {
  Shape st(shape.size());
  int64_t s = 1;
  for (int i = static_cast<int>(shape.size()) - 1; i >= 0; --i) {
    st[i] = s;
    s *= shape[i];
  }
  return st;
}
}  // namespace

Tensor Tensor::empty(const Shape& shape, DType dtype) {
  for (int64_t d : shape) TESSERA_CHECK(d >= 0, "negative dimension in shape ", shape_str(shape));
  Tensor t;
  t.storage_ = std::make_shared<Storage>();
  t.storage_->bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  t.storage_->data = base::allocate_cached(t.storage_->bytes);
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dtype;
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype) {
  Tensor t = empty(shape, dtype);
  std::memset(t.raw_data(), 0, t.nbytes());
  return t;
}

Tensor Tensor::from_blob(void* data, const Shape& shape, DType dtype, std::shared_ptr<void> owner) {
  Tensor t;
  t.storage_ = std::make_shared<Storage>();
  t.storage_->data = data;
  t.storage_->bytes = static_cast<size_t>(shape_numel(shape)) * dtype_size(dtype);
  t.storage_->owner = owner ? std::move(owner) : std::shared_ptr<void>(data, [](void*) {});
  t.shape_ = shape;
  t.strides_ = contiguous_strides(shape);
  t.dtype_ = dtype;
  return t;
}

int64_t Tensor::size(int d) const {
  if (d < 0) d += dim();
  TESSERA_CHECK(d >= 0 && d < dim(), "dim ", d, " out of range for ", describe());
  return shape_[d];
}

int64_t Tensor::stride(int d) const {
  if (d < 0) d += dim();
  TESSERA_CHECK(d >= 0 && d < dim(), "dim ", d, " out of range for ", describe());
  return strides_[d];
}

bool Tensor::is_contiguous() const {
  int64_t s = 1;
  for (int i = dim() - 1; i >= 0; --i) {
    if (shape_[i] != 1 && strides_[i] != s) return false;
    s *= shape_[i];
  }
  return true;
}

void* Tensor::raw_data() const {
  if (!storage_) return nullptr;
  return static_cast<char*>(storage_->data) + offset_ * static_cast<int64_t>(dtype_size(dtype_));
}

void Tensor::check_dtype(DType expected) const {
  TESSERA_CHECK(dtype_ == expected, "expected a ", dtype_name(expected), " tensor, got ",
                describe());
}

std::string Tensor::describe() const {
  return std::string(dtype_name(dtype_)) + shape_str(shape_);
}

Tensor Tensor::view(const Shape& shape) const {
  TESSERA_CHECK(is_contiguous(), "view of non-contiguous tensor ", describe());
  Shape s = shape;
  int64_t known = 1;
  int infer = -1;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == -1) {
      TESSERA_CHECK(infer < 0, "view: more than one -1 in ", shape_str(shape));
      infer = static_cast<int>(i);
    } else {
      known *= s[i];
    }
  }
  if (infer >= 0) {
    TESSERA_CHECK(known > 0 && numel() % known == 0, "view: cannot infer ", shape_str(shape),
                  " from ", describe());
    s[infer] = numel() / known;
  }
  TESSERA_CHECK(shape_numel(s) == numel(), "view: shape ", shape_str(s), " does not match ",
                describe());
  Tensor t = *this;
  t.shape_ = s;
  t.strides_ = contiguous_strides(s);
  return t;
}

Tensor Tensor::slice(int d, int64_t begin, int64_t end) const {
  if (d < 0) d += dim();
  TESSERA_CHECK(d >= 0 && d < dim(), "slice: dim ", d, " out of range for ", describe());
  TESSERA_CHECK(0 <= begin && begin <= end && end <= shape_[d], "slice [", begin, ", ", end,
                ") out of range for dim ", d, " of ", describe());
  Tensor t = *this;
  t.offset_ += begin * strides_[d];
  t.shape_[d] = end - begin;
  return t;
}

Tensor Tensor::select(int d, int64_t index) const {
  if (d < 0) d += dim();
  Tensor t = slice(d, index, index + 1);
  t.shape_.erase(t.shape_.begin() + d);
  t.strides_.erase(t.strides_.begin() + d);
  return t;
}

Tensor Tensor::transpose(int d0, int d1) const {
  if (d0 < 0) d0 += dim();
  if (d1 < 0) d1 += dim();
  TESSERA_CHECK(d0 >= 0 && d0 < dim() && d1 >= 0 && d1 < dim(), "transpose dims out of range");
  Tensor t = *this;
  std::swap(t.shape_[d0], t.shape_[d1]);
  std::swap(t.strides_[d0], t.strides_[d1]);
  return t;
}

Tensor Tensor::as_strided(const Shape& shape, const Shape& strides, int64_t offset) const {
  TESSERA_CHECK(shape.size() == strides.size(), "as_strided: shape and strides differ in rank");
  Tensor t = *this;
  t.offset_ += offset;
  t.shape_ = shape;
  t.strides_ = strides;
  // Bounds: the last element addressed must lie inside the storage.
  int64_t last = t.offset_;
  for (size_t i = 0; i < shape.size(); ++i)
    if (shape[i] > 0) last += (shape[i] - 1) * strides[i];
  TESSERA_CHECK(t.offset_ >= 0 && (numel() == 0 || static_cast<size_t>(last + 1) * dtype_size(dtype_) <= storage_->bytes),
                "as_strided: view ", shape_str(shape), " runs past the storage of ", describe());
  return t;
}

Tensor Tensor::contiguous() const {
  if (is_contiguous()) return *this;
  return clone();
}

Tensor Tensor::clone() const {
  Tensor t = empty(shape_, dtype_);
  t.copy_from(*this);
  return t;
}

Tensor Tensor::to(DType dtype) const {
  if (dtype == dtype_) return *this;
  const base::TraceScope trace("tensor_convert", "kernel");
  Tensor t = empty(shape_, dtype);
  t.copy_from(*this);
  return t;
}

namespace {
// Float dtypes convert among themselves (fp8 e4m3 included: its codes are values).
bool is_float(DType d) {
  return d == DType::kF32 || d == DType::kBF16 || d == DType::kF16 || d == DType::kF8E4M3;
}

// Visits the contiguous innermost rows of a strided tensor: fn(src_offset_elems, row_index).
template <typename F>
void for_each_row(const Shape& shape, const Shape& strides, F&& fn) {
  const int nd = static_cast<int>(shape.size());
  if (nd == 0) {
    fn(0, 0);
    return;
  }
  int64_t rows = 1;
  for (int i = 0; i < nd - 1; ++i) rows *= shape[i];
  std::vector<int64_t> idx(nd, 0);
  for (int64_t r = 0; r < rows; ++r) {
    int64_t off = 0;
    int64_t rem = r;
    for (int i = nd - 2; i >= 0; --i) {
      off += (rem % shape[i]) * strides[i];
      rem /= shape[i];
    }
    fn(off, r);
  }
}
}  // namespace

void Tensor::copy_from(const Tensor& src) {
  TESSERA_CHECK(src.shape_ == shape_, "copy_from: shape ", src.describe(), " into ", describe());
  TESSERA_CHECK(dtype_ == src.dtype_ || (is_float(dtype_) && is_float(src.dtype_)),
                "copy_from: cannot convert ", src.describe(), " to ", describe());
  if (numel() == 0) return;
  const size_t es = dtype_size(src.dtype_), ed = dtype_size(dtype_);
  if (is_contiguous() && src.is_contiguous()) {
    if (dtype_ == src.dtype_)
      std::memcpy(raw_data(), src.raw_data(), nbytes());
    else
      convert_elements(src.raw_data(), src.dtype_, raw_data(), dtype_, numel());
    return;
  }
  const int nd = dim();
  const int64_t inner = nd ? shape_[nd - 1] : 1;
  const int64_t sstride_in = nd ? src.strides_[nd - 1] : 1;
  const int64_t dstride_in = nd ? strides_[nd - 1] : 1;
  char* dbase = static_cast<char*>(raw_data());
  const char* sbase = static_cast<const char*>(src.raw_data());
  // Destination offsets for each row.
  std::vector<int64_t> doffs;
  for_each_row(shape_, strides_, [&](int64_t off, int64_t) { doffs.push_back(off); });
  for_each_row(src.shape_, src.strides_, [&](int64_t soff, int64_t r) {
    const char* s = sbase + soff * es;
    char* d = dbase + doffs[r] * ed;
    if (sstride_in == 1 && dstride_in == 1) {
      if (dtype_ == src.dtype_)
        std::memcpy(d, s, inner * es);
      else
        convert_elements(s, src.dtype_, d, dtype_, inner);
    } else {
      for (int64_t i = 0; i < inner; ++i)
        convert_elements(s + i * sstride_in * es, src.dtype_, d + i * dstride_in * ed, dtype_, 1);
    }
  });
}

void Tensor::fill(float value) {
  TESSERA_CHECK(is_contiguous(), "fill on non-contiguous tensor ", describe());
  const int64_t n = numel();
  switch (dtype_) {
    case DType::kF32: std::fill_n(data<float>(), n, value); break;
    case DType::kBF16: {
      bf16 b{f32_to_bf16(value)};
      std::fill_n(data<bf16>(), n, b);
      break;
    }
    case DType::kF16: {
      f16 h{f32_to_f16(value)};
      std::fill_n(data<f16>(), n, h);
      break;
    }
    case DType::kI8: std::fill_n(data<int8_t>(), n, static_cast<int8_t>(value)); break;
    case DType::kU8: std::fill_n(data<uint8_t>(), n, static_cast<uint8_t>(value)); break;
    case DType::kI32: std::fill_n(data<int32_t>(), n, static_cast<int32_t>(value)); break;
    case DType::kI64: std::fill_n(data<int64_t>(), n, static_cast<int64_t>(value)); break;
    case DType::kF8E4M3: std::fill_n(static_cast<uint8_t*>(raw_data()), n, f32_to_fp8_e4m3(value)); break;
  }
}

void Tensor::zero() {
  TESSERA_CHECK(is_contiguous(), "zero on non-contiguous tensor ", describe());
  std::memset(raw_data(), 0, nbytes());
}

float Tensor::item_f32(int64_t i) const {
  TESSERA_CHECK(is_contiguous() && i >= 0 && i < numel(), "item_f32 index ", i, " for ",
                describe());
  const void* p = static_cast<const char*>(raw_data()) + i * dtype_size(dtype_);
  switch (dtype_) {
    case DType::kF32: return *static_cast<const float*>(p);
    case DType::kBF16: return bf16_to_f32(*static_cast<const uint16_t*>(p));
    case DType::kF16: return f16_to_f32(*static_cast<const uint16_t*>(p));
    case DType::kI8: return *static_cast<const int8_t*>(p);
    case DType::kU8: return *static_cast<const uint8_t*>(p);
    case DType::kI32: return static_cast<float>(*static_cast<const int32_t*>(p));
    case DType::kI64: return static_cast<float>(*static_cast<const int64_t*>(p));
    case DType::kF8E4M3: return fp8_e4m3_to_f32(*static_cast<const uint8_t*>(p));
  }
  return 0.f;
}

std::vector<float> Tensor::to_f32_vector() const {
  Tensor c = contiguous();
  std::vector<float> out(numel());
  if (is_float(dtype_)) {
    convert_elements(c.raw_data(), dtype_, out.data(), DType::kF32, numel());
  } else {
    for (int64_t i = 0; i < numel(); ++i) out[i] = c.item_f32(i);
  }
  return out;
}

namespace {

__attribute__((target("avx512f,avx512bw"))) void f32_to_bf16_avx512(const float* s, uint16_t* d,
                                                                     int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + i), bf16_pack(_mm512_loadu_ps(s + i)));
  for (; i < n; ++i) d[i] = f32_to_bf16(s[i]);
}

__attribute__((target("avx512f"))) void bf16_to_f32_avx512(const uint16_t* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    __m512i u = _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
    _mm512_storeu_ps(d + i, _mm512_castsi512_ps(u));
  }
  for (; i < n; ++i) d[i] = bf16_to_f32(s[i]);
}

void convert_serial(const void* src, DType sd, void* dst, DType dd, int64_t n) {
  const bool avx512 = base::cpu_features().avx512bw;
  if (sd == DType::kF32 && dd == DType::kBF16) {
    if (avx512)
      f32_to_bf16_avx512(static_cast<const float*>(src), static_cast<uint16_t*>(dst), n);
    else
      for (int64_t i = 0; i < n; ++i)
        static_cast<uint16_t*>(dst)[i] = f32_to_bf16(static_cast<const float*>(src)[i]);
    return;
  }
  if (sd == DType::kBF16 && dd == DType::kF32) {
    if (avx512)
      bf16_to_f32_avx512(static_cast<const uint16_t*>(src), static_cast<float*>(dst), n);
    else
      for (int64_t i = 0; i < n; ++i)
        static_cast<float*>(dst)[i] = bf16_to_f32(static_cast<const uint16_t*>(src)[i]);
    return;
  }
  auto load = [&](int64_t i) -> float {
    switch (sd) {
      case DType::kF32: return static_cast<const float*>(src)[i];
      case DType::kBF16: return bf16_to_f32(static_cast<const uint16_t*>(src)[i]);
      case DType::kF16: return f16_to_f32(static_cast<const uint16_t*>(src)[i]);
      case DType::kF8E4M3: return fp8_e4m3_to_f32(static_cast<const uint8_t*>(src)[i]);
      default: fail("convert_elements: unsupported source dtype ", dtype_name(sd));
    }
  };
  for (int64_t i = 0; i < n; ++i) {
    const float v = load(i);
    switch (dd) {
      case DType::kF32: static_cast<float*>(dst)[i] = v; break;
      case DType::kBF16: static_cast<uint16_t*>(dst)[i] = f32_to_bf16(v); break;
      case DType::kF16: static_cast<uint16_t*>(dst)[i] = f32_to_f16(v); break;
      case DType::kF8E4M3: static_cast<uint8_t*>(dst)[i] = f32_to_fp8_e4m3(v); break;
      default: fail("convert_elements: unsupported target dtype ", dtype_name(dd));
    }
  }
}

}  // namespace

namespace {

__attribute__((target("avx512f"))) void round_bf16_avx512(const float* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(d + i, _mm512_castsi512_ps(bf16_round_bits(_mm512_loadu_ps(s + i))));
  for (; i < n; ++i) d[i] = bf16_to_f32(f32_to_bf16(s[i]));
}

__attribute__((target("avx512f"))) void round_f16_avx512(const float* s, float* d, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(s + i), _MM_FROUND_TO_NEAREST_INT);
    _mm512_storeu_ps(d + i, _mm512_cvtph_ps(h));
  }
  for (; i < n; ++i) d[i] = f16_to_f32(f32_to_f16(s[i]));
}

}  // namespace

// n floats from s rounded to a 16-bit float format and widened back into d (d may be
// s): `avx512` is the format's vector loop, `round` its scalar rounding. This runs on
// the matmul operands of emulated 16-bit training.
static void round_floats(const float* s, float* d, int64_t n,
                         void (*avx512)(const float*, float*, int64_t), float (*round)(float)) {
  const bool vec = base::cpu_features().avx512f;
  base::parallel_for(n, 1 << 15, [&](int64_t b, int64_t e) {
    if (vec) {
      avx512(s + b, d + b, e - b);
    } else {
      for (int64_t i = b; i < e; ++i) d[i] = round(s[i]);
    }
  });
}

// t rounded into a new f32 tensor; `wide` is the format's dtype.
static Tensor rounded_copy(const Tensor& t, DType wide, void (*avx512)(const float*, float*, int64_t),
                    float (*round)(float), const char* what) {
  TESSERA_CHECK(t.dtype() == DType::kF32 || t.dtype() == wide, what, ": expected f32 or ",
                dtype_name(wide), ", got ", t.describe());
  if (t.dtype() == wide || !t.is_contiguous()) return t.to(wide).to(DType::kF32);
  Tensor out = Tensor::empty(t.shape(), DType::kF32);
  round_floats(t.data<float>(), out.data<float>(), t.numel(), avx512, round);
  return out;
}

static void round_in_place(Tensor& t, void (*avx512)(const float*, float*, int64_t),
                           float (*round)(float), const char* what) {
  TESSERA_CHECK(t.dtype() == DType::kF32 && t.is_contiguous(), what,
                ": expected a contiguous f32 tensor, got ", t.describe());
  round_floats(t.data<float>(), t.data<float>(), t.numel(), avx512, round);
}

static float round_f16_scalar(float v) { return f16_to_f32(f32_to_f16(v)); }
static float round_bf16_scalar(float v) { return bf16_to_f32(f32_to_bf16(v)); }

Tensor f16_rounded(const Tensor& t) {
  return rounded_copy(t, DType::kF16, round_f16_avx512, round_f16_scalar, "f16_rounded");
}

Tensor bf16_rounded(const Tensor& t) {
  return rounded_copy(t, DType::kBF16, round_bf16_avx512, round_bf16_scalar, "bf16_rounded");
}

void round_f16_in_place(Tensor& t) {
  round_in_place(t, round_f16_avx512, round_f16_scalar, "round_f16_in_place");
}

void round_bf16_in_place(Tensor& t) {
  round_in_place(t, round_bf16_avx512, round_bf16_scalar, "round_bf16_in_place");
}

void copy_rounded(Tensor& dst, const Tensor& src, DType format) {
  TESSERA_CHECK(dst.dtype() == DType::kF32 && src.dtype() == DType::kF32 && dst.is_contiguous() &&
                    src.is_contiguous() && dst.numel() == src.numel(),
                "copy_rounded: dst ", dst.describe(), " and src ", src.describe(),
                " must be contiguous f32 tensors of one size");
  if (format == DType::kBF16)
    round_floats(src.data<float>(), dst.data<float>(), src.numel(), round_bf16_avx512, round_bf16_scalar);
  else if (format == DType::kF16)
    round_floats(src.data<float>(), dst.data<float>(), src.numel(), round_f16_avx512, round_f16_scalar);
  else
    dst.copy_from(src);
}

void convert_elements(const void* src, DType sd, void* dst, DType dd, int64_t n) {
  if (sd == dd) {
    std::memcpy(dst, src, n * dtype_size(sd));
    return;
  }
  const size_t ss = dtype_size(sd), ds = dtype_size(dd);
  base::parallel_for(n, 1 << 16, [&](int64_t b, int64_t e) {
    convert_serial(static_cast<const char*>(src) + b * ss, sd, static_cast<char*>(dst) + b * ds,
                   dd, e - b);
  });
}

}  // namespace tessera
