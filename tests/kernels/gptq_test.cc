// GPTQ against a NumPy transcription of the published algorithm (tests/parity/
// gptq_reference.py, AutoGPTQ's fasterquant in float64): the same codes, scales and zero
// points, with groups, act-order, symmetric and dead inputs; and the layer's output error
// on its calibration rows, ||X W^T - X Q^T||, below round-to-nearest's at the same bits.
#include "tessera/kernels/gptq.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <random>

#include <nlohmann/json.hpp>

#include "io/io_test_util.h"
#include "tessera/base/error.h"
#include "tessera/io/safetensors.h"
#include "test_util/run_command.h"

namespace tessera::kernels {
namespace {

struct Case {
  std::string name;
  int bits;
  int64_t group;
  bool sym, act_order;
  int64_t out, in, block;
  bool dead_input;
};

// Calibration rows with correlated integer features (so H is far from diagonal and its
// sums are exact in f32): each feature is a shared latent factor times a small weight plus
// noise, all small integers.
Tensor calibration(int64_t n, int64_t in, uint32_t seed, bool dead_input) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> latent(-3, 3), noise(-1, 1), mult(1, 3);
  std::vector<int> m(in);
  for (auto& v : m) v = mult(rng);
  std::vector<float> x(n * in);
  for (int64_t r = 0; r < n; ++r) {
    int f[8];
    for (int& v : f) v = latent(rng);
    for (int64_t j = 0; j < in; ++j) x[r * in + j] = static_cast<float>(f[j % 8] * m[j] + noise(rng));
  }
  if (dead_input)
    for (int64_t r = 0; r < n; ++r) x[r * in + 5] = 0.f;  // never seen: H_55 = 0
  return Tensor::from_vector(x, {n, in});
}

std::vector<double> gram(const Tensor& x) {
  const int64_t n = x.size(0), in = x.size(1);
  std::vector<double> h(in * in, 0.0);
  const float* p = x.data<float>();
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i < in; ++i)
      for (int64_t j = 0; j < in; ++j) h[i * in + j] += double{p[r * in + i]} * p[r * in + j];
  return h;
}

// ||X W^T - X Q^T||_F over the calibration rows.
double output_error(const Tensor& x, const Tensor& w, const Tensor& q) {
  const int64_t n = x.size(0), in = x.size(1), out = w.size(0);
  double e = 0;
  for (int64_t r = 0; r < n; ++r)
    for (int64_t o = 0; o < out; ++o) {
      double d = 0;
      for (int64_t j = 0; j < in; ++j)
        d += double{x.data<float>()[r * in + j]} * (w.data<float>()[o * in + j] - q.data<float>()[o * in + j]);
      e += d * d;
    }
  return std::sqrt(e);
}

// The stored codes of a QuantWeight as integers (int4 unpacked), stored column order.
std::vector<int32_t> codes_of(const QuantWeight& q) {
  std::vector<int32_t> c(q.out * q.in);
  for (int64_t o = 0; o < q.out; ++o)
    for (int64_t j = 0; j < q.in; ++j) {
      if (q.scheme == QuantScheme::kInt4) {
        const uint8_t b = q.q.data<uint8_t>()[o * (q.in / 2) + (j / 32) * 16 + (j % 32) % 16];
        c[o * q.in + j] = (j % 32) < 16 ? (b & 0xF) : (b >> 4);
      } else {
        c[o * q.in + j] = q.q.data<uint8_t>()[o * q.in + j];
      }
    }
  return c;
}

