// Quantized block linears: replacing float weights by quantized ones, and reading and
// writing them as AutoGPTQ / AutoAWQ checkpoint tensors (one set per Hugging Face module,
// stacked into Tessera's fused qkv and gate/up linears).
#include <cstdio>

#include "tessera/base/error.h"
#include "tessera/base/logging.h"
#include "tessera/io/quant_checkpoint.h"
#include "tessera/io/safetensors.h"
#include "tessera/model/model.h"

namespace tessera::model {
namespace {

// The block linear's weight as (out, in) f32.
Tensor out_in_f32(const Linear& lin) {
  const Tensor w = lin.in_out ? lin.weight.transpose(0, 1) : lin.weight;
  return w.to(DType::kF32).contiguous();
}

int64_t in_features(const Linear& lin) {
  if (lin.quant) return lin.quant->in;
  return lin.in_out ? lin.weight.size(0) : lin.weight.size(1);
}

}  // namespace

void Model::quantize_linears(const LinearQuantizer& quantize,
                             std::optional<io::QuantCheckpointFormat> format) {
  for (int64_t l = 0; l < config_.num_layers; ++l) quantize_layer(l, quantize);
  finish_quantization(std::move(format));
}

void Model::quantize_layer(int64_t l, const LinearQuantizer& quantize) {
  TESSERA_CHECK(!quantized_, "the model's linears are already quantized");
  TESSERA_CHECK(!config_.is_moe(), "quantizing mixture-of-experts models is not supported yet");
  TESSERA_CHECK(shard_.size == 1 && stage_.whole(),
                "quantization needs the whole model (not a tensor-parallel shard or pipeline stage)");
  TESSERA_CHECK(hooks_ == nullptr, "quantized weights are for inference, not under a training wrapper");
  TESSERA_CHECK(l >= 0 && l < config_.num_layers, "quantize: layer ", l, " out of range");
  for (int which = 0; which < 4; ++which) {
    Linear& lin = weights_.layers[l].linear(which);
    TESSERA_CHECK(lin.weight.defined(), "quantize: layer ", l, " linear ", which, " has no weight");
    const Tensor w = out_in_f32(lin);
    auto q = std::make_shared<kernels::QuantWeight>(quantize(l, which, w));
    q->validate("layer " + std::to_string(l) + " linear " + std::to_string(which));
    TESSERA_CHECK(q->out == w.size(0) && q->in == w.size(1), "quantize: layer ", l, " linear ",
                  which, " came back (", q->out, ", ", q->in, "), expected ", shape_str(w.shape()));
    lin.quant = std::move(q);
    lin.weight = Tensor();
  }
  if (has_compute_copy_) refresh_compute_unit(static_cast<int>(l) + 1);
}

void Model::finish_quantization(std::optional<io::QuantCheckpointFormat> format) {
  for (int64_t l = 0; l < config_.num_layers; ++l)
    for (int which = 0; which < 4; ++which)
      TESSERA_CHECK(weights_.layers[l].linear(which).quant, "quantize: layer ", l, " linear ",
                    which, " was not quantized");
  quantized_ = true;
  config_.quantization = std::move(format);
  refresh_compute_weights();  // the compute copies point at the quantized linears too
}

void Model::quantize_lm_head(const std::function<kernels::QuantWeight(const Tensor& weight)>& quantize) {
  TESSERA_CHECK(!quant_lm_head_, "the model's lm_head is already quantized");
  TESSERA_CHECK(shard_.size == 1 && stage_.whole(),
                "quantization needs the whole model (not a tensor-parallel shard or pipeline stage)");
  TESSERA_CHECK(hooks_ == nullptr, "quantized weights are for inference, not under a training wrapper");
  TESSERA_CHECK(weights_.lm_head.defined(), "quantize: the model has no lm_head");
  const Tensor w = weights_.lm_head.to(DType::kF32).contiguous();
  set_quantized_lm_head(quantize(w), "lm_head");
  compute_.lm_head = Tensor();
}

void Model::set_quantized_lm_head(kernels::QuantWeight q, const std::string& what) {
  q.validate(what);
  TESSERA_CHECK(q.out == config_.vocab_size && q.in == config_.hidden_size, what, ": (", q.out, ", ", q.in,
                "), expected (", config_.vocab_size, ", ", config_.hidden_size, ")");
  quant_lm_head_ = std::make_shared<kernels::QuantWeight>(std::move(q));
  if (!config_.tie_word_embeddings) weights_.lm_head = Tensor();  // (tied: it is the embedding table)
}

std::string Model::weights_description() const {
  const auto scheme = [](const kernels::QuantWeight& q) {
    std::string s = kernels::quant_scheme_name(q.scheme);
    if (q.group != q.in) s += " g" + std::to_string(q.group);
    return s;
  };
  std::string s = quantized_ ? scheme(*weights_.layers[0].qkv.quant) : std::string(dtype_name(compute_dtype_));
  if (quantized_ && config_.quantization && !config_.quantization->quantizer.empty())
    s += " (" + config_.quantization->quantizer + ")";
  if (quant_lm_head_) s += ", lm_head " + scheme(*quant_lm_head_);
  return s;
}

int64_t Model::matmul_weight_bytes() const {
  int64_t n = 0;
  const int64_t es = static_cast<int64_t>(dtype_size(compute_dtype_));
  for (const auto& L : weights_.layers)
    for (int which = 0; which < 4; ++which) {
      const Linear& lin = L.linear(which);
      if (lin.quant)
        n += lin.quant->nbytes();
      else if (lin.weight.defined())
        n += lin.weight.numel() * es;
    }
  const Tensor& head = compute_lm_head();
  if (quant_lm_head_)
    n += quant_lm_head_->nbytes();
  else if (head.defined())
    n += static_cast<int64_t>(head.nbytes());
  return n;
}

void Model::load_quantized_linears(const io::SafetensorsModel& file, const std::string& dir,
                                   std::set<std::string>& used) {
  const io::QuantCheckpointFormat& f = *config_.quantization;
  if (f.fp8_activations)
    TESSERA_LOG(kInfo, dir, ": the checkpoint's dynamic fp8 activations run as float here (fp8 weights, "
                "float products), as vLLM does on hardware without fp8 compute");
  // A module's tensors by suffix ("qweight", ...), each a one-line error when missing.
  const auto module_tensors = [&](const std::string& module) {
    return [&, module](const std::string& suffix) {
      const std::string name = module + "." + suffix;
      TESSERA_CHECK(file.has(name), dir, ": tensor '", name, "' is missing from the ", f.method, " checkpoint");
      used.insert(name);
      return file.get(name);
    };
  };
  for (int64_t l = 0; l < config_.num_layers; ++l)
    for (int which = 0; which < 4; ++which) {
      Linear& lin = weights_.layers[l].linear(which);
      const int64_t in = in_features(lin);
      std::vector<kernels::QuantWeight> parts;
      for (const auto& mod : linear_modules(config_, l, which))
        parts.push_back(io::unpack_quant_linear(module_tensors(mod.name), mod.rows, in, f, dir + ": " + mod.name));
      auto q = std::make_shared<kernels::QuantWeight>(
          parts.size() == 1 ? std::move(parts[0])
                            : kernels::quant_stack_rows(parts, dir + ": layer " + std::to_string(l)));
      q->validate(dir + ": layer " + std::to_string(l));
      lin.quant = std::move(q);
      lin.weight = Tensor();
    }
  if (f.lm_head)  // GPTQModel's quantized head: its tensors under "lm_head." (the float head is not read)
    set_quantized_lm_head(io::unpack_quant_linear(module_tensors("lm_head"), config_.vocab_size, config_.hidden_size,
                                                  f.lm_head_format(), dir + ": lm_head"),
                          dir + ": lm_head");
  quantized_ = true;
}

std::vector<std::pair<std::string, Tensor>> Model::quantized_tensors() const {
  TESSERA_CHECK(config_.quantization.has_value(), "saving ",
                weights_description(), " weights is not supported (int8 and int4 save in AutoGPTQ's format, w8a8 and "
                "fp8 in compressed-tensors')");
  const io::QuantCheckpointFormat& f = *config_.quantization;
  std::vector<std::pair<std::string, Tensor>> out;
  for (int64_t l = 0; l < config_.num_layers; ++l)
    for (int which = 0; which < 4; ++which) {
      const auto& q = *weights_.layers[l].linear(which).quant;
      int64_t row = 0;
      for (const auto& mod : linear_modules(config_, l, which)) {
        const kernels::QuantWeight part = kernels::quant_rows(q, row, row + mod.rows);
        row += mod.rows;
        for (auto& [suffix, t] : io::pack_quant_linear(part, f))
          out.emplace_back(mod.name + "." + suffix, std::move(t));
      }
    }
  TESSERA_CHECK(!quant_lm_head_ || f.lm_head, "saving: the quantized lm_head (", weights_description(),
                ") has no place in this ", f.method, " checkpoint");
  if (quant_lm_head_)
    for (auto& [suffix, t] : io::pack_quant_linear(*quant_lm_head_, f.lm_head_format()))
      out.emplace_back("lm_head." + suffix, std::move(t));
  return out;
}

}  // namespace tessera::model
