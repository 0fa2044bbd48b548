// Mixture-of-experts MLP: routing, grouped expert GEMMs, backward, balance loss (moe.h).
#include "tessera/model/moe.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>

#include "tessera/base/error.h"
#include "tessera/base/thread_pool.h"
#include "tessera/kernels/activation.h"
#include "tessera/kernels/matmul.h"
#include "tessera/kernels/packed_b.h"

namespace tessera::model {
namespace {

// c = x W^T (trans) or x W with expert e's weight W, from its packed copy when the model
// keeps one (MoeWeights::gate_up_fwd, ...) and the product takes it.
void expert_product(const Tensor& x, const Tensor& w, const std::vector<kernels::PackedB>& packed, int64_t e,
                    Tensor& c, bool trans) {
  if (static_cast<size_t>(e) < packed.size() && kernels::takes_packed(packed[e], x.size(0)))
    return kernels::matmul_packed(x, packed[e], c);
  kernels::matmul(x, w, c, false, trans);
}

}  // namespace

void pack_expert_weights(MoeWeights& w, bool on) {
  const size_t E = on ? static_cast<size_t>(w.gate_up.size(0)) : 0;
  for (auto* v : {&w.gate_up_fwd, &w.gate_up_dx, &w.down_fwd, &w.down_dx}) v->resize(E);
  for (size_t e = 0; e < E; ++e) {  // (E, out, in): x W^T reads each as (N, K), dy W as (K, N)
    const auto i = static_cast<int64_t>(e);
    kernels::pack_b(w.gate_up.select(0, i), true, w.gate_up_fwd[e]);
    kernels::pack_b(w.gate_up.select(0, i), false, w.gate_up_dx[e]);
    kernels::pack_b(w.down.select(0, i), true, w.down_fwd[e]);
    kernels::pack_b(w.down.select(0, i), false, w.down_dx[e]);
  }
}

namespace {

void check_shapes(const MoeSpec& spec, const MoeWeights& w, const Tensor& h, const EpComm* ep) {
  const int64_t E = spec.num_experts, H = h.size(1);
  const int64_t El = ep ? E / ep->size() : E;  // experts held here
  TESSERA_CHECK(!ep || E % ep->size() == 0, "moe: ep = ", ep ? ep->size() : 1, " does not divide ", E, " experts");
  TESSERA_CHECK(E >= 1 && spec.top_k >= 1 && spec.top_k <= E, "moe: top_k ", spec.top_k, " of ", E,
                " experts");
  TESSERA_CHECK(spec.n_group >= 1 && E % spec.n_group == 0 && spec.topk_group >= 1 && spec.topk_group <= spec.n_group &&
                    spec.top_k <= spec.topk_group * (E / spec.n_group),
                "moe: ", E, " experts in n_group = ", spec.n_group, " groups, topk_group = ", spec.topk_group,
                ", top_k = ", spec.top_k, " do not fit (the groups must divide the experts and hold top_k)");
  TESSERA_CHECK(spec.group_score == MoeGroupScore::kMax || E / spec.n_group >= 2,
                "moe: a group score of its two best experts needs groups of 2 or more experts");
  TESSERA_CHECK(h.dim() == 2 && h.dtype() == DType::kF32, "moe: h must be (N, H) f32, got ", h.describe());
  TESSERA_CHECK(w.router.shape() == (Shape{E, H}), "moe: router is ", w.router.describe(), ", expected (", E,
                ", ", H, ")");
  TESSERA_CHECK(w.gate_up.dim() == 3 && w.gate_up.size(0) == El && w.gate_up.size(2) == H &&
                    w.gate_up.size(1) % 2 == 0,
                "moe: gate_up is ", w.gate_up.describe(), ", expected (", El, ", 2F, ", H, ")");
  const int64_t F = w.gate_up.size(1) / 2;
  TESSERA_CHECK(w.down.shape() == (Shape{El, H, F}), "moe: down is ", w.down.describe(), ", expected (", El, ", ",
                H, ", ", F, ")");
}

// Top-k of the scores per token (ties to the lower expert id), weights, and the slots
// grouped by expert.
MoeRouting route(const MoeSpec& spec, Tensor scores, const Tensor& bias) {
  const int64_t N = scores.size(0), E = spec.num_experts, k = spec.top_k;
  MoeRouting r;
  r.tokens = N, r.top_k = k;
  r.expert.resize(N * k);
  r.weight.resize(N * k);
  const float* p = scores.data<float>();
  const float* b = bias.defined() ? bias.data<float>() : nullptr;
  const int64_t G = spec.n_group, per = E / G;
  base::parallel_for(N, 64, [&](int64_t n0, int64_t n1) {
    std::vector<int32_t> ids(E), gids(G);
    std::vector<float> key(E), gscore(G);
    for (int64_t n = n0; n < n1; ++n) {
      const float* pn = p + n * E;
      for (int64_t e = 0; e < E; ++e) key[e] = b ? pn[e] + b[e] : pn[e];  // chooses; pn weighs
      if (G > 1) {
        // The topk_group best groups keep their keys; the others' read 0 (as DeepSeek's
        // masked_fill), so they are chosen only if nothing kept scores above 0.
        for (int64_t g = 0; g < G; ++g) {
          const float* kg = key.data() + g * per;
          if (spec.group_score == MoeGroupScore::kMax) {
            gscore[g] = *std::max_element(kg, kg + per);
          } else {
            float a = -INFINITY, c = -INFINITY;
            for (int64_t i = 0; i < per; ++i)
              if (kg[i] > a) c = a, a = kg[i];
              else if (kg[i] > c) c = kg[i];
            gscore[g] = a + c;
          }
        }
        std::iota(gids.begin(), gids.end(), 0);
        std::partial_sort(gids.begin(), gids.begin() + spec.topk_group, gids.end(), [&](int32_t x, int32_t y) {
          return gscore[x] > gscore[y] || (gscore[x] == gscore[y] && x < y);
        });
        std::vector<uint8_t> keep(G, 0);
        for (int64_t i = 0; i < spec.topk_group; ++i) keep[gids[i]] = 1;
        for (int64_t e = 0; e < E; ++e)
          if (!keep[e / per]) key[e] = 0.f;
      }
      std::iota(ids.begin(), ids.end(), 0);
      std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int32_t a, int32_t c) {
        return key[a] > key[c] || (key[a] == key[c] && a < c);
      });
      float sum = 0.f;
      for (int64_t j = 0; j < k; ++j) sum += pn[ids[j]];
      const float scale = static_cast<float>(spec.routed_scaling_factor);
      for (int64_t j = 0; j < k; ++j) {
        r.expert[n * k + j] = ids[j];
        r.weight[n * k + j] = (spec.norm_topk_prob ? pn[ids[j]] / sum : pn[ids[j]]) * scale;
      }
    }
  });
  // Capacity: slots past an expert's limit (in slot order) are dropped.
  const int64_t S = N * k;
  const int64_t cap = spec.capacity_factor > 0
                          ? static_cast<int64_t>(std::ceil(spec.capacity_factor * static_cast<double>(S) /
                                                           static_cast<double>(E) - 1e-9))
                          : S;
  std::vector<uint8_t> kept(S, 1);
  r.offsets.assign(E + 1, 0);
  for (int64_t s = 0; s < S; ++s) {
    int64_t& n = r.offsets[r.expert[s] + 1];
    if (n < cap)
      ++n;
    else
      kept[s] = 0;
  }
  for (int64_t e = 0; e < E; ++e) r.offsets[e + 1] += r.offsets[e];
  r.order.resize(S);
  std::vector<int64_t> next(r.offsets.begin(), r.offsets.end() - 1);
  int64_t tail = r.offsets[E];
  for (int64_t s = 0; s < S; ++s) r.order[kept[s] ? next[r.expert[s]]++ : tail++] = static_cast<int32_t>(s);
  r.scores = std::move(scores);
  return r;
}

