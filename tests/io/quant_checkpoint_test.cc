// AutoGPTQ / AutoAWQ checkpoint tensors: bit-identical to a NumPy transcription of the
// projects' own pack code (tests/parity/quant_pack_reference.py), dequantized there as
// their kernels do to kernels::dequantize's values, exact round trips, one-line errors
// naming the module for malformed tensors, and config.json's quantization_config.
#include "tessera/io/quant_checkpoint.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <numeric>
#include <random>

#include <nlohmann/json.hpp>

#include "io_test_util.h"
#include "tessera/io/safetensors.h"
#include "test_util/run_command.h"

namespace tessera::io {
namespace {

using kernels::QuantScheme;
using kernels::QuantWeight;
using testing::error_of;
using testing::TempDir;
using Named = std::vector<std::pair<std::string, Tensor>>;

const std::string kModule = "DIR: model.layers.0.mlp.down_proj";

struct Case {
  std::string method = "gptq";
  int bits = 4;
  int64_t group_size = 128;
  int version = 1;
  bool desc_act = false;

  std::string name() const {
    return method + (method == "gptq" ? "_v" + std::to_string(version) : "") + "_b" +
           std::to_string(bits) + "_g" + (group_size < 0 ? "all" : std::to_string(group_size)) +
           (desc_act ? "_act" : "");
  }
  QuantCheckpointFormat format() const {
    QuantCheckpointFormat f;
    f.method = method, f.bits = bits, f.group_size = group_size, f.gptq_version = version;
    f.desc_act = desc_act, f.sym = false;
    return f;
  }
  // The zero points the format can hold: v1 stores z - 1, v2 and awq z, in `bits` bits.
  int zlo() const { return method == "gptq" && version == 1 ? 1 : 0; }
  int zhi() const { return (1 << bits) - 1 + zlo(); }
};

std::vector<Case> gptq_cases() {
  std::vector<Case> cs;
  for (int version : {1, 2})
    for (int bits : {4, 8})
      for (int64_t g : {32, 128, -1})
        for (bool act : {false, true}) cs.push_back({"gptq", bits, g, version, act});
  return cs;
}

// A weight with random codes, f16-exact scales and zero points in [zlo, zhi]; with
// act_order, perm = the stable sort of a shuffled g_idx (each group exactly `group` columns).
QuantWeight random_weight(int bits, int64_t out, int64_t in, int64_t group, int zlo, int zhi,
                          bool act_order, uint64_t seed) {
  std::mt19937_64 rng(seed);
  QuantWeight w;
  w.scheme = bits == 4 ? QuantScheme::kInt4 : QuantScheme::kInt8;
  w.out = out, w.in = in, w.group = group;
  const int64_t G = in / group;
  w.q = Tensor::zeros(bits == 4 ? Shape{out, in / 2} : Shape{out, in}, DType::kU8);
  uint8_t* q = w.q.data<uint8_t>();
  for (int64_t o = 0; o < out; ++o)
    for (int64_t j = 0; j < in; ++j) {
      const uint8_t c = static_cast<uint8_t>(rng() % (1u << bits));
      if (bits == 8) {
        q[o * in + j] = c;
      } else {  // the header's layout: byte j of a 32-run holds w[j] low, w[j + 16] high
        uint8_t& b = q[o * (in / 2) + (j / 32) * 16 + j % 16];
        b |= (j % 32) < 16 ? c : static_cast<uint8_t>(c << 4);
      }
    }
  w.scales = Tensor::empty({out, G}, DType::kF32);
  w.zeros = Tensor::empty({out, G}, DType::kF32);
  std::uniform_real_distribution<float> sd(1e-3f, 3e-2f);
  for (int64_t i = 0; i < out * G; ++i) {
    w.scales.data<float>()[i] = f16_to_f32(f32_to_f16(sd(rng)));
    w.zeros.data<float>()[i] = static_cast<float>(zlo + static_cast<int>(rng() % (zhi - zlo + 1)));
  }
  if (act_order) {
    std::vector<int32_t> g_idx(in), perm(in);
    for (int64_t k = 0; k < in; ++k) g_idx[k] = static_cast<int32_t>(k / group);
    std::shuffle(g_idx.begin(), g_idx.end(), rng);
    std::iota(perm.begin(), perm.end(), 0);
    std::stable_sort(perm.begin(), perm.end(), [&](int32_t a, int32_t b) { return g_idx[a] < g_idx[b]; });
    // One group sorts to the identity, which a checkpoint reads back as no perm at all.
    if (G > 1) w.perm = Tensor::from_vector(perm, {in});
  }
  w.validate("random_weight");
  return w;
}

QuantWeight weight_for(const Case& c, uint64_t seed, int64_t out = 64, int64_t in = 256) {
  return random_weight(c.bits, out, in, c.group_size < 0 ? in : c.group_size, c.zlo(), c.zhi(),
                       c.desc_act, seed);
}

::testing::AssertionResult same_bytes(const Tensor& a, const Tensor& b) {
  if (a.defined() != b.defined())
    return ::testing::AssertionFailure() << (a.defined() ? "second" : "first") << " is undefined";
  if (!a.defined()) return ::testing::AssertionSuccess();
  if (a.dtype() != b.dtype() || a.shape() != b.shape())
    return ::testing::AssertionFailure() << a.describe() << " vs " << b.describe();
  const Tensor ca = a.contiguous(), cb = b.contiguous();
  const auto* pa = static_cast<const uint8_t*>(ca.raw_data());
  const auto* pb = static_cast<const uint8_t*>(cb.raw_data());
  for (size_t i = 0; i < ca.nbytes(); ++i)
    if (pa[i] != pb[i]) return ::testing::AssertionFailure() << "byte " << i << " differs";
  return ::testing::AssertionSuccess();
}

void expect_same_weight(const QuantWeight& a, const QuantWeight& b, const std::string& what) {
  EXPECT_EQ(a.scheme, b.scheme) << what;
  EXPECT_EQ(a.out, b.out) << what;
  EXPECT_EQ(a.in, b.in) << what;
  EXPECT_EQ(a.group, b.group) << what;
  EXPECT_TRUE(same_bytes(a.q, b.q)) << what << ": q";
  EXPECT_TRUE(same_bytes(a.scales, b.scales)) << what << ": scales";
  EXPECT_TRUE(same_bytes(a.zeros, b.zeros)) << what << ": zeros";
  EXPECT_TRUE(same_bytes(a.perm, b.perm)) << what << ": perm";
}

std::function<Tensor(const std::string&)> getter(const Named& tensors, const std::string& module) {
  return [tensors, module](const std::string& suffix) {
    for (const auto& [n, t] : tensors)
      if (n == suffix) return t;
    fail(module, ".", suffix, ": missing from the checkpoint");
  };
}

Tensor find(const Named& ts, const std::string& name) {
  for (const auto& [n, t] : ts)
    if (n == name) return t;
  fail("no tensor ", name);
}

// f32 (out, in) -> the f16 values a kernel computing in half would produce, as f16 bits.
Tensor f16_of(const Tensor& t) { return t.to(DType::kF16); }

// ---- against the Python transcription --------------------------------------------------

TEST(QuantCheckpoint, PackAndDequantizeMatchAutoGptqAndAutoAwqTranscriptions) {
  TempDir dir;
  std::vector<Case> cases = gptq_cases();
  for (int64_t g : {32, 128}) cases.push_back({"awq", 4, g, 1, false});
  Named in;
  std::map<std::string, std::string> meta;
  std::map<std::string, QuantWeight> weights;
  std::map<std::string, Named> ours;
  uint64_t seed = 1;
  for (const Case& c : cases) {
    const std::string n = c.name();
    QuantWeight w = weight_for(c, seed++);
    in.emplace_back(n + ".W", kernels::dequantize(w));
    in.emplace_back(n + ".scales", w.scales);
    in.emplace_back(n + ".zeros", w.zeros);
    std::vector<int32_t> id(w.in);
    std::iota(id.begin(), id.end(), 0);
    in.emplace_back(n + ".perm", w.perm.defined() ? w.perm : Tensor::from_vector(id, {w.in}));
    ours[n] = pack_quant_linear(w, c.format());
    for (const auto& [suffix, t] : ours[n]) in.emplace_back(n + ".ours." + suffix, t);
    meta["case:" + n] = nlohmann::json{{"method", c.method}, {"bits", c.bits},
                                       {"group_size", c.group_size}, {"version", c.version}}.dump();
    weights[n] = std::move(w);
  }
  save_safetensors(dir.file("in.safetensors"), in, meta);
  const auto r = tessera::testing::run_command(std::string(TESSERA_PYTHON) + " " + TESSERA_SOURCE_DIR +
                                               "/tests/parity/quant_pack_reference.py " +
                                               dir.file("in.safetensors") + " " + dir.file("out.safetensors"));
  ASSERT_EQ(r.code, 0) << r.out;
  const auto ref = SafetensorsFile::open(dir.file("out.safetensors"));

  for (const Case& c : cases) {
    const std::string n = c.name();
    SCOPED_TRACE(n);
    const QuantWeight& w = weights[n];
    const Tensor W = kernels::dequantize(w);
    // The same integers packed by the projects' code: the same bits.
    for (const std::string& suffix : quant_linear_suffixes(c.format()))
      EXPECT_TRUE(same_bytes(ref->get(n + "." + suffix), find(ours[n], suffix))) << suffix;
    // Our tensors dequantized as their kernels do: our values (f32 arithmetic exactly;
    // half arithmetic = our exact product rounded once to f16).
    EXPECT_TRUE(same_bytes(ref->get(n + ".deq_f32"), W));
    EXPECT_TRUE(same_bytes(ref->get(n + ".deq_f16"), f16_of(W)));
    if (c.method == "gptq" && c.bits == 4) {
      std::vector<int32_t> id(w.in);
      std::iota(id.begin(), id.end(), 0);
      EXPECT_TRUE(same_bytes(ref->get(n + ".exllama_x_map"), w.perm.defined() ? w.perm : Tensor::from_vector(id, {w.in})));
      EXPECT_TRUE(same_bytes(ref->get(n + ".exllama_deq"), f16_of(W)));
    }
    // Their packing read back here: the weight we started from.
    Named theirs;
    for (const std::string& suffix : quant_linear_suffixes(c.format()))
      theirs.emplace_back(suffix, ref->get(n + "." + suffix));
    expect_same_weight(unpack_quant_linear(getter(theirs, kModule), w.out, w.in, c.format(), kModule), w, n);
  }
}

// ---- round trips -----------------------------------------------------------------------

TEST(QuantCheckpoint, PackUnpackRoundTripsExactly) {
  std::vector<Case> cases = gptq_cases();
  for (int64_t g : {32, 64, 128}) cases.push_back({"awq", 4, g, 1, false});
  uint64_t seed = 100;
  for (const Case& c : cases)
    for (auto [out, in] : {std::pair<int64_t, int64_t>{64, 256}, {8, 384}, {24, 128}}) {
      if (c.group_size > 0 && in % c.group_size != 0) continue;
      const QuantWeight w = weight_for(c, seed++, out, in);
      const Named t = pack_quant_linear(w, c.format());
      expect_same_weight(unpack_quant_linear(getter(t, kModule), out, in, c.format(), kModule), w,
                         c.name() + " " + std::to_string(out) + "x" + std::to_string(in));
    }
}

TEST(QuantCheckpoint, RoundTripThroughASafetensorsFile) {
  TempDir dir;
  const Case c{"gptq", 4, 32, 1, true};
  const QuantWeight w = weight_for(c, 7);
  Named file;
  for (auto& [suffix, t] : pack_quant_linear(w, c.format())) file.emplace_back("m." + suffix, t);
  save_safetensors(dir.file("model.safetensors"), file);
  const auto st = SafetensorsFile::open(dir.file("model.safetensors"));
  EXPECT_EQ(st->info("m.qweight").dtype, DType::kI32);
  EXPECT_EQ(st->info("m.scales").dtype, DType::kF16);
  const auto get = [&](const std::string& s) { return st->get("m." + s); };
  expect_same_weight(unpack_quant_linear(get, w.out, w.in, c.format(), "m"), w, "file");
}

TEST(QuantCheckpoint, ActOrderWithinAGroupIsNormalisedAndIdentityDropped) {
  // GPTQ's act-order visits a group's columns in activation order, not index order: the
  // checkpoint cannot say which, so reading gives the sorted order and the same W.
  const Case c{"gptq", 8, 32, 2, true};
  QuantWeight w = weight_for(c, 11, 16, 128);
  std::vector<int32_t> perm(w.in);
  std::memcpy(perm.data(), w.perm.data<int32_t>(), perm.size() * 4);
  std::reverse(perm.begin(), perm.begin() + 32);  // reverse the columns of stored group 0
  w.perm = Tensor::from_vector(perm, {w.in});
  const QuantWeight back = unpack_quant_linear(getter(pack_quant_linear(w, c.format()), "m"), w.out, w.in,
                                               c.format(), "m");
  EXPECT_TRUE(same_bytes(kernels::dequantize(back), kernels::dequantize(w)));
  EXPECT_FALSE(same_bytes(back.perm, w.perm));
  // desc_act with an identity order (or no perm at all) reads back without a perm.
  QuantWeight plain = weight_for({"gptq", 4, 64, 1, false}, 12, 16, 128);
  Case act{"gptq", 4, 64, 1, true};
  const QuantWeight b2 = unpack_quant_linear(getter(pack_quant_linear(plain, act.format()), "m"), 16, 128,
                                             act.format(), "m");
  EXPECT_FALSE(b2.perm.defined());
  expect_same_weight(b2, plain, "identity");
}

TEST(QuantCheckpoint, SymmetricQuantizationStoresTheAutoGptqConstant) {
  // RTN's symmetric int8 / int4 zero points are 2^(bits-1): v1 stores 0x77777777 / 0x7f7f7f7f.
  Tensor x = Tensor::empty({32, 64}, DType::kF32);
  std::mt19937 rng(3);
  std::normal_distribution<float> nd;
  for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = nd(rng);
  for (int bits : {4, 8}) {
    auto w = kernels::quantize_rtn(x, bits == 4 ? QuantScheme::kInt4 : QuantScheme::kInt8, 32, true, true);
    QuantCheckpointFormat f;
    f.bits = bits, f.group_size = 32, f.sym = true;
    const Named t = pack_quant_linear(w, f);
    const Tensor qz = find(t, "qzeros");
    for (int64_t i = 0; i < qz.numel(); ++i)
      ASSERT_EQ(static_cast<uint32_t>(qz.data<int32_t>()[i]), bits == 4 ? 0x77777777u : 0x7f7f7f7fu);
    expect_same_weight(unpack_quant_linear(getter(t, "m"), 32, 64, f, "m"), w, "sym");
  }
}

// ---- malformed tensors -----------------------------------------------------------------

Named replaced(Named t, const std::string& suffix, const Tensor& with) {
  for (auto& [n, v] : t)
    if (n == suffix) v = with;
  return t;
}

Tensor i32_tensor(const Shape& s, int32_t fill = 0) {
  Tensor t = Tensor::empty(s, DType::kI32);
  std::fill(t.data<int32_t>(), t.data<int32_t>() + t.numel(), fill);
  return t;
}

void expect_module_error(const Named& t, int64_t out, int64_t in, const QuantCheckpointFormat& f,
                         const std::string& needle) {
  const std::string e = error_of([&] { unpack_quant_linear(getter(t, kModule), out, in, f, kModule); });
  EXPECT_NE(e.find(kModule), std::string::npos) << e;
  EXPECT_NE(e.find(needle), std::string::npos) << "wanted '" << needle << "' in: " << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
}

TEST(QuantCheckpoint, MalformedGptqTensorsAreOneLineErrorsNamingTheModule) {
  const Case c{"gptq", 4, 32, 1, true};
  const auto f = c.format();
  const QuantWeight w = weight_for(c, 21, 64, 128);
  const Named good = pack_quant_linear(w, f);
  expect_module_error(replaced(good, "qweight", Tensor::zeros({16, 64}, DType::kF32)), 64, 128, f,
                      ".qweight: is f32(16, 64), expected i32(16, 64)");
  expect_module_error(replaced(good, "qweight", i32_tensor({16, 32})), 64, 128, f, ".qweight: is i32(16, 32)");
  expect_module_error(replaced(good, "qzeros", i32_tensor({4, 16})), 64, 128, f, ".qzeros: is i32(4, 16)");
  expect_module_error(replaced(good, "scales", find(good, "scales").to(DType::kF32).view({64, 4})), 64, 128,
                      f, ".scales: is f32(64, 4)");
  expect_module_error(replaced(good, "scales", i32_tensor({4, 64})), 64, 128, f, ".scales: is i32(4, 64)");
  expect_module_error(replaced(good, "g_idx", i32_tensor({64})), 64, 128, f, ".g_idx: is i32(64,), expected i32(128,)");
  expect_module_error(replaced(good, "g_idx", i32_tensor({128}, 4)), 64, 128, f, ".g_idx: entry 0 = 4");
  expect_module_error(replaced(good, "g_idx", i32_tensor({128}, 1)), 64, 128, f,
                      ".g_idx: group 0 has 0 columns, expected group_size 32");
  expect_module_error(Named{}, 64, 128, f, ".qweight: missing");
  Tensor inf_scales = find(good, "scales").clone();
  inf_scales.data<f16>()[5].bits = 0x7C00;
  expect_module_error(replaced(good, "scales", inf_scales), 64, 128, f, ".scales: value inf");
  // Without desc_act, g_idx must be k / group_size.
  auto plain = f;
  plain.desc_act = false;
  expect_module_error(good, 64, 128, plain, "(desc_act is false)");
  // sym: the zero points must be the symmetric constant.
  auto sym = f;
  sym.sym = true;
  expect_module_error(good, 64, 128, sym, ".qzeros: zero point");
  // Shapes the layout cannot have.
  expect_module_error(good, 60, 128, f, "60 output features");
  auto g48 = f;
  g48.group_size = 48;
  expect_module_error(good, 64, 96, g48, "4-bit groups of 48");
  auto g100 = f;
  g100.group_size = 100;
  expect_module_error(good, 64, 128, g100, "group_size 100 does not divide the 128 input features");
  auto b8 = f;
  b8.bits = 8, b8.group_size = -1;
  expect_module_error(good, 64, 6, b8, "6 input features do not fill whole int32 rows");
}

TEST(QuantCheckpoint, MalformedAwqTensorsAreOneLineErrorsNamingTheModule) {
  const Case c{"awq", 4, 64, 1, false};
  const auto f = c.format();
  const Named good = pack_quant_linear(weight_for(c, 22, 32, 128), f);
  expect_module_error(replaced(good, "qweight", i32_tensor({16, 32})), 32, 128, f,
                      ".qweight: is i32(16, 32), expected i32(128, 4)");
  expect_module_error(replaced(good, "qzeros", i32_tensor({2, 32})), 32, 128, f, ".qzeros: is i32(2, 32)");
  expect_module_error(replaced(good, "scales", i32_tensor({2, 32})), 32, 128, f, ".scales: is i32(2, 32)");
  expect_module_error(good, 36, 128, f, "36 output features");
}

TEST(QuantCheckpoint, PackRefusesWhatTheFormatCannotHold) {
  const auto pack_error = [](const QuantWeight& w, const QuantCheckpointFormat& f) {
    return error_of([&] { pack_quant_linear(w, f); });
  };
  const Case v1{"gptq", 4, 32, 1, false};
  QuantWeight w = weight_for(v1, 31, 16, 64);
  w.zeros.data<float>()[3] = 0.f;  // v1 stores z - 1: 0 would read back as 16
  EXPECT_NE(pack_error(w, v1.format()).find("use checkpoint_format gptq_v2"), std::string::npos);
  const Case v2{"gptq", 4, 32, 2, false};
  w.zeros.data<float>()[3] = 16.f;
  EXPECT_NE(pack_error(w, v2.format()).find("zero point 16 of (output 1, group 1)"), std::string::npos);
  const Case awq{"awq", 4, 32, 1, false};
  EXPECT_NE(pack_error(w, awq.format()).find("zero point 16"), std::string::npos);
  w.zeros.data<float>()[3] = 2.5f;  // a GGUF Q4_K zero point: no integer to store
  EXPECT_NE(pack_error(w, v2.format()).find("zero point 2.5 of (output 1, group 1) is not an integer"),
            std::string::npos);
  const QuantWeight ok = weight_for(v1, 32, 16, 64);
  auto f8 = v1.format();
  f8.bits = 8;
  EXPECT_NE(pack_error(ok, f8).find("cannot be stored as 8-bit gptq"), std::string::npos);
  auto g64 = v1.format();
  g64.group_size = 64;
  EXPECT_NE(pack_error(ok, g64).find("group size 32 is not the format's group_size 64"), std::string::npos);
  auto sym = v1.format();
  sym.sym = true;
  EXPECT_NE(pack_error(ok, sym).find("though sym is true"), std::string::npos);
  const QuantWeight act = weight_for({"gptq", 4, 32, 1, true}, 33, 16, 64);
  EXPECT_NE(pack_error(act, v1.format()).find("needs desc_act"), std::string::npos);
  auto fp8 = kernels::quantize_rtn(kernels::dequantize(ok), QuantScheme::kFp8, 32);
  EXPECT_NE(pack_error(fp8, v1.format()).find("fp8 weights have no gptq layout"), std::string::npos);
  auto bad = v1.format();
  bad.method = "exl2";
  EXPECT_NE(pack_error(ok, bad).find("'exl2' is not supported"), std::string::npos);
}

// ---- quantization_config ---------------------------------------------------------------

nlohmann::json parse(const std::string& text) { return nlohmann::json::parse(text); }

TEST(QuantizationConfig, ReadsWhatAutoGptqAndAutoAwqWrite) {
  // As AutoGPTQ 0.7's BaseQuantizeConfig.to_dict writes it into config.json.
  const auto g = parse_quantization_config(parse(R"({"bits": 4, "group_size": 128, "damp_percent": 0.01,
      "desc_act": true, "static_groups": false, "sym": true, "true_sequential": true,
      "model_name_or_path": null, "model_file_base_name": null, "quant_method": "gptq",
      "checkpoint_format": "gptq", "meta": {"quantizer": "autogptq:0.8.0.dev1"}})"), "x/config.json");
  EXPECT_EQ(g.method, "gptq");
  EXPECT_EQ(g.bits, 4);
  EXPECT_EQ(g.group_size, 128);
  EXPECT_TRUE(g.desc_act);
  EXPECT_TRUE(g.sym);
  EXPECT_EQ(g.gptq_version, 1);
  EXPECT_EQ(g.quantizer, "autogptq:0.8.0.dev1");
  // transformers' GPTQConfig defaults: group 128, desc_act false, sym true, format gptq.
  const auto d = parse_quantization_config(parse(R"({"quant_method": "gptq", "bits": 8,
      "checkpoint_format": "gptq_v2", "group_size": -1})"), "x");
  EXPECT_EQ(d.bits, 8);
  EXPECT_EQ(d.group_size, -1);
  EXPECT_FALSE(d.desc_act);
  EXPECT_TRUE(d.sym);
  EXPECT_EQ(d.gptq_version, 2);
  // As AutoAWQ's to_transformers_dict writes it.
  const auto a = parse_quantization_config(parse(R"({"quant_method": "awq", "zero_point": true,
      "group_size": 64, "bits": 4, "version": "gemm", "modules_to_not_convert": ["visual"]})"), "x");
  EXPECT_EQ(a.method, "awq");
  EXPECT_EQ(a.group_size, 64);
  EXPECT_EQ(a.modules_to_not_convert, std::vector<std::string>{"visual"});
}

TEST(QuantizationConfig, WritesWhatReadsBack) {
  QuantCheckpointFormat f;
  f.bits = 8, f.group_size = 64, f.sym = true, f.desc_act = true, f.gptq_version = 2, f.quantizer = "gptq";
  const nlohmann::json j = quantization_config_json(f);
  EXPECT_EQ(j.at("quant_method"), "gptq");
  EXPECT_EQ(j.at("checkpoint_format"), "gptq_v2");
  EXPECT_EQ(j.at("meta").at("quantizer"), nlohmann::json::array({"tessera:gptq"}));
  const auto b = parse_quantization_config(j, "x");
  EXPECT_EQ(b.bits, 8);
  EXPECT_EQ(b.group_size, 64);
  EXPECT_TRUE(b.sym && b.desc_act);
  EXPECT_EQ(b.gptq_version, 2);
  EXPECT_EQ(b.quantizer, "gptq");
  QuantCheckpointFormat a;
  a.method = "awq", a.bits = 4, a.group_size = 128, a.quantizer = "awq";
  const nlohmann::json ja = quantization_config_json(a);
  EXPECT_EQ(ja.dump(), nlohmann::json::parse(R"({"quant_method": "awq", "zero_point": true, "group_size": 128,
      "bits": 4, "version": "gemm", "modules_to_not_convert": null,
      "meta": {"quantizer": ["tessera:awq"]}})").dump());
  const auto ab = parse_quantization_config(ja, "x");
  EXPECT_EQ(ab.method, "awq");
  EXPECT_EQ(ab.quantizer, "awq");
  EXPECT_TRUE(ab.modules_to_not_convert.empty());
  QuantCheckpointFormat bad;
  bad.bits = 3;
  EXPECT_NE(error_of([&] { quantization_config_json(bad); }).find("bits = 3 is not supported"), std::string::npos);
}

// config.json's quantization_config as llm-compressor writes it for its W8A8 int8 scheme
// (compressed-tensors 0.9), with `top` added to the top level and `weights` / `acts`
// added to (and overriding) the weights' and input activations' arguments.
std::string ct_config(const std::string& top = "", const std::string& weights = "",
                      const std::string& acts = "") {
  const auto args = [](const std::string& base, const std::string& extra) {
    nlohmann::json j = nlohmann::json::parse("{" + base + "}");
    if (!extra.empty()) j.update(nlohmann::json::parse("{" + extra + "}"));
    return j.dump();
  };
  nlohmann::json j = nlohmann::json::parse(R"({"config_groups": {"group_0": {
      "input_activations": "ACTS", "output_activations": null, "targets": ["Linear"], "weights": "WEIGHTS"}},
      "format": "int-quantized", "global_compression_ratio": 1.4579, "ignore": ["lm_head"],
      "kv_cache_scheme": null, "quant_method": "compressed-tensors", "quantization_status": "compressed"})");
  std::string text = j.dump();
  const std::string w = args(R"("actorder": null, "block_structure": null, "dynamic": false, "group_size": null,
      "num_bits": 8, "observer": "minmax", "observer_kwargs": {}, "strategy": "channel", "symmetric": true, "type": "int")", weights);
  const std::string a = args(R"("actorder": null, "block_structure": null, "dynamic": true, "group_size": null,
      "num_bits": 8, "observer": null, "observer_kwargs": {}, "strategy": "token", "symmetric": true, "type": "int")", acts);
  text.replace(text.find("\"ACTS\""), 6, a);
  text.replace(text.find("\"WEIGHTS\""), 9, w);
  if (!top.empty()) {
    nlohmann::json t = nlohmann::json::parse(text);
    t.update(nlohmann::json::parse("{" + top + "}"));
    text = t.dump();
  }
  return text;
}

