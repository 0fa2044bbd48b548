// Llama / Qwen2 models as GGUF files, the way llama.cpp's convert_hf_to_gguf.py writes them:
// metadata keys ({arch}.block_count, ...), tensor names (blk.N.attn_q.weight, ...), Llama's
// q / k rows permuted from Hugging Face's rotate-half order to GGML's interleaved pairs
// (Qwen2 runs NEOX rope in llama.cpp and keeps Hugging Face's order), 1-D tensors in F32.
// Import (Model::load_gguf, model/gguf_import.cc) undoes exactly what export does.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "tessera/io/gguf.h"
#include "tessera/io/tokenizer.h"
#include "tessera/model/config.h"

namespace tessera::model {

class Model;

// The model configuration a GGUF file's metadata and tensor dims describe. Architectures
// "llama" and "qwen2"; anything Tessera cannot run (rope scaling, experts, partial rotary
// dims, sliding windows) is a one-line error naming the key. `source` names the file.
ModelConfig gguf_model_config(const io::GgufHeader& h, const std::string& source);

// llama.cpp's name of a Hugging Face tensor of a llama / qwen2 model
// ("model.layers.3.self_attn.q_proj.weight" -> "blk.3.attn_q.weight"); "" when it has none.
std::string gguf_tensor_name(const std::string& hf_name);

// The rows of a Llama q or k projection (rows = heads * head_dim) in GGUF order: entry r is
// the Hugging Face row that GGUF row r holds (convert_hf_to_gguf.py's LlamaModel.permute:
// within each head, row pairs (i, i + head_dim / 2) become rows (2i, 2i + 1)).
std::vector<int64_t> llama_gguf_row_order(int64_t heads, int64_t rows);
// Copies `rows` rows of `row_bytes` bytes of a Llama q / k tensor with `heads` heads from
// Hugging Face's row order to GGUF's (to_gguf) or back. Each head's rows stay among
// themselves, so any run of whole heads reorders on its own.
void reorder_llama_rows(const uint8_t* src, uint8_t* dst, int64_t heads, int64_t rows, int64_t row_bytes,
                        bool to_gguf);

// The tensor type of `tensors` and the file type a `tessera export --type` names: f32, f16,
// bf16, q8_0, q4_0, q4_k (one-line error otherwise).
io::GgmlType parse_gguf_export_type(const std::string& name);

struct GgufExportOptions {
  io::GgmlType type = io::GgmlType::kF16;  // of the 2-D weights
  std::string name;                        // general.name
};

// What export_gguf wrote: every tensor's name and type, in file order.
struct GgufExportReport {
  std::vector<std::pair<std::string, io::GgmlType>> tensors;
};

// Writes the whole model `m` (llama or qwen2; quantized linears are dequantized first) and
// its tokenizer (`tok` may be null: no tokenizer.ggml.* keys, and llama.cpp will not load
// the file) to `path`. 2-D weights take o.type, except where a row length is not a whole
// number of its blocks (the next type down: q4_k -> q4_0 -> f16, q8_0 / q4_0 -> f16) and
// the output head under the 4-bit types, which is Q8_0 (llama.cpp's quantizer keeps the
// head at Q6_K, which Tessera does not write); 1-D tensors are F32.
GgufExportReport export_gguf(const Model& m, const io::Tokenizer* tok, const std::string& path,
                             const GgufExportOptions& o);

}  // namespace tessera::model
