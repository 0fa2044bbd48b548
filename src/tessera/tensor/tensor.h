// Tensor: a typed, strided view of shared storage on a device. Storage is 64-byte
// aligned when Tessera allocates it; a Tensor may also view memory it does not own
// (an mmap'd safetensors file), keeping the owner alive through a shared handle.
#pragma once
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "tessera/base/error.h"
#include "tessera/tensor/dtype.h"

namespace tessera {

enum class Device : uint8_t { kCPU, kCUDA };

using Shape = std::vector<int64_t>;
std::string shape_str(const Shape& s);  // "(2, 3, 4)"
int64_t shape_numel(const Shape& s);

// A block of bytes. `owner` keeps foreign memory (an mmap) alive.
struct Storage {
  void* data = nullptr;
  size_t bytes = 0;
  Device device = Device::kCPU;
  std::shared_ptr<void> owner;  // null when Tessera allocated `data` itself
  ~Storage();
};

class Tensor {
 public:
  Tensor() = default;

  // Uninitialised / zero-filled contiguous tensors on the CPU.
  static Tensor empty(const Shape& shape, DType dtype);
  static Tensor zeros(const Shape& shape, DType dtype);
  // Views foreign memory; `owner` is kept alive as long as any view exists.
  static Tensor from_blob(void* data, const Shape& shape, DType dtype,
                          std::shared_ptr<void> owner);
  template <typename T>
  static Tensor from_vector(const std::vector<T>& v, const Shape& shape);

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  Device device() const { return storage_ ? storage_->device : Device::kCPU; }
  const Shape& shape() const { return shape_; }
  const Shape& strides() const { return strides_; }  // in elements
  int dim() const { return static_cast<int>(shape_.size()); }
  int64_t size(int d) const;    // negative d counts from the end
  int64_t stride(int d) const;
  int64_t numel() const { return shape_numel(shape_); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  bool is_contiguous() const;

  void* raw_data() const;
  template <typename T>
  T* data() const {
    check_dtype(DTypeOf<T>::value);
    return static_cast<T*>(raw_data());
  }

  // Views (share storage).
  Tensor view(const Shape& shape) const;             // needs contiguous; one dim may be -1
  Tensor slice(int d, int64_t begin, int64_t end) const;
  Tensor select(int d, int64_t index) const;         // drops dim d
  Tensor transpose(int d0, int d1) const;
  // Arbitrary view of the same storage: offset (in elements) relative to this view's start.
  Tensor as_strided(const Shape& shape, const Shape& strides, int64_t offset = 0) const;

  // Copies.
  Tensor contiguous() const;                          // self if already contiguous
  Tensor clone() const;
  Tensor to(DType dtype) const;                       // converts (copies when dtype differs)
  void copy_from(const Tensor& src);                  // same shape; converts dtype
  void fill(float value);
  void zero();

  // Reads element i of a contiguous tensor as float (any float dtype); for tests and tools.
  float item_f32(int64_t flat_index) const;
  std::vector<float> to_f32_vector() const;

  void check_dtype(DType expected) const;
  std::string describe() const;  // "bf16(2, 3)"

 private:
  std::shared_ptr<Storage> storage_;
  int64_t offset_ = 0;  // in elements
  Shape shape_;
  Shape strides_;
  DType dtype_ = DType::kF32;
};

template <typename T>
Tensor Tensor::from_vector(const std::vector<T>& v, const Shape& shape) {
  Tensor t = empty(shape, DTypeOf<T>::value);
  TESSERA_CHECK(static_cast<int64_t>(v.size()) == t.numel(), "from_vector: ", v.size(),
                " values for shape ", shape_str(shape));
  std::copy(v.begin(), v.end(), t.data<T>());
  return t;
}

// An f32 copy of t with every value rounded to the nearest bf16 (bf16 arithmetic
// emulated in f32 storage: products of such values are exact in f32).
Tensor bf16_rounded(const Tensor& t);
// The same with fp16 rounding (overflow to +-inf), for emulated fp16 compute.
Tensor f16_rounded(const Tensor& t);
// The same roundings in place, on a contiguous f32 tensor.
void round_bf16_in_place(Tensor& t);
void round_f16_in_place(Tensor& t);
// dst = src rounded to `format` (bf16, f16; f32: a plain copy) in one pass over both:
// contiguous f32 tensors of one size.
void copy_rounded(Tensor& dst, const Tensor& src, DType format);

// Converts n elements between float dtypes (f32, bf16, f16); vectorised where possible.
void convert_elements(const void* src, DType src_dtype, void* dst, DType dst_dtype, int64_t n);

}  // namespace tessera
