// LoRA forward and backward over the fused block linears.
#include "tessera/base/mix64.h"
#include "tessera/model/lora_ops.h"

#include <algorithm>

#include "tessera/base/error.h"
#include "tessera/base/thread_pool.h"
#include "tessera/kernels/matmul.h"
#include "tessera/model/lora.h"

namespace tessera::model {
namespace {

using base::mix64;

// x as f32 with the dropout of module `mod` applied (inverted dropout: kept values scaled by
// 1 / (1 - p)); x itself (any dtype) when there is no dropout.
Tensor dropped_input(const Model& m, int64_t l, LoraModule mod, const Tensor& x, bool training) {
  const double p = m.lora()->config.dropout;
  if (!training || p <= 0) return x;
  Tensor d = x.dtype() == DType::kF32 ? x.contiguous().clone() : x.to(DType::kF32).contiguous();
  const uint64_t key = mix64(m.lora_seed() ^ mix64(static_cast<uint64_t>(l) * 8 + static_cast<uint64_t>(mod) + 1));
  // A value is kept when its 53-bit uniform is >= p.
  const uint64_t threshold = static_cast<uint64_t>(p * 0x1.0p53);
  const float keep = static_cast<float>(1.0 / (1.0 - p));
  float* v = d.data<float>();
  base::parallel_for(d.numel(), 1 << 14, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      v[i] = (mix64(key + static_cast<uint64_t>(i) * 0x9E3779B97F4A7C15ull) >> 11) >= threshold ? v[i] * keep : 0.f;
  });
  return d;
}

// fn(module, its adapter, where it sits) for each of w's adapters on layer l's linear `which`.
template <typename Fn>
void for_each_adapter(const Model& m, const LoraWeights& w, int64_t l, int which, Fn fn) {
  for (int k = 0; k < kLoraModules; ++k) {
    const LoraPair& p = w.layers[l][k];
    if (!p.a.defined()) continue;
    const auto mod = static_cast<LoraModule>(k);
    const LoraRows g = lora_module_rows(m.config(), l, mod);
    if (g.which == which) fn(mod, p, g);
  }
}

}  // namespace

LoraGroups group_rows_by_adapter(const std::vector<int32_t>& row_adapter, int64_t bank_size) {
  std::vector<int64_t> index(static_cast<size_t>(bank_size), -1);  // adapter -> its group
  LoraGroups out;
  for (size_t i = 0; i < row_adapter.size(); ++i) {
    const int32_t a = row_adapter[i];
    TESSERA_CHECK(a >= -1 && a < bank_size, "LoRA: row ", i, " names adapter ", a, "; the bank holds ", bank_size,
                  " (-1: the base model)");
    if (a < 0) continue;
    if (index[a] < 0) {
      index[a] = static_cast<int64_t>(out.groups.size());
      out.groups.push_back({a, {}, -1});
    }
    out.groups[index[a]].rows.push_back(static_cast<int64_t>(i));
  }
  for (auto& g : out.groups) {
    const int64_t first = g.rows.front(), n = static_cast<int64_t>(g.rows.size());
    if (g.rows.back() - first + 1 == n) g.begin = first;
  }
  return out;
}

