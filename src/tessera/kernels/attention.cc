// Attention entry points: validate shapes, strides and dtypes, then run the CPU kernel.
#include "tessera/kernels/attention.h"
#include "tessera/kernels/dispatch.h"

#include <cmath>

#include "tessera/kernels/cpu/attention_amx.h"
#include "tessera/kernels/cpu/attention_cpu.h"

namespace tessera::kernels {
namespace {

using cpu::AttnDims;
using cpu::AttnView;
using cpu::LseView;

// A (B, T, H, D) f32 CPU tensor with head stride D and contiguous head dim.
void check_bthd(const Tensor& t, const char* name) {
  TESSERA_CHECK(t.defined(), "attention: ", name, " is undefined");
  TESSERA_CHECK(t.dim() == 4, "attention: ", name, " must be (B, T, H, D), got ",
                shape_str(t.shape()));
  TESSERA_CHECK(t.dtype() == DType::kF32, "attention: ", name, " must be f32, got ",
                dtype_name(t.dtype()));
  TESSERA_CHECK(t.device() == Device::kCPU, "attention: ", name, " must be on the CPU");
  const int64_t H = t.size(2), D = t.size(3);
  TESSERA_CHECK(D <= 1 || t.stride(3) == 1, "attention: ", name, " ", shape_str(t.shape()),
                " needs a contiguous last dim, stride is ", t.stride(3));
  TESSERA_CHECK(H <= 1 || t.stride(2) == D, "attention: ", name, " ", shape_str(t.shape()),
                " needs head stride == D (", D, "), got ", t.stride(2));
}

void check_same_shape(const Tensor& a, const char* a_name, const Tensor& b, const char* b_name) {
  TESSERA_CHECK(a.shape() == b.shape(), "attention: ", a_name, " ", shape_str(a.shape()),
                " must have the shape of ", b_name, " ", shape_str(b.shape()));
}

// Packed documents: only for a causal self-attention over whole rows, and each position
// must lie in [0, i] so every query sees itself and no key before its row.
void check_doc_positions(const AttentionParams& p, const AttnDims& d) {
  TESSERA_CHECK(p.causal && p.q_offset == 0 && d.Tq == d.Tk,
                "attention: doc_positions need causal self-attention with q_offset 0 and Tq == Tk, "
                "got ", p.causal ? "causal" : "non-causal", " q_offset ", p.q_offset, " Tq ", d.Tq,
                " Tk ", d.Tk);
  TESSERA_CHECK(d.B <= 1 || p.doc_positions_stride >= d.Tq,
                "attention: doc_positions_stride (", p.doc_positions_stride,
                ") must be at least Tq (", d.Tq, ")");
  for (int64_t b = 0; b < d.B; ++b) {
    const int32_t* pos = p.doc_positions + b * p.doc_positions_stride;
    for (int64_t i = 0; i < d.Tq; ++i)
      TESSERA_CHECK(pos[i] >= 0 && pos[i] <= i, "attention: doc_positions[", b, ", ", i, "] = ",
                    pos[i], " (batch row ", b, ", token ", i, ") must be in [0, ", i, "]");
  }
}

AttnDims check_qkv(const Tensor& q, const Tensor& k, const Tensor& v,
                   const AttentionParams& params) {
  check_bthd(q, "q");
  check_bthd(k, "k");
  check_bthd(v, "v");
  check_same_shape(v, "v", k, "k");
  AttnDims d;
  d.B = q.size(0), d.Tq = q.size(1), d.Hq = q.size(2), d.D = q.size(3);
  d.Tk = k.size(1), d.Hkv = k.size(2);
  TESSERA_CHECK(k.size(0) == d.B, "attention: k ", shape_str(k.shape()), " and q ",
                shape_str(q.shape()), " differ in batch size");
  TESSERA_CHECK(k.size(3) == d.D, "attention: k ", shape_str(k.shape()), " and q ",
                shape_str(q.shape()), " differ in head dim");
  TESSERA_CHECK(d.Hq > 0 && d.D > 0, "attention: q ", shape_str(q.shape()),
                " needs at least one head and a non-empty head dim");
  TESSERA_CHECK(d.Hkv > 0 && d.Hq % d.Hkv == 0, "attention: query heads (", d.Hq, ", q ",
                shape_str(q.shape()), ") must be a multiple of kv heads (", d.Hkv, ", k ",
                shape_str(k.shape()), ")");
  TESSERA_CHECK(std::isfinite(params.scale) && params.scale != 0.f,
                "attention: params.scale must be finite and non-zero (usually 1/sqrt(D) = ",
                1.0 / std::sqrt(static_cast<double>(d.D)), "), got ", params.scale);
  TESSERA_CHECK(d.Tq == 0 || d.Tk > 0, "attention: k ", shape_str(k.shape()), " has no keys for ",
                d.Tq, " queries");
  TESSERA_CHECK(std::isfinite(params.softcap) && params.softcap >= 0.f, "attention: params.softcap must be >= 0 "
                "(0 = none), got ", params.softcap);
  TESSERA_CHECK(params.window >= 0 && (params.window == 0 || params.causal),
                "attention: a sliding window (", params.window, ") must be positive and causal");
  if (params.causal) {
    TESSERA_CHECK(params.q_offset >= 0 && params.q_offset + d.Tq <= d.Tk,
                  "attention: causal q_offset ", params.q_offset, " with Tq ", d.Tq, " (q ",
                  shape_str(q.shape()), ") needs 0 <= q_offset and q_offset + Tq <= Tk (", d.Tk,
                  ", k ", shape_str(k.shape()), ")");
  }
  if (params.doc_positions) check_doc_positions(params, d);
  return d;
}

LseView check_lse(const Tensor& lse, const AttnDims& d) {
  TESSERA_CHECK(lse.defined(), "attention: lse is undefined");
  TESSERA_CHECK(lse.dtype() == DType::kF32, "attention: lse must be f32, got ",
                dtype_name(lse.dtype()));
  TESSERA_CHECK(lse.device() == Device::kCPU, "attention: lse must be on the CPU");
  const Shape want{d.B, d.Hq, d.Tq};
  TESSERA_CHECK(lse.shape() == want, "attention: lse must be (B, Hq, Tq) = ", shape_str(want),
                ", got ", shape_str(lse.shape()));
  return LseView{lse.data<float>(), lse.stride(0), lse.stride(1), lse.stride(2)};
}

AttnView view_of(const Tensor& t) { return AttnView{t.data<float>(), t.stride(0), t.stride(1)}; }

bool runs_on_amx(const AttnDims& d, const AttentionParams& p) {
  return p.bf16_products && cpu_has(IsaLevel::kAmx) && cpu::amx_attention_supports(d);
}

}  // namespace

void attention_forward(const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out, Tensor* lse,
                       const AttentionParams& params) {
  const AttnDims d = check_qkv(q, k, v, params);
  check_bthd(out, "out");
  check_same_shape(out, "out", q, "q");
  const LseView lv = lse ? check_lse(*lse, d) : LseView{};
  if (runs_on_amx(d, params)) {
    TESSERA_KERNEL("attention_forward",
                   cpu::attention_forward_amx(d, view_of(q), view_of(k), view_of(v), view_of(out), lv, params),
                   q, k, v, out);
    return;
  }
  TESSERA_KERNEL("attention_forward",
                 cpu::attention_forward_cpu(d, view_of(q), view_of(k), view_of(v), view_of(out), lv,
                                            params, cpu::best_attention_isa()),
                 q, k, v, out);
}

void attention_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                        const Tensor& lse, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                        const AttentionParams& params) {
  const AttnDims d = check_qkv(q, k, v, params);
  check_bthd(out, "out");
  check_same_shape(out, "out", q, "q");
  check_bthd(dout, "dout");
  check_same_shape(dout, "dout", q, "q");
  check_bthd(dq, "dq");
  check_same_shape(dq, "dq", q, "q");
  check_bthd(dk, "dk");
  check_same_shape(dk, "dk", k, "k");
  check_bthd(dv, "dv");
  check_same_shape(dv, "dv", v, "v");
  const LseView lv = check_lse(lse, d);
  if (runs_on_amx(d, params)) {
    TESSERA_KERNEL("attention_backward",
                   cpu::attention_backward_amx(d, view_of(q), view_of(k), view_of(v), view_of(out), lv, view_of(dout),
                                               view_of(dq), view_of(dk), view_of(dv), params),
                   q, k, v, out, dout, dq, dk, dv);
    return;
  }
  TESSERA_KERNEL("attention_backward",
                 cpu::attention_backward_cpu(d, view_of(q), view_of(k), view_of(v), view_of(out), lv,
                                             view_of(dout), view_of(dq), view_of(dk), view_of(dv),
                                             params, cpu::best_attention_isa()),
                 q, k, v, out, dout, dq, dk, dv);
}

}  // namespace tessera::kernels