TEST(QuantizationConfig, ReadsAndWritesLlmCompressorsW8A8) {
  const auto f = parse_quantization_config(parse(ct_config()), "x/config.json");
  EXPECT_EQ(f.method, "compressed-tensors");
  EXPECT_EQ(f.bits, 8);
  EXPECT_EQ(f.group_size, -1);
  EXPECT_TRUE(f.sym);
  // Ours reads back, and has the fields vLLM's compressed-tensors loader looks at.
  QuantCheckpointFormat w;
  w.method = kCompressedTensors, w.bits = 8, w.group_size = -1, w.sym = true, w.quantizer = "smoothquant";
  const nlohmann::json j = quantization_config_json(w);
  const auto& grp = j.at("config_groups").at("group_0");
  EXPECT_EQ(grp.at("targets"), nlohmann::json::array({"Linear"}));
  EXPECT_EQ(grp.at("weights").at("strategy"), "channel");
  EXPECT_EQ(grp.at("input_activations").at("dynamic"), true);
  EXPECT_EQ(j.at("ignore"), nlohmann::json::array({"lm_head"}));
  const auto back = parse_quantization_config(j, "x");
  EXPECT_EQ(back.method, "compressed-tensors");
  EXPECT_EQ(back.quantizer, "smoothquant");
}