namespace {

// One adapted module of one group: y[group rows, module rows] += s (x_g A^T) B^T.
struct LoraTask {
  const LoraGroups::Group* group;
  const LoraPair* pair;
  LoraRows rows;
  float scale;
  const Tensor* xg;  // (n, in): the group's rows of x
};

void run_lora_task(const LoraTask& t, Tensor& y) {
  const LoraGroups::Group& g = *t.group;
  const LoraPair& p = *t.pair;
  const LoraRows& r = t.rows;
  const int64_t n = static_cast<int64_t>(g.rows.size());
  Tensor xa = Tensor::empty({n, p.a.size(0)}, DType::kF32);
  kernels::matmul(*t.xg, p.a, xa, false, true);  // (n, rank)
  if (g.begin >= 0) {
    Tensor out = y.slice(0, g.begin, g.begin + n).slice(1, r.row0, r.row0 + r.rows);
    kernels::matmul(xa, p.b, out, false, true, t.scale, 1.f);
    return;
  }
  Tensor d = Tensor::empty({n, r.rows}, DType::kF32);
  kernels::matmul(xa, p.b, d, false, true, t.scale, 0.f);  // (n, module rows), scattered back
  const float* dv = d.data<float>();
  for (int64_t i = 0; i < n; ++i) {
    float* yr = y.data<float>() + g.rows[i] * y.stride(0) + r.row0 * y.stride(1);
    for (int64_t j = 0; j < r.rows; ++j) yr[j * y.stride(1)] += dv[i * r.rows + j];
  }
}

// Every group's adapted modules of linear `which`. Decode-sized groups make many tiny
// products (groups x modules, a few rows each), whose cost is the thread team's wake-up, not
// the arithmetic: those run as one parallel_for over the (group, module) tasks, each product
// on one thread (they write disjoint rows or columns of y). Larger groups keep the
// matmuls' own threading.
void lora_forward_groups(const Model& m, int64_t l, int which, const Tensor& x, Tensor& y, const LoraGroups& groups) {
  constexpr int64_t kSmallGroup = 64;  // rows
  std::vector<Tensor> xg(groups.groups.size());
  std::vector<LoraTask> tasks;
  bool small = true;
  for (size_t gi = 0; gi < groups.groups.size(); ++gi) {
    const LoraGroups::Group& g = groups.groups[gi];
    const LoraWeights& w = *m.lora_bank()[static_cast<size_t>(g.adapter)];
    const int64_t n = static_cast<int64_t>(g.rows.size());
    for (int k = 0; k < kLoraModules; ++k) {
      const LoraPair& p = w.layers[l][k];
      if (!p.a.defined()) continue;
      const LoraRows r = lora_module_rows(m.config(), l, static_cast<LoraModule>(k));
      if (r.which != which) continue;
      if (!xg[gi].defined()) {
        if (g.begin >= 0) {
          xg[gi] = x.slice(0, g.begin, g.begin + n);
        } else {
          const int64_t in = x.size(1);
          xg[gi] = Tensor::empty({n, in}, DType::kF32);
          float* dst = xg[gi].data<float>();
          if (x.dtype() == DType::kF32 && x.stride(1) == 1) {
            for (int64_t i = 0; i < n; ++i)
              std::copy_n(x.data<float>() + g.rows[i] * x.stride(0), in, dst + i * in);
          } else {
            for (int64_t i = 0; i < n; ++i) xg[gi].slice(0, i, i + 1).copy_from(x.slice(0, g.rows[i], g.rows[i] + 1));
          }
        }
      }
      tasks.push_back({&g, &p, r, static_cast<float>(w.config.scale()), &xg[gi]});
      small = small && n <= kSmallGroup;
    }
  }
  if (small && tasks.size() > 1) {
    base::parallel_for(static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
      for (int64_t t = t0; t < t1; ++t) run_lora_task(tasks[t], y);
    });
    return;
  }
  for (const LoraTask& t : tasks) run_lora_task(t, y);
}

}  // namespace

void lora_forward(const Model& m, int64_t l, int which, const Tensor& x, Tensor& y, bool training,
                  const LoraGroups* groups) {
  if (groups) {
    lora_forward_groups(m, l, which, x, y, *groups);
    return;
  }
  const LoraWeights* w = m.lora();
  if (!w) return;
  const float s = static_cast<float>(w->config.scale());
  const int64_t N = x.size(0);
  for_each_adapter(m, *w, l, which, [&](LoraModule mod, const LoraPair& p, const LoraRows& g) {
    const Tensor xd = dropped_input(m, l, mod, x, training);
    Tensor xa = Tensor::empty({N, p.a.size(0)}, DType::kF32);
    kernels::matmul(xd, p.a, xa, false, true);  // (N, r)
    Tensor out = y.slice(1, g.row0, g.row0 + g.rows);
    kernels::matmul(xa, p.b, out, false, true, s, 1.f);
  });
}

