// Post-training quantizers over the model's block linears.
#include "tessera/model/quantize.h"

#include <algorithm>

#include "tessera/base/error.h"
#include "tessera/model/calibrated_quant.h"

namespace tessera::model {

using kernels::QuantScheme;

QuantizeOptions quantize_options(const std::string& method, int bits, int64_t group_size,
                                 const std::string& type) {
  QuantizeOptions o;
  o.method = method;
  TESSERA_CHECK(type == "int" || type == "fp8", "--type '", type, "' is not one of int, fp8");
  if (type == "fp8") {
    TESSERA_CHECK(method == "rtn", "--type fp8 quantizes by rounding to nearest (--method rtn), not ", method);
    TESSERA_CHECK(bits == 8, "--type fp8 is 8 bits (--bits 8), not ", bits);
    TESSERA_CHECK(group_size == 0 || group_size == -1 || group_size >= 1,
                  "--group-size ", group_size, " must be positive or -1 (per channel)");
    o.scheme = QuantScheme::kFp8;
    o.group_size = group_size;
    o.sym = true;
    return o;
  }
  TESSERA_CHECK(method == "rtn" || method == "gptq" || method == "awq" || method == "smoothquant",
                "--method '", method, "' is not one of rtn, gptq, awq, smoothquant");
  TESSERA_CHECK(bits == 8 || bits == 4, "--bits ", bits, " is not supported (8 or 4)");
  TESSERA_CHECK(method != "awq" || bits == 4, "awq quantizes to 4 bits (--bits 4), not ", bits);
  TESSERA_CHECK(method != "awq" || group_size != -1,
                "awq keeps one scale per group (--group-size 32, 64 or 128), not per channel");
  TESSERA_CHECK(method != "smoothquant" || bits == 8,
                "smoothquant is W8A8 (--bits 8), not ", bits, " bits");
  o.scheme = method == "smoothquant" ? QuantScheme::kW8A8
             : bits == 4             ? QuantScheme::kInt4
                                     : QuantScheme::kInt8;
  TESSERA_CHECK(group_size == 0 || group_size == -1 || group_size >= 1,
                "--group-size ", group_size, " must be positive or -1 (per channel)");
  TESSERA_CHECK(group_size == 0 || bits == 4 || group_size == -1 || method != "smoothquant",
                "smoothquant has one scale per output channel (no --group-size)");
  TESSERA_CHECK(bits != 4 || group_size <= 0 || group_size % 32 == 0,
                "--group-size ", group_size, " for 4 bits must be a multiple of 32 (32, 64, 128)");
  o.group_size = group_size;
  o.sym = o.scheme != QuantScheme::kInt4;
  return o;
}

QuantizeOptions quantize_options_for_scheme(const std::string& scheme) {
  QuantizeOptions o;
  o.scheme = kernels::parse_quant_scheme(scheme);
  o.sym = o.scheme != QuantScheme::kInt4;
  return o;
}

void check_quantize_options(const QuantizeOptions& o) {
  TESSERA_CHECK(o.method == "awq" || (!o.awq_clip_qk && o.awq_inspect_tokens == 0),
                "--awq-clip-qk and --awq-inspect-tokens go with --method awq, not ", o.method);
  TESSERA_CHECK(o.awq_inspect_tokens >= 0, "--awq-inspect-tokens must be 0 or more, got ", o.awq_inspect_tokens);
  if (!o.lm_head) return;
  TESSERA_CHECK(o.scheme == QuantScheme::kInt8 || o.scheme == QuantScheme::kInt4,
                "quantizing lm_head goes with int8 or int4 weights (", kernels::quant_scheme_name(o.scheme),
                " keeps it float, as compressed-tensors checkpoints do)");
  TESSERA_CHECK(o.method != "awq", "awq keeps lm_head float (AutoAWQ's checkpoints have no quantized head); "
                "quantize it with --method gptq or rtn");
}

namespace {

// How save() stores the result: AutoGPTQ tensors for int8 / int4 (whatever chose the
// integers; AutoAWQ's for AWQ), compressed-tensors for w8a8 and fp8.
std::optional<io::QuantCheckpointFormat> checkpoint_format(const QuantizeOptions& o,
                                                           int64_t group) {
  if (o.scheme == QuantScheme::kW8A8 || o.scheme == QuantScheme::kFp8) {
    io::QuantCheckpointFormat f;
    f.method = io::kCompressedTensors;
    f.fp8 = o.scheme == QuantScheme::kFp8;
    f.bits = 8, f.group_size = f.fp8 ? group : -1, f.sym = true;
    f.quantizer = o.method;
    return f;
  }
  if (o.scheme != QuantScheme::kInt8 && o.scheme != QuantScheme::kInt4) return std::nullopt;
  io::QuantCheckpointFormat f;
  f.method = o.method == "awq" ? "awq" : "gptq";  // AWQ models save as AutoAWQ's GEMM layout
  f.bits = kernels::quant_bits(o.scheme);
  f.group_size = group;
  f.sym = o.sym;
  f.desc_act = o.act_order;
  f.quantizer = o.method;
  f.lm_head = o.lm_head;
  if (o.lm_head && !(f.bits == 8 && f.group_size == -1 && f.sym && !f.desc_act))
    f.lm_head_override = io::QuantCheckpointFormat::ModuleOverride{8, -1, true, false};
  return f;
}

// The head: int8 per output channel, symmetric, f16 scales (what the checkpoint stores).
void quantize_head(Model& m, const QuantizeOptions& o) {
  if (!o.lm_head) return;
  m.quantize_lm_head([](const Tensor& w) {
    return kernels::quantize_rtn(w, QuantScheme::kInt8, w.size(1), /*sym=*/true, /*f16_scales=*/true);
  });
}

}  // namespace

Tensor calibration_windows(const std::vector<int32_t>& ids, int64_t samples, int64_t seq,
                           const std::string& what) {
  TESSERA_CHECK(samples > 0 && seq > 0, what, ": calibration needs positive sample and sequence counts, got ",
                samples, " x ", seq);
  const auto n_ids = static_cast<int64_t>(ids.size());
  TESSERA_CHECK(n_ids >= seq, what, ": ", n_ids, " tokens, fewer than one calibration window (--calib-seq) of ", seq);
  const int64_t n = std::min(samples, n_ids / seq);
  Tensor t = Tensor::empty({n, seq}, DType::kI32);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t start = n == 1 ? 0 : i * (n_ids - seq) / (n - 1);
    std::copy(ids.begin() + start, ids.begin() + start + seq, t.data<int32_t>() + i * seq);
  }
  return t;
}