TEST(Gptq, MatchesTheNumpyTranscriptionAndBeatsRoundToNearest) {
  const std::vector<Case> cases = {
      {"int4_g32", 4, 32, false, false, 24, 256, 64, false},
      {"int4_g64_act_order", 4, 64, false, true, 24, 256, 128, false},
      {"int4_g128_block32_dead", 4, 128, false, false, 17, 256, 32, true},
      {"int8_channel_sym", 8, 0, true, false, 16, 192, 64, false},
      {"int8_g64_act_order", 8, 64, false, true, 16, 192, 48, false},
  };
  io::testing::TempDir dir;
  std::vector<std::pair<std::string, Tensor>> in;
  std::map<std::string, std::string> meta;
  std::map<std::string, QuantWeight> ours;
  std::map<std::string, Tensor> weights, xs;
  uint32_t seed = 3;
  for (const Case& c : cases) {
    std::mt19937 rng(seed++);
    std::normal_distribution<float> nd(0.f, 0.02f);
    std::vector<float> wv(c.out * c.in);
    for (float& v : wv) v = nd(rng);
    const Tensor w = Tensor::from_vector(wv, {c.out, c.in});
    const Tensor x = calibration(384, c.in, seed++, c.dead_input);
    const std::vector<double> h = gram(x);
    std::vector<float> hf(h.begin(), h.end());  // integers below 2^24: exact
    GptqOptions o;
    o.group = c.group, o.symmetric = c.sym, o.act_order = c.act_order, o.block = c.block;
    const QuantScheme s = c.bits == 4 ? QuantScheme::kInt4 : QuantScheme::kInt8;
    ours[c.name] = quantize_gptq(w, h, s, o);
    weights[c.name] = w;
    xs[c.name] = x;
    in.emplace_back(c.name + ".W", w);
    in.emplace_back(c.name + ".H", Tensor::from_vector(hf, {c.in, c.in}));
    meta["case:" + c.name] = nlohmann::json{{"bits", c.bits}, {"group", c.group > 0 ? c.group : c.in},
                                            {"sym", c.sym}, {"act_order", c.act_order},
                                            {"percdamp", 0.01}, {"block", c.block}}.dump();
  }
  io::save_safetensors(dir.file("in.safetensors"), in, meta);
  const auto r = tessera::testing::run_command(std::string(TESSERA_PYTHON) + " " + TESSERA_SOURCE_DIR +
                                               "/tests/parity/gptq_reference.py " + dir.file("in.safetensors") +
                                               " " + dir.file("out.safetensors"));
  ASSERT_EQ(r.code, 0) << r.out;
  const auto ref = io::SafetensorsFile::open(dir.file("out.safetensors"));
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const QuantWeight& q = ours.at(c.name);
    // Act-order: the same column order.
    const Tensor perm = ref->get(c.name + ".perm");
    for (int64_t j = 0; j < c.in; ++j) {
      const int32_t want = perm.data<int32_t>()[j];
      ASSERT_EQ(q.perm.defined() ? q.perm.data<int32_t>()[j] : static_cast<int32_t>(j), want) << j;
    }
    // The same group parameters and codes (float64 on both sides; a code may differ only
    // where the two sides' last-bit differences meet a rounding tie).
    const Tensor sc = ref->get(c.name + ".scales"), zc = ref->get(c.name + ".zeros");
    ASSERT_EQ(sc.numel(), q.scales.numel());
    for (int64_t i = 0; i < sc.numel(); ++i) {
      ASSERT_NEAR(q.scales.data<float>()[i], sc.data<float>()[i], 1e-6f * std::fabs(sc.data<float>()[i])) << i;
      ASSERT_EQ(q.zeros.data<float>()[i], zc.data<float>()[i]) << i;
    }
    const Tensor rc = ref->get(c.name + ".codes");
    const std::vector<int32_t> mine = codes_of(q);
    int64_t differ = 0;
    for (int64_t i = 0; i < c.out * c.in; ++i) {
      const int32_t a = mine[i], b = rc.data<int32_t>()[i];
      ASSERT_LE(std::abs(a - b), 1) << i;
      differ += a != b;
    }
    EXPECT_LE(differ, c.out * c.in / 1000) << differ << " codes differ";
    // Better than round-to-nearest on the calibration rows, at the same bits and groups.
    const QuantScheme s = c.bits == 4 ? QuantScheme::kInt4 : QuantScheme::kInt8;
    const QuantWeight rtn = quantize_rtn(weights.at(c.name), s, c.group, c.sym);
    const double e_gptq = output_error(xs.at(c.name), weights.at(c.name), dequantize(q));
    const double e_rtn = output_error(xs.at(c.name), weights.at(c.name), dequantize(rtn));
    std::printf("%-24s ||XW - XQ||: gptq %.4f, rtn %.4f (%.2fx)\n", c.name.c_str(), e_gptq, e_rtn, e_rtn / e_gptq);
    EXPECT_LT(e_gptq, 0.9 * e_rtn);
  }
}

TEST(Gptq, BadArgumentsAreOneLine) {
  const Tensor w = Tensor::zeros({4, 64}, DType::kF32);
  std::vector<double> h(64 * 64, 0.0);
  for (int i = 0; i < 64; ++i) h[i * 64 + i] = 1.0;
  for (const auto& [what, fn] : std::vector<std::pair<std::string, std::function<void()>>>{
           {"is not int8 or int4", [&] { quantize_gptq(w, h, QuantScheme::kFp8); }},
           {"values, not 64 x 64", [&] { quantize_gptq(w, std::vector<double>(10), QuantScheme::kInt4); }},
           {"does not divide", [&] { GptqOptions o; o.group = 48; quantize_gptq(w, h, QuantScheme::kInt8, o); }},
           {"percdamp", [&] { GptqOptions o; o.percdamp = 0; quantize_gptq(w, h, QuantScheme::kInt4, o); }}}) {
    try {
      fn();
      ADD_FAILURE() << what;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
    }
  }
}

}  // namespace
}  // namespace tessera::kernels
