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

// log(sum_i exp(x_i)) of one row of n f32 logits, in double (max subtracted first): the
// log-probabilities are x_i - log_sum_exp (log-probability reports, perplexity figures).
double log_sum_exp(const float* x, int64_t n);

}  // namespace tessera::kernels

namespace tessera::kernels {

// Cross-entropy over a vocabulary split by columns across ranks (vocab-parallel,
// Megatron-LM): this rank's logits (N, Vr) are the columns [begin, begin + Vr) of the whole
// (N, V). The caller combines the per-rank statistics between the steps (max, then sum),
// so the whole logits are never gathered.
// 1. max (N) = each row's maximum over this shard.
void shard_row_max(const Tensor& logits, Tensor& max);
// 2. With max the group's row maxima: sums (2N) = [sum_j exp(logit_j - max) over this
//    shard's columns | the target's logit where this shard holds it, else 0]. A target
//    outside the whole vocabulary [0, vocab) throws tessera::Error naming it.
void shard_softmax_sums(const Tensor& logits, const Tensor& max, const Tensor& targets,
                        int64_t begin, int64_t vocab, Tensor& sums);
// 3. With sums the group's totals: the loss (as cross_entropy), and dlogits (N, Vr)
//    written with grad_scale * (softmax - onehot) over this shard's columns (may alias
//    logits). Targets as step 2 checked them.
CrossEntropyResult shard_cross_entropy(const Tensor& logits, const Tensor& targets,
                                       int64_t begin, const Tensor& max, const Tensor& sums,
                                       Tensor* dlogits, float grad_scale);

}  // namespace tessera::kernels

namespace tessera::kernels {

// The same loss over vocabulary-major logits: logits_t (V, N) f32 or bf16 (autocast's
// logits: the head's bf16 product rounded once) is the transpose of
// cross_entropy's (N, V), as the head's product W h^T writes it (the layout whose bf16
// GEMMs run fastest on AMX: W is the plain A operand). The gradient comes in factors, so
// that each logit costs one exp and the (V, N) gradient is written once, in bf16:
//   dlogits_t[v][n] = exps_t[v][n] * col_scale[n] - grad_scale * (v == targets[n])
// with exps_t (V, N) f32 or bf16 written with exp(logit - max over the token's column)
// and col_scale (N) f32 = grad_scale / sum (0 for ignored targets, whose exps are 0).
// exps_t and col_scale go together (both or neither); exps_t may be logits_t itself (the
// same dtype), written over. The loss is summed in token order
// in double and does not depend on the thread count.
CrossEntropyResult cross_entropy_columns(const Tensor& logits_t, const Tensor& targets,
                                         float grad_scale, Tensor* exps_t, Tensor* col_scale);

}  // namespace tessera::kernels