TEST(QuantCheckpoint, CompressedTensorsW8A8RoundTripsAndChecksItsTensors) {
  QuantCheckpointFormat f;
  f.method = kCompressedTensors, f.bits = 8, f.group_size = -1, f.sym = true;
  std::mt19937 rng(41);
  std::normal_distribution<float> nd;
  Tensor wf = Tensor::empty({24, 80}, DType::kF32);
  for (int64_t i = 0; i < wf.numel(); ++i) wf.data<float>()[i] = nd(rng);
  const QuantWeight w = kernels::quantize_rtn(wf, kernels::QuantScheme::kW8A8, 0);
  const Named t = pack_quant_linear(w, f);
  ASSERT_EQ(t.size(), 2u);
  EXPECT_EQ(find(t, "weight").dtype(), DType::kI8);
  EXPECT_EQ(find(t, "weight_scale").shape(), (Shape{24, 1}));
  const auto get = [](const Named& n) {
    return [&n](const std::string& s) { return find(n, s); };
  };
  const QuantWeight back = unpack_quant_linear(get(t), 24, 80, f, "m.q_proj");
  EXPECT_EQ(std::memcmp(back.q.raw_data(), w.q.raw_data(), w.q.nbytes()), 0);
  EXPECT_EQ(std::memcmp(back.scales.raw_data(), w.scales.raw_data(), w.scales.nbytes()), 0);
  // W = s q, each weight within half a step of the float one.
  const Tensor d = kernels::dequantize(back);
  for (int64_t o = 0; o < 24; ++o)
    for (int64_t k = 0; k < 80; ++k)
      ASSERT_NEAR(d.data<float>()[o * 80 + k], wf.data<float>()[o * 80 + k], 0.5f * back.scales.data<float>()[o] + 1e-6f);
  // bf16 scales of shape (out) read too; llm-compressor's -128 reads as -127.
  Named other = replaced(t, "weight_scale", find(t, "weight_scale").view({24}).to(DType::kBF16));
  Tensor q = find(t, "weight").clone();
  q.data<int8_t>()[7] = -128;
  other = replaced(other, "weight", q);
  const QuantWeight b2 = unpack_quant_linear(get(other), 24, 80, f, "m.q_proj");
  EXPECT_EQ(b2.q.data<int8_t>()[7], -127);
  expect_module_error(replaced(t, "weight", Tensor::zeros({24, 80}, DType::kF32)), 24, 80, f,
                      ".weight: is f32(24, 80), expected i8(24, 80)");
  expect_module_error(replaced(t, "weight_scale", Tensor::zeros({24, 2}, DType::kF32)), 24, 80, f,
                      ".weight_scale: is f32(24, 2), expected a float (24, 1)");
  Tensor nan_scale = find(t, "weight_scale").clone();
  nan_scale.data<float>()[3] = NAN;
  expect_module_error(replaced(t, "weight_scale", nan_scale), 24, 80, f, ".weight_scale: value nan of output 3");
  // Only w8a8 weights have this layout.
  EXPECT_NE(error_of([&] { pack_quant_linear(kernels::quantize_rtn(wf, kernels::QuantScheme::kInt8, 0, true), f); })
                .find("no compressed-tensors W8A8 layout"),
            std::string::npos);
}

