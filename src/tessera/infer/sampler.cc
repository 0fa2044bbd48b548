// Sampler: greedy argmax, or softmax(logits / T) restricted to top-k then top-p.
#include "tessera/infer/sampler.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace tessera::infer {

void SamplingParams::validate() const {
  TESSERA_CHECK(std::isfinite(temperature) && temperature >= 0.f,
                "temperature must be >= 0, got ", temperature);
  TESSERA_CHECK(top_k >= 0, "top-k must be >= 0, got ", top_k);
  TESSERA_CHECK(std::isfinite(top_p) && top_p > 0.f && top_p <= 1.f,
                "top-p must be in (0, 1], got ", top_p);
}

Sampler::Sampler(const SamplingParams& p) : params_(p), rng_(p.seed) { p.validate(); }

int32_t Sampler::sample(const Tensor& logits) {
  TESSERA_CHECK(logits.dtype() == DType::kF32 && logits.is_contiguous() &&
                    (logits.dim() == 1 || (logits.dim() == 2 && logits.size(0) == 1)),
                "sampler: expected f32 logits (V) or (1, V), got ", logits.describe());
  const float* x = logits.data<float>();
  const int64_t V = logits.numel();
  if (params_.temperature == 0.f) return static_cast<int32_t>(std::max_element(x, x + V) - x);

  std::vector<int32_t> idx(V);
  std::iota(idx.begin(), idx.end(), 0);
  int64_t keep = V;
  if (params_.top_k > 0 && params_.top_k < V) keep = params_.top_k;
  // Sort the candidates by logit (descending); ties broken by id for determinism.
  auto cmp = [&](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
  std::partial_sort(idx.begin(), idx.begin() + keep, idx.end(), cmp);
  idx.resize(keep);
  const float inv_t = 1.f / params_.temperature;
  const float mx = x[idx[0]];
  std::vector<double> p(keep);
  double sum = 0.0;
  for (int64_t i = 0; i < keep; ++i) sum += p[i] = std::exp(static_cast<double>((x[idx[i]] - mx) * inv_t));
  if (params_.top_p < 1.f) {
    // Smallest prefix whose probability mass reaches top_p (always at least one token).
    double acc = 0.0;
    int64_t cut = keep;
    for (int64_t i = 0; i < keep; ++i) {
      acc += p[i] / sum;
      if (acc >= params_.top_p) {
        cut = i + 1;
        break;
      }
    }
    keep = cut;
    sum = std::accumulate(p.begin(), p.begin() + keep, 0.0);
  }
  std::uniform_real_distribution<double> u(0.0, sum);
  double r = u(rng_), acc = 0.0;
  for (int64_t i = 0; i < keep; ++i) {
    acc += p[i];
    if (r < acc) return idx[i];
  }
  return idx[keep - 1];
}

}  // namespace tessera::infer
