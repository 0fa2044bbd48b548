// Sampler: logits processing and drawing in vLLM's order, raw log-probabilities, and
// stop-string matching for streamed text. The parameter checks are in sampling_params.cc.
#include "tessera/infer/sampler.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <mutex>
#include <numeric>

namespace tessera::infer {
namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// Seeds requests that give none: one process-wide generator, seeded once from the OS.
uint64_t process_seed() {
  static std::mutex mu;
  static std::mt19937_64 gen{[] {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd();
  }()};
  std::lock_guard<std::mutex> lock(mu);
  return gen();
}

// Largest logit and its id (lowest id on ties). NaN or +inf logits mean a broken model
// (or an overflowing penalty): error. The scans are `omp simd` reductions so that they
// vectorize without -ffast-math (the library is built with OpenMP; without it they still work).
float max_logit(const float* x, int64_t vocab, int64_t& best) {
  float m = kNegInf, bad = 0.f;
#pragma omp simd reduction(max : m, bad)
  for (int64_t i = 0; i < vocab; ++i) {
    m = x[i] > m ? x[i] : m;
    bad = x[i] - x[i] == 0.f ? bad : 1.f;  // x - x is NaN for NaN and +-inf only
  }
  if (bad != 0.f && std::any_of(x, x + vocab, [](float v) { return v != v; }))
    fail("sampler: logit ", std::find_if(x, x + vocab, [](float v) { return v != v; }) - x, " is NaN");
  TESSERA_CHECK(m > kNegInf, "sampler: every one of the ", vocab, " logits is -inf");
  best = std::find(x, x + vocab, m) - x;
  TESSERA_CHECK(std::isfinite(m), "sampler: logit ", best, " is +inf");
  return m;
}

float min_logit(const float* x, int64_t vocab) {
  float m = std::numeric_limits<float>::infinity();
#pragma omp simd reduction(min : m)
  for (int64_t i = 0; i < vocab; ++i) m = x[i] < m ? x[i] : m;
  return m;
}

// e^x for x <= 0 (logits minus their max), within 1e-7 relative of exp; 0 below -87 and
// for -inf. Cephes expf's reduction and polynomial, written without branches (the clamp is
// on the bits: for negative floats a larger pattern is a larger magnitude) so that the
// loops calling it vectorize; std::exp does not, and this is the sampler's main cost.
inline float exp_nonpositive(float x) {
  constexpr uint32_t kMinus87 = 0xC2AE0000u;
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t below = 0u - static_cast<uint32_t>(bits > kMinus87);  // all ones below -87
  x = std::bit_cast<float>((bits & ~below) | (kMinus87 & below));
  const float keep = std::bit_cast<float>(0x3F800000u & ~below);  // 1.f, or 0.f below -87
  const float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round(x / ln 2)
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  return p * std::bit_cast<float>((static_cast<int32_t>(n) + 127) * (1 << 23)) * keep;
}

// out[i] = exp((x[i] - m) * inv_t): unnormalised probabilities, the top one exactly 1.
void fill_exp(const float* x, int64_t vocab, float m, float inv_t, float* out) {
  for (int64_t i = 0; i < vocab; ++i) out[i] = exp_nonpositive((x[i] - m) * inv_t);
}

double sum_weights(const float* w, int64_t n) {
  double s = 0.0;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += w[i];
  return s;
}

}  // namespace

Sampler::Sampler(const SamplingParams& params, std::vector<int32_t> eos_token_ids,
                 int64_t sample_index)
    : params_(params) {
  params_.validate();
  TESSERA_CHECK(sample_index >= 0 && sample_index < params_.n, "sampler: sample index ",
                sample_index, " outside [0, n = ", params_.n, ")");
  for (int32_t e : eos_token_ids)
    if (e >= 0) eos_.push_back(e);
  rng_.seed(params_.seed ? *params_.seed + static_cast<uint64_t>(sample_index) : process_seed());
}