// llm-compressor's FP8 presets: weights e4m3 per channel (FP8), with dynamic fp8 per-token
// activations (FP8_DYNAMIC), per tensor, or per group.
std::string fp8_config(const std::string& weights = "", const std::string& acts = "null") {
  nlohmann::json w = nlohmann::json::parse(R"({"actorder": null, "block_structure": null, "dynamic": false,
      "group_size": null, "num_bits": 8, "observer": "minmax", "observer_kwargs": {}, "strategy": "channel",
      "symmetric": true, "type": "float"})");
  if (!weights.empty()) w.update(nlohmann::json::parse("{" + weights + "}"));
  nlohmann::json j = nlohmann::json::parse(R"({"config_groups": {"group_0": {"output_activations": null,
      "targets": ["Linear"]}}, "format": "float-quantized", "ignore": ["lm_head"], "kv_cache_scheme": null,
      "quant_method": "compressed-tensors", "quantization_status": "compressed"})");
  j["config_groups"]["group_0"]["weights"] = w;
  j["config_groups"]["group_0"]["input_activations"] = nlohmann::json::parse(acts);
  return j.dump();
}

const char* kFp8DynamicActs = R"({"actorder": null, "block_structure": null, "dynamic": true, "group_size": null,
    "num_bits": 8, "observer": null, "observer_kwargs": {}, "strategy": "token", "symmetric": true, "type": "float"})";

