// Context parallelism's transfers (context_parallel.h).
#include "tessera/parallel/context_parallel.h"

#include "tessera/base/error.h"
#include "tessera/base/timer.h"
#include "tessera/kernels/attention.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace tessera::parallel {
namespace {

constexpr int kRingTag = 0x7c000;  // + channel; callers' tags are below 2^20

class RingPending : public model::CpComm::Pending {
 public:
  RingPending(comm::RequestPtr s, comm::RequestPtr r) : send_(std::move(s)), recv_(std::move(r)) {}
  ~RingPending() override {
    try {
      wait();
    } catch (...) {  // reported where it was waited for
    }
  }
  void wait() override {
    if (send_) send_->wait();
    if (recv_) recv_->wait();
    send_ = recv_ = nullptr;
  }

 private:
  comm::RequestPtr send_, recv_;
};

}  // namespace

std::unique_ptr<model::CpComm::Pending> CommCp::ring_shift(const Tensor& send, Tensor& recv, int channel) {
  TESSERA_CHECK(send.is_contiguous() && recv.is_contiguous() && send.nbytes() == recv.nbytes(),
                "context parallelism: ring_shift needs contiguous buffers of equal size");
  TESSERA_CHECK(channel >= 0 && channel < 8, "context parallelism: ring channel ", channel, " outside [0, 8)");
  const int P = group_.size(), r = group_.rank();
  const auto bytes = static_cast<int64_t>(send.nbytes());
  auto rq = group_.irecv(recv.raw_data(), bytes, (r - 1 + P) % P, kRingTag + channel);
  auto sq = group_.isend(send.raw_data(), bytes, (r + 1) % P, kRingTag + channel);
  return std::make_unique<RingPending>(std::move(sq), std::move(rq));
}

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

Tensor random_tensor(const Shape& shape, uint64_t seed) {
  Tensor t = Tensor::empty(shape, DType::kF32);
  uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel(); ++i) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    p[i] = static_cast<float>((s >> 40) & 0xffff) / 32768.f - 1.f;
  }
  return t;
}

}  // namespace

CpBench bench_context_parallel(const CpBenchOptions& o) {
  const auto method = model::parse_cp_method(o.method, "bench cp --method");
  TESSERA_CHECK(o.cp >= 2, "bench cp: --cp must be >= 2, got ", o.cp);
  TESSERA_CHECK(o.repeats >= 1, "bench cp: --repeats must be >= 1");
  const int64_t B = o.batch, T = o.tokens, Hq = o.heads, Hk = o.kv_heads, D = o.head_dim, P = o.cp;
  TESSERA_CHECK(Hq > 0 && Hk > 0 && Hq % Hk == 0, "bench cp: --heads ", Hq, " must be a multiple of --kv-heads ", Hk);
  TESSERA_CHECK(T % (method == model::CpMethod::kRing ? 2 * P : P) == 0, "bench cp: --tokens ", T,
                " does not split over cp = ", P, method == model::CpMethod::kRing ? " (ring: 2 chunks per rank)" : "");
  TESSERA_CHECK(method == model::CpMethod::kRing || (Hq % P == 0 && Hk % P == 0), "bench cp: ulysses needs --heads ",
                Hq, " and --kv-heads ", Hk, " divisible by --cp ", P);
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  CpBench r;
  // The whole sequence on one rank.
  {
    const Tensor q = random_tensor({B, T, Hq, D}, 1), k = random_tensor({B, T, Hk, D}, 2),
                 v = random_tensor({B, T, Hk, D}, 3), dout = random_tensor({B, T, Hq, D}, 4);
    Tensor out = Tensor::empty(q.shape(), DType::kF32), lse = Tensor::empty({B, Hq, T}, DType::kF32);
    Tensor dq = Tensor::empty(q.shape(), DType::kF32), dk = Tensor::empty(k.shape(), DType::kF32),
           dv = Tensor::empty(v.shape(), DType::kF32);
    kernels::AttentionParams p;
    p.scale = scale;
    std::vector<double> t;
    for (int i = 0; i < o.repeats; ++i) {
      base::Timer timer;
      kernels::attention_forward(q, k, v, out, &lse, p);
      kernels::attention_backward(q, k, v, out, lse, dout, dq, dk, dv, p);
      t.push_back(timer.seconds());
    }
    r.single_s = median(t);
  }
  auto body = [&](comm::Communicator& c) {
    TESSERA_CHECK(c.size() == P, "bench cp: --cp ", P, " under mpirun needs -np ", P, ", got ", c.size());
    CommCp cp(c);
    const int64_t Tl = T / P;
    const Tensor q = random_tensor({B, Tl, Hq, D}, 10 + c.rank()), k = random_tensor({B, Tl, Hk, D}, 20 + c.rank()),
                 v = random_tensor({B, Tl, Hk, D}, 30 + c.rank()), dout = random_tensor({B, Tl, Hq, D}, 40 + c.rank());
    Tensor out = Tensor::empty(q.shape(), DType::kF32), lse;
    Tensor dq = Tensor::empty(q.shape(), DType::kF32), dk = Tensor::empty(k.shape(), DType::kF32),
           dv = Tensor::empty(v.shape(), DType::kF32);
    std::vector<double> step, att, wait;
    int64_t bytes = 0;
    for (int i = 0; i <= o.repeats; ++i) {  // (the first is a warm-up)
      cp.attention_s = cp.wait_s = 0;
      cp.bytes_sent = 0;
      c.barrier();
      base::Timer timer;
      model::CpSaved saved;
      model::cp_attention_forward(cp, method, q, k, v, out, lse, saved, scale);
      model::cp_attention_backward(cp, method, q, k, v, out, lse, saved, dout, dq, dk, dv, scale);
      if (i == 0) continue;
      step.push_back(timer.seconds());
      att.push_back(cp.attention_s);
      wait.push_back(cp.wait_s);
      bytes = cp.bytes_sent;
    }
    // The transfers alone: ring, 2 (P - 1) shifts of the K/V block and P of its dK / dV;
    // Ulysses, the four all-to-alls of a forward and backward.
    std::vector<double> xfer;
    for (int i = 0; i < o.repeats; ++i) {
      c.barrier();
      base::Timer timer;
      if (method == model::CpMethod::kRing) {
        Tensor a = Tensor::zeros({2, B, Tl, Hk, D}, DType::kF32), b = Tensor::empty({2, B, Tl, Hk, D}, DType::kF32);
        for (int64_t s = 0; s < 3 * P - 2; ++s) {
          cp.ring_shift(a, b, 0)->wait();
          std::swap(a, b);
        }
      } else {
        const int64_t n = B * Tl * D;
        for (int64_t elems : {n * (Hq + 2 * Hk), n * Hq, n * Hq, n * (Hq + 2 * Hk)}) {
          Tensor a = Tensor::zeros({elems}, DType::kF32), b = Tensor::empty({elems}, DType::kF32);
          cp.all_to_all(a, b);
        }
      }
      xfer.push_back(timer.seconds());
    }
    if (c.rank() == 0) {
      r.step_s = median(step);
      r.attention_s = median(att);
      r.wait_s = median(wait);
      r.transfer_s = median(xfer);
      r.bytes = bytes;
    }
  };
  if (comm::running_under_mpi()) {
    body(comm::mpi_world());
  } else {
    comm::run_local(static_cast<int>(P), body);
  }
  return r;
}

}  // namespace tessera::parallel
