// GPTQ over a whole model (quantize.h): the calibration tokens run through the model one
// layer at a time, as AutoGPTQ does. Layer l's four linears see the inputs the float
// layer l computes from what the already-quantized layers 0..l-1 produced; each linear's
// Hessian is X^T X of its input rows (q, k, v share one, as do gate and up); after GPTQ
// the layer runs again through its quantized linears to give layer l + 1 its input.
#include "tessera/model/gptq_model.h"

#include "tessera/base/error.h"
#include "tessera/kernels/gptq.h"
#include "tessera/kernels/matmul.h"
#include "tessera/model/activations.h"
#include "tessera/model/block.h"

namespace tessera::model {
namespace {

// X^T X of the rows of x (N, in) f32, accumulated in f32 by the GEMM as AutoGPTQ does,
// widened to f64 for the factorisation.
std::vector<double> gram(const Tensor& x) {
  const Tensor xc = x.to(DType::kF32).contiguous();
  const int64_t in = xc.size(1);
  Tensor h = Tensor::empty({in, in}, DType::kF32);
  kernels::matmul(xc, xc, h, true, false);
  return std::vector<double>(h.data<float>(), h.data<float>() + in * in);
}

}  // namespace

void quantize_model_gptq(Model& m, const kernels::GptqOptions& o, kernels::QuantScheme scheme,
                         const Tensor& calib_ids, const std::function<void(int64_t)>& layer_done) {
  const auto& c = m.config();
  TESSERA_CHECK(calib_ids.defined() && calib_ids.dim() == 2 && calib_ids.dtype() == DType::kI32 &&
                    calib_ids.numel() > 0,
                "gptq: calibration ids must be a non-empty i32 (sequences, tokens) tensor");
  const int64_t B = calib_ids.size(0), T = calib_ids.size(1), N = B * T;
  Activations acts;
  acts.B = B, acts.T = T;
  acts.ids = calib_ids.contiguous().view({N});
  acts.positions = make_positions(B, T, 0);
  BlockState s;
  s.x = embed_tokens(m, acts.ids, acts.positions);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    // The layer's input, kept to run it again once quantized.
    const Tensor x_in = s.x.clone();
    const Tensor delta_in = s.delta.defined() ? s.delta.clone() : Tensor();
    LayerActivations A;
    layer_forward_train(m, l, acts, s, A, true);
    const std::vector<double> h[4] = {gram(A.h1), gram(A.att), gram(A.h2), gram(A.a)};
    A = LayerActivations{};
    m.quantize_layer(l, [&](int64_t, int which, const Tensor& w) {
      return kernels::quantize_gptq(w, h[which], scheme, o);
    });
    s = BlockState{};
    s.x = x_in;
    s.delta = delta_in;
    LayerActivations again;
    layer_forward_train(m, l, acts, s, again, false);
    if (layer_done) layer_done(l + 1);
  }
}

}  // namespace tessera::model