TEST(QuantizationConfig, ReadsAndWritesLlmCompressorsFp8) {
  const auto ch = parse_quantization_config(parse(fp8_config()), "x");
  EXPECT_TRUE(ch.fp8);
  EXPECT_FALSE(ch.fp8_activations);
  EXPECT_EQ(ch.group_size, -1);
  const auto dyn = parse_quantization_config(parse(fp8_config("", kFp8DynamicActs)), "x");
  EXPECT_TRUE(dyn.fp8_activations);
  EXPECT_EQ(parse_quantization_config(parse(fp8_config("\"strategy\": \"tensor\"")), "x").group_size, -1);
  const auto grp = parse_quantization_config(parse(fp8_config("\"strategy\": \"group\", \"group_size\": 64")), "x");
  EXPECT_EQ(grp.group_size, 64);
  // What we write reads back the same, in llm-compressor's fields.
  for (const auto& f : {ch, dyn, grp}) {
    const nlohmann::json j = quantization_config_json(f);
    EXPECT_EQ(j.at("format"), "float-quantized");
    const auto& w = j.at("config_groups").at("group_0").at("weights");
    EXPECT_EQ(w.at("type"), "float");
    EXPECT_EQ(w.at("strategy"), f.group_size > 0 ? "group" : "channel");
    EXPECT_EQ(j.at("config_groups").at("group_0").at("input_activations").is_null(), !f.fp8_activations);
    const auto back = parse_quantization_config(j, "x");
    EXPECT_EQ(back.fp8, true);
    EXPECT_EQ(back.fp8_activations, f.fp8_activations);
    EXPECT_EQ(back.group_size, f.group_size);
  }
}