void lora_backward(const Model& m, int64_t l, int which, const Tensor& x, const Tensor& dy, Tensor& dx) {
  const LoraWeights* w = m.lora();
  if (!w) return;
  LoraWeights* grads = m.lora_grads();
  TESSERA_CHECK(grads, "LoRA: a training pass needs the adapters' gradients (Model::set_lora)");
  const float s = static_cast<float>(w->config.scale());
  const int64_t N = x.size(0);
  for_each_adapter(m, *w, l, which, [&](LoraModule mod, const LoraPair& p, const LoraRows& g) {
    LoraPair& gp = grads->layers[l][static_cast<int>(mod)];
    const int64_t r = p.a.size(0);
    const Tensor xd = dropped_input(m, l, mod, x, true);
    Tensor xa = Tensor::empty({N, r}, DType::kF32);
    kernels::matmul(xd, p.a, xa, false, true);  // the forward's (N, r), recomputed
    const Tensor dym = dy.slice(1, g.row0, g.row0 + g.rows);
    kernels::matmul(dym, xa, gp.b, true, false, s, 1.f);  // dB += s dy^T xa
    Tensor dxa = Tensor::empty({N, r}, DType::kF32);
    kernels::matmul(dym, p.b, dxa, false, false, s, 0.f);  // s dy B
    kernels::matmul(dxa, xd, gp.a, true, false, 1.f, 1.f);  // dA += dxa^T dropout(x)
    if (m.lora()->config.dropout <= 0) {
      kernels::matmul(dxa, p.a, dx, false, false, 1.f, 1.f);  // dx += dxa A
      return;
    }
    // Through the dropout: dxa A under the same mask and scale as the forward's input.
    Tensor dxd = Tensor::empty({N, g.in}, DType::kF32);
    kernels::matmul(dxa, p.a, dxd, false, false);
    const Tensor masked = dropped_input(m, l, mod, dxd, true);
    const float* add = masked.data<float>();
    for (int64_t n = 0; n < N; ++n) {
      float* row = dx.data<float>() + n * dx.stride(0);
      for (int64_t j = 0; j < g.in; ++j) row[j] += add[n * g.in + j];
    }
  });
}

}  // namespace tessera::model

namespace tessera::model {

void Model::check_lora(const LoraWeights& w, const LoraWeights* grads) const {
  const ModelConfig& c = config_;
  TESSERA_CHECK(shard_.size == 1 && stage_.whole(), "LoRA runs on a whole model at tp 1 (this is ", shard_.size > 1
                ? "a tensor-parallel shard" : "a pipeline stage", "); tensor and pipeline parallelism with LoRA are not "
                "supported yet");
  TESSERA_CHECK(!c.is_moe(), "LoRA on a mixture-of-experts model (", c.model_type, ") is not supported yet");
  if (quantized_)  // QLoRA: the backward runs through the dequantized weights
    for (const auto& layer : weights_.layers)
      for (const Linear* lin : {&layer.qkv, &layer.o, &layer.up, &layer.down})
        TESSERA_CHECK(!lin->quant || lin->quant->scheme != kernels::QuantScheme::kW8A8, "LoRA over a W8A8 "
                      "(SmoothQuant) base is not supported: its activations are quantized too; use int8, int4 or fp8");
  TESSERA_CHECK(static_cast<int64_t>(w.layers.size()) == c.num_layers, "LoRA adapters for ",
                w.layers.size(), " layers, the model has ", c.num_layers);
  for (int64_t l = 0; l < c.num_layers; ++l)
    for (int k = 0; k < kLoraModules; ++k) {
      const LoraPair& p = w.layers[l][k];
      if (!p.a.defined()) continue;
      const auto mod = static_cast<LoraModule>(k);
      const LoraRows g = lora_module_rows(c, l, mod);  // throws for a model it cannot adapt
      const int64_t r = w.config.rank;
      TESSERA_CHECK(p.a.dtype() == DType::kF32 && p.a.shape() == (Shape{r, g.in}) && p.b.dtype() == DType::kF32 &&
                        p.b.shape() == (Shape{g.rows, r}),
                    "LoRA layer ", l, " ", lora_module_name(mod), ": A ", p.a.describe(), " and B ", p.b.describe(),
                    " must be f32 (", r, ", ", g.in, ") and (", g.rows, ", ", r, ")");
      if (grads)
        TESSERA_CHECK(grads->layers.size() == w.layers.size() && grads->layers[l][k].a.defined() &&
                          grads->layers[l][k].a.shape() == p.a.shape() && grads->layers[l][k].b.shape() == p.b.shape(),
                      "LoRA gradients must be LoraWeights::zeros_like the adapters");
    }
}

void Model::set_lora(const LoraWeights* weights, LoraWeights* grads) {
  lora_ = nullptr;
  lora_grads_ = nullptr;
  if (!weights) return;
  check_lora(*weights, grads);
  lora_ = weights;
  lora_grads_ = grads;
}

void Model::set_lora_bank(std::vector<const LoraWeights*> bank) {
  for (size_t i = 0; i < bank.size(); ++i) {
    TESSERA_CHECK(bank[i], "LoRA bank: adapter ", i, " is null");
    try {
      check_lora(*bank[i], nullptr);
    } catch (const Error& e) {
      throw Error("LoRA bank adapter " + std::to_string(i) + ": " + e.what());
    }
  }
  lora_bank_ = std::move(bank);
}

}  // namespace tessera::model