// rows (K, W) with zero rows appended up to S (the dropped slots' rows); rows when K = S.
Tensor pad_rows(const Tensor& rows, int64_t S) {
  const int64_t K = rows.size(0);
  if (K == S) return rows;
  Tensor out = Tensor::empty({S, rows.size(1)}, rows.dtype());
  out.slice(0, 0, K).copy_from(rows);
  out.slice(0, K, S).zero();
  return out;
}

// out[n] (overwritten) = the sum over token n's k slots, in choice order, of `rows`, each
// times its combine weight when `weighted`. Sorted slot i's row is (*row_of)[i], and slots
// past row_of's end (the dropped ones) have none; without row_of, row i.
void sum_slots(const MoeRouting& r, const Tensor& rows, bool weighted, Tensor& out,
               const std::vector<int32_t>* row_of) {
  const int64_t N = r.tokens, k = r.top_k, H = rows.size(1);
  std::vector<int32_t> pos(N * k);
  for (int64_t i = 0; i < N * k; ++i) {
    const bool dropped = row_of && i >= static_cast<int64_t>(row_of->size());
    pos[r.order[i]] = !row_of ? static_cast<int32_t>(i) : dropped ? -1 : (*row_of)[i];
  }
  const float* src = rows.data<float>();
  float* op = out.data<float>();
  const int64_t ldo = out.stride(0);
  base::parallel_for(N, 16, [&](int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; ++n) {
      float* o = op + n * ldo;
      std::fill_n(o, H, 0.f);
      for (int64_t j = 0; j < k; ++j) {
        if (pos[n * k + j] < 0) continue;
        const float wt = weighted ? r.weight[n * k + j] : 1.f;
        const float* y = src + static_cast<int64_t>(pos[n * k + j]) * H;
        for (int64_t c = 0; c < H; ++c) o[c] += wt * y[c];
      }
    }
  });
}