bool Sampler::is_stop_token(int32_t token) const {
  const auto& ids = params_.stop_token_ids;
  if (std::find(ids.begin(), ids.end(), token) != ids.end()) return true;
  return !params_.ignore_eos && std::find(eos_.begin(), eos_.end(), token) != eos_.end();
}

double Sampler::uniform() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }

// Returns `logits` itself when nothing applies, else work_ with min-tokens suppression and
// penalties applied. Penalties touch only the distinct ids of prompt + output: O(len), with
// vocab-sized scratch that is left zeroed for the next call.
const float* Sampler::process(const float* logits, int64_t vocab, const std::vector<int32_t>& prompt,
                              const std::vector<int32_t>& output) {
  const auto& p = params_;
  const bool rep = p.repetition_penalty != 1.f;
  const bool pres_freq = p.presence_penalty != 0.f || p.frequency_penalty != 0.f;
  const bool suppress = static_cast<int64_t>(output.size()) < p.min_tokens;
  processed_is_raw_ = !rep && !pres_freq && !suppress && !mask_;
  if (processed_is_raw_) return logits;
  if (mask_) {  // structured outputs: disallowed tokens first, so nothing below revives them
    work_.resize(vocab);
    const uint64_t* m = mask_;
    for (int64_t i = 0; i < vocab; ++i) work_[i] = (m[i >> 6] >> (i & 63)) & 1 ? logits[i] : kNegInf;
  } else {
    work_.assign(logits, logits + vocab);
  }
  if (rep || pres_freq) {
    // Check every id before touching the scratch, so an error leaves it clean.
    auto check = [vocab](const std::vector<int32_t>& ids, const char* what) {
      for (size_t i = 0; i < ids.size(); ++i)
        TESSERA_CHECK(ids[i] >= 0 && ids[i] < vocab, "sampler: ", what, " token ", i, " has id ",
                      ids[i], " outside the vocabulary [0, ", vocab, ")");
    };
    check(output, "output");
    if (rep) check(prompt, "prompt");
    if (static_cast<int64_t>(counts_.size()) != vocab) {
      counts_.assign(vocab, 0);
      seen_.assign(vocab, 0);
    }
    touched_.clear();
    auto touch = [this](int32_t t) {
      if (!seen_[t]) {
        seen_[t] = 1;
        touched_.push_back(t);
      }
    };
    for (int32_t t : output) {
      touch(t);
      ++counts_[t];
    }
    if (rep)
      for (int32_t t : prompt) touch(t);
    const float r = p.repetition_penalty;
    for (int32_t t : touched_) {
      float& x = work_[t];
      if (rep) x = x > 0.f ? x / r : x * r;  // HF / vLLM: always towards "less likely"
      if (const int32_t c = counts_[t]; c > 0)
        x -= p.frequency_penalty * static_cast<float>(c) + p.presence_penalty;  // OpenAI
      counts_[t] = 0;
      seen_[t] = 0;
    }
  }
  if (suppress) {
    for (int32_t t : p.stop_token_ids)
      if (t < vocab) work_[t] = kNegInf;
    if (!p.ignore_eos)
      for (int32_t t : eos_)
        if (t < vocab) work_[t] = kNegInf;
  }
  return work_.data();
}

std::vector<float> Sampler::processed_logits(const float* logits, int64_t vocab,
                                             const std::vector<int32_t>& prompt_tokens,
                                             const std::vector<int32_t>& output_tokens) {
  const float* x = process(logits, vocab, prompt_tokens, output_tokens);
  return std::vector<float>(x, x + vocab);
}

