// Context parallelism: ring and Ulysses attention over a cp group (context_parallel.h).
#include "tessera/model/context_parallel.h"

#include <cmath>
#include <limits>
#include <utility>

#include "tessera/base/error.h"
#include "tessera/base/thread_pool.h"
#include "tessera/base/timer.h"

namespace tessera::model {
namespace {

// (B, T, H, D) views with the (H, D) of each token contiguous (head stride D, as the
// attention kernel lays them out): calls f(b, t, pointer) for every token.
template <typename F>
void for_tokens(const Tensor& x, F&& f) {
  const int64_t B = x.size(0), T = x.size(1);
  TESSERA_CHECK(x.dim() == 4 && x.stride(3) == 1 && x.stride(2) == x.size(3), "context parallelism: ",
                x.describe(), " is not a (B, T, H, D) view with contiguous heads");
  base::parallel_for(B * T, 16, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) f(i / T, i % T);
  });
}

// dst += src over (B, T, H, D) views.
void add_tokens(Tensor dst, const Tensor& src) {
  const int64_t HD = dst.size(2) * dst.size(3);
  float* d = dst.data<float>();
  const float* s = src.data<float>();
  for_tokens(dst, [&](int64_t b, int64_t t) {
    float* o = d + b * dst.stride(0) + t * dst.stride(1);
    const float* p = s + b * src.stride(0) + t * src.stride(1);
    for (int64_t c = 0; c < HD; ++c) o[c] += p[c];
  });
}

// The online softmax's merge: (o, lse) over some keys and (op, lp) over others -> over
// both. o (B, C, H, D) and lse (B, H, C) are updated in place.
void merge_partial(Tensor o, Tensor lse, const Tensor& op, const Tensor& lp) {
  const int64_t H = o.size(2), D = o.size(3);
  float* od = o.data<float>();
  const float* pd = op.data<float>();
  float* ld = lse.data<float>();
  const float* lpd = lp.data<float>();
  for_tokens(o, [&](int64_t b, int64_t t) {
    for (int64_t h = 0; h < H; ++h) {
      float& l = ld[b * lse.stride(0) + h * lse.stride(1) + t * lse.stride(2)];
      const float l2 = lpd[b * lp.stride(0) + h * lp.stride(1) + t * lp.stride(2)];
      const float m = std::max(l, l2);
      const float L = m + std::log(std::exp(l - m) + std::exp(l2 - m));
      const float w1 = std::exp(l - L), w2 = std::exp(l2 - L);
      float* x = od + b * o.stride(0) + t * o.stride(1) + h * D;
      const float* y = pd + b * op.stride(0) + t * op.stride(1) + h * D;
      for (int64_t c = 0; c < D; ++c) x[c] = x[c] * w1 + y[c] * w2;
      l = L;
    }
  });
}

// Adds the seconds of its scope to `acc`.
class Timed {
 public:
  explicit Timed(double& acc) : acc_(acc) {}
  ~Timed() { acc_ += timer_.seconds(); }
  Timed(const Timed&) = delete;
  Timed& operator=(const Timed&) = delete;

 private:
  double& acc_;
  base::Timer timer_;
};

// The global chunk (of 2 cp) held at local half `half` of rank r (ring).
int64_t ring_chunk(int r, int P, int half) { return half == 0 ? r : 2 * P - 1 - r; }

// ---- Ulysses ----

// x (B, Tl, H, D) -> the all-to-all's block j: heads [j H / P, (j + 1) H / P) of every token.
void pack_heads(const Tensor& x, Tensor send, int64_t at, int P) {
  const int64_t B = x.size(0), Tl = x.size(1), h = x.size(2) / P, D = x.size(3);
  const int64_t n = B * Tl * h * D;
  for (int j = 0; j < P; ++j)
    send.select(0, j).slice(0, at, at + n).view({B, Tl, h, D}).copy_from(x.slice(2, j * h, (j + 1) * h));
}

// Received blocks (rank j's tokens, this rank's heads) -> (B, P Tl, h, D), rank j's tokens at [j Tl, (j + 1) Tl).
void unpack_tokens(const Tensor& recv, int64_t at, Tensor full, int P) {
  const int64_t B = full.size(0), Tl = full.size(1) / P, h = full.size(2), D = full.size(3);
  const int64_t n = B * Tl * h * D;
  for (int j = 0; j < P; ++j)
    full.slice(1, j * Tl, (j + 1) * Tl).copy_from(recv.select(0, j).slice(0, at, at + n).view({B, Tl, h, D}));
}