// sv's padded blocks from its local_offsets: each expert's rows rounded up to `pad`.
// `bound`: the most padded rows any routing of this layer's shape can give (0: unknown).
void pad_blocks(MoeSaved& sv, int64_t pad, int64_t bound) {
  const size_t El = sv.local_offsets.size() - 1;
  sv.pad_offsets.assign(El + 1, 0);
  sv.padded_row.resize(static_cast<size_t>(sv.local_offsets[El]));
  for (size_t e = 0; e < El; ++e) {
    const int64_t lo = sv.local_offsets[e], hi = sv.local_offsets[e + 1];
    sv.pad_offsets[e + 1] = sv.pad_offsets[e] + (hi - lo + pad - 1) / pad * pad;
    for (int64_t i = lo; i < hi; ++i) sv.padded_row[i] = static_cast<int32_t>(sv.pad_offsets[e] + i - lo);
  }
  // The row counts change every step, and the tensor allocator recycles blocks by exact
  // size (base::allocate_cached): buffers of `row_capacity` rows come back from it every
  // step instead of fresh pages (a 1,024-token layer's ~80 MB page-faulted in per forward).
  const int64_t Rp = sv.pad_offsets[El];
  sv.row_capacity = bound >= Rp ? bound : (Rp + 255) / 256 * 256;
}

// (Rp, W) rows of a (row_capacity, W) block: the padded blocks' buffers.
Tensor block_rows(const MoeSaved& sv, int64_t W) {
  return Tensor::empty({sv.row_capacity, W}, DType::kF32).slice(0, 0, sv.pad_offsets.back());
}

// (Rp, W) in sv's padded blocks, its padding rows zero and the others uninitialised.
Tensor padded_blocks(const MoeSaved& sv, int64_t W) {
  Tensor out = block_rows(sv, W);
  for (size_t e = 0; e + 1 < sv.pad_offsets.size(); ++e) {
    const int64_t used = sv.pad_offsets[e] + sv.local_offsets[e + 1] - sv.local_offsets[e];
    if (used < sv.pad_offsets[e + 1]) out.slice(0, used, sv.pad_offsets[e + 1]).zero();
  }
  return out;
}

// padded_blocks with grouped row i from src(i) (W floats).
template <typename Src>
Tensor scatter_padded(const MoeSaved& sv, int64_t W, const Src& src) {
  Tensor out = padded_blocks(sv, W);
  float* dst = out.data<float>();
  base::parallel_for(static_cast<int64_t>(sv.padded_row.size()), 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) std::copy_n(src(i), W, dst + static_cast<int64_t>(sv.padded_row[i]) * W);
  });
  return out;
}

