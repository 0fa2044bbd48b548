// Model::load_gguf: a llama / qwen2 GGUF file as a Model. Block linears stored in Q8_0,
// Q4_0, Q4_K or Q6_K keep their quantization in the kernels' exact form (io/gguf_blocks.h);
// everything else is dequantized to the model's float dtype.
#include <algorithm>
#include <cstring>
#include <set>

#include "tessera/base/error.h"
#include "tessera/base/logging.h"
#include "tessera/io/gguf_blocks.h"
#include "tessera/model/gguf_model.h"
#include "tessera/model/model.h"

namespace tessera::model {

namespace {

// Rows of `rows` x `row_bytes` bytes reordered so that output row order[r] is input row r:
// a Llama q / k tensor (any type: rows are whole blocks) back in Hugging Face's order.
std::string unpermute_rows(const uint8_t* src, int64_t rows, int64_t row_bytes, const std::vector<int64_t>& order) {
  std::string out(static_cast<size_t>(rows * row_bytes), '\0');
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(out.data() + order[r] * row_bytes, src + r * row_bytes, static_cast<size_t>(row_bytes));
  return out;
}

bool keeps_quantization(io::GgmlType t) {
  return t == io::GgmlType::kQ8_0 || t == io::GgmlType::kQ4_0 || t == io::GgmlType::kQ4_K ||
         t == io::GgmlType::kQ6_K;
}

class Reader {
 public:
  Reader(const io::GgufFile& f, const ModelConfig& c) : f_(f), c_(c) {}

  // The tensor `name` with the dims of a (rows, cols) matrix, or of a vector when cols is 0.
  const io::GgufTensorInfo& tensor(const std::string& name, int64_t rows, int64_t cols) {
    const io::GgufTensorInfo* t = f_.tensor(name);
    TESSERA_CHECK(t, f_.path(), ": tensor '", name, "' is missing");
    const std::vector<int64_t> want = cols > 0 ? std::vector<int64_t>{cols, rows} : std::vector<int64_t>{rows};
    TESSERA_CHECK(t->ne == want, f_.path(), ": tensor '", name, "' has dims ", dims(t->ne), " (innermost first), ",
                  "the metadata implies ", dims(want));
    used_.insert(name);
    return *t;
  }

  // The tensor's bytes in Hugging Face row order: in place in the mapping, or for a Llama
  // q / k tensor (`heads` > 0) unpermuted into `keep`.
  const uint8_t* bytes(const io::GgufTensorInfo& t, int64_t heads, std::string& keep) const {
    const uint8_t* p = f_.data(t);
    if (heads == 0) return p;
    // A vector's elements are its rows: only element types without blocks can be reordered.
    const int64_t rows = t.ne.size() > 1 ? t.rows() : t.ne[0];
    TESSERA_CHECK(t.ne.size() > 1 || io::ggml_type_traits(static_cast<uint32_t>(t.type))->block == 1, f_.path(),
                  ": tensor '", t.name, "' is a ", io::ggml_type_name(t.type), " vector, whose blocks cannot be "
                  "reordered to Hugging Face's rope order");
    keep = unpermute_rows(p, rows, static_cast<int64_t>(t.nbytes) / rows, llama_gguf_row_order(heads, rows));
    return reinterpret_cast<const uint8_t*>(keep.data());
  }

  // Dequantizes the tensor into dst ((rows, cols), or (cols) for a vector; f32 or bf16),
  // a few hundred rows at a time so no whole f32 copy of a bf16 embedding is made.
  void load_float(const io::GgufTensorInfo& t, int64_t heads, Tensor dst) const {
    std::string keep;
    const uint8_t* src = bytes(t, heads, keep);
    const int64_t cols = t.ne[0], rows = t.rows();
    const std::string what = f_.path() + ": tensor '" + t.name + "'";
    const int64_t rb = io::ggml_row_bytes(t.type, cols, what);
    Tensor d = dst.view({rows, cols});
    if (d.dtype() == DType::kF32) {
      io::dequantize_rows(t.type, src, rows, cols, d.data<float>(), what);
      return;
    }
    const int64_t chunk = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(cols, 1));
    Tensor tmp = Tensor::empty({std::min(chunk, rows), cols}, DType::kF32);
    for (int64_t r0 = 0; r0 < rows; r0 += chunk) {
      const int64_t r1 = std::min(rows, r0 + chunk);
      Tensor part = tmp.slice(0, 0, r1 - r0);
      io::dequantize_rows(t.type, src + r0 * rb, r1 - r0, cols, part.data<float>(), what);
      Tensor out = d.slice(0, r0, r1);
      out.copy_from(part);
    }
  }

  int64_t heads_of(const std::string& gguf_name) const {
    if (c_.arch != Arch::kLlama) return 0;
    if (gguf_name.find(".attn_q.") != std::string::npos) return c_.num_heads;
    if (gguf_name.find(".attn_k.") != std::string::npos) return c_.num_kv_heads;
    return 0;
  }

  const std::set<std::string>& used() const { return used_; }

 private:
  static std::string dims(const std::vector<int64_t>& ne) {
    std::string s = "[";
    for (size_t i = 0; i < ne.size(); ++i) s += (i ? ", " : "") + std::to_string(ne[i]);
    return s + "]";
  }
  const io::GgufFile& f_;
  const ModelConfig& c_;
  std::set<std::string> used_;
};

}  // namespace