// full (B, P Tl, h, D) -> block j: rank j's tokens.
void pack_tokens(const Tensor& full, Tensor send, int64_t at, int P) {
  const int64_t B = full.size(0), Tl = full.size(1) / P, h = full.size(2), D = full.size(3);
  const int64_t n = B * Tl * h * D;
  for (int j = 0; j < P; ++j)
    send.select(0, j).slice(0, at, at + n).view({B, Tl, h, D}).copy_from(full.slice(1, j * Tl, (j + 1) * Tl));
}

// Received blocks (this rank's tokens, rank j's heads) -> x (B, Tl, H, D).
void unpack_heads(const Tensor& recv, int64_t at, Tensor x, int P) {
  const int64_t B = x.size(0), Tl = x.size(1), h = x.size(2) / P, D = x.size(3);
  const int64_t n = B * Tl * h * D;
  for (int j = 0; j < P; ++j)
    x.slice(2, j * h, (j + 1) * h).copy_from(recv.select(0, j).slice(0, at, at + n).view({B, Tl, h, D}));
}

// Each of xs cut into P blocks by pack(x, send, at, P), side by side in one buffer per
// destination rank; one all-to-all; returns what arrived (P, the same per-rank size).
template <typename Pack>
Tensor exchange_blocks(CpComm& cp, const std::vector<const Tensor*>& xs, Pack pack) {
  const int P = cp.size();
  int64_t per = 0;
  for (const Tensor* x : xs) per += x->numel() / P;
  Tensor send = Tensor::empty({P, per}, DType::kF32), recv = Tensor::empty({P, per}, DType::kF32);
  int64_t at = 0;
  for (const Tensor* x : xs) {
    pack(*x, send, at, P);
    at += x->numel() / P;
  }
  Tensor flat = recv.view({recv.numel()});
  {
    Timed w{cp.wait_s};
    cp.all_to_all(send.view({send.numel()}), flat);
  }
  cp.bytes_sent += static_cast<int64_t>(send.nbytes()) / P * (P - 1);
  return recv;
}

// Sequence split -> head split for several (B, Tl, H_i, D) tensors at once.
std::vector<Tensor> to_heads(CpComm& cp, const std::vector<const Tensor*>& xs) {
  const int P = cp.size();
  const Tensor recv = exchange_blocks(cp, xs, pack_heads);
  std::vector<Tensor> out;
  int64_t at = 0;
  for (const Tensor* x : xs) {
    Tensor full = Tensor::empty({x->size(0), x->size(1) * P, x->size(2) / P, x->size(3)}, DType::kF32);
    unpack_tokens(recv, at, full, P);
    at += x->numel() / P;
    out.push_back(full);
  }
  return out;
}

// Head split -> sequence split: fulls (B, T, h_i, D) into outs (B, T / P, h_i P, D).
void to_tokens(CpComm& cp, const std::vector<const Tensor*>& fulls, const std::vector<Tensor*>& outs) {
  const int P = cp.size();
  const Tensor recv = exchange_blocks(cp, fulls, pack_tokens);
  int64_t at = 0;
  for (size_t i = 0; i < fulls.size(); ++i) {
    unpack_heads(recv, at, *outs[i], P);
    at += fulls[i]->numel() / P;
  }
}

// Ring attention's travelling key/value block: this rank's at first, then at step s the
// block of rank (r - s) mod P, the next one's transfer running while `cur` is attended.
struct KvRing {
  CpComm& cp;
  Tensor cur, nxt;  // (2, B, Tl, Hk, D): k, v
  std::unique_ptr<CpComm::Pending> pending;
  KvRing(CpComm& c, const Tensor& k, const Tensor& v) : cp(c) {
    const Shape shape{2, k.size(0), k.size(1), k.size(2), k.size(3)};
    cur = Tensor::empty(shape, DType::kF32), nxt = Tensor::empty(shape, DType::kF32);
    cur.select(0, 0).copy_from(k);
    cur.select(0, 1).copy_from(v);
  }
  void start(int step) {  // step s of P: pass the block on unless it is the last
    if (step + 1 >= cp.size()) return;
    pending = cp.ring_shift(cur, nxt, 0);
    cp.bytes_sent += static_cast<int64_t>(cur.nbytes());
  }
  void finish() {
    if (!pending) return;
    Timed w{cp.wait_s};
    pending->wait();
    pending.reset();
    std::swap(cur, nxt);
  }
};

// The (query half, key half) pairs of rank r's chunks against rank src's that the causal
// mask leaves anything of: f(qh, kh, causal) (causal: the same chunk, its diagonal).
template <typename F>
void visible_pairs(int r, int src, int P, F&& f) {
  for (int qh = 0; qh < 2; ++qh)
    for (int kh = 0; kh < 2; ++kh) {
      const int64_t qc = ring_chunk(r, P, qh), kc = ring_chunk(src, P, kh);
      if (kc <= qc) f(qh, kh, kc == qc);  // (a later chunk is wholly in the future)
    }
}