// Expert parallelism: the rows of a padded (Rp, W) back in the order they arrived (R, W),
// ready to return to their senders: out[group[i]] = padded[padded_row[i]], one copy.
Tensor rows_as_received(const MoeSaved& sv, const Tensor& padded) {
  const int64_t R = static_cast<int64_t>(sv.padded_row.size()), W = padded.size(1);
  Tensor out = Tensor::empty({R, W}, DType::kF32);
  const float* src = padded.data<float>();
  float* dst = out.data<float>();
  base::parallel_for(R, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i)
      std::copy_n(src + static_cast<int64_t>(sv.padded_row[i]) * W, W, dst + static_cast<int64_t>(sv.group[i]) * W);
  });
  return out;
}

// Row padding for the experts' products: bf16 experts run oneDNN primitives made for their
// exact shapes, so their row counts are kept to multiples of kMoeRowPad (MoeSaved); f32
// experts (sgemm, or primitives taking runtime sizes) are not padded.
int64_t row_pad(const MoeWeights& w) { return w.gate_up.dtype() == DType::kBF16 ? kMoeRowPad : 1; }

}  // namespace

void moe_forward(const MoeSpec& spec, const MoeWeights& w, const Tensor& h, Tensor& out, MoeSaved* save,
                 EpComm* ep) {
  check_shapes(spec, w, h, ep);
  // Each expert's row count changes every step. bf16: padded to a few counts (row_pad);
  // f32: one GEMM primitive per layout, not per count.
  const int64_t pad = row_pad(w);
  std::optional<kernels::VaryingShapes> varying;
  if (pad == 1) varying.emplace();
  const int64_t N = h.size(0), H = h.size(1), E = spec.num_experts, k = spec.top_k;
  const int64_t F = w.gate_up.size(1) / 2, S = N * k, El = w.gate_up.size(0);
  Tensor logits = Tensor::empty({N, E}, DType::kF32);
  kernels::matmul(h, w.router, logits, false, true);
  if (spec.scoring == MoeScoring::kSoftmax) {
    kernels::softmax_forward(logits, logits);
  } else {
    float* l = logits.data<float>();
    for (int64_t i = 0; i < logits.numel(); ++i) l[i] = 1.f / (1.f + std::exp(-l[i]));
  }
  MoeSaved local;
  MoeSaved& sv = save ? *save : local;
  TESSERA_CHECK(!w.bias.defined() || (w.bias.shape() == Shape{E} && w.bias.dtype() == DType::kF32),
                "moe: the selection bias is ", w.bias.describe(), ", expected (", E, ") f32");
  sv.routing = route(spec, logits, w.bias);
  const MoeRouting& r = sv.routing;
  const int64_t K = r.kept();  // the slots the experts compute

  // The kept slots' input rows in expert order.
  const float* hp = h.data<float>();
  const int64_t ldh = h.stride(0);
  if (!ep) {
    sv.local_offsets = r.offsets;
    pad_blocks(sv, pad, S + El * (pad - 1));
    sv.x = scatter_padded(sv, H, [&](int64_t i) { return hp + (r.order[i] / k) * ldh; });
  } else {
    Tensor xs = Tensor::empty({K, H}, DType::kF32);
    float* xp = xs.data<float>();
    base::parallel_for(K, 64, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) std::copy_n(hp + (r.order[i] / k) * ldh, H, xp + i * H);
    });
    // Each rank's experts are consecutive, so are their slots: send them, with their
    // experts, and group what arrives by local expert (stable: by sender, then order).
    const int P = ep->size();
    sv.send_rows.assign(P, 0);
    for (int64_t e = 0; e < E; ++e) sv.send_rows[e / El] += r.load(e);
    Tensor ids = Tensor::empty({K, 1}, DType::kI32);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t i = r.offsets[e]; i < r.offsets[e + 1]; ++i) ids.data<int32_t>()[i] = static_cast<int32_t>(e);
    const Tensor xr = ep->all_to_allv(xs, sv.send_rows, &sv.recv_rows);
    const Tensor er = ep->all_to_allv(ids, sv.send_rows, nullptr);
    const int64_t R = xr.size(0), first = static_cast<int64_t>(ep->rank()) * El;
    sv.local_offsets.assign(El + 1, 0);
    for (int64_t i = 0; i < R; ++i) {
      const int64_t e = er.data<int32_t>()[i] - first;
      TESSERA_CHECK(e >= 0 && e < El, "moe: rank ", ep->rank(), " received a row for expert ", e + first,
                    ", which it does not hold");
      ++sv.local_offsets[e + 1];
    }
    for (int64_t e = 0; e < El; ++e) sv.local_offsets[e + 1] += sv.local_offsets[e];
    sv.group.resize(R);
    std::vector<int64_t> next(sv.local_offsets.begin(), sv.local_offsets.end() - 1);
    for (int64_t i = 0; i < R; ++i) sv.group[next[er.data<int32_t>()[i] - first]++] = static_cast<int32_t>(i);
    pad_blocks(sv, pad, 0);
    const float* xrp = xr.data<float>();
    sv.x = scatter_padded(sv, H, [&](int64_t i) { return xrp + static_cast<int64_t>(sv.group[i]) * H; });
  }

  // One GEMM per linear per expert held here, over its padded block (zero rows give zeros).
  sv.u = block_rows(sv, 2 * F);
  sv.a = block_rows(sv, F);
  Tensor y = block_rows(sv, H);
  for (int64_t e = 0; e < El; ++e) {
    const int64_t i0 = sv.pad_offsets[e], i1 = sv.pad_offsets[e + 1];
    if (i0 == i1) continue;
    Tensor u = sv.u.slice(0, i0, i1), a = sv.a.slice(0, i0, i1), ye = y.slice(0, i0, i1);
    expert_product(sv.x.slice(0, i0, i1), w.gate_up.select(0, e), w.gate_up_fwd, e, u, true);
    kernels::swiglu_forward(u.slice(1, 0, F), u.slice(1, F, 2 * F), a);
    expert_product(a, w.down.select(0, e), w.down_fwd, e, ye, true);
  }
  if (!ep) {
    // The slots' outputs stay in the padded blocks (a dropped slot has none).
    sv.y = y;
  } else {
    // The outputs back to the ranks whose tokens they are (the dropped slots' are 0).
    sv.y = pad_rows(ep->all_to_allv(rows_as_received(sv, y), sv.recv_rows, nullptr), S);
  }

  // out[n] = sum_j weight * y[slot], each token's k slots summed in choice order.
  TESSERA_CHECK(out.shape() == (Shape{N, H}) && out.dtype() == DType::kF32, "moe: out is ", out.describe(),
                ", expected (", N, ", ", H, ") f32");
  sum_slots(r, sv.y, true, out, ep ? nullptr : &sv.padded_row);
}