// Draws from softmax(x / T) restricted by min-p and top-k, then top-p on what is left.
// Nothing sorts the vocabulary: top-k keeps a k-sized heap in one pass, and top-p finds its
// cut by binning -log p (see top_p_cut), sorting only the tokens in the bin it falls in.
int32_t Sampler::draw(const float* x, int64_t vocab) {
  const auto& p = params_;
  int64_t best = 0;
  const float m = max_logit(x, vocab, best);
  const float inv_t = 1.f / p.temperature;
  // Higher logit first; equal logits by lower id, so every order is deterministic.
  auto before = [x](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };

  if (p.top_k > 0 && p.top_k < vocab) {
    const int64_t k = p.top_k;
    idx_.clear();
    if (k * 16 < vocab) {
      // A heap whose front is the worst of the best k so far. Ids come in increasing
      // order, so a later token beats the front only with a strictly larger logit.
      idx_.resize(k);
      std::iota(idx_.begin(), idx_.end(), 0);
      std::make_heap(idx_.begin(), idx_.end(), before);
      float worst = x[idx_.front()];
      for (int64_t b = k; b < vocab; b += 16) {
        const int64_t e = std::min(vocab, b + 16);
        int any = 0;  // skip whole blocks with one vectorized test
        for (int64_t i = b; i < e; ++i) any |= x[i] > worst;
        if (!any) continue;
        for (int64_t i = b; i < e; ++i) {
          if (!(x[i] > worst)) continue;
          std::pop_heap(idx_.begin(), idx_.end(), before);
          idx_.back() = static_cast<int32_t>(i);
          std::push_heap(idx_.begin(), idx_.end(), before);
          worst = x[idx_.front()];
        }
      }
      std::sort_heap(idx_.begin(), idx_.end(), before);
    } else {
      idx_.resize(vocab);
      std::iota(idx_.begin(), idx_.end(), 0);
      std::nth_element(idx_.begin(), idx_.begin() + k, idx_.end(), before);
      idx_.resize(k);
      std::sort(idx_.begin(), idx_.end(), before);
    }
    // idx_ is in order, so min-p and top-p each keep a prefix. probs_ is by position here.
    probs_.resize(k);
    int64_t n = 0;
    double mass = 0.0;
    for (; n < k; ++n) {
      const float q = exp_nonpositive((x[idx_[n]] - m) * inv_t);
      if (q < p.min_p) break;  // p_i < min_p * p_max; the unnormalised p_max is exp(0) = 1
      mass += probs_[n] = q;
    }
    if (p.top_p < 1.f) {
      // Keep a token while the mass before it is < top_p of the candidates' mass (vLLM:
      // drop where the ascending cumulative sum <= 1 - top_p); the first always stays.
      const double target = p.top_p * mass;
      double acc = 0.0;
      int64_t cut = 0;
      while (cut < n && acc < target) acc += probs_[cut++];
      n = cut;
      mass = acc;
    }
    const double r = uniform() * mass;
    double acc = 0.0;
    int32_t last = idx_[0];
    for (int64_t j = 0; j < n && probs_[j] > 0.f; ++j) {  // descending: zeros only at the end
      last = idx_[j];
      if (r < (acc += probs_[j])) return last;
    }
    return last;  // r landed in the rounding slack at the very end
  }

  // Whole vocabulary: probs_ becomes the final unnormalised weights, 0 where excluded.
  probs_.resize(vocab);
  float* w = probs_.data();
  fill_exp(x, vocab, m, inv_t, w);
  if (p.min_p > 0.f) {
    const float thr = p.min_p;  // p_i >= min_p * p_max, and the unnormalised p_max is 1
    for (int64_t i = 0; i < vocab; ++i) w[i] = w[i] >= thr ? w[i] : 0.f;
  }
  double mass = sum_weights(w, vocab);
  if (processed_is_raw_ && p.temperature == 1.f && p.min_p == 0.f) {
    full_sum_ = mass;  // the raw log-softmax normaliser comes for free
    full_max_ = m;
  }
  if (p.top_p < 1.f) {
    const int32_t cut = top_p_cut(x, vocab, m, inv_t, p.top_p * mass, mass);
    if (cut >= 0) {
      const float xc = x[cut];
      for (int64_t i = 0; i < vocab; ++i)
        w[i] = x[i] > xc || (x[i] == xc && i < cut) ? w[i] : 0.f;
    }
  }
  // Walk blocks by their (vectorized) sums, then tokens inside the block that holds r.
  constexpr int64_t kBlock = 256;
  const double r = uniform() * mass;
  double acc = 0.0;
  for (int64_t b = 0; b < vocab; b += kBlock) {
    const int64_t e = std::min(vocab, b + kBlock);
    const double s = sum_weights(w + b, e - b);
    if (r < acc + s) {
      for (int64_t i = b; i < e; ++i)
        if (w[i] > 0.f && r < (acc += w[i])) return static_cast<int32_t>(i);
      continue;  // rounding left r just past this block: the next weight takes it
    }
    acc += s;
  }
  for (int64_t i = vocab - 1; i >= 0; --i)  // r landed in the rounding slack at the very end
    if (w[i] > 0.f) return static_cast<int32_t>(i);
  return static_cast<int32_t>(best);
}