kernels::AttentionParams params_of(float scale, bool causal) {
  kernels::AttentionParams p;
  p.scale = scale;
  p.causal = causal;
  return p;
}

}  // namespace

CpMethod parse_cp_method(const std::string& name, const std::string& where) {
  if (name == "ring") return CpMethod::kRing;
  if (name == "ulysses") return CpMethod::kUlysses;
  fail(where, ": cp_method must be \"ring\" or \"ulysses\", got \"", name, "\"");
}

const char* cp_method_name(CpMethod m) { return m == CpMethod::kRing ? "ring" : "ulysses"; }

std::vector<int64_t> cp_positions(CpMethod method, int rank, int size, int64_t local_tokens) {
  std::vector<int64_t> pos(static_cast<size_t>(local_tokens));
  if (method == CpMethod::kUlysses) {
    for (int64_t t = 0; t < local_tokens; ++t) pos[t] = rank * local_tokens + t;
    return pos;
  }
  TESSERA_CHECK(local_tokens % 2 == 0, "ring attention: ", local_tokens, " tokens per rank do not split in 2 chunks");
  const int64_t C = local_tokens / 2;
  for (int half = 0; half < 2; ++half)
    for (int64_t t = 0; t < C; ++t) pos[half * C + t] = ring_chunk(rank, size, half) * C + t;
  return pos;
}

Tensor cp_local_tokens(const Tensor& batch, CpMethod method, int rank, int size) {
  const int64_t B = batch.size(0), T = batch.size(1), parts = method == CpMethod::kRing ? 2 * size : size;
  TESSERA_CHECK(T % parts == 0, "context parallelism (", cp_method_name(method), ", cp = ", size, "): ", T,
                " tokens per sequence do not split in ", parts, " equal chunks");
  const int64_t Tl = T / size;
  Tensor out = Tensor::empty({B, Tl}, batch.dtype());
  const auto pos = cp_positions(method, rank, size, Tl);
  if (method == CpMethod::kUlysses) {
    out.copy_from(batch.slice(1, pos[0], pos[0] + Tl));
  } else {
    const int64_t C = Tl / 2;
    out.slice(1, 0, C).copy_from(batch.slice(1, pos[0], pos[0] + C));
    out.slice(1, C, Tl).copy_from(batch.slice(1, pos[C], pos[C] + C));
  }
  return out;
}

int64_t CpSaved::bytes() const {
  int64_t n = 0;
  for (const Tensor* t : {&q, &k, &v, &lse})
    if (t->defined()) n += static_cast<int64_t>(t->nbytes());
  return n;
}

void cp_attention_forward(CpComm& cp, CpMethod method, const Tensor& q, const Tensor& k, const Tensor& v,
                          Tensor& out, Tensor& lse, CpSaved& saved, float scale) {
  const int P = cp.size(), r = cp.rank();
  const int64_t B = q.size(0), Tl = q.size(1), Hq = q.size(2), D = q.size(3), Hk = k.size(2);
  if (method == CpMethod::kUlysses) {
    TESSERA_CHECK(Hq % P == 0 && Hk % P == 0, "ulysses attention: cp = ", P, " does not divide the ", Hq,
                  " query and ", Hk, " key/value heads this rank holds");
    auto full = to_heads(cp, {&q, &k, &v});
    saved.q = full[0], saved.k = full[1], saved.v = full[2];
    // The head-split output is not kept: it is `out` again, in the other split, and the
    // backward brings it back with dout's all-to-all (P - 1) / P of out's bytes, instead of
    // holding the same activation twice.
    Tensor out_heads = Tensor::empty({B, Tl * P, Hq / P, D}, DType::kF32);
    saved.lse = Tensor::empty({B, Hq / P, Tl * P}, DType::kF32);
    {
      Timed a{cp.attention_s};
      kernels::attention_forward(saved.q, saved.k, saved.v, out_heads, &saved.lse, params_of(scale, true));
    }
    to_tokens(cp, {&out_heads}, {&out});
    lse = Tensor();  // (the head-split lse is saved.lse)
    return;
  }
  // Ring: this rank's queries (its two chunks) against every rank's key/value chunks as
  // they come round, the next block's transfer running meanwhile.
  TESSERA_CHECK(Tl % 2 == 0, "ring attention: ", Tl, " tokens per rank do not split in 2 chunks");
  const int64_t C = Tl / 2;
  const auto half = [C](const Tensor& t, int h, int dim = 1) { return t.slice(dim, h * C, (h + 1) * C); };
  KvRing ring(cp, k, v);
  Tensor acc = Tensor::zeros({B, Tl, Hq, D}, DType::kF32);
  lse = Tensor::empty({B, Hq, Tl}, DType::kF32);
  lse.fill(-std::numeric_limits<float>::infinity());
  Tensor op = Tensor::empty({B, C, Hq, D}, DType::kF32), lp = Tensor::empty({B, Hq, C}, DType::kF32);
  for (int s = 0; s < P; ++s) {
    ring.start(s);
    {
      Timed a{cp.attention_s};
      visible_pairs(r, (r - s + P) % P, P, [&](int qh, int kh, bool causal) {
        kernels::attention_forward(half(q, qh), half(ring.cur.select(0, 0), kh), half(ring.cur.select(0, 1), kh), op,
                                   &lp, params_of(scale, causal));
        merge_partial(half(acc, qh), half(lse, qh, 2), op, lp);
      });
    }
    ring.finish();
  }
  out.copy_from(acc);
}

