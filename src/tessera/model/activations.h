// Activations the training forward saves for the backward pass. Internal to model/.
#pragma once
#include <vector>

#include "tessera/model/model.h"

namespace tessera::model {

struct LayerActivations {
  Tensor x_in;          // (N, H) residual stream entering the layer
  Tensor mean1, rstd1;  // (N)
  Tensor h1;            // (N, H) norm1 output
  Tensor qkv;           // (N, Q + 2 KV) after RoPE
  Tensor att;           // (N, Q) attention output
  Tensor lse;           // (B, heads, T)
  Tensor x_mid;         // (N, H) residual after attention
  Tensor mean2, rstd2;  // (N)
  Tensor h2;            // (N, H) norm2 output
  Tensor u;             // (N, 2F | F) MLP up projection (gate | up)
  Tensor a;             // (N, F) activation output
};

struct Activations {
  int64_t B = 0, T = 0;
  Tensor ids;        // (N) i32
  Tensor positions;  // (N) i32
  std::vector<LayerActivations> layers;
  Tensor x_final;           // (N, H)
  Tensor meanf, rstdf;      // (N)
  Tensor hf;                // (N, H) final norm output
};

// Training-path forward; fills `acts` and returns the final hidden states hf (N, H).
// What each layer keeps follows m.recompute(): everything (kNone), everything but the
// attention output and log-sum-exp (kSelective), or only x_in (kFull).
Tensor forward_train(const Model& m, const Tensor& ids, Activations& acts);

// One layer of the training forward: reads A.x_in, fills the rest of A, and returns the
// layer's output (N, H). With keep_attention false, A.att and A.lse are scratch the
// caller may not rely on afterwards (they are recomputed by recompute_attention).
Tensor layer_forward_train(const Model& m, int64_t l, const Activations& acts,
                           LayerActivations& A, bool keep_attention);
// A.att and A.lse from A.qkv (the selective recompute of the backward pass).
void recompute_attention(const Model& m, const Activations& acts, LayerActivations& A);

}  // namespace tessera::model
