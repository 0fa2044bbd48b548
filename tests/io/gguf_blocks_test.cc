// GGUF block formats against an independent NumPy transcription of llama.cpp's published
// layouts (tests/parity/gguf_blocks_reference.py): F16 / BF16 / Q8_0 / Q4_0 / Q4_K / Q6_K
// dequantize to the same bits, blocks of random bytes included (every code, scale and min
// pattern); quantizing to F16 / BF16 / Q8_0 / Q4_0 / Q4_K gives the bytes ggml's
// quantize_row_*_ref gives; and each quantized type's kernel form holds the same values.
#include "tessera/io/gguf_blocks.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <random>

#include "io_test_util.h"
#include "tessera/kernels/cpu/quant_cpu.h"
#include "tessera/io/safetensors.h"
#include "test_util/run_command.h"

namespace tessera::io {
namespace {

using testing::TempDir;

// Matrices whose rows stress the quantizers: zeros, a constant, all positive, an outlier,
// values small enough for f16 subnormal scales, and plain noise.
std::map<std::string, Tensor> inputs() {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.f, 0.05f);
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  std::map<std::string, Tensor> in;
  Tensor a = Tensor::empty({7, 512}, DType::kF32);
  float* p = a.data<float>();
  for (int64_t r = 0; r < 7; ++r)
    for (int64_t c = 0; c < 512; ++c) {
      float v = normal(rng);
      if (r == 1) v = 0.f;
      if (r == 2) v = 0.3f;
      if (r == 3) v = std::fabs(v);
      if (r == 4 && c % 97 == 7) v = 10.f;
      if (r == 5) v *= 1e-6f;
      if (r == 6 && c >= 256) v = -std::fabs(v);
      p[r * 512 + c] = v;
    }
  in["normal"] = a;
  Tensor b = Tensor::empty({3, 768}, DType::kF32);
  for (int64_t i = 0; i < b.numel(); ++i) b.data<float>()[i] = uniform(rng);
  in["wide"] = b;
  Tensor c = Tensor::empty({4, 96}, DType::kF32);
  for (int64_t i = 0; i < c.numel(); ++i) c.data<float>()[i] = normal(rng) * 3.f;
  in["narrow"] = c;
  return in;
}

// `rows` rows of random blocks of type t, each block's f16 scale fields set to finite
// values (random bytes there would be inf / nan half the time at the top exponent).
std::string random_blocks(GgmlType t, int64_t rows, int64_t cols, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> scale(-0.02f, 0.02f);
  const auto* tr = ggml_type_traits(static_cast<uint32_t>(t));
  std::string b(static_cast<size_t>(rows * cols / tr->block * tr->bytes), '\0');
  for (char& ch : b) ch = static_cast<char>(rng());
  auto put_f16 = [&](size_t at) {
    const uint16_t h = f32_to_f16(scale(rng));
    b[at] = static_cast<char>(h);
    b[at + 1] = static_cast<char>(h >> 8);
  };
  for (size_t blk = 0; blk < b.size(); blk += tr->bytes) {
    if (t == GgmlType::kQ6_K) {
      put_f16(blk + 208);
    } else {
      put_f16(blk);
      if (t == GgmlType::kQ4_K) {
        put_f16(blk + 2);
        if ((blk / tr->bytes) % 3 == 0) {  // sub-block 0: scale 0, min 5 (a constant)
          b[blk + 4] = static_cast<char>(b[blk + 4] & 0xC0);
          b[blk + 8] = static_cast<char>((b[blk + 8] & 0xC0) | 5);
        }
      }
    }
  }
  return b;
}

// w in the int8 group-16 form quant_stack_rows gives it when stacked beside an int8 g16
// part (a fused linear whose q is Q4_K and whose v is Q6_K): w's rows of the stack.
kernels::QuantWeight widened(const kernels::QuantWeight& w) {
  const kernels::QuantWeight g16 =
      kernels::quantize_rtn(Tensor::from_vector(std::vector<float>(static_cast<size_t>(w.in), 0.5f), {1, w.in}),
                            kernels::QuantScheme::kInt8, 16);
  const kernels::QuantWeight stacked = kernels::quant_stack_rows({w, g16}, "test");
  EXPECT_EQ(stacked.scheme, kernels::QuantScheme::kInt8);
  EXPECT_EQ(stacked.group, 16);
  return kernels::quant_rows(stacked, 0, w.out);
}

TEST(GgufBlocks, MatchTheNumPyTranscriptionBitForBit) {
  TempDir dir;
  const auto in = inputs();
  std::vector<std::pair<std::string, Tensor>> in_list(in.begin(), in.end());
  save_safetensors(dir.file("in.safetensors"), in_list);

  // Our quantization of every input to every type, and blocks of random bytes.
  std::vector<GgufTensorSpec> specs;
  std::vector<std::string> bytes;
  const std::pair<const char*, GgmlType> kTypes[] = {{"f32", GgmlType::kF32},   {"f16", GgmlType::kF16},
                                                     {"bf16", GgmlType::kBF16}, {"q8_0", GgmlType::kQ8_0},
                                                     {"q4_0", GgmlType::kQ4_0}, {"q4_k", GgmlType::kQ4_K}};
  for (const auto& [name, x] : in)
    for (const auto& [tn, t] : kTypes) {
      if (x.size(1) % ggml_type_traits(static_cast<uint32_t>(t))->block != 0) continue;
      specs.push_back({name + "." + tn, {x.size(1), x.size(0)}, t});
      bytes.push_back(quantize_rows(t, x.data<float>(), x.size(0), x.size(1), specs.back().name));
    }
  const std::tuple<const char*, GgmlType, int64_t, int64_t> kRandom[] = {
      {"rand.q8_0", GgmlType::kQ8_0, 8, 64}, {"rand.q4_0", GgmlType::kQ4_0, 8, 64},
      {"rand.q4_k", GgmlType::kQ4_K, 6, 512}, {"rand.q6_k", GgmlType::kQ6_K, 6, 512}};
  uint32_t seed = 11;
  for (const auto& [name, t, rows, cols] : kRandom) {
    specs.push_back({name, {cols, rows}, t});
    bytes.push_back(random_blocks(t, rows, cols, seed++));
  }
  const std::string path = dir.file("blocks.gguf");
  write_gguf(path, {}, specs, [&](size_t i) { return bytes[i]; });

  const std::string script = std::string(TESSERA_PYTHON) + " " + TESSERA_SOURCE_DIR + "/tests/parity/gguf_blocks_reference.py ";
  auto r = tessera::testing::run_command(script + "read " + path + " " + dir.file("deq.safetensors") + " " +
                                         dir.file("info.json"));
  ASSERT_EQ(r.code, 0) << r.out;
  r = tessera::testing::run_command(script + "quant " + dir.file("in.safetensors") + " " + dir.file("ref.safetensors"));
  ASSERT_EQ(r.code, 0) << r.out;
  const auto deq = SafetensorsFile::open(dir.file("deq.safetensors"));
  const auto ref = SafetensorsFile::open(dir.file("ref.safetensors"));

  const auto f = GgufFile::open(path);
  int quantized_compared = 0;
  for (size_t i = 0; i < specs.size(); ++i) {
    const GgufTensorInfo& t = *f->tensor(specs[i].name);
    SCOPED_TRACE(t.name);
    const int64_t rows = t.rows(), cols = t.ne[0];
    // Quantized here as quantize_row_*_ref quantizes: the same bytes.
    if (t.type != GgmlType::kF32 && ref->has(t.name)) {
      const Tensor theirs = ref->get(t.name);
      ASSERT_EQ(theirs.nbytes(), bytes[i].size());
      int64_t differ = 0;
      const int64_t block = ggml_type_traits(static_cast<uint32_t>(t.type))->bytes;
      for (size_t at = 0; at < bytes[i].size(); at += block)
        differ += std::memcmp(bytes[i].data() + at, static_cast<const char*>(theirs.raw_data()) + at, block) != 0;
      EXPECT_EQ(differ, 0) << differ << " of " << bytes[i].size() / block << " blocks differ";
      ++quantized_compared;
    }
    // Dequantized here as dequantize_row_* does: the same bits.
    std::vector<float> ours(static_cast<size_t>(rows * cols));
    dequantize_rows(t.type, f->data(t), rows, cols, ours.data(), t.name);
    const Tensor theirs = deq->get(t.name);
    ASSERT_EQ(theirs.shape(), (Shape{rows, cols}));
    EXPECT_EQ(std::memcmp(theirs.raw_data(), ours.data(), ours.size() * 4), 0);
    // The kernels' form holds the same values: exactly, except Q4_K, whose zero point
    // dmin m / (d sc) is rounded once.
    const auto q = gguf_quant_weight(t.type, f->data(t), rows, cols);
    if (!q) continue;
    q->validate(t.name);
    const Tensor w = kernels::dequantize(*q);
    const float* want = theirs.data<float>();
    float range = 0.f;
    for (int64_t k = 0; k < theirs.numel(); ++k) range = std::max(range, std::fabs(want[k]));
    const float tol = t.type == GgmlType::kQ4_K ? 2e-6f * range : 0.f;
    for (int64_t k = 0; k < w.numel(); ++k)
      ASSERT_LE(std::fabs(w.data<float>()[k] - want[k]), tol) << "element " << k;
    // ... and so does its int8 form with finer groups (how differently stored parts of a
    // fused linear are stacked).
    const Tensor wide = kernels::dequantize(widened(*q));
    EXPECT_EQ(std::memcmp(wide.raw_data(), w.raw_data(), w.nbytes()), 0);
  }
  EXPECT_EQ(quantized_compared, 14);  // f16, bf16, q8_0, q4_0 of 3 inputs, q4_k of 2
}

// Q4_K's real-valued zero points and Q6_K's int8 groups of 16 (Tessera's own quantizers
// make neither) through every product path and row-kernel level this CPU runs, against the
// product of the dequantized values in double. The GEMV may quantize x to int8 per run of
// 32 columns (half a step of max |x| per weight), the GEMM may multiply in bf16 (2^-7
// relative per product): the bound allows both and nothing more.
TEST(GgufBlocks, KernelFormsMultiplyAsTheirValues) {
  std::vector<kernels::cpu::QuantIsa> isas = {kernels::cpu::QuantIsa::kScalar};
  for (auto isa : {kernels::cpu::QuantIsa::kAvx2, kernels::cpu::QuantIsa::kAvx512, kernels::cpu::QuantIsa::kAvx512Vnni})
    if (isa <= kernels::cpu::best_quant_isa()) isas.push_back(isa);
  const int64_t out = 13, cols = 512;
  uint32_t seed = 40;
  for (GgmlType t : {GgmlType::kQ4_K, GgmlType::kQ6_K, GgmlType::kQ8_0, GgmlType::kQ4_0}) {
    SCOPED_TRACE(ggml_type_name(t));
    const std::string b = random_blocks(t, out, cols, seed++);
    const auto q = gguf_quant_weight(t, reinterpret_cast<const uint8_t*>(b.data()), out, cols);
    ASSERT_TRUE(q.has_value());
    for (const kernels::QuantWeight& w : {*q, widened(*q)}) {
      std::vector<float> wd(static_cast<size_t>(out * cols));
      dequantize_rows(t, reinterpret_cast<const uint8_t*>(b.data()), out, cols, wd.data(), "w");
      for (int64_t M : {1, 3, 9}) {
        std::mt19937 rng(seed++);
        std::normal_distribution<float> n(0.f, 1.f);
        Tensor x = Tensor::empty({M, cols}, DType::kF32);
        for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = n(rng);
        for (auto isa : isas) {
          kernels::cpu::force_quant_isa_for_testing(isa);
          for (auto path : {kernels::QuantPath::kGemv, kernels::QuantPath::kGemm, kernels::QuantPath::kReference}) {
            Tensor y = Tensor::empty({M, out}, DType::kF32);
            kernels::quant_matmul_with(path, x, w, y);
            for (int64_t m = 0; m < M; ++m) {
              const float* xr = x.data<float>() + m * cols;
              float xmax = 0;
              for (int64_t k = 0; k < cols; ++k) xmax = std::max(xmax, std::fabs(xr[k]));
              for (int64_t o = 0; o < out; ++o) {
                double dot = 0, absdot = 0, wsum = 0;
                for (int64_t k = 0; k < cols; ++k) {
                  dot += static_cast<double>(xr[k]) * wd[o * cols + k];
                  absdot += std::fabs(static_cast<double>(xr[k]) * wd[o * cols + k]);
                  wsum += std::fabs(wd[o * cols + k]);
                }
                const double tol = 1e-5 * absdot + (path == kernels::QuantPath::kGemv ? xmax / 254.0 * wsum : 0.0) +
                                   (path == kernels::QuantPath::kGemm ? absdot / 128.0 : 0.0);
                ASSERT_NEAR(y.data<float>()[m * out + o], dot, tol)
                    << kernels::quant_scheme_name(w.scheme) << " g" << w.group << " isa " << static_cast<int>(isa)
                    << " path " << static_cast<int>(path) << " at " << m << "," << o;
              }
            }
          }
        }
        kernels::cpu::force_quant_isa_for_testing(std::nullopt);
      }
    }
  }
}

TEST(GgufBlocks, RejectWhatTheyCannotHold) {
  const float nan_row[32] = {std::nanf("")};
  EXPECT_NE(testing::error_of([&] { quantize_rows(GgmlType::kQ8_0, nan_row, 1, 32, "w"); }).find("w: value 0 is nan"),
            std::string::npos);
  EXPECT_NE(testing::error_of([&] { quantize_rows(GgmlType::kQ4_K, nan_row, 1, 32, "w"); })
                .find("w: row length 32 is not a multiple of Q4_K's block of 256"),
            std::string::npos);
  EXPECT_NE(testing::error_of([&] { quantize_rows(GgmlType::kQ6_K, nan_row, 1, 256, "w"); }).find("cannot be written"),
            std::string::npos);
  const uint8_t raw[64] = {};
  float out[64];
  EXPECT_NE(testing::error_of([&] { dequantize_rows(GgmlType::kQ5_K, raw, 1, 256, out, "w"); })
                .find("w: ggml type Q5_K cannot be read"),
            std::string::npos);
  EXPECT_FALSE(gguf_quant_weight(GgmlType::kF16, raw, 1, 32).has_value());
}

}  // namespace
}  // namespace tessera::io