void quantize_model(Model& m, const QuantizeOptions& o, const Tensor& calib_ids,
                    const QuantizeProgress& progress) {
  check_quantize_options(o);
  const auto& c = m.config();
  // One group size for the whole model, as the checkpoint formats record one: every
  // linear's input features must be a multiple of it (per channel: each linear's own).
  const bool per_channel = o.scheme == QuantScheme::kW8A8 || o.group_size == -1 ||
                           (o.group_size == 0 && o.scheme != QuantScheme::kInt4);
  const int64_t group = per_channel ? -1 : o.group_size == 0 ? 128 : o.group_size;
  if (!per_channel)
    for (int64_t in : {c.hidden_size, c.q_dim(), c.intermediate_size})
      TESSERA_CHECK(in % group == 0, "group size ", group, " does not divide the model's ", in,
                    "-feature linears (use --group-size 32, 64 or -1)");
  const int64_t L = c.num_layers;
  quantize_head(m, o);  // (first: the calibrated quantizers run the layers only)
  if (o.method == "rtn") {
    m.quantize_linears(
        [&](int64_t layer, int which, const Tensor& w) {
          // f16 scales: what the AutoGPTQ checkpoint stores, so saving changes nothing.
          auto q = kernels::quantize_rtn(w, o.scheme, per_channel ? w.size(1) : group, o.sym,
                                         /*f16_scales=*/true);
          if (which == 3 && progress) progress(layer + 1, L);
          return q;
        },
        checkpoint_format(o, group));
    return;
  }
  TESSERA_CHECK(calib_ids.defined(), o.method, " needs calibration text (--calib FILE)");
  if (o.method == "gptq") {
    kernels::GptqOptions g;
    g.group = per_channel ? 0 : group;
    g.symmetric = o.sym;
    g.act_order = o.act_order;
    g.percdamp = o.damp_percent;
    g.block = o.block_size;
    g.f16_scales = true;  // what the AutoGPTQ checkpoint stores, so saving changes nothing
    quantize_model_gptq(m, g, o.scheme, calib_ids, [&](int64_t done) {
      if (progress) progress(done, L);
    });
    m.finish_quantization(checkpoint_format(o, group));
    return;
  }
  if (o.method == "awq") {
    kernels::AwqOptions a;
    a.group = group;
    a.symmetric = o.sym;
    a.inspect_tokens = o.awq_inspect_tokens;
    a.clip_qk = o.awq_clip_qk;
    quantize_model_awq(m, a, o.scheme, calib_ids, [&](int64_t done) {
      if (progress) progress(done, L);
    });
    m.finish_quantization(checkpoint_format(o, group));
    return;
  }
  TESSERA_CHECK(o.method == "smoothquant", "quantization method '", o.method, "' is not implemented");
  quantize_model_smoothquant(m, o.alpha, calib_ids, [&](int64_t done) {
    if (progress) progress(done, L);
  });
  m.finish_quantization(checkpoint_format(o, group));
}

void quantize_on_load(Model& m, const LoadQuantization& q) {
  if (q.none()) {
    TESSERA_CHECK(!q.lm_head || m.quantized_lm_head(), "--quantize-lm-head goes with --quantization int8 or int4 ",
                  "(or a checkpoint whose lm_head is quantized)");
    return;
  }
  TESSERA_CHECK(!m.quantized(), "--quantization ", q.scheme, ": the model is already quantized (",
                m.weights_description(), ") by its checkpoint");
  QuantizeOptions o = quantize_options_for_scheme(q.scheme);
  o.lm_head = q.lm_head;
  quantize_model(m, o);
}

}  // namespace tessera::model
