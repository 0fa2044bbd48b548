// Causal multi-head attention with grouped-query heads, computed tile by tile with
// an online softmax (FlashAttention): the (Tq, Tk) score matrix is never stored.
// Layout (B, T, H, D): head dim contiguous, head stride == D, token and batch strides
// arbitrary (q, k, v are usually column slices of one fused QKV buffer). All f32.
#pragma once
#include "tessera/tensor/tensor.h"

namespace tessera::kernels {

struct AttentionParams {
  float scale = 0.f;     // usually 1 / sqrt(D)
  bool causal = true;
  // Absolute position of query row 0 among the keys: query i sees keys j <= q_offset + i.
  // For a forward over a whole sequence it is 0; for decode with a KV cache it is Tk - Tq.
  int64_t q_offset = 0;
  // Sliding window (causal only; 0 = none): query at position p = q_offset + i sees keys
  // (p - window, p], the last `window` positions including its own (Mistral's
  // sliding_window as transformers masks it).
  int64_t window = 0;
  // Logit soft-capping (Gemma 2's attn_logit_softcapping; 0 = none): each scaled score s
  // becomes softcap * tanh(s / softcap) before the mask and softmax.
  float softcap = 0.f;
  // Packed documents (causal, q_offset 0, Tq == Tk only; nullptr = none): positions (B, Tq) i32
  // with row stride `doc_positions_stride` (>= Tq when B > 1), each token's position inside
  // its own document (0 at the document's first token; 0 <= pos[b, i] <= i). Query i of batch
  // b sees only keys j >= i - pos[b, i]: no attention across documents. Key tiles before a
  // query block's earliest document start are skipped, so short documents are cheap.
  const int32_t* doc_positions = nullptr;
  int64_t doc_positions_stride = 0;
  // Multiply in bf16, as autocast does (what native bf16 training asks for): where the CPU
  // has AMX, the head dim is a multiple of 32 (up to 256) and there are at least 128 keys
  // (cpu/attention_amx.h: below that the f32 kernels are faster), every product of a key tile
  // runs on AMX-BF16 tiles with its operands rounded to bf16 (q scaled first), accumulated
  // in f32; the softmax stays f32. Elsewhere the f32 kernels run (on a CPU without AMX, bf16
  // products would be no faster).
  bool bf16_products = false;
};

// q (B, Tq, Hq, D); k, v (B, Tk, Hkv, D) with Hq % Hkv == 0 (query head h reads kv head
// h / (Hq / Hkv)); out (B, Tq, Hq, D). lse (B, Hq, Tq) f32, optional: the log-sum-exp
// of each query's scores, saved for the backward pass.
void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out,
                       Tensor* lse, const AttentionParams& params);

// Gradients for q, k, v (same layouts as the inputs; overwritten, not accumulated).
void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk,
                        Tensor& dv, const AttentionParams& params);

}  // namespace tessera::kernels