Tensor EpComm::all_gather_rows(const Tensor& in) {
  const int P = size();
  const int64_t n = in.size(0);
  Tensor rep = Tensor::empty({P * n, in.size(1)}, in.dtype());
  for (int j = 0; j < P; ++j) rep.slice(0, j * n, (j + 1) * n).copy_from(in);
  return all_to_allv(rep, std::vector<int64_t>(P, n), nullptr);
}

void moe_forward_replicated(const MoeSpec& spec, const MoeWeights& w, const Tensor& h, Tensor& out,
                            EpComm& ep, std::vector<int64_t>* load) {
  const int64_t N = h.size(0), H = h.size(1), E = spec.num_experts, P = ep.size(), r = ep.rank();
  const int64_t b = N * r / P, e = N * (r + 1) / P;
  Tensor mine = Tensor::empty({e - b, H}, DType::kF32);
  MoeSaved routed;
  moe_forward(spec, w, h.slice(0, b, e).contiguous(), mine, &routed, &ep);
  out.copy_from(ep.all_gather_rows(mine));
  if (!load) return;
  Tensor counts = Tensor::empty({1, E}, DType::kF32);  // exact: < 2^24 slots per step
  for (int64_t x = 0; x < E; ++x) counts.data<float>()[x] = static_cast<float>(routed.routing.load(x));
  const Tensor all = ep.all_gather_rows(counts);
  load->assign(E, 0);
  for (int64_t j = 0; j < P; ++j)
    for (int64_t x = 0; x < E; ++x) (*load)[x] += static_cast<int64_t>(all.data<float>()[j * E + x]);
}