void cp_attention_backward(CpComm& cp, CpMethod method, const Tensor& q, const Tensor& k, const Tensor& v,
                           const Tensor& out, const Tensor& lse, const CpSaved& saved, const Tensor& dout,
                           Tensor& dq, Tensor& dk, Tensor& dv, float scale) {
  const int P = cp.size(), r = cp.rank();
  const int64_t B = q.size(0), Tl = q.size(1), Hq = q.size(2), D = q.size(3), Hk = k.size(2);
  if (method == CpMethod::kUlysses) {
    const auto got = to_heads(cp, {&dout, &out});  // (a permutation: the forward's values exactly)
    const Tensor &dfull = got[0], &out_heads = got[1];
    Tensor dqf = Tensor::empty(saved.q.shape(), DType::kF32), dkf = Tensor::empty(saved.k.shape(), DType::kF32),
           dvf = Tensor::empty(saved.v.shape(), DType::kF32);
    {
      Timed a{cp.attention_s};
      kernels::attention_backward(saved.q, saved.k, saved.v, out_heads, saved.lse, dfull, dqf, dkf, dvf,
                                  params_of(scale, true));
    }
    to_tokens(cp, {&dqf, &dkf, &dvf}, {&dq, &dk, &dv});
    return;
  }
  const int64_t C = Tl / 2;
  const auto half = [C](const Tensor& t, int h, int dim = 1) { return t.slice(dim, h * C, (h + 1) * C); };
  // The key/value blocks travel as in the forward; with each goes its dK / dV so far,
  // which after the last step reaches the rank that owns the block.
  KvRing ring(cp, k, v);
  Tensor dq_acc = Tensor::zeros({B, Tl, Hq, D}, DType::kF32);
  Tensor blk = Tensor::empty({2, B, Tl, Hk, D}, DType::kF32);  // this step's part of the block's dK / dV
  Tensor dsend = Tensor::empty({2, B, Tl, Hk, D}, DType::kF32), drecv = Tensor::empty({2, B, Tl, Hk, D}, DType::kF32);
  Tensor dq_t = Tensor::empty({B, C, Hq, D}, DType::kF32), dk_t = Tensor::empty({B, C, Hk, D}, DType::kF32),
         dv_t = Tensor::empty({B, C, Hk, D}, DType::kF32);
  std::unique_ptr<CpComm::Pending> dpending;
  for (int s = 0; s < P; ++s) {
    ring.start(s);
    blk.zero();
    {
      Timed a{cp.attention_s};
      visible_pairs(r, (r - s + P) % P, P, [&](int qh, int kh, bool causal) {
        kernels::attention_backward(half(q, qh), half(ring.cur.select(0, 0), kh), half(ring.cur.select(0, 1), kh),
                                    half(out, qh), half(lse, qh, 2), half(dout, qh), dq_t, dk_t, dv_t,
                                    params_of(scale, causal));
        add_tokens(half(dq_acc, qh), dq_t);
        add_tokens(half(blk.select(0, 0), kh), dk_t);
        add_tokens(half(blk.select(0, 1), kh), dv_t);
      });
    }
    // This block's dK / dV so far (from the rank before) plus this step's, on to the next rank.
    if (dpending) {
      Timed w{cp.wait_s};
      dpending->wait();
      add_tokens(drecv.select(0, 0), blk.select(0, 0));
      add_tokens(drecv.select(0, 1), blk.select(0, 1));
      std::swap(dsend, drecv);
    } else {
      dsend.copy_from(blk);
    }
    dpending = cp.ring_shift(dsend, drecv, 1);
    cp.bytes_sent += static_cast<int64_t>(dsend.nbytes());
    ring.finish();
  }
  {
    Timed w{cp.wait_s};
    dpending->wait();  // this rank's own block, every rank's contributions summed
  }
  dq.copy_from(dq_acc);
  dk.copy_from(drecv.select(0, 0));
  dv.copy_from(drecv.select(0, 1));
}

}  // namespace tessera::model
