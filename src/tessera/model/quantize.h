// Post-training quantization of a model's block linears (embeddings, norms and, unless
// asked, the head stay in their float dtype): round-to-nearest, GPTQ (Frantar et al.), AWQ (Lin et al.)
// and SmoothQuant W8A8 (Xiao et al.), the last three calibrated on token ids run through
// the model layer by layer. `tessera quantize` saves the result as an AutoGPTQ / AutoAWQ
// checkpoint; `generate`, `serve` and `bench` can also quantize a float model on load.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "tessera/kernels/quant.h"
#include "tessera/model/model.h"

namespace tessera::model {

struct QuantizeOptions {
  std::string method = "rtn";  // rtn | gptq | awq | smoothquant
  kernels::QuantScheme scheme = kernels::QuantScheme::kInt8;
  int64_t group_size = 0;  // 0: the scheme's default (int4 128; int8, fp8: per channel); -1 per channel
  bool sym = false;        // int4: asymmetric by default; int8 is always symmetric
  double damp_percent = 0.01;  // gptq
  bool act_order = false;      // gptq
  int64_t block_size = 128;    // gptq lazy batch
  double alpha = 0.5;          // smoothquant migration strength
  // awq: q/k/v and gate/up scales scored on the layer's output over this many calibration
  // tokens (kernels::AwqOptions::inspect_tokens; 0: each linear on its own output)
  int64_t awq_inspect_tokens = 0;
  bool awq_clip_qk = false;  // awq: clip search on q and k too (kernels::AwqOptions::clip_qk)
  // The head too, int8 per output channel by rounding (llama.cpp keeps its output tensor at
  // 6-8 bits; GPTQModel's lm_head = True): int8 / int4 weights saved in AutoGPTQ's format
  // only (AutoAWQ's and compressed-tensors' keep lm_head float).
  bool lm_head = false;
};

// Options from the command line's spelling: `bits` 8 | 4 with `method`, or a scheme name
// (int8 | int4 | fp8 | w8a8) for on-the-fly quantization; one-line errors for the rest
// (e.g. awq at 8 bits, smoothquant at 4).
// `type` "int" (integers) or "fp8" (e4m3 weights: rtn, 8 bits, per channel or group).
QuantizeOptions quantize_options(const std::string& method, int bits, int64_t group_size,
                                 const std::string& type = "int");
QuantizeOptions quantize_options_for_scheme(const std::string& scheme);

// Options that do not go together, a one-line error each: AWQ's flags with another method,
// a quantized head with what cannot hold it (int8 / int4, not awq). quantize_model checks
// them first; a CLI calls this before it loads anything.
void check_quantize_options(const QuantizeOptions& o);

// The calibration windows of a tokenized text: min(samples, ids / seq) windows of seq
// tokens, (windows, seq) i32, spread evenly over the text and never overlapping: the first
// starts the text, the last ends it (window i starts at i (ids - seq) / (windows - 1)).
// GPTQ's reference code draws its windows at random over the whole training text, and
// AutoAWQ shuffles its dataset: a file's first tokens alone (one source, one topic) are
// not what the model will see. Fewer than seq tokens is a one-line error naming `what`.
Tensor calibration_windows(const std::vector<int32_t>& ids, int64_t samples, int64_t seq,
                           const std::string& what);

// Progress: (layers done, layers in all).
using QuantizeProgress = std::function<void(int64_t, int64_t)>;

// Quantizes m's block linears in place. calib_ids (B, T) i32 are the calibration tokens
// (gptq, awq, smoothquant need them; rtn ignores them).
void quantize_model(Model& m, const QuantizeOptions& o, const Tensor& calib_ids = Tensor(),
                    const QuantizeProgress& progress = {});

// `--quantization SCHEME` of generate / serve / eval / bench: round-to-nearest on load
// (nothing for "" or "none"); a model already quantized by its checkpoint is a one-line
// error (it runs as stored).
// `--quantization SCHEME [--quantize-lm-head]`: the scheme ("" or "none": none) and
// whether the head is quantized too (QuantizeOptions::lm_head).
struct LoadQuantization {
  std::string scheme;
  bool lm_head = false;
  LoadQuantization() = default;
  LoadQuantization(std::string s, bool head = false) : scheme(std::move(s)), lm_head(head) {}  // NOLINT: implicit
  LoadQuantization(const char* s) : scheme(s) {}                                                 // NOLINT: implicit
  bool none() const { return scheme.empty() || scheme == "none"; }
};
void quantize_on_load(Model& m, const LoadQuantization& q);

}  // namespace tessera::model