TEST(QuantCheckpoint, CompressedTensorsFp8RoundTripsAndChecksItsTensors) {
  std::mt19937 rng(43);
  std::normal_distribution<float> nd;
  Tensor wf = Tensor::empty({16, 64}, DType::kF32);
  for (int64_t i = 0; i < wf.numel(); ++i) wf.data<float>()[i] = nd(rng);
  const auto get = [](const Named& n) {
    return [&n](const std::string& s) { return find(n, s); };
  };
  for (int64_t group : {int64_t{-1}, int64_t{32}}) {
    QuantCheckpointFormat f;
    f.method = kCompressedTensors, f.fp8 = true, f.bits = 8, f.group_size = group, f.sym = true;
    const QuantWeight w = kernels::quantize_rtn(wf, kernels::QuantScheme::kFp8, group > 0 ? group : 64);
    const Named t = pack_quant_linear(w, f);
    ASSERT_EQ(t.size(), 2u);
    EXPECT_EQ(find(t, "weight").dtype(), DType::kF8E4M3);
    EXPECT_EQ(find(t, "weight_scale").shape(), (Shape{16, group > 0 ? 2 : 1}));
    const QuantWeight back = unpack_quant_linear(get(t), 16, 64, f, "m.q_proj");
    EXPECT_EQ(back.scheme, kernels::QuantScheme::kFp8);
    EXPECT_EQ(std::memcmp(back.q.raw_data(), w.q.raw_data(), w.q.nbytes()), 0);
    EXPECT_EQ(std::memcmp(back.scales.raw_data(), w.scales.raw_data(), w.scales.nbytes()), 0);
    // The weight as a tensor converts to the values the kernels dequantize.
    const Tensor d = kernels::dequantize(back), codes = find(t, "weight").to(DType::kF32);
    for (int64_t i = 0; i < d.numel(); ++i)
      ASSERT_EQ(d.data<float>()[i], codes.data<float>()[i] * back.scales.data<float>()[(i / 64) * w.groups() + (i % 64) / w.group]);
    expect_module_error(replaced(t, "weight", Tensor::zeros({16, 64}, DType::kI8)), 16, 64, f,
                        ".weight: is i8(16, 64), expected f8e4m3(16, 64)");
    Tensor nan = find(t, "weight").clone();
    static_cast<uint8_t*>(nan.raw_data())[70] = 0xFF;
    expect_module_error(replaced(t, "weight", nan), 16, 64, f, ".weight: element (1, 6) is an fp8 NaN");
    // Int8 weights have no fp8 layout.
    EXPECT_NE(error_of([&] { pack_quant_linear(kernels::quantize_rtn(wf, kernels::QuantScheme::kW8A8, 0), f); })
                  .find("no compressed-tensors fp8 layout"),
              std::string::npos);
  }
  // One scale for the whole tensor (the "tensor" strategy) reads as that scale per channel.
  QuantCheckpointFormat f;
  f.method = kCompressedTensors, f.fp8 = true, f.bits = 8, f.group_size = -1, f.sym = true;
  const Named t = pack_quant_linear(kernels::quantize_rtn(wf, kernels::QuantScheme::kFp8, 64), f);
  const Named one = replaced(t, "weight_scale", Tensor::from_vector(std::vector<float>{0.25f}, {1}));
  const QuantWeight b = unpack_quant_linear(get(one), 16, 64, f, "m.q_proj");
  for (int64_t o = 0; o < 16; ++o) EXPECT_EQ(b.scales.data<float>()[o], 0.25f);
}

