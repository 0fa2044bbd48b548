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
  // q / k tensor (`heads` > 0) reordered into `keep`.
  const uint8_t* bytes(const io::GgufTensorInfo& t, int64_t heads, std::string& keep) const {
    const uint8_t* p = f_.data(t);
    if (heads == 0) return p;
    check_reorderable(t);
    const int64_t rows = t.ne.size() > 1 ? t.rows() : t.ne[0];
    keep.resize(t.nbytes);
    reorder_llama_rows(p, reinterpret_cast<uint8_t*>(keep.data()), heads, rows, static_cast<int64_t>(t.nbytes) / rows,
                       false);
    return reinterpret_cast<const uint8_t*>(keep.data());
  }

  // The block `piece` covers of tensor t (whose Hugging Face shape is piece.full) into
  // piece.view, converted to its dtype. A matrix is read a few hundred rows at a time,
  // only the piece's rows (a tensor-parallel shard reads its slice, never the whole).
  void load_piece(const io::GgufTensorInfo& t, int64_t heads, const Piece& piece) const {
    const std::string what = f_.path() + ": tensor '" + t.name + "'";
    if (piece.full.size() == 1) {  // a vector: small, read whole
      std::string keep;
      const uint8_t* src = bytes(t, heads, keep);
      Tensor v = Tensor::empty({piece.full[0]}, DType::kF32);
      io::dequantize_rows(t.type, src, 1, piece.full[0], v.data<float>(), what);
      Tensor dst = piece.view;
      dst.copy_from(piece.block_of(v));
      return;
    }
    const int64_t rows = piece.full[0], cols = piece.full[1];
    const int64_t r0 = piece.offset[0], nr = piece.view.size(0);
    const int64_t c0 = piece.offset[1], nc = piece.view.size(1);
    const int64_t rb = io::ggml_row_bytes(t.type, cols, what);
    // Chunks of whole heads when the rows are reordered (head-aligned: tp splits by heads).
    const int64_t unit = heads > 0 ? rows / heads : 1;
    if (heads > 0) check_reorderable(t);
    TESSERA_CHECK(r0 % unit == 0 && nr % unit == 0, what, ": rows ", r0, "-", r0 + nr,
                  " do not cover whole heads");
    const int64_t chunk = std::max<int64_t>(1, (int64_t{1} << 20) / std::max<int64_t>(cols, 1) / unit) * unit;
    Tensor tmp = Tensor::empty({std::min(chunk, nr), cols}, DType::kF32);
    std::vector<uint8_t> reordered(heads > 0 ? static_cast<size_t>(std::min(chunk, nr) * rb) : 0);
    const uint8_t* base = f_.data(t);
    for (int64_t a = r0; a < r0 + nr; a += chunk) {
      const int64_t b = std::min(r0 + nr, a + chunk);
      const uint8_t* src = base + a * rb;
      if (heads > 0) {
        reorder_llama_rows(src, reordered.data(), (b - a) / unit, b - a, rb, false);
        src = reordered.data();
      }
      Tensor part = tmp.slice(0, 0, b - a);
      io::dequantize_rows(t.type, src, b - a, cols, part.data<float>(), what);
      Tensor out = piece.view.slice(0, a - r0, b - r0);
      out.copy_from(nc == cols ? part : part.slice(1, c0, c0 + nc));
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
  // A vector's elements are its rows: only element types without blocks can be reordered.
  void check_reorderable(const io::GgufTensorInfo& t) const {
    TESSERA_CHECK(t.ne.size() > 1 || io::ggml_type_traits(static_cast<uint32_t>(t.type))->block == 1, f_.path(),
                  ": tensor '", t.name, "' is a ", io::ggml_type_name(t.type), " vector, whose blocks cannot be "
                  "reordered to Hugging Face's rope order");
  }
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

Model Model::load_gguf(const std::string& path, DType dtype, TpShard shard, const PpStage& stage) {
  TESSERA_CHECK(dtype == DType::kF32 || dtype == DType::kBF16,
                "model weights must load as f32 or bf16, not ", dtype_name(dtype));
  const auto file = io::GgufFile::open(path);
  Model m;
  m.config_ = gguf_model_config(file->header(), path);
  const ModelConfig& c = m.config_;
  m.shard_ = shard;
  m.stage_ = stage;
  m.dims_ = local_dims(c, shard);
  m.dtype_ = m.compute_dtype_ = dtype;
  m.bf16_mode_ = dtype == DType::kBF16 ? Bf16Mode::kNative : Bf16Mode::kOff;
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
  TESSERA_CHECK(!quantized || (shard.size == 1 && stage.whole()), path,
                ": quantized weights load whole (tensor or pipeline parallelism over them is not supported yet)");
  // Not zeroed: the pages of linears that stay quantized are never touched.
  m.weights_ = Params::allocate(c, dtype, m.dims_, false, stage);

  if (quantized)
    for (int64_t l = 0; l < L; ++l)
      for (int which = 0; which < 4; ++which) {
        Linear& lin = m.weights_.layers[l].linear(which);
        const int64_t in = lin.weight.size(1);
        std::vector<kernels::QuantWeight> parts;
        for (const LinearModule& mod : linear_modules(c, l, which)) {
          const std::string name = gguf_tensor_name(mod.name + ".weight");
          const io::GgufTensorInfo& t = rd.tensor(name, mod.rows, in);
          std::string keep;
          parts.push_back(*io::gguf_quant_weight(t.type, rd.bytes(t, rd.heads_of(name), keep), mod.rows, in));
        }
        const std::string what = path + ": layer " + std::to_string(l);
        auto q = std::make_shared<kernels::QuantWeight>(parts.size() == 1 ? std::move(parts[0])
                                                                           : kernels::quant_stack_rows(parts, what));
        q->validate(what);
        lin.quant = std::move(q);
        lin.weight = Tensor();  // pieces() below skips it
      }
  // The head runs as stored too where its type has a quantized form in groups of 32 (Q8_0,
  // Q4_0, Q4_K; a tied head is token_embd's rows), beside a float embedding table; an
  // untied float head is then never allocated. Q6_K (llama.cpp's usual output type) is
  // dequantized: its groups of 16 take the GEMV's scalar tail, slower than a float head.
  if (quantized) {
    const std::string head = gguf_tensor_name("lm_head.weight");
    const std::string name = file->tensor(head) || !c.tie_word_embeddings ? head : gguf_tensor_name(embedding_name(c));
    const io::GgufTensorInfo* t = file->tensor(name);
    if (t && keeps_quantization(t->type) && t->type != io::GgmlType::kQ6_K) {
      const io::GgufTensorInfo& info = rd.tensor(name, c.vocab_size, c.hidden_size);
      std::string keep;
      m.set_quantized_lm_head(
          *io::gguf_quant_weight(info.type, rd.bytes(info, rd.heads_of(name), keep), c.vocab_size, c.hidden_size),
          path + ": " + name);
    }
  }

  // Every float tensor (or this shard's block of it), by its Hugging Face name. A tied head
  // on a pipeline stage without the embeddings reads them.
  for (const Piece& piece : m.weights_.pieces(c, shard)) {
    std::string hf = piece.name;
    if (hf == "lm_head.weight" && c.tie_word_embeddings) hf = embedding_name(c);
    const std::string name = gguf_tensor_name(hf);
    TESSERA_CHECK(!name.empty(), path, ": tensor '", hf, "' has no GGUF name");
    const io::GgufTensorInfo& t = rd.tensor(name, piece.full[0], piece.full.size() > 1 ? piece.full[1] : 0);
    rd.load_piece(t, rd.heads_of(name), piece);
  }
  m.quantized_ = quantized;

  int unused = 0;
  if (shard.size == 1 && stage.whole())
    for (const io::GgufTensorInfo& t : file->header().tensors)
      if (!rd.used().count(t.name) && ++unused <= 5)
        TESSERA_LOG(kWarn, path, ": ignoring unexpected tensor '", t.name, "'");
  return m;
}

}  // namespace tessera::model
