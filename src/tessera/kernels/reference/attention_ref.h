// Naive attention in double precision: the full softmax of every query row, no tiling.
// Used only by tests as the independent reference for kernels/attention.h.
#pragma once
#include <cstdint>

#include "tessera/kernels/attention.h"
#include "tessera/tensor/tensor.h"

namespace tessera::kernels::reference {

struct AttnShape {
  int64_t B = 0, Tq = 0, Tk = 0, Hq = 0, Hkv = 0, D = 0;
};

// Contiguous arrays: q, out, dout, dq (B, Tq, Hq, D); k, v, dk, dv (B, Tk, Hkv, D);
// lse (B, Hq, Tq), may be null. Same masking and GQA rules as attention_forward.
void attention_forward_f64(const AttnShape& s, const double* q, const double* k, const double* v,
                           double* out, double* lse, const AttentionParams& params);
// Exact gradients of sum(out * dout), recomputing the softmax (no saved out / lse needed).
void attention_backward_f64(const AttnShape& s, const double* q, const double* k, const double* v,
                            const double* dout, double* dq, double* dk, double* dv,
                            const AttentionParams& params);

// Tensor front ends: f32 (B, T, H, D) tensors with any strides; results written through
// the outputs' strides.
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor* lse,
                       const AttentionParams& params);
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& dout,
                        Tensor& dq, Tensor& dk, Tensor& dv, const AttentionParams& params);

}  // namespace tessera::kernels::reference
