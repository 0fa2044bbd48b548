// Calibrated quantizers over a whole model (calibrated_quant.h): the calibration tokens
// run through the model one layer at a time, as AutoGPTQ and AutoAWQ do, and each
// method turns a layer's inputs into its quantized linears.
#include "tessera/model/calibrated_quant.h"

#include <algorithm>
#include <optional>

#include "tessera/base/error.h"
#include "tessera/kernels/elementwise.h"
#include "tessera/model/activations.h"
#include "tessera/model/block.h"

namespace tessera::model {
namespace {

// X^T X of the rows of x (N, in) f32 (input_stats' Gram matrix, accumulated in f32 by the
// GEMM as AutoGPTQ does), widened to f64 for the factorisation.
std::vector<double> gram(const Tensor& x) {
  const Tensor h = kernels::input_stats(x).gram;
  return std::vector<double>(h.data<float>(), h.data<float>() + h.numel());
}

// t[j] /= s[j] for a norm's weight or bias (any float dtype; undefined: nothing).
void divide_vector(Tensor& t, const std::vector<float>& s) {
  if (!t.defined()) return;
  Tensor f = t.to(DType::kF32).contiguous().clone();
  TESSERA_CHECK(f.numel() == static_cast<int64_t>(s.size()), "scale fold: ", s.size(),
                " scales for ", t.describe());
  for (int64_t j = 0; j < f.numel(); ++j) f.data<float>()[j] /= s[j];
  t.copy_from(f);
}

// A linear's weight as an (out, in) view (GPT-2's Conv1D weights are stored (in, out)).
Tensor out_in_view(const Linear& lin) { return lin.in_out ? lin.weight.transpose(0, 1) : lin.weight; }

// Rows [r0, r0 + n) of the (out, in) view of t, element (r, k) replaced by f(r, k, value).
template <typename F>
void update_rows(const Tensor& t, int64_t r0, int64_t n, F f) {
  Tensor rows = t.slice(0, r0, r0 + n);
  Tensor v = rows.to(DType::kF32).contiguous().clone();
  const int64_t in = v.size(1);
  for (int64_t r = 0; r < n; ++r)
    for (int64_t k = 0; k < in; ++k) v.data<float>()[r * in + k] = f(r, k, v.data<float>()[r * in + k]);
  rows.copy_from(v);
}

// Output rows [r0, r0 + s.size()) of a linear (weight and bias) divided by s: what its
// consumer's columns are multiplied by.
void divide_rows(Linear& lin, int64_t r0, const std::vector<float>& s) {
  const int64_t n = static_cast<int64_t>(s.size());
  update_rows(out_in_view(lin), r0, n, [&](int64_t r, int64_t, float v) { return v / s[r]; });
  if (lin.bias.defined()) {
    Tensor b = lin.bias.slice(0, r0, r0 + n);
    divide_vector(b, s);
  }
}

void multiply_columns(Linear& lin, const std::vector<float>& s) {
  const Tensor w = out_in_view(lin);
  TESSERA_CHECK(w.size(1) == static_cast<int64_t>(s.size()), "scale: ", s.size(), " scales for ",
                w.size(1), " input features");
  update_rows(w, 0, w.size(0), [&](int64_t, int64_t k, float v) { return v * s[k]; });
}

// The weight of a linear as (out, in) f32 (a copy).
Tensor out_in(const Linear& lin) { return out_in_view(lin).to(DType::kF32).contiguous().clone(); }

}  // namespace

bool input_scale_foldable(const ModelConfig& c, int which) {
  switch (which) {
    case 0:
    case 2:
      return true;
    case 1:  // att = softmax(q k) v: an o input channel is one v row only without GQA
      return c.num_heads == c.num_kv_heads;
    default:  // a = silu(gate) * up is linear in up; GELU(fc) is not
      return c.gated_mlp();
  }
}

void scale_layer_inputs(Model& m, int64_t l, const LayerScales& sc) {
  const auto& c = m.config();
  TESSERA_CHECK(l >= 0 && l < c.num_layers, "scale: layer ", l, " out of range");
  LayerParams& P = m.weights().layers[l];
  for (int which = 0; which < 4; ++which) {
    const auto& s = sc.s[which];
    if (s.empty()) continue;
    TESSERA_CHECK(input_scale_foldable(c, which), "scale: layer ", l, " linear ", which,
                  "'s input does not fold a per-channel scale");
    multiply_columns(P.linear(which), s);
    switch (which) {
      case 0: divide_vector(P.norm1_w, s), divide_vector(P.norm1_b, s); break;
      case 1: divide_rows(P.qkv, c.q_dim() + c.kv_dim(), s); break;
      case 2: divide_vector(P.norm2_w, s), divide_vector(P.norm2_b, s); break;
      default: divide_rows(P.up, c.intermediate_size, s); break;
    }
  }
  m.refresh_compute_unit(static_cast<int>(l) + 1);
}

void quantize_layers_calibrated(Model& m, const Tensor& calib_ids, const LayerQuantizer& quantize,
                                const std::function<void(int64_t)>& layer_done) {
  const auto& c = m.config();
  TESSERA_CHECK(calib_ids.defined() && calib_ids.dim() == 2 && calib_ids.dtype() == DType::kI32 &&
                    calib_ids.numel() > 0,
                "quantize: calibration ids must be a non-empty i32 (sequences, tokens) tensor");
  const int64_t B = calib_ids.size(0), T = calib_ids.size(1), N = B * T;
  Activations acts;
  acts.B = B, acts.T = T;
  acts.train = false;  // (no dropout: AutoGPTQ and AutoAWQ run the model in eval mode)
  acts.ids = calib_ids.contiguous().view({N});
  acts.positions = make_positions(B, T, 0);
  BlockState s;
  s.x = embed_tokens(m, acts.ids, acts.positions);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    // The layer's input, kept to run it again once quantized.
    const Tensor x_in = s.x.clone();
    const Tensor delta_in = s.delta.defined() ? s.delta.clone() : Tensor();
    LayerInputs in;
    in.layer_x = x_in, in.layer_delta = delta_in, in.acts = &acts;
    {
      LayerActivations A;
      layer_forward_train(m, l, acts, s, A, true);
      const Tensor* x[4] = {&A.h1, &A.att, &A.h2, &A.a};
      for (int which = 0; which < 4; ++which)
        in.x[which] = x[which]->to(DType::kF32).contiguous().clone();
    }
    quantize(l, in);
    in = LayerInputs{};
    s = BlockState{};
    s.x = x_in;
    s.delta = delta_in;
    LayerActivations again;
    layer_forward_train(m, l, acts, s, again, false);
    if (layer_done) layer_done(l + 1);
  }
}