ExpertLoad::ExpertLoad(int64_t experts) : counts_(new std::atomic<int64_t>[experts]), n_(experts) {
  for (int64_t e = 0; e < n_; ++e) counts_[e] = 0;
}

void ExpertLoad::add(const MoeRouting& r) {
  for (int64_t e = 0; e < n_ && e + 1 < static_cast<int64_t>(r.offsets.size()); ++e)
    counts_[e].fetch_add(r.load(e), std::memory_order_relaxed);
}

void ExpertLoad::add(const std::vector<int64_t>& load) {
  for (int64_t e = 0; e < n_ && e < static_cast<int64_t>(load.size()); ++e)
    counts_[e].fetch_add(load[e], std::memory_order_relaxed);
}

std::vector<int64_t> ExpertLoad::counts() const {
  std::vector<int64_t> c(static_cast<size_t>(n_));
  for (int64_t e = 0; e < n_; ++e) c[e] = counts_[e].load(std::memory_order_relaxed);
  return c;
}

void MoeBalance::add(const MoeRouting& r) {
  const int64_t E = static_cast<int64_t>(routed.size());
  TESSERA_CHECK(r.scores.size(1) == E, "MoeBalance: ", r.scores.size(1), " experts, expected ", E);
  std::vector<double> load(E);
  for (int64_t e = 0; e < E; ++e) load[e] = static_cast<double>(r.load(e)), routed[e] += load[e];
  layer_routed.push_back(std::move(load));
  dropped += r.dropped();
  const float* p = r.scores.data<float>();
  for (int64_t n = 0; n < r.tokens; ++n)
    for (int64_t e = 0; e < E; ++e) prob[e] += p[n * E + e];
  tokens += r.tokens;
}

void MoeBalance::add(const MoeRouting& r, int64_t groups) {
  add(r);
  const int64_t E = static_cast<int64_t>(routed.size()), k = r.top_k;
  TESSERA_CHECK(groups > 0 && r.tokens % groups == 0, "MoeBalance: ", r.tokens, " tokens do not split in ", groups,
                " equal groups");
  GroupStats g;
  g.groups = groups, g.tokens_per_group = r.tokens / groups, g.top_k = k;
  g.slots.assign(static_cast<size_t>(groups * E), 0.0);
  g.prob.assign(static_cast<size_t>(groups * E), 0.0);
  const float* p = r.scores.data<float>();
  for (int64_t n = 0; n < r.tokens; ++n) {
    const int64_t b = n / g.tokens_per_group;
    for (int64_t j = 0; j < k; ++j) g.slots[b * E + r.expert[n * k + j]] += 1.0;
    for (int64_t e = 0; e < E; ++e) g.prob[b * E + e] += p[n * E + e];
  }
  layer_groups.push_back(std::move(g));
}

double MoeBalance::GroupStats::ce(size_t i) const {
  const double E = static_cast<double>(slots.size() / static_cast<size_t>(groups));
  return slots[i] * E / (static_cast<double>(tokens_per_group) * static_cast<double>(top_k));
}

double MoeBalance::group_loss() const {
  double total = 0;
  for (const GroupStats& g : layer_groups) {
    double s = 0;
    for (size_t i = 0; i < g.slots.size(); ++i) s += g.ce(i) * (g.prob[i] / static_cast<double>(g.tokens_per_group));
    total += s / static_cast<double>(g.groups);
  }
  return total;
}

std::vector<float> MoeBalance::group_score_grad(size_t layer, double coef) const {
  TESSERA_CHECK(layer < layer_groups.size(), "MoeBalance: no group statistics for MoE layer ", layer);
  const GroupStats& g = layer_groups[layer];
  const double per = coef / static_cast<double>(g.groups * g.tokens_per_group);
  std::vector<float> out(g.slots.size());
  for (size_t i = 0; i < g.slots.size(); ++i) out[i] = static_cast<float>(per * g.ce(i));
  return out;
}

