// Fused softmax + cross-entropy over the vocabulary: one pass computes each row's
// loss and (optionally) writes the gradient over the logits in place, so the
// (N, V) probability matrix is never stored separately.
#pragma once
#include "tessera/tensor/tensor.h"

namespace tessera::kernels {

struct CrossEntropyResult {
  double loss_sum = 0.0;  // sum of -log p(target) over counted rows
  int64_t count = 0;      // rows whose target != ignore_index
};

constexpr int32_t kIgnoreIndex = -100;

// logits (N, V) f32; targets (N) i32 (kIgnoreIndex rows are skipped); losses (N) f32
// optional (0 for ignored rows). When dlogits is given (N, V) f32, it is written with
// grad_scale * (softmax(logits) - onehot(target)) (0 rows for ignored targets);
// dlogits may alias logits. A target outside [0, V) throws tessera::Error naming it.
CrossEntropyResult cross_entropy(const Tensor& logits, const Tensor& targets, Tensor* losses,
                                 Tensor* dlogits, float grad_scale);

}  // namespace tessera::kernels