TEST(QuantizationConfig, UnsupportedValuesAreOneLineErrorsNamingTheField) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"quant_method": "bitsandbytes", "load_in_4bit": true})",
       "DIR/config.json: quantization_config.quant_method = \"bitsandbytes\" is not supported (gptq, awq or compressed-tensors)"},
      {R"({"bits": 4})", "DIR/config.json: quantization_config.quant_method is missing"},
      {R"({"quant_method": "gptq"})", "DIR/config.json: quantization_config.bits is missing"},
      {R"({"quant_method": "gptq", "bits": 3})",
       "DIR/config.json: quantization_config.bits = 3 is not supported (4 or 8)"},
      {R"({"quant_method": "gptq", "bits": "4"})", "quantization_config.bits: expected an integer, got \"4\""},
      {R"({"quant_method": "awq", "bits": 8})", "quantization_config.bits = 8 is not supported (4 with"},
      {R"({"quant_method": "gptq", "bits": 4, "group_size": 0})", "quantization_config.group_size = 0"},
      {R"({"quant_method": "gptq", "bits": 4, "group_size": -2})", "quantization_config.group_size = -2"},
      {R"({"quant_method": "gptq", "bits": 4, "group_size": 1.5})", "quantization_config.group_size: expected an integer"},
      {R"({"quant_method": "awq", "group_size": -1})", "quantization_config.group_size = -1 is not supported"},
      {R"({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"})",
       "quantization_config.checkpoint_format = \"marlin\" is not supported (gptq or gptq_v2)"},
      {R"({"quant_method": "gptq", "bits": 4, "is_marlin_format": true})", "quantization_config.is_marlin_format = true"},
      {R"({"quant_method": "gptq", "bits": 4, "desc_act": "yes"})", "quantization_config.desc_act: expected true or false"},
      {R"({"quant_method": "gptq", "bits": 4, "sym": 1})", "quantization_config.sym: expected true or false"},
      {R"({"quant_method": "gptq", "bits": 4, "damp_percent": 2})", "quantization_config.damp_percent = 2"},
      {R"({"quant_method": "awq", "version": "gemv"})", "quantization_config.version = \"gemv\" is not supported (gemm"},
      {R"({"quant_method": "awq", "zero_point": false})", "quantization_config.zero_point = false is not supported"},
      {R"({"quant_method": "awq", "modules_to_not_convert": "lm_head"})", "quantization_config.modules_to_not_convert: expected a list"},
      {R"({"quant_method": "gptq", "bits": 4, "meta": {"quantizer": 3}})", "quantization_config.meta.quantizer: expected"},
      {R"([1, 2])", "DIR/config.json: quantization_config: expected an object"},
      // compressed-tensors: only the W8A8 int8 scheme, each departure named.
      {ct_config("\"format\": \"pack-quantized\""), "quantization_config.format = \"pack-quantized\" is not supported"},
      {ct_config("\"format\": \"float-quantized\""), "config_groups.group_0.weights.type = \"int\" is not supported (\"float\""},
      {fp8_config("\"strategy\": \"block\", \"block_structure\": [128, 128]"), "weights.strategy = \"block\" is not supported (\"channel\""},
      {fp8_config("\"strategy\": \"group\", \"group_size\": 0"), "weights.group_size = 0 is not a positive number"},
      {fp8_config("", R"({"dynamic": false, "num_bits": 8, "strategy": "tensor", "symmetric": true, "type": "float"})"),
       "input_activations.dynamic = false is not supported (true"},
      {ct_config("", "\"strategy\": \"tensor\""), "config_groups.group_0.weights.strategy = \"tensor\" is not supported (\"channel\""},
      {ct_config("", "\"num_bits\": 4"), "config_groups.group_0.weights.num_bits = 4 is not supported (8"},
      {ct_config("", "", "\"dynamic\": false"), "config_groups.group_0.input_activations.dynamic = false is not supported (true"},
      {ct_config("", "", "\"type\": \"float\""), "input_activations.type = \"float\" is not supported (\"int\""},
      {ct_config("\"ignore\": [\"lm_head\", \"model.layers.0.mlp.down_proj\"]"), "quantization_config.ignore: \"model.layers.0.mlp.down_proj\" is not supported"},
      {ct_config("\"kv_cache_scheme\": {\"num_bits\": 8}"), "quantization_config.kv_cache_scheme = an object is not supported"},
      {ct_config("\"quantization_status\": \"frozen\""), "quantization_status = \"frozen\" is not supported"},
  };
  testing::expect_config_errors(cases, [](const std::string& text) {
    parse_quantization_config(parse(text), "DIR/config.json");
  });
}

}  // namespace
}  // namespace tessera::io