// Top-p over the candidates (probs_[i] > 0) without sorting them: bin each by
// z = (max - x) / T = -log of its unnormalised probability (monotone in the order), sum the
// mass per bin, and sort only the bin where the running mass crosses `target`. Returns the
// first token (in order) whose preceding mass is >= target, or -1; `kept` = mass before it.
int32_t Sampler::top_p_cut(const float* x, int64_t vocab, float m, float inv_t, double target,
                           double& kept) {
  constexpr int kBins = 2048;
  const float* w = probs_.data();
  // Mass beyond 40 nats is < 5e-18 of the top token's: one last bin holds all of it.
  const float span = std::min((m - min_logit(x, vocab)) * inv_t, 40.f);
  const float scale = span > 0.f ? (kBins - 1) / span : 0.f;
  bins_.resize(vocab);
  for (int64_t i = 0; i < vocab; ++i) {  // -inf gives inf or NaN (inf * 0): the last bin
    const float b = (m - x[i]) * inv_t * scale;
    bins_[i] = static_cast<uint16_t>(b < kBins - 1 ? b : kBins - 1);
  }
  bin_mass_.assign(kBins, 0.0);
  for (int64_t i = 0; i < vocab; ++i) bin_mass_[bins_[i]] += w[i];
  auto before = [x](int32_t a, int32_t b) { return x[a] > x[b] || (x[a] == x[b] && a < b); };
  double acc = 0.0;
  for (int b = 0; b < kBins; ++b) {
    if (bin_mass_[b] == 0.0) continue;
    if (acc + bin_mass_[b] < target) {
      acc += bin_mass_[b];
      continue;
    }
    idx_.clear();
    for (int64_t i = 0; i < vocab; ++i)
      if (bins_[i] == b && w[i] > 0.f) idx_.push_back(static_cast<int32_t>(i));
    std::sort(idx_.begin(), idx_.end(), before);
    for (int32_t id : idx_) {
      if (acc >= target) {
        kept = acc;
        return id;
      }
      acc += w[id];
    }
    // The whole bin fit (target reached exactly at its end): the next bin's first is the cut.
  }
  kept = acc;
  return -1;
}

void Sampler::fill_logprobs(const float* raw, int64_t vocab, SampleResult& r) {
  double lse;
  if (full_sum_ > 0.0) {
    lse = full_max_ + std::log(full_sum_);
  } else {
    int64_t best = 0;
    const float m = max_logit(raw, vocab, best);
    probs_.resize(vocab);  // free to reuse: the token is drawn already
    fill_exp(raw, vocab, m, 1.f, probs_.data());
    lse = m + std::log(sum_weights(probs_.data(), vocab));
  }
  r.logprob = static_cast<float>(raw[r.token] - lse);
  const int64_t want = std::min<int64_t>(*params_.logprobs, vocab);
  if (want == 0) return;
  // The best `want` ids kept sorted in a small array: O(V log want), no vocab-sized sort.
  auto before = [raw](int32_t a, int32_t b) { return raw[a] > raw[b] || (raw[a] == raw[b] && a < b); };
  std::vector<int32_t> top;
  top.reserve(want + 1);
  for (int64_t i = 0; i < vocab; ++i) {
    const auto id = static_cast<int32_t>(i);
    if (static_cast<int64_t>(top.size()) == want && !before(id, top.back())) continue;
    top.insert(std::upper_bound(top.begin(), top.end(), id, before), id);
    if (static_cast<int64_t>(top.size()) > want) top.pop_back();
  }
  r.top_logprobs.reserve(want);
  for (int32_t id : top) r.top_logprobs.push_back({id, static_cast<float>(raw[id] - lse)});
}

