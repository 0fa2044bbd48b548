// AutoGPTQ / AutoAWQ / compressed-tensors (W8A8, fp8) checkpoint tensors <-> kernels::QuantWeight. The layouts are those AutoGPTQ's QuantLinear.pack and AutoAWQ's
// WQLinear_GEMM.from_linear write and their kernels read (tests/parity/quant_pack_reference.py
// transcribes both).
#include "tessera/io/quant_checkpoint.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/io/json_file.h"

namespace tessera::io {
namespace {

using kernels::QuantScheme;
using kernels::QuantWeight;

// AutoAWQ's GEMM packing: nibble t of each int32 holds output column 8 c + kAwqOrder[t].
constexpr int kAwqOrder[8] = {0, 2, 4, 6, 1, 3, 5, 7};

int64_t group_of(const QuantCheckpointFormat& f, int64_t in) {
  return f.group_size == -1 ? in : f.group_size;
}

// The shape rules of the packed layouts, for a weight (out, in): `what` names it.
void check_layout(const QuantCheckpointFormat& f, int64_t out, int64_t in, const std::string& what) {
  TESSERA_CHECK(out > 0 && in > 0, what, ": a quantized linear of shape (", out, ", ", in, ")");
  const int64_t group = group_of(f, in);
  TESSERA_CHECK(in % group == 0, what, ": group_size ", group, " does not divide the ", in,
                " input features");
  TESSERA_CHECK(f.bits == 8 || group % 32 == 0, what, ": 4-bit groups of ", group,
                " input features are not supported (a multiple of 32)");
  const int64_t pack = 32 / f.bits;
  if (f.method == "gptq") {
    TESSERA_CHECK(in % pack == 0, what, ": ", in, " input features do not fill whole int32 rows of ",
                  pack, " ", f.bits, "-bit values (gptq packs along the input dim)");
  }
  TESSERA_CHECK(out % pack == 0, what, ": ", out, " output features do not fill whole int32s of ",
                pack, " ", f.bits, "-bit values (", f.method, " packs zero points along the output dim)");
}

// Code (integer) of weight (o, j), j a stored column, and its setter.
int32_t code_at(const QuantWeight& w, int64_t o, int64_t j) {
  if (w.scheme == QuantScheme::kInt4) {
    const uint8_t b = w.q.data<uint8_t>()[o * (w.in / 2) + (j / 32) * 16 + j % 16];
    return (j % 32) < 16 ? (b & 0xF) : (b >> 4);
  }
  return w.q.data<uint8_t>()[o * w.in + j];
}

void set_code(QuantWeight& w, int64_t o, int64_t j, uint32_t c) {
  if (w.scheme == QuantScheme::kInt4) {
    uint8_t& b = w.q.data<uint8_t>()[o * (w.in / 2) + (j / 32) * 16 + j % 16];
    b = (j % 32) < 16 ? static_cast<uint8_t>((b & 0xF0) | c) : static_cast<uint8_t>((b & 0x0F) | (c << 4));
    return;
  }
  w.q.data<uint8_t>()[o * w.in + j] = static_cast<uint8_t>(c);
}

Tensor i32_from(const std::vector<uint32_t>& v, const Shape& shape) {
  Tensor t = Tensor::empty(shape, DType::kI32);
  std::memcpy(t.raw_data(), v.data(), v.size() * sizeof(uint32_t));
  return t;
}

// One fetched checkpoint tensor, checked against the shape and dtypes the format has.
Tensor fetch(const std::function<Tensor(const std::string&)>& get, const std::string& module,
             const std::string& suffix, const Shape& shape, std::initializer_list<DType> dtypes,
             const std::string& layout) {
  const std::string name = module + "." + suffix;
  Tensor t = get(suffix);
  TESSERA_CHECK(t.defined(), name, ": missing");
  const bool dtype_ok = std::find(dtypes.begin(), dtypes.end(), t.dtype()) != dtypes.end();
  if (!dtype_ok || t.shape() != shape) {
    std::string also;
    for (auto it = dtypes.begin() + 1; it != dtypes.end(); ++it)
      also += (also.empty() ? "; " : ", ") + std::string(dtype_name(*it));
    fail(name, ": is ", t.describe(), ", expected ", dtype_name(*dtypes.begin()), shape_str(shape), " (",
         layout, also.empty() ? "" : also + " also read", ")");
  }
  return t.contiguous();
}

// compressed-tensors: weight (out, in) I8 (W8A8) or F8_E4M3 (fp8) and weight_scale
// (out, groups) (groups = 1 per channel), W = s q.
std::vector<std::pair<std::string, Tensor>> pack_compressed_tensors(const QuantWeight& w, const QuantCheckpointFormat& f,
                                                                    const std::string& what) {
  const QuantScheme want = f.fp8 ? QuantScheme::kFp8 : QuantScheme::kW8A8;
  TESSERA_CHECK(w.scheme == want, what, ": ", kernels::quant_scheme_name(w.scheme),
                " weights have no compressed-tensors ", f.fp8 ? "fp8 layout (fp8)" : "W8A8 layout (w8a8)");
  w.validate(what);
  TESSERA_CHECK(!w.smooth.defined() && !w.perm.defined(), what,
                ": smoothing scales or a column order have no place in a compressed-tensors checkpoint");
  TESSERA_CHECK(w.group == group_of(f, w.in), what, ": the weight's group size ", w.group,
                " is not the format's group_size ", f.group_size);
  Tensor q = w.q.clone();
  if (f.fp8) {  // the same bytes, typed as what they hold
    q = Tensor::empty({w.out, w.in}, DType::kF8E4M3);
    std::memcpy(q.raw_data(), w.q.raw_data(), w.q.nbytes());
  }
  return {{"weight", q}, {"weight_scale", w.scales.view({w.out, w.groups()}).clone()}};
}

QuantWeight unpack_compressed_tensors(const std::function<Tensor(const std::string&)>& get, int64_t out,
                                      int64_t in, const QuantCheckpointFormat& f, const std::string& module) {
  const int64_t group = group_of(f, in);
  TESSERA_CHECK(in % group == 0, module, ": group_size ", group, " does not divide the ", in, " input features");
  const int64_t G = in / group;
  const std::string layout = std::string("compressed-tensors ") + (f.fp8 ? "fp8" : "W8A8") + " weight (" +
                             std::to_string(out) + ", " + std::to_string(in) + ")" +
                             (G > 1 ? ", group_size " + std::to_string(group) : std::string());
  QuantWeight w;
  w.scheme = f.fp8 ? QuantScheme::kFp8 : QuantScheme::kW8A8;
  w.out = out, w.in = in, w.group = group;
  const Tensor q = fetch(get, module, "weight", {out, in}, {f.fp8 ? DType::kF8E4M3 : DType::kI8}, layout);
  w.q = Tensor::empty({out, in}, f.fp8 ? DType::kU8 : DType::kI8);  // the kernels' code types
  std::memcpy(w.q.raw_data(), q.raw_data(), q.nbytes());
  // Scales (out, G), or (out) per channel; fp8 per tensor: one scale, shape (1), (1, 1) or ().
  const Tensor scale = get("weight_scale");
  const bool per_tensor = f.fp8 && G == 1 && scale.defined() && scale.numel() == 1 && scale.dim() <= 2;
  TESSERA_CHECK(scale.defined() &&
                    (scale.dtype() == DType::kF32 || scale.dtype() == DType::kBF16 || scale.dtype() == DType::kF16) &&
                    (scale.shape() == Shape{out, G} || (G == 1 && scale.shape() == Shape{out}) || per_tensor),
                module, ".weight_scale: is ", scale.defined() ? scale.describe() : "missing", ", expected a float (",
                out, ", ", G, ") (", layout, ")");
  const Tensor s32 = scale.to(DType::kF32).contiguous();
  w.scales = Tensor::empty({out, G}, DType::kF32);
  for (int64_t i = 0; i < out * G; ++i) w.scales.data<float>()[i] = s32.data<float>()[per_tensor ? 0 : i];
  for (int64_t i = 0; i < out * G; ++i) {
    const float v = w.scales.data<float>()[i];
    TESSERA_CHECK(std::isfinite(v) && v >= 0, module, ".weight_scale: value ", v, " of output ", i / G,
                  G > 1 ? ", group " + std::to_string(i % G) : std::string(), " is not a finite non-negative scale");
  }
  if (f.fp8) {
    const uint8_t* c = w.q.data<uint8_t>();
    for (int64_t i = 0; i < w.q.numel(); ++i)
      TESSERA_CHECK((c[i] & 0x7F) != 0x7F, module, ".weight: element (", i / in, ", ", i % in,
                    ") is an fp8 NaN (code 0x", std::hex, static_cast<int>(c[i]), ")");
  } else {
    // llm-compressor's int8 range is [-128, 127]; the int8 kernels negate codes, so -128
    // (a value at exactly -absmax, rare) becomes -127: one code step on that weight.
    int8_t* c = w.q.data<int8_t>();
    for (int64_t i = 0; i < w.q.numel(); ++i) c[i] = std::max<int8_t>(c[i], -127);
  }
  w.validate(module);
  return w;
}

}  // namespace

// ---- tensors ---------------------------------------------------------------------------

std::vector<std::string> quant_linear_suffixes(const QuantCheckpointFormat& f) {
  check_quant_format(f, "quant_linear_suffixes");
  if (f.method == kCompressedTensors) return {"weight", "weight_scale"};
  if (f.method == "awq") return {"qweight", "qzeros", "scales"};
  return {"qweight", "qzeros", "scales", "g_idx"};
}

std::vector<std::pair<std::string, Tensor>> pack_quant_linear(const QuantWeight& w,
                                                              const QuantCheckpointFormat& f) {
  const std::string what = "pack_quant_linear";
  check_quant_format(f, what);
  if (f.method == kCompressedTensors) return pack_compressed_tensors(w, f, what);
  TESSERA_CHECK(w.scheme == QuantScheme::kInt8 || w.scheme == QuantScheme::kInt4, what, ": ",
                kernels::quant_scheme_name(w.scheme), " weights have no ", f.method,
                " layout (int8 or int4)");
  w.validate(what);
  const int bits = kernels::quant_bits(w.scheme);
  TESSERA_CHECK(bits == f.bits, what, ": a ", kernels::quant_scheme_name(w.scheme),
                " weight cannot be stored as ", f.bits, "-bit ", f.method);
  check_layout(f, w.out, w.in, what);
  TESSERA_CHECK(w.group == group_of(f, w.in), what, ": the weight's group size ", w.group,
                " is not the format's group_size ", f.group_size);
  TESSERA_CHECK(!w.smooth.defined(), what, ": smoothing scales have no place in ", f.method,
                " checkpoints (fold them into the previous layer first)");
  TESSERA_CHECK(!w.perm.defined() || f.desc_act, what,
                ": an act-order weight needs desc_act (gptq's g_idx) to be stored");
  const int64_t out = w.out, in = w.in, G = w.groups(), pack = 32 / bits;
  const uint32_t mask = (1u << bits) - 1;
  const bool gptq = f.method == "gptq";
  const int z_offset = gptq && f.gptq_version == 1 ? 1 : 0;  // v1 stores z - 1
  const float* s = w.scales.data<float>();
  const float* z = w.zeros.data<float>();

  // scales (G, out) f16; zero points checked against what the format can hold.
  Tensor scales = Tensor::empty({G, out}, DType::kF16);
  std::vector<uint32_t> qzeros(static_cast<size_t>(G * (out / pack)), 0);
  const int zlo = z_offset, zhi = static_cast<int>(mask) + z_offset;
  for (int64_t o = 0; o < out; ++o)
    for (int64_t g = 0; g < G; ++g) {
      const uint16_t h = f32_to_f16(s[o * G + g]);
      TESSERA_CHECK(std::isfinite(f16_to_f32(h)), what, ": scale ", s[o * G + g], " of (output ", o,
                    ", group ", g, ") overflows f16");
      scales.data<f16>()[g * out + o].bits = h;
      TESSERA_CHECK(z[o * G + g] == std::floor(z[o * G + g]), what, ": zero point ", z[o * G + g],
                    " of (output ", o, ", group ", g, ") is not an integer (", f.method,
                    " stores integer zero points; GGUF K-quants' are not)");
      const int zi = static_cast<int>(z[o * G + g]);
      TESSERA_CHECK(zi >= zlo && zi <= zhi, what, ": zero point ", zi, " of (output ", o, ", group ",
                    g, ") does not fit ", f.method, gptq ? (z_offset ? " (v1, stores z - 1)" : " v2") : "",
                    " ", bits, "-bit zero points [", zlo, ", ", zhi, "]",
                    z_offset && zi == 0 ? "; use checkpoint_format gptq_v2" : "");
      TESSERA_CHECK(!(gptq && f.sym) || zi == (1 << (bits - 1)), what, ": zero point ", zi, " of (output ", o,
                    ", group ", g, ") is not ", (1 << (bits - 1)), " though sym is true");
      const int64_t c = o / pack;
      const int t = gptq ? static_cast<int>(o % pack)
                         : static_cast<int>(std::find(kAwqOrder, kAwqOrder + 8, o % 8) - kAwqOrder);
      qzeros[g * (out / pack) + c] |= (static_cast<uint32_t>(zi - z_offset) & mask) << (bits * t);
    }

  std::vector<std::pair<std::string, Tensor>> r;
  if (gptq) {
    // qweight rows follow W's original columns: column k sits at stored position inv[k].
    std::vector<int64_t> inv(in);
    for (int64_t j = 0; j < in; ++j) inv[w.perm.defined() ? w.perm.data<int32_t>()[j] : j] = j;
    std::vector<uint32_t> qweight(static_cast<size_t>((in / pack) * out), 0);
    for (int64_t o = 0; o < out; ++o)
      for (int64_t k = 0; k < in; ++k)
        qweight[(k / pack) * out + o] |= static_cast<uint32_t>(code_at(w, o, inv[k])) << (bits * (k % pack));
    Tensor g_idx = Tensor::empty({in}, DType::kI32);
    for (int64_t k = 0; k < in; ++k) g_idx.data<int32_t>()[k] = static_cast<int32_t>(inv[k] / w.group);
    r.emplace_back("qweight", i32_from(qweight, {in / pack, out}));
    r.emplace_back("qzeros", i32_from(qzeros, {G, out / pack}));
    r.emplace_back("scales", scales);
    r.emplace_back("g_idx", g_idx);
  } else {
    std::vector<uint32_t> qweight(static_cast<size_t>(in * (out / 8)), 0);
    for (int64_t k = 0; k < in; ++k)
      for (int64_t c = 0; c < out / 8; ++c) {
        uint32_t v = 0;
        for (int t = 0; t < 8; ++t) v |= static_cast<uint32_t>(code_at(w, c * 8 + kAwqOrder[t], k)) << (4 * t);
        qweight[k * (out / 8) + c] = v;
      }
    r.emplace_back("qweight", i32_from(qweight, {in, out / 8}));
    r.emplace_back("qzeros", i32_from(qzeros, {G, out / 8}));
    r.emplace_back("scales", scales);
  }
  return r;
}

QuantWeight unpack_quant_linear(const std::function<Tensor(const std::string&)>& get, int64_t out,
                                int64_t in, const QuantCheckpointFormat& f, const std::string& module) {
  check_quant_format(f, module);
  if (f.method == kCompressedTensors) return unpack_compressed_tensors(get, out, in, f, module);
  check_layout(f, out, in, module);
  const bool gptq = f.method == "gptq";
  const int bits = f.bits;
  const int64_t group = group_of(f, in), G = in / group, pack = 32 / bits;
  const uint32_t mask = (1u << bits) - 1;
  const std::string layout = std::to_string(bits) + "-bit " + f.method + " weight (" +
                             std::to_string(out) + ", " + std::to_string(in) + "), group_size " +
                             std::to_string(f.group_size);
  QuantWeight w;
  w.scheme = bits == 4 ? QuantScheme::kInt4 : QuantScheme::kInt8;
  w.out = out, w.in = in, w.group = group;
  w.q = Tensor::zeros(bits == 4 ? Shape{out, in / 2} : Shape{out, in}, DType::kU8);

  const Tensor qweight = fetch(get, module, "qweight", gptq ? Shape{in / pack, out} : Shape{in, out / 8},
                               {DType::kI32}, layout);
  const Tensor qzeros = fetch(get, module, "qzeros", {G, out / pack}, {DType::kI32}, layout);
  const Tensor scales = fetch(get, module, "scales", {G, out}, {DType::kF16, DType::kBF16, DType::kF32},
                              layout).to(DType::kF32);

  // Scales and zero points, transposed to (out, G).
  w.scales = Tensor::empty({out, G}, DType::kF32);
  w.zeros = Tensor::empty({out, G}, DType::kF32);
  const uint32_t* qz = reinterpret_cast<const uint32_t*>(qzeros.raw_data());
  const int z_offset = gptq && f.gptq_version == 1 ? 1 : 0;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t o = 0; o < out; ++o) {
      const float s = scales.data<float>()[g * out + o];
      TESSERA_CHECK(std::isfinite(s), module, ".scales: value ", s, " at (group ", g, ", output ", o,
                    ") is not finite");
      w.scales.data<float>()[o * G + g] = s;
      const int t = gptq ? static_cast<int>(o % pack)
                         : static_cast<int>(std::find(kAwqOrder, kAwqOrder + 8, o % 8) - kAwqOrder);
      const int zi = static_cast<int>((qz[g * (out / pack) + o / pack] >> (bits * t)) & mask) + z_offset;
      TESSERA_CHECK(!(gptq && f.sym) || zi == (1 << (bits - 1)), module, ".qzeros: zero point ", zi,
                    " of (output ", o, ", group ", g, ") is not ", (1 << (bits - 1)),
                    " though quantization_config.sym is true");
      w.zeros.data<float>()[o * G + g] = static_cast<float>(zi);
    }