Model Model::load_gguf(const std::string& path, DType dtype) {
  TESSERA_CHECK(dtype == DType::kF32 || dtype == DType::kBF16,
                "model weights must load as f32 or bf16, not ", dtype_name(dtype));
  const auto file = io::GgufFile::open(path);
  Model m;
  m.config_ = gguf_model_config(file->header(), path);
  const ModelConfig& c = m.config_;
  m.dims_ = local_dims(c, {});
  m.dtype_ = m.compute_dtype_ = dtype;
  m.bf16_mode_ = dtype == DType::kBF16 ? Bf16Mode::kNative : Bf16Mode::kOff;
  // Not zeroed: the pages of linears that stay quantized are never touched.
  m.weights_ = Params::allocate(c, dtype, m.dims_, false);
  Reader rd(*file, c);

  // The block linears keep their quantization only if every one of them can: Tessera's
  // quantized models are quantized throughout (save, shard and training checks rely on it).
  const int64_t L = c.num_layers;
  int64_t quantizable = 0, total = 0;
  std::string first_float;
  for (int64_t l = 0; l < L; ++l)
    for (int which = 0; which < 4; ++which)
      for (const LinearModule& mod : linear_modules(c, l, which)) {
        const std::string name = gguf_tensor_name(mod.name + ".weight");
        const io::GgufTensorInfo* t = file->tensor(name);
        TESSERA_CHECK(t, path, ": tensor '", name, "' is missing");
        ++total;
        if (keeps_quantization(t->type))
          ++quantizable;
        else if (first_float.empty())
          first_float = name + " (" + io::ggml_type_name(t->type) + ")";
      }
  const bool quantized = quantizable == total;
  if (quantizable > 0 && !quantized)
    TESSERA_LOG(kWarn, path, ": ", total - quantizable, " of ", total, " block linear tensors (", first_float,
                ", ...) have no quantized form in Tessera's kernels: every block linear is dequantized to ",
                dtype_name(dtype));

  for (int64_t l = 0; l < L; ++l) {
    LayerParams& P = m.weights_.layers[l];
    const std::string blk = "blk." + std::to_string(l) + ".";
    rd.load_float(rd.tensor(blk + "attn_norm.weight", c.hidden_size, 0), 0, P.norm1_w);
    rd.load_float(rd.tensor(blk + "ffn_norm.weight", c.hidden_size, 0), 0, P.norm2_w);
    for (int which = 0; which < 4; ++which) {
      Linear& lin = P.linear(which);
      const int64_t in = lin.weight.size(1);
      std::vector<kernels::QuantWeight> parts;
      int64_t row = 0;
      for (const LinearModule& mod : linear_modules(c, l, which)) {
        const std::string name = gguf_tensor_name(mod.name + ".weight");
        const io::GgufTensorInfo& t = rd.tensor(name, mod.rows, in);
        const int64_t heads = rd.heads_of(name);
        if (quantized) {
          std::string keep;
          parts.push_back(*io::gguf_quant_weight(t.type, rd.bytes(t, heads, keep), mod.rows, in));
        } else {
          rd.load_float(t, heads, lin.weight.slice(0, row, row + mod.rows));
        }
        if (lin.bias.defined()) {
          const std::string bias = gguf_tensor_name(mod.name + ".bias");
          rd.load_float(rd.tensor(bias, mod.rows, 0), rd.heads_of(bias), lin.bias.slice(0, row, row + mod.rows));
        }
        row += mod.rows;
      }
      if (!quantized) continue;
      // Parts stored in different forms (a Q4_K q with a Q6_K v) share the finest one.
      const bool same = std::all_of(parts.begin(), parts.end(), [&](const kernels::QuantWeight& q) {
        return q.scheme == parts[0].scheme && q.group == parts[0].group;
      });
      if (!same) {
        int64_t group = parts[0].group;
        for (const auto& q : parts) group = std::min(group, q.group);
        for (auto& q : parts) q = io::widen_quant_weight(q, group);
      }
      const std::string what = path + ": layer " + std::to_string(l);
      auto q = std::make_shared<kernels::QuantWeight>(parts.size() == 1 ? std::move(parts[0])
                                                                         : kernels::quant_stack_rows(parts, what));
      q->validate(what);
      lin.quant = std::move(q);
      lin.weight = Tensor();
    }
  }
  rd.load_float(rd.tensor("token_embd.weight", c.vocab_size, c.hidden_size), 0, m.weights_.embed);
  rd.load_float(rd.tensor("output_norm.weight", c.hidden_size, 0), 0, m.weights_.final_norm_w);
  if (!c.tie_word_embeddings)
    rd.load_float(rd.tensor("output.weight", c.vocab_size, c.hidden_size), 0, m.weights_.lm_head);
  m.quantized_ = quantized;

  int unused = 0;
  for (const io::GgufTensorInfo& t : file->header().tensors)
    if (!rd.used().count(t.name) && ++unused <= 5)
      TESSERA_LOG(kWarn, path, ": ignoring unexpected tensor '", t.name, "'");
  return m;
}

}  // namespace tessera::model