double MoeBalance::loss() const {
  if (tokens == 0) return 0.0;
  const double T = static_cast<double>(tokens);
  double s = 0;
  for (size_t e = 0; e < routed.size(); ++e) s += (routed[e] / T) * (prob[e] / T);
  return s * static_cast<double>(routed.size());
}

std::vector<float> MoeBalance::score_grad(double coef) const {
  std::vector<float> g(routed.size(), 0.f);
  if (tokens == 0) return g;
  const double T = static_cast<double>(tokens);
  for (size_t e = 0; e < routed.size(); ++e)
    g[e] = static_cast<float>(coef * static_cast<double>(routed.size()) * routed[e] / (T * T));
  return g;
}

void moe_backward(const MoeSpec& spec, const MoeWeights& w, const Tensor& h, const MoeSaved& sv,
                  const Tensor& dout, Tensor& dh, MoeWeights& grads, const std::vector<float>* aux_score_grad,
                  EpComm* ep) {
  check_shapes(spec, w, h, ep);
  // Runtime-size products over each expert's own rows, padded experts too: for the
  // backward's shapes (dY W2, the weight gradients' K = rows, dU Wgu) oneDNN's runtime-size
  // kernels matched or beat the static ones of the padded counts (a layer's backward
  // 144.9 ms against 155.2, 2 cores with AMX).
  kernels::VaryingShapes varying;
  const MoeRouting& r = sv.routing;
  const int64_t N = h.size(0), H = h.size(1), E = spec.num_experts, k = spec.top_k;
  const int64_t F = w.gate_up.size(1) / 2, S = N * k;
  TESSERA_CHECK(r.tokens == N && r.top_k == k, "moe_backward: the saved routing is of another forward");
  const int64_t aux_groups = aux_score_grad ? static_cast<int64_t>(aux_score_grad->size()) / E : 0;
  TESSERA_CHECK(!aux_score_grad || (aux_groups > 0 && aux_groups * E == static_cast<int64_t>(aux_score_grad->size()) &&
                                    N % aux_groups == 0),
                "moe_backward: aux_score_grad has ", aux_score_grad ? aux_score_grad->size() : 0,
                " entries, expected ", E, " per group of the ", N, " tokens");

  // Each slot's output gradient (its weight times the token's) and its weight's gradient.
  // One process: each kept slot's straight into its padded row (a dropped slot has none:
  // its output was 0). Expert parallelism: in sorted-slot order, sent to the ranks holding
  // the experts, grouped there as the forward grouped the rows.
  const int64_t K = r.kept();
  Tensor dy = ep ? Tensor::empty({K, H}, DType::kF32) : block_rows(sv, H);
  std::vector<float> dweight(S, 0.f);
  const float* dop = dout.data<float>();
  const int64_t ldd = dout.stride(0);
  const float* yp = sv.y.data<float>();
  float* dyp = dy.data<float>();
  base::parallel_for(K, 64, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int32_t slot = r.order[i];
      const float* g = dop + (slot / k) * ldd;
      const int64_t row = ep ? i : static_cast<int64_t>(sv.padded_row[i]);  // as moe_forward keeps y
      const float* y = yp + row * H;
      float* d_out = dyp + row * H;
      const float wt = r.weight[slot];
      double d = 0;
      for (int64_t c = 0; c < H; ++c) {
        d_out[c] = wt * g[c];
        d += static_cast<double>(g[c]) * y[c];
      }
      dweight[slot] = static_cast<float>(d);
    }
  });
  Tensor dyg = dy;
  if (ep) {
    const Tensor got = ep->all_to_allv(dy, sv.send_rows, nullptr);
    const float* gp = got.data<float>();
    dyg = scatter_padded(sv, H, [&](int64_t i) { return gp + static_cast<int64_t>(sv.group[i]) * H; });
  }

  // The experts, one block of rows each (its rows of the padded blocks, without the
  // padding): dA = dY W2, dW2 += dY^T A, dU by SwiGLU, dWgu += dU^T X, dX = dU Wgu.
  const int64_t El = w.gate_up.size(0);
  Tensor da = block_rows(sv, F), du = block_rows(sv, 2 * F), dxg = block_rows(sv, H);
  for (int64_t e = 0; e < El; ++e) {
    const int64_t i0 = sv.pad_offsets[e], i1 = i0 + sv.local_offsets[e + 1] - sv.local_offsets[e];
    if (i0 == i1) continue;
    const Tensor dye = dyg.slice(0, i0, i1), u = sv.u.slice(0, i0, i1);
    Tensor dae = da.slice(0, i0, i1), due = du.slice(0, i0, i1), dxe = dxg.slice(0, i0, i1);
    Tensor gdown = grads.down.select(0, e), ggu = grads.gate_up.select(0, e);
    expert_product(dye, w.down.select(0, e), w.down_dx, e, dae, false);
    kernels::matmul(dye, sv.a.slice(0, i0, i1), gdown, true, false, 1.f, 1.f);
    Tensor dgate = due.slice(1, 0, F), dup = due.slice(1, F, 2 * F);
    kernels::swiglu_backward(dae, u.slice(1, 0, F), u.slice(1, F, 2 * F), dgate, dup);
    kernels::matmul(due, sv.x.slice(0, i0, i1), ggu, true, false, 1.f, 1.f);
    expert_product(due, w.gate_up.select(0, e), w.gate_up_dx, e, dxe, false);
  }

  // dh = the slots' input gradients summed per token (choice order), then the router's.
  TESSERA_CHECK(dh.shape() == (Shape{N, H}) && dh.dtype() == DType::kF32, "moe_backward: dh is ", dh.describe());
  if (!ep) {
    sum_slots(r, dxg, false, dh, &sv.padded_row);  // the padded rows, as the forward's outputs
  } else {
    const Tensor dx =
        pad_rows(ep->all_to_allv(rows_as_received(sv, dxg), sv.recv_rows, nullptr), S);
    sum_slots(r, dx, false, dh, nullptr);
  }

  // d scores: the chosen ones' through the (renormalised) weights, plus the balance
  // loss's for every expert; then through the softmax to the logits.
  Tensor dscores = Tensor::zeros({N, E}, DType::kF32);
  const float* p = r.scores.data<float>();
  float* ds = dscores.data<float>();
  for (int64_t n = 0; n < N; ++n) {
    float* d = ds + n * E;
    if (aux_score_grad) {
      const float* a = aux_score_grad->data() + n / (N / aux_groups) * E;
      for (int64_t e = 0; e < E; ++e) d[e] = a[e];
    }
    const float c = static_cast<float>(spec.routed_scaling_factor);
    if (spec.norm_topk_prob) {
      // w_j = c p_j / S: d p_j = (c dw_j - sum_i dw_i w_i) / S.
      float sum = 0.f, dot = 0.f;
      for (int64_t j = 0; j < k; ++j) sum += p[n * E + r.expert[n * k + j]];
      for (int64_t j = 0; j < k; ++j) dot += dweight[n * k + j] * r.weight[n * k + j];
      for (int64_t j = 0; j < k; ++j) d[r.expert[n * k + j]] += (c * dweight[n * k + j] - dot) / sum;
    } else {
      for (int64_t j = 0; j < k; ++j) d[r.expert[n * k + j]] += c * dweight[n * k + j];
    }
  }
  Tensor dlogits = Tensor::empty({N, E}, DType::kF32);
  if (spec.scoring == MoeScoring::kSoftmax) {
    kernels::softmax_backward(dscores, r.scores, dlogits);
  } else {  // d logit = d s * s (1 - s)
    const float* dsp = dscores.data<float>();
    float* dl = dlogits.data<float>();
    for (int64_t i = 0; i < N * E; ++i) dl[i] = dsp[i] * p[i] * (1.f - p[i]);
  }
  kernels::matmul(dlogits, w.router, dh, false, false, 1.f, 1.f);
  kernels::matmul(dlogits, h, grads.router, true, false, 1.f, 1.f);
}

}  // namespace tessera::model