SampleResult Sampler::sample(const float* logits, int64_t vocab,
                             const std::vector<int32_t>& prompt_tokens,
                             const std::vector<int32_t>& output_tokens) {
  TESSERA_CHECK(logits != nullptr && vocab > 0, "sampler: expected logits over a vocabulary of "
                "at least one token, got ", vocab);
  const float* x = process(logits, vocab, prompt_tokens, output_tokens);
  mask_ = nullptr;
  SampleResult r;
  full_sum_ = 0.0;
  if (params_.is_greedy()) {
    int64_t best = 0;
    max_logit(x, vocab, best);
    r.token = static_cast<int32_t>(best);
  } else {
    r.token = draw(x, vocab);
  }
  if (params_.logprobs) fill_logprobs(logits, vocab, r);
  return r;
}

SampleResult Sampler::sample(const Tensor& logits, const std::vector<int32_t>& prompt_tokens,
                             const std::vector<int32_t>& output_tokens) {
  TESSERA_CHECK(logits.dtype() == DType::kF32 && logits.is_contiguous() &&
                    (logits.dim() == 1 || (logits.dim() == 2 && logits.size(0) == 1)),
                "sampler: expected f32 logits (V) or (1, V), got ", logits.describe());
  return sample(logits.data<float>(), logits.numel(), prompt_tokens, output_tokens);
}

// ---- StopChecker ----

StopChecker::StopChecker(std::vector<std::string> stop_strings) : stops_(std::move(stop_strings)) {
  for (size_t i = 0; i < stops_.size(); ++i)
    TESSERA_CHECK(!stops_[i].empty(), "stop: entry ", i, " is an empty string");
}

std::optional<StopChecker::Match> StopChecker::find(std::string_view text, size_t new_from) const {
  std::optional<Match> best;
  for (size_t i = 0; i < stops_.size(); ++i) {
    const std::string& s = stops_[i];
    // A match that includes a byte at or after new_from starts after new_from - |s|.
    const size_t from = new_from >= s.size() ? new_from - s.size() + 1 : 0;
    const size_t pos = text.find(s, from);
    if (pos != std::string_view::npos && (!best || pos < best->pos)) best = Match{pos, i};
  }
  return best;
}

size_t StopChecker::hold_back(std::string_view text) const {
  size_t best = 0;
  for (const std::string& s : stops_) {
    const std::string_view sv(s);
    for (size_t len = std::min(sv.size() - 1, text.size()); len > best; --len)
      if (text.substr(text.size() - len) == sv.substr(0, len)) {
        best = len;
        break;
      }
  }
  return best;
}

StopChecker::Update StopChecker::append(std::string_view piece) {
  Update u;
  if (stopped_) return u;
  const size_t old_size = text_.size();
  text_.append(piece);
  size_t safe;
  if (auto m = find(text_, old_size)) {
    // Held-back bytes were a maximal stop prefix, so a new match never starts in emitted text.
    text_.resize(m->pos);
    stopped_ = u.stopped = true;
    safe = text_.size();
  } else {
    safe = text_.size() - hold_back(text_);
  }
  if (safe > emitted_) {
    u.emit = text_.substr(emitted_, safe - emitted_);
    emitted_ = safe;
  }
  return u;
}

std::string StopChecker::flush() {
  std::string rest = text_.substr(std::min(emitted_, text_.size()));
  emitted_ = text_.size();
  return rest;
}

}  // namespace tessera::infer