void quantize_model_gptq(Model& m, const kernels::GptqOptions& o, kernels::QuantScheme scheme,
                         const Tensor& calib_ids, const std::function<void(int64_t)>& layer_done) {
  quantize_layers_calibrated(
      m, calib_ids,
      [&](int64_t l, const LayerInputs& in) {
        const std::vector<double> h[4] = {gram(in.x[0]), gram(in.x[1]), gram(in.x[2]), gram(in.x[3])};
        m.quantize_layer(l, [&](int64_t, int which, const Tensor& w) {
          return kernels::quantize_gptq(w, h[which], scheme, o);
        });
      },
      layer_done);
}

namespace {

// The first calibration windows of a layer's input (at least one window, about `tokens`
// tokens) and the float layer's output on them, for scoring candidate weights on the
// layer's output.
struct LayerProbe {
  Activations acts;
  Tensor x, delta, reference;
};

// Layer l's output (the residual stream plus its pending block output) on p's windows.
Tensor layer_output(const Model& m, int64_t l, const LayerProbe& p) {
  BlockState s;
  s.x = p.x.clone();
  if (p.delta.defined()) s.delta = p.delta.clone();
  LayerActivations A;
  layer_forward_train(m, l, p.acts, s, A, false);
  Tensor out = s.x.to(DType::kF32).contiguous().clone();
  if (s.delta.defined()) kernels::add_inplace(out, s.delta.to(DType::kF32).contiguous());
  return out;
}

LayerProbe make_probe(const Model& m, int64_t l, const LayerInputs& in, int64_t tokens) {
  const Activations& all = *in.acts;
  LayerProbe p;
  const int64_t B = std::clamp<int64_t>((tokens + all.T - 1) / all.T, 1, all.B), N = B * all.T;
  p.acts.B = B, p.acts.T = all.T, p.acts.train = false;
  p.acts.ids = all.ids.slice(0, 0, N).contiguous();
  p.acts.positions = all.positions.slice(0, 0, N).contiguous();
  p.x = in.layer_x.slice(0, 0, N).contiguous();
  if (in.layer_delta.defined()) p.delta = in.layer_delta.slice(0, 0, N).contiguous();
  p.reference = layer_output(m, l, p);
  return p;
}

// AWQ's scale search for layer l's linear `which` (float weight w (out, in)), each
// candidate fake-quantized into the layer in turn and scored on the layer's output; the
// layer gets w back.
std::vector<float> awq_scales_on_layer_output(Model& m, int64_t l, int which, const Tensor& w,
                                              const kernels::InputStats& stats, kernels::QuantScheme scheme,
                                              const kernels::AwqOptions& o, const LayerProbe& p) {
  Linear& lin = m.weights().layers[l].linear(which);
  const auto set_weight = [&](const Tensor& v) {
    out_in_view(lin).copy_from(v);
    m.refresh_compute_unit(static_cast<int>(l) + 1);
  };
  const std::vector<float> s = kernels::awq_search_scales(w, stats, scheme, o, [&](Tensor q) {
    set_weight(q);
    const Tensor out = layer_output(m, l, p);
    double err = 0;
    for (int64_t k = 0; k < out.numel(); ++k) {
      const double d = static_cast<double>(out.data<float>()[k]) - p.reference.data<float>()[k];
      err += d * d;
    }
    return err;
  });
  set_weight(w);
  return s;
}

}  // namespace