  const uint32_t* qw = reinterpret_cast<const uint32_t*>(qweight.raw_data());
  if (!gptq) {
    for (int64_t k = 0; k < in; ++k)
      for (int64_t c = 0; c < out / 8; ++c) {
        const uint32_t v = qw[k * (out / 8) + c];
        for (int t = 0; t < 8; ++t) set_code(w, c * 8 + kAwqOrder[t], k, (v >> (4 * t)) & 0xF);
      }
    w.validate(module);
    return w;
  }

  // g_idx: the group of each original column. Stored order = columns stably sorted by it.
  const Tensor gt = fetch(get, module, "g_idx", {in}, {DType::kI32, DType::kI64}, layout);
  std::vector<int64_t> g_idx(in);
  for (int64_t k = 0; k < in; ++k)
    g_idx[k] = gt.dtype() == DType::kI32 ? gt.data<int32_t>()[k] : gt.data<int64_t>()[k];
  std::vector<int64_t> count(G, 0);
  for (int64_t k = 0; k < in; ++k) {
    TESSERA_CHECK(g_idx[k] >= 0 && g_idx[k] < G, module, ".g_idx: entry ", k, " = ", g_idx[k],
                  " is not a group in [0, ", G, ")");
    TESSERA_CHECK(f.desc_act || g_idx[k] == k / group, module, ".g_idx: entry ", k, " = ", g_idx[k],
                  " is not ", k, " / group_size = ", k / group, " (desc_act is false)");
    ++count[g_idx[k]];
  }
  std::vector<int32_t> perm(in);
  std::vector<int64_t> next(G);
  for (int64_t g = 0; g < G; ++g) {
    TESSERA_CHECK(count[g] == group, module, ".g_idx: group ", g, " has ", count[g],
                  " columns, expected group_size ", group);
    next[g] = g * group;
  }
  bool identity = true;
  for (int64_t k = 0; k < in; ++k) {
    const int64_t j = next[g_idx[k]]++;
    perm[j] = static_cast<int32_t>(k);
    identity = identity && j == k;
  }
  if (!identity) w.perm = Tensor::from_vector(perm, {in});
  for (int64_t j = 0; j < in; ++j) {
    const int64_t k = perm[j];
    const uint32_t* row = qw + (k / pack) * out;
    const int shift = static_cast<int>(bits * (k % pack));
    for (int64_t o = 0; o < out; ++o) set_code(w, o, j, (row[o] >> shift) & mask);
  }
  w.validate(module);
  return w;
}

}  // namespace tessera::io
