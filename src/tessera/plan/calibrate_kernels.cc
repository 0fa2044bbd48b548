// Calibration measurements on this machine: the GEMM grid, Tessera's memory-bound layer
// kernels and its optimizer step, all devices busy at once as in a multi-rank run.
#include <algorithm>
#include <cstdio>
#include <thread>

#include "tessera/base/strings.h"
#include "tessera/base/timer.h"
#include "tessera/kernels/activation.h"
#include "tessera/kernels/attention.h"
#include "tessera/kernels/elementwise.h"
#include "tessera/kernels/matmul.h"
#include "tessera/kernels/norm.h"
#include "tessera/kernels/peak.h"
#include "tessera/kernels/rope.h"
#include "tessera/model/precision.h"
#include "tessera/plan/calibrate.h"
#include "tessera/plan/time_model.h"
#include "tessera/train/grad_utils.h"
#include "tessera/train/optimizer.h"

namespace tessera::plan {
namespace {

void note(std::string* log, const std::string& line) {
  if (log) *log += line + "\n";
}

// Median seconds of `reps` calls of fn after one warm-up call.
double median_seconds(int reps, const std::function<void()>& fn) {
  fn();
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    base::Timer timer;
    fn();
    t.push_back(timer.seconds());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

double mean(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x;
  return s / static_cast<double>(v.size());
}

Tensor filled(const Shape& shape, float v) {
  Tensor t = Tensor::empty(shape, DType::kF32);
  t.fill(v);
  return t;
}

}  // namespace

std::vector<double> on_all_devices(int devices, const std::function<double(int)>& fn) {
  std::vector<double> out(static_cast<size_t>(devices));
  std::vector<std::thread> pool;
  for (int d = 0; d < devices; ++d) pool.emplace_back([&out, &fn, d] { out[d] = fn(d); });
  for (auto& t : pool) t.join();
  return out;
}

GemmTable measure_gemm_table(DType dtype, const CalibrateOptions& o, int devices,
                             std::string* log) {
  GemmTable t;
  t.k = o.gemm_k;
  t.mn = o.gemm_mn;
  t.flops.assign(t.k.size(), std::vector<double>(t.mn.size(), 0));
  // Each device walks the whole grid; both are busy throughout, as the ranks of a run are.
  // Each point times the three layouts a training step calls, as `bench gemm` times one
  // (median call): forward x W^T, input gradient dy W, weight gradient dy^T x (accumulated).
  // Operands cycle through copies spanning 32 MiB or more: in a step they were last
  // touched many kernels ago and come from beyond the per-core caches (about 10% slower
  // than operands a loop keeps hot).
  std::vector<std::vector<std::vector<double>>> per(devices, t.flops);
  on_all_devices(devices, [&](int d) {
    for (size_t i = 0; i < t.k.size(); ++i)
      for (size_t j = 0; j < t.mn.size(); ++j) {
        const auto mn = static_cast<int64_t>(t.mn[j]), k = static_cast<int64_t>(t.k[i]);
        const double bytes = 4.0 * (3.0 * mn * k + mn * mn);
        const int copies = static_cast<int>(std::clamp(32.0 * (1 << 20) / bytes, 1.0, 64.0));
        std::vector<Tensor> x, w, wt, c;
        for (int r = 0; r < copies; ++r) {
          x.push_back(filled({mn, k}, 0.01f).to(dtype));
          w.push_back(filled({mn, k}, 0.02f).to(dtype));
          wt.push_back(filled({k, mn}, 0.02f).to(dtype));
          c.push_back(filled({mn, mn}, 0.f));
        }
        double seconds = 0;
        seconds += base::median_call_seconds([&](int64_t r) {
          kernels::matmul(x[r % copies], w[r % copies], c[r % copies], false, true, 1.f, 0.f);
        }, o.min_seconds);
        seconds += base::median_call_seconds([&](int64_t r) {
          kernels::matmul(x[r % copies], wt[r % copies], c[r % copies], false, false, 1.f, 0.f);
        }, o.min_seconds);
        seconds += base::median_call_seconds([&](int64_t r) {
          kernels::matmul(wt[r % copies], wt[r % copies], c[r % copies], true, false, 1.f, 1.f);
        }, o.min_seconds);
        per[d][i][j] = 3 * 2.0 * mn * mn * k / seconds;
      }
    return 0.0;
  });
  for (size_t i = 0; i < t.k.size(); ++i) {
    std::string line = "  gemm " + std::string(dtype_name(dtype)) + " k=" +
                       std::to_string(static_cast<int>(t.k[i])) + ":";
    for (size_t j = 0; j < t.mn.size(); ++j) {
      std::vector<double> v;
      for (int d = 0; d < devices; ++d) v.push_back(per[d][i][j]);
      t.flops[i][j] = mean(v);
      line += base::strprintf(" %.0f", t.flops[i][j] / 1e9);
    }
    note(log, line + " GFLOP/s (mn = " + std::to_string(static_cast<int>(t.mn.front())) + " .. " +
                  std::to_string(static_cast<int>(t.mn.back())) + ")");
  }
  return t;
}

double measure_elementwise_bandwidth(int devices, std::string* log) {
  // A Llama layer of 2048 tokens: hidden 512, 8 heads of 64 (4 KV heads), MLP 1408.
  const int64_t N = 2048, H = 512, hd = 64, Q = 512, KV = 256, F = 1408;
  ModelSpec m;
  m.name = "calibration layer";
  m.layers = 1, m.hidden = H, m.heads = Q / hd, m.kv_heads = KV / hd, m.head_dim = hd;
  m.ffn = F, m.vocab = 1;
  TrainSetup s;
  s.devices = 1, s.seq = N, s.global_batch = 1;
  Hardware cpu;
  cpu.store_16bit_as_f32 = true;
  const double bytes = layer_elementwise_bytes(m, 0, s, Layout{}, cpu);
  const auto seconds = on_all_devices(devices, [&](int) {
    Tensor x = filled({N, H}, 0.5f), w = filled({H}, 1.f), h1 = filled({N, H}, 0.f);
    Tensor rstd = filled({N}, 0.f), rstd2 = filled({N}, 0.f), dw = filled({H}, 0.f);
    Tensor qk = filled({N, Q + KV}, 0.25f), o = filled({N, H}, 0.1f), h2 = filled({N, H}, 0.f);
    Tensor gate = filled({N, F}, 0.3f), up = filled({N, F}, 0.2f), a = filled({N, F}, 0.f);
    Tensor dgate = filled({N, F}, 0.f), dup = filled({N, F}, 0.f), dx = filled({N, H}, 0.f);
    std::vector<int32_t> pos(N);
    for (int64_t i = 0; i < N; ++i) pos[i] = static_cast<int32_t>(i % 1024);
    const Tensor positions = Tensor::from_vector(pos, {N});
    // Operands the layer's matmuls round: (in, out) of qkv, o, gate|up, down.
    const std::pair<int64_t, int64_t> linears[] = {{H, Q + 2 * KV}, {Q, H}, {H, 2 * F}, {F, H}};
    std::vector<Tensor> in_ops, out_ops;
    for (const auto& [in, out] : linears) {
      in_ops.push_back(filled({N, in}, 0.1f));
      out_ops.push_back(filled({N, out}, 0.1f));
    }
    return median_seconds(5, [&] {
      // The engine allocates every saved activation and gradient buffer afresh each step.
      h1 = Tensor::empty({N, H}, DType::kF32), h2 = Tensor::empty({N, H}, DType::kF32);
      rstd = Tensor::empty({N}, DType::kF32), rstd2 = Tensor::empty({N}, DType::kF32);
      a = Tensor::empty({N, F}, DType::kF32), dx = Tensor::empty({N, H}, DType::kF32);
      dgate = Tensor::empty({N, F}, DType::kF32), dup = Tensor::empty({N, F}, DType::kF32);
      // Forward: norm, RoPE, residual copy + add-norm, SwiGLU, residual add.
      kernels::rmsnorm_forward(x, w, 1e-5f, h1, &rstd);
      kernels::rope_apply(qk, hd, positions, 10000.f);
      Tensor mid = x.clone();
      kernels::add_rmsnorm_forward(mid, o, w, 1e-5f, h2, &rstd2);
      kernels::swiglu_forward(gate, up, a);
      Tensor out = mid.clone();
      kernels::add_inplace(out, o);
      // Backward: SwiGLU, two norms, residual gradient adds, RoPE inverse.
      kernels::swiglu_backward(a, gate, up, dgate, dup);
      kernels::rmsnorm_backward(o, mid, w, rstd2, dx, dw);
      kernels::add_inplace(dx, o);
      kernels::rmsnorm_backward(dx, x, w, rstd, h1, dw);
      kernels::add_inplace(h1, dx);
      kernels::rope_apply(qk, hd, positions, 10000.f, true);
      // Operand rounding of each linear: x forward and for the weight gradient, dy for
      // the input gradient and the weight gradient.
      for (size_t i = 0; i < in_ops.size(); ++i)
        for (int r = 0; r < 2; ++r) {
          bf16_rounded(in_ops[i]);
          bf16_rounded(out_ops[i]);
        }
    });
  });
  const double bw = bytes / mean(seconds);
  note(log, base::strprintf("  layer kernels (norms, RoPE, SwiGLU, adds, rounding): %.1f ms "
                            "-> %.2f GB/s of the model's elementwise bytes",
                            mean(seconds) * 1e3, bw / 1e9));
  return bw;
}

double measure_optimizer_bandwidth(int devices, std::string* log) {
  const int64_t n = int64_t{4} << 20;  // 4M parameters in 4 tensors
  StateBytes b;
  b.weight = b.grad = 4;  // f32 storage, bf16 training: fp32 master + AdamW moments
  const double bytes = optimizer_bytes_per_param(b) * static_cast<double>(n);
  const auto seconds = on_all_devices(devices, [&](int) {
    std::vector<train::ParamRef> refs;
    std::vector<Tensor> weights;
    for (int i = 0; i < 4; ++i) {
      train::ParamRef r;
      r.name = std::to_string(i);  // (not "w" + ...: GCC 12 warns falsely on that)
      r.param = filled({n / 4}, 0.01f);
      r.grad = filled({n / 4}, 0.001f);
      r.decay = true;
      refs.push_back(r);
      weights.push_back(filled({n / 4}, 0.f));
    }
    train::Optimizer opt(train::OptimizerConfig{}, refs);
    // The trainer's update (train::update_weights under bf16): the norm, then one pass
    // applying the clip and writing the rounded weights and, where bf16 runs natively
    // (the one decision, model::choose_bf16_mode), the matmuls' bf16 copies.
    const bool native = model::choose_bf16_mode(DType::kBF16) == model::Bf16Mode::kNative;
    std::vector<train::ParamCopies> copies(refs.size());
    for (size_t i = 0; i < refs.size(); ++i) {
      copies[i].rounded = weights[i];
      if (native) copies[i].bf16 = Tensor::zeros({n / 4}, DType::kBF16);
    }
    return median_seconds(5, [&] {
      train::StepOptions so;
      so.grad_scale = train::grad_clip(refs, 1e-9).coef;  // always clips, as early training does
      so.copies = &copies;
      opt.step(1.0, so);
    });
  });
  const double bw = bytes / mean(seconds);
  note(log, base::strprintf("  optimizer step (norm; clip, AdamW and publish in one pass) of %lldM params: "
                            "%.1f ms -> %.2f GB/s of the model's optimizer bytes",
                            static_cast<long long>(n >> 20), mean(seconds) * 1e3, bw / 1e9));
  return bw;
}

double measure_attention_flops(int devices, std::string* log) {
  const int64_t T = 512, Hq = 8, Hkv = 4, D = 64;
  // The time model's count: forward T x s x heads x (d_qk + d_v) (causal half), backward 2.5x.
  const double flops = 3.5 * T * T * Hq * (D + D);
  const auto seconds = on_all_devices(devices, [&](int) {
    Tensor q = filled({1, T, Hq, D}, 0.01f), k = filled({1, T, Hkv, D}, 0.02f);
    Tensor v = filled({1, T, Hkv, D}, 0.03f), out = filled({1, T, Hq, D}, 0.f);
    Tensor lse = filled({1, Hq, T}, 0.f), dout = filled({1, T, Hq, D}, 0.01f);
    Tensor dq = filled({1, T, Hq, D}, 0.f), dk = filled({1, T, Hkv, D}, 0.f);
    Tensor dv = filled({1, T, Hkv, D}, 0.f);
    kernels::AttentionParams p;
    p.scale = 0.125f;
    return median_seconds(5, [&] {
      kernels::attention_forward(q, k, v, out, &lse, p);
      kernels::attention_backward(q, k, v, out, lse, dout, dq, dk, dv, p);
    });
  });
  const double rate = flops / mean(seconds);
  note(log, base::strprintf("  attention forward + backward (512 tokens, 8 x 64): %.2f ms -> "
                            "%.1f GFLOP/s",
                            mean(seconds) * 1e3, rate / 1e9));
  return rate;
}

}  // namespace tessera::plan