void quantize_model_awq(Model& m, const kernels::AwqOptions& o, kernels::QuantScheme scheme,
                        const Tensor& calib_ids, const std::function<void(int64_t)>& layer_done) {
  const auto& c = m.config();
  quantize_layers_calibrated(
      m, calib_ids,
      [&](int64_t l, const LayerInputs& in) {
        LayerScales sc;
        kernels::InputStats stats[4];
        std::optional<LayerProbe> probe;
        if (o.inspect_tokens > 0) probe = make_probe(m, l, in, o.inspect_tokens);
        for (int which = 0; which < 4; ++which) {
          stats[which] = kernels::input_stats(in.x[which]);
          if (!input_scale_foldable(c, which)) continue;
          const Tensor w = out_in(m.weights().layers[l].linear(which));
          // AutoAWQ's inspected modules: the attention block for q/k/v, the MLP for
          // gate/up; o and down on their own output.
          sc.s[which] = probe && (which == 0 || which == 2)
                            ? awq_scales_on_layer_output(m, l, which, w, stats[which], scheme, o, *probe)
                            : kernels::awq_search_scales(w, stats[which], scheme, o);
        }
        scale_layer_inputs(m, l, sc);
        m.quantize_layer(l, [&](int64_t, int which, const Tensor& w_scaled) {
          const auto& s = sc.s[which];
          Tensor w = w_scaled.contiguous().clone();
          // q and k keep their full range unless o.clip_qk (AutoAWQ skips them: attention
          // scores are the most sensitive to clipping); every other row is clipped.
          const int64_t row0 = which == 0 && !o.clip_qk ? c.q_dim() + c.kv_dim() : 0;
          kernels::awq_clip(w, s.empty() ? stats[which].gram : kernels::unscale_gram(stats[which].gram, s),
                            row0, w.size(0), scheme, o);
          return kernels::quantize_rtn(w, scheme, o.group <= 0 ? w.size(1) : o.group, o.symmetric,
                                       o.f16_scales);
        });
      },
      layer_done);
}

void quantize_model_smoothquant(Model& m, double alpha, const Tensor& calib_ids,
                                const std::function<void(int64_t)>& layer_done) {
  const auto& c = m.config();
  quantize_layers_calibrated(
      m, calib_ids,
      [&](int64_t l, const LayerInputs& in) {
        LayerScales sc;
        for (int which : {0, 2, 3}) {
          if (!input_scale_foldable(c, which)) continue;
          sc.s[which] = kernels::smoothquant_scales(
              out_in(m.weights().layers[l].linear(which)),
              kernels::input_stats(in.x[which], /*with_gram=*/false).max_abs, alpha);
        }
        scale_layer_inputs(m, l, sc);
        m.quantize_layer(l, [&](int64_t, int, const Tensor& w) {
          return kernels::quantize_rtn(w, kernels::QuantScheme::kW8A8, 0);
        });
      },
      layer_done);
}

}  // namespace tessera::model
