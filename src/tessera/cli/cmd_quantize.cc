// `tessera quantize`: post-training quantization of a model directory into a quantized
// one (config.json's quantization_config and the tensors of AutoGPTQ, AutoAWQ or
// compressed-tensors), which `generate`, `serve`, `eval` and `bench` load as they load any.
#include <cstdio>
#include <filesystem>

#include "tessera/base/error.h"
#include "tessera/base/timer.h"
#include "tessera/cli/commands.h"
#include "tessera/io/gguf_tokenizer.h"
#include "tessera/io/json_file.h"
#include "tessera/io/tokenizer.h"
#include "tessera/model/quantize.h"

namespace tessera::cli {
namespace {

struct QuantizeFlags {
  std::string model, out, method = "rtn", calib, dtype = "bf16", type = "int";
  int bits = 8;
  int64_t group_size = 0;
  int64_t calib_samples = 32, calib_seq = 256, awq_inspect_tokens = 0;
  double damp = 0.01, alpha = 0.5;
  bool act_order = false;
  bool lm_head = false;
  bool awq_clip_qk = false;
};

// calib_samples windows of calib_seq tokens spread over the text, through the model's
// tokenizer (model::calibration_windows).
Tensor calibration_ids(const QuantizeFlags& f) {
  const auto tok = io::load_model_tokenizer(f.model);
  TESSERA_CHECK(tok.has_value(), "--calib: ", f.model,
                " has no tokenizer (tokenizer.json, or a GGUF file's tokenizer.ggml.*) to encode the "
                "calibration text with");
  const auto ids = tok->encode(io::read_file_bytes(f.calib), false);
  Tensor t = model::calibration_windows(ids, f.calib_samples, f.calib_seq, "--calib " + f.calib);
  if (t.size(0) < f.calib_samples)
    std::fprintf(stderr, "quantize: %s holds %zu tokens: calibrating on %lld sequences of %lld\n",
                 f.calib.c_str(), ids.size(), static_cast<long long>(t.size(0)),
                 static_cast<long long>(f.calib_seq));
  return t;
}

int run_quantize(const QuantizeFlags& f) {
  namespace fs = std::filesystem;
  model::QuantizeOptions o = model::quantize_options(f.method, f.bits, f.group_size, f.type);
  o.damp_percent = f.damp;
  o.act_order = f.act_order;
  o.alpha = f.alpha;
  o.awq_inspect_tokens = f.awq_inspect_tokens;
  o.awq_clip_qk = f.awq_clip_qk;
  o.lm_head = f.lm_head;
  model::check_quantize_options(o);
  TESSERA_CHECK(fs::absolute(f.out).lexically_normal() != fs::absolute(f.model).lexically_normal(),
                "--out ", f.out, " is the input model directory; write the quantized model elsewhere");
  TESSERA_CHECK(f.method == "rtn" || !f.calib.empty(), "--method ", f.method,
                " needs calibration text: --calib FILE");
  const Tensor calib = f.calib.empty() ? Tensor() : calibration_ids(f);
  base::Timer timer;
  model::Model m = model::Model::load(f.model, parse_dtype(f.dtype));
  TESSERA_CHECK(!m.quantized(), f.model, " is already quantized (", m.weights_description(), ")");
  const int64_t before = m.matmul_weight_bytes();
  base::ProgressBar bar("quantize " + f.method, m.config().num_layers);
  model::quantize_model(m, o, calib, [&](int64_t done, int64_t) { bar.update(done); });
  bar.finish();
  m.save(f.out);
  if (fs::is_directory(f.model)) {
    for (const char* extra : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"})
      if (fs::exists(fs::path(f.model) / extra))
        fs::copy_file(fs::path(f.model) / extra, fs::path(f.out) / extra,
                      fs::copy_options::overwrite_existing);
  } else if (const auto tok = io::load_model_tokenizer(f.model)) {
    tok->save(f.out);  // a GGUF file's tokenizer, as tokenizer.json
  }
  std::printf("quantized %s -> %s: %s, matmul weights %.1f MB -> %.1f MB (%.2fx smaller) in %.1f s\n",
              f.model.c_str(), f.out.c_str(), m.weights_description().c_str(), before / 1e6,
              m.matmul_weight_bytes() / 1e6, static_cast<double>(before) / m.matmul_weight_bytes(),
              timer.seconds());
  return 0;
}

}  // namespace

void add_quantize(CLI::App& app, Action& action) {
  auto f = std::make_shared<QuantizeFlags>();
  auto* cmd = app.add_subcommand("quantize", "Quantize a model's linear layers (int8 / int4) into a new directory");
  cmd->add_option("--model", f->model, "Hugging Face model directory or GGUF file (float weights)")->required();
  cmd->add_option("--out", f->out, "Output directory (AutoGPTQ, AutoAWQ or compressed-tensors layout)")->required();
  cmd->add_option("--method", f->method, "rtn, gptq, awq or smoothquant")->capture_default_str();
  cmd->add_option("--bits", f->bits, "8 or 4")->capture_default_str();
  cmd->add_option("--type", f->type,
                  "int (integer codes) or fp8 (e4m3 weights, --method rtn --bits 8; saved as "
                  "compressed-tensors float-quantized)")
      ->capture_default_str();
  cmd->add_option("--group-size", f->group_size,
                  "Columns per scale (4 bits: default 128; 8 bits: default per channel; -1 per channel)");
  cmd->add_option("--calib", f->calib, "Calibration text file (gptq, awq, smoothquant)");
  cmd->add_option("--calib-samples", f->calib_samples, "Calibration windows, spread evenly over the --calib text")->capture_default_str();
  cmd->add_option("--calib-seq", f->calib_seq, "Tokens per calibration sequence")->capture_default_str();
  cmd->add_option("--damp", f->damp, "GPTQ damping (fraction of the mean Hessian diagonal)")->capture_default_str();
  cmd->add_flag("--act-order", f->act_order, "GPTQ: quantize columns in order of decreasing activation energy");
  cmd->add_option("--alpha", f->alpha, "SmoothQuant migration strength")->capture_default_str();
  cmd->add_option("--awq-inspect-tokens", f->awq_inspect_tokens,
                  "AWQ: score the q/k/v and gate/up scales on the whole layer's output over this many "
                  "calibration tokens (AutoAWQ's block objective); 0: each linear on its own output")
      ->capture_default_str();
  cmd->add_flag("--awq-clip-qk", f->awq_clip_qk,
                "AWQ: run the clip search on q_proj and k_proj too (AutoAWQ leaves them unclipped)");
  cmd->add_flag("--quantize-lm-head", f->lm_head,
                "Quantize the head too, int8 per output channel (gptq / rtn; saved as GPTQModel's "
                "\"lm_head\": true)");
  cmd->add_option("--dtype", f->dtype, "dtype of the tensors left in float (embeddings, norms, head)")
      ->capture_default_str();
  cmd->callback([&action, f] { action = [f] { return run_quantize(*f); }; });
}

}  // namespace tessera::cli
