// Model construction: loading and saving Hugging Face directories, random init,
// and the compute-dtype weight copies.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <set>
#include <tuple>

#include "tessera/base/cpu_features.h"
#include "tessera/base/logging.h"
#include "tessera/base/thread_pool.h"
#include "tessera/io/gguf.h"
#include "tessera/io/json_file.h"
#include "tessera/io/safetensors.h"
#include "tessera/model/model.h"

namespace tessera::model {

KVCache KVCache::create(const ModelConfig& c, int64_t capacity, TpShard shard) {
  TESSERA_CHECK(capacity > 0, "KV cache capacity must be positive, got ", capacity);
  const int64_t kv_heads = local_dims(c, shard).kv_heads;
  KVCache kv;
  kv.capacity = capacity;
  // (The multi-token prediction layer's too: --speculative mtp runs it over its own cache.)
  for (int64_t l = 0; l < c.num_layers + c.mtp_layers; ++l) {
    if (c.uses_mla()) {
      kv.k.push_back(Tensor::empty({capacity, 1, c.kv_lora_rank + c.qk_rope_head_dim}, DType::kF32));
      kv.v.emplace_back();
      continue;
    }
    kv.k.push_back(Tensor::empty({capacity, kv_heads, c.head_dim}, DType::kF32));
    kv.v.push_back(Tensor::empty({capacity, kv_heads, c.head_dim}, DType::kF32));
  }
  return kv;
}

KVCache KVCache::create_mtp(const ModelConfig& c, int64_t capacity) {
  TESSERA_CHECK(c.mtp_layers > 0 && c.uses_mla(), c.model_type, " has no multi-token prediction module");
  TESSERA_CHECK(capacity > 0, "KV cache capacity must be positive, got ", capacity);
  KVCache kv;  // (the module's own layer only)
  kv.capacity = capacity;
  kv.k.resize(c.num_layers + 1);
  kv.v.resize(c.num_layers + 1);
  kv.k[c.num_layers] = Tensor::empty({capacity, 1, c.kv_lora_rank + c.qk_rope_head_dim}, DType::kF32);
  return kv;
}

void KvAttention::attend_latent(int64_t, const Tensor&, const LatentFn&) {
  fail("this KV cache holds per-head keys and values, not the latent rows a latent-attention model caches");
}

namespace {

// Names that checkpoints carry but that hold no parameters (buffers).
bool is_ignorable_buffer(const std::string& name) {
  auto ends_with = [&](const char* s) {
    const std::string suf(s);
    return name.size() >= suf.size() && name.compare(name.size() - suf.size(), suf.size(), suf) == 0;
  };
  return ends_with(".attn.bias") || ends_with(".attn.masked_bias") ||
         ends_with("rotary_emb.inv_freq");
}

// Gemma's RMSNorm multiplies by 1 + weight: its norm weights are held as 1 + w (so the
// norm kernels run unchanged) and written back as w. Adds `delta` to every norm weight.
bool is_norm_weight(const std::string& name) {
  return name.size() > 11 && name.compare(name.size() - 11, 11, "norm.weight") == 0;
}

void shift_by(Tensor& t, float delta) {
  Tensor f = t.to(DType::kF32).contiguous();
  if (f.data<float>() == t.raw_data()) f = f.clone();
  for (int64_t i = 0; i < f.numel(); ++i) f.data<float>()[i] += delta;
  t.copy_from(f);
}

}  // namespace

Model Model::load(const std::string& dir, DType dtype) { return load(dir, dtype, TpShard{}); }

Model Model::load(const std::string& dir, DType dtype, TpShard shard) {
  return load(dir, dtype, shard, PpStage{});
}

Model Model::load(const std::string& dir, DType dtype, TpShard shard, const PpStage& stage) {
  if (io::is_gguf_path(dir)) return load_gguf(dir, dtype, shard, stage);
  ModelConfig::check_model_path(dir);
  TESSERA_CHECK(dtype == DType::kF32 || dtype == DType::kBF16,
                "model weights must load as f32 or bf16, not ", dtype_name(dtype));
  TESSERA_CHECK(std::filesystem::is_directory(dir), "model directory '", dir,
                "' does not exist");
  Model m;
  m.config_ = ModelConfig::load(dir);
  m.shard_ = shard;
  m.stage_ = stage;
  m.dims_ = local_dims(m.config_, shard);
  m.dtype_ = m.compute_dtype_ = dtype;
  m.bf16_mode_ = dtype == DType::kBF16 ? Bf16Mode::kNative : Bf16Mode::kOff;
  const bool quantized = m.config_.quantization.has_value();
  TESSERA_CHECK(!quantized || (shard.size == 1 && stage.whole()), dir,
                ": quantized weights load whole (tensor or pipeline parallelism over them is "
                "not supported yet)");
  // Quantized: the float linears are dropped before anything touches their pages.
  m.weights_ = Params::allocate(m.config_, dtype, m.dims_, !quantized, stage);
  const auto file = io::SafetensorsModel::open(dir);
  std::set<std::string> used;
  if (quantized) m.load_quantized_linears(file, dir, used);

  // GPT-2 checkpoints from the hub name tensors with or without "transformer.".
  std::string strip;
  if (m.config_.arch == Arch::kGpt2 && !file.has("transformer.wte.weight") &&
      file.has("wte.weight"))
    strip = "transformer.";

  // A tied head on a pipeline stage without the embeddings reads its copy from them.
  const std::string embed_name = embedding_name(m.config_);
  for (auto& piece : m.weights_.pieces(m.config_, shard)) {
    std::string name = piece.name;
    if (name == "lm_head.weight" && m.config_.tie_word_embeddings && !file.has(name)) name = embed_name;
    const std::string stored = strip.empty() ? name : name.substr(strip.size());
    // A selection bias the checkpoint lacks (a model trained without one) starts at 0.
    if (!file.has(stored) && name.size() > 23 && name.compare(name.size() - 23, 23, "e_score_correction_bias") == 0)
      continue;
    TESSERA_CHECK(file.has(stored), dir, ": tensor '", stored, "' is missing from the checkpoint");
    Tensor src = file.get(stored);  // a view of the mapping: only the block is read
    TESSERA_CHECK(src.shape() == piece.full, dir, ": tensor '", stored, "' has shape ",
                  shape_str(src.shape()), " but config.json implies ", shape_str(piece.full));
    TESSERA_CHECK(src.dtype() == DType::kF32 || src.dtype() == DType::kBF16 ||
                      src.dtype() == DType::kF16,
                  dir, ": tensor '", stored, "' has dtype ", dtype_name(src.dtype()),
                  ", expected a float type");
    piece.view.copy_from(piece.block_of(src));
    if (m.config_.norm_offset && is_norm_weight(name)) shift_by(piece.view, 1.f);
    used.insert(stored);
  }
  int unused = 0;
  for (const auto& name : file.names()) {
    if (used.count(name) || is_ignorable_buffer(name) || is_mtp_shared_copy(m.config_, name)) continue;
    if (!stage.whole() || shard.ep_size > 1) continue;  // the other stages' or ranks' tensors
    // A tied checkpoint may still carry lm_head.weight; it must equal the embedding.
    if (name == "lm_head.weight" && m.config_.tie_word_embeddings) continue;
    if (++unused <= 5) TESSERA_LOG(kWarn, dir, ": ignoring unexpected tensor '", name, "'");
  }
  return m;
}

void Model::set_moe_capacity_factor(double f) {
  TESSERA_CHECK(f == 0.0 || (f > 0.0 && f <= 1e6), "moe capacity factor must be > 0 (or 0: no limit), got ", f);
  moe_capacity_factor_ = f;
}

void Model::set_mtp_loss_weight(double w) {
  TESSERA_CHECK(std::isfinite(w) && w >= 0.0 && w <= 1e3, "mtp loss weight must be in [0, 1000], got ", w);
  TESSERA_CHECK(w == 0.0 || config_.mtp_layers > 0, "mtp loss weight ", w, ": ", config_.model_type,
                " has no multi-token prediction module (num_nextn_predict_layers)");
  TESSERA_CHECK(w == 0.0 || stage_.whole(), "multi-token prediction under pipeline parallelism is not supported yet");
  mtp_loss_weight_ = w;
}

void Model::set_cp_comm(CpComm* cp, CpMethod method) {
  TESSERA_CHECK(!cp || !sequence_parallel_, "context parallelism with sequence parallelism is not supported yet");
  cp_comm_ = cp;
  cp_method_ = method;
}

void Model::set_ep_comm(EpComm* ep) {
  TESSERA_CHECK(!ep || (ep->size() == shard_.ep_size && ep->rank() == shard_.ep_rank),
                "Model::set_ep_comm: the model is expert shard ", shard_.ep_rank, " of ", shard_.ep_size,
                ", the group has rank ", ep ? ep->rank() : 0, " of ", ep ? ep->size() : 0);
  ep_comm_ = ep;
}

void Model::set_sequence_parallel(bool on) {
  TESSERA_CHECK(!on || (tp_comm_ && shard_.size > 1),
                "sequence parallelism needs tensor parallelism (tp > 1 with its collectives)");
  TESSERA_CHECK(!on || !config_.uses_mla(), "sequence parallelism over ", config_.model_type,
                "'s latent attention is not supported yet");
  sequence_parallel_ = on;
}

Model Model::stage(const PpStage& stage) const {
  TESSERA_CHECK(stage_.whole(), "Model::stage: this model is already a pipeline stage");
  TESSERA_CHECK(!quantized_ && !quant_lm_head_, "pipeline stages of quantized weights are not supported yet");
  Model m;
  m.config_ = config_;
  m.shard_ = shard_;
  m.stage_ = stage;
  m.dims_ = dims_;
  m.dtype_ = m.compute_dtype_ = dtype_;
  m.bf16_mode_ = dtype_ == DType::kBF16 ? Bf16Mode::kNative : Bf16Mode::kOff;
  m.recompute_ = recompute_;
  m.weights_ = Params::allocate(config_, dtype_, dims_, false, stage);
  const auto mine = m.weights_.pieces(config_, shard_);
  const auto all = weights_.pieces(config_, shard_);
  for (const auto& piece : mine) {
    if (piece.name == "lm_head.weight" && config_.tie_word_embeddings) continue;  // copied below
    // The same (name, offset) piece of this model; a fused tensor may list several.
    const auto it = std::find_if(all.begin(), all.end(), [&](const Piece& p) {
      return p.name == piece.name && p.offset == piece.offset;
    });
    TESSERA_CHECK(it != all.end(), "Model::stage: tensor '", piece.name, "' is missing");
    Tensor dst = piece.view;
    dst.copy_from(it->view);
  }
  // A tied head on a stage without the embeddings: its copy of them.
  if (config_.tie_word_embeddings && !m.weights_.embed.defined() && m.weights_.lm_head.defined())
    m.weights_.lm_head.copy_from(weights_.embed);
  return m;
}

Model Model::shard(TpShard shard) const {
  TESSERA_CHECK(shard_.whole(), "Model::shard: this model is already a shard");
  TESSERA_CHECK(!quantized_ && !quant_lm_head_, "tensor-parallel shards of quantized weights are not supported yet");
  Model m;
  m.config_ = config_;
  m.shard_ = shard;
  m.dims_ = local_dims(config_, shard);
  m.dtype_ = m.compute_dtype_ = dtype_;
  m.bf16_mode_ = dtype_ == DType::kBF16 ? Bf16Mode::kNative : Bf16Mode::kOff;
  m.recompute_ = recompute_;
  m.weights_ = Params::allocate(config_, dtype_, m.dims_);
  std::map<std::string, Tensor> whole;
  for (auto& [name, t] : weights_.named(config_)) whole.emplace(name, t);
  for (auto& piece : m.weights_.pieces(config_, shard))
    piece.view.copy_from(piece.block_of(whole.at(piece.name)));
  return m;
}

namespace {

// splitmix64: a fast, seedable generator so multi-GB random models start quickly.
inline uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Fills t with a sum of uniforms scaled to standard deviation `std` (close to normal).
void fill_random(Tensor& t, float std, uint64_t seed) {
  Tensor f = Tensor::empty(t.shape(), DType::kF32);
  float* p = f.data<float>();
  const int64_t n = f.numel();
  constexpr int64_t kChunk = 1 << 16;
  base::parallel_for((n + kChunk - 1) / kChunk, 1, [&](int64_t b, int64_t e) {
    for (int64_t c = b; c < e; ++c) {
      uint64_t s = seed * 0x100000001b3ull + static_cast<uint64_t>(c) * 0x9e3779b97f4a7c15ull;
      const int64_t end = std::min(n, (c + 1) * kChunk);
      for (int64_t i = c * kChunk; i < end; ++i) {
        // Sum of 4 uniforms in [-0.5, 0.5): variance 4/12.
        float acc = 0.f;
        uint64_t r = splitmix(s);
        for (int k = 0; k < 4; ++k) acc += static_cast<float>((r >> (16 * k)) & 0xffff) / 65536.f - 0.5f;
        p[i] = acc * std * 1.7320508f;
      }
    }
  });
  t.copy_from(f);
}

}  // namespace

Model Model::random(const ModelConfig& config, DType dtype, uint64_t seed) {
  return random(config, dtype, seed, TpShard{}, PpStage{});
}

Model Model::random(const ModelConfig& config, DType dtype, uint64_t seed, TpShard shard,
                    const PpStage& stage) {
  config.validate("random model config");
  Model m;
  m.config_ = config;
  m.shard_ = shard;
  m.stage_ = stage;
  m.dims_ = local_dims(config, shard);
  m.dtype_ = m.compute_dtype_ = dtype;
  m.bf16_mode_ = dtype == DType::kBF16 ? Bf16Mode::kNative : Bf16Mode::kOff;
  m.weights_ = Params::allocate(config, dtype, m.dims_, true, stage);
  const bool whole = shard.whole() && stage.whole();
  // Where each Hugging Face tensor goes on this rank (a tied stage's lm_head copy is the
  // embedding's); the draw order (and so every value) is the whole model's, as listed by
  // an untouched layout of it.
  std::map<std::string, std::vector<Piece>> mine;
  if (!whole) {
    const std::string embed = embedding_name(config);
    for (auto& p : m.weights_.pieces(config, shard)) {
      const std::string name = config.tie_word_embeddings && p.name == "lm_head.weight" ? embed : p.name;
      mine[name].push_back(std::move(p));
    }
  }
  const Params layout = whole ? Params() : Params::allocate(config, dtype, local_dims(config, {}), false);
  const auto named = whole ? m.weights_.named(config) : layout.named(config);
  uint64_t k = 0;
  for (const auto& [name, view] : named) {
    ++k;
    if (!whole && !mine.count(name)) continue;
    const bool is_norm = name.find("norm") != std::string::npos ||
                         name.find("ln_") != std::string::npos;
    const bool is_bias = name.size() > 5 && (name.compare(name.size() - 5, 5, ".bias") == 0 ||
                                             name.compare(name.size() - 5, 5, "_bias") == 0);
    Tensor t = whole ? view : Tensor::empty(view.shape(), dtype);
    if (is_norm && !is_bias)
      t.fill(1.f);
    else if (is_bias)
      t.zero();
    else
      fill_random(t, 0.02f, seed * 1000003ull + k);
    if (whole) continue;
    for (const Piece& p : mine.at(name)) {
      Tensor dst = p.view;
      dst.copy_from(p.block_of(t));
    }
  }
  return m;
}

std::vector<std::pair<std::string, std::string>> Model::hf_json_files() const {
  nlohmann::json j = config_.to_json();
  j["torch_dtype"] = dtype_ == DType::kBF16 ? "bfloat16" : "float32";
  nlohmann::json g = nlohmann::json::object();
  if (config_.bos_token_id >= 0) g["bos_token_id"] = config_.bos_token_id;
  if (config_.eos_token_id >= 0) g["eos_token_id"] = config_.eos_token_id;
  return {{"config.json", j.dump(2) + "\n"}, {"generation_config.json", g.dump(2) + "\n"}};
}

void save_hf_directory(const std::string& dir,
                       const std::vector<std::pair<std::string, std::string>>& json_files,
                       const std::vector<std::pair<std::string, Tensor>>& tensors,
                       uint64_t max_shard_bytes) {
  std::filesystem::create_directories(dir);
  for (const auto& [name, text] : json_files) io::write_file_atomic(dir + "/" + name, text);
  io::save_safetensors_sharded(dir, tensors, max_shard_bytes, {{"format", "pt"}});
}

void Model::save(const std::string& dir, uint64_t max_shard_bytes) const {
  TESSERA_CHECK(quantized_ || !quant_lm_head_, "saving: a quantized lm_head over float linears has no "
                "checkpoint format (quantize the linears too)");
  auto tensors = weights_.named(config_);
  if (quantized_)
    for (auto& t : quantized_tensors()) tensors.push_back(std::move(t));
  save_hf_model(dir, config_, hf_json_files(), std::move(tensors), max_shard_bytes);
}

void save_hf_model(const std::string& dir, const ModelConfig& config,
                   const std::vector<std::pair<std::string, std::string>>& json_files,
                   std::vector<std::pair<std::string, Tensor>> tensors, uint64_t max_shard_bytes,
                   std::optional<DType> save_as) {
  add_mtp_shared_copies(config, tensors);
  std::vector<std::pair<std::string, std::string>> files = json_files;
  if (save_as) {
    TESSERA_CHECK(*save_as == DType::kF32 || *save_as == DType::kBF16, "models save as f32 or bf16, not ",
                  dtype_name(*save_as));
    for (auto& [name, t] : tensors)
      if (t.dtype() == DType::kF32 || t.dtype() == DType::kBF16) t = t.to(*save_as);
    for (auto& [name, text] : files)
      if (name == "config.json") {
        nlohmann::json j = nlohmann::json::parse(text);
        j["torch_dtype"] = *save_as == DType::kBF16 ? "bfloat16" : "float32";
        text = j.dump(2) + "\n";
      }
  }
  if (config.norm_offset)
    for (auto& [name, t] : tensors)
      if (is_norm_weight(name)) {
        Tensor w = Tensor::empty(t.shape(), t.dtype());
        w.copy_from(t);
        shift_by(w, -1.f);
        t = w;
      }
  save_hf_directory(dir, files, tensors, max_shard_bytes);
}

Recompute parse_recompute(const std::string& name) {
  if (name == "none") return Recompute::kNone;
  if (name == "selective") return Recompute::kSelective;
  if (name == "full") return Recompute::kFull;
  fail("activation checkpointing '", name, "' is not one of none, selective, full");
}

const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::kNone: return "none";
    case Recompute::kSelective: return "selective";
    default: return "full";
  }
}

void Model::set_compute_dtype(DType dtype, Bf16Request request) {
  TESSERA_CHECK(dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16,
                "compute dtype must be f32, bf16 or f16, not ", dtype_name(dtype));
  TESSERA_CHECK(dtype != DType::kF16 || dtype_ == DType::kF32,
                "f16 compute needs f32 master weights, the model holds ", dtype_name(dtype_));
  compute_dtype_ = dtype;
  has_compute_copy_ = dtype != dtype_;
  // bf16 storage multiplies natively whatever the CPU: there is nothing to emulate.
  bf16_mode_ = dtype_ == DType::kBF16 && dtype == DType::kBF16 ? Bf16Mode::kNative
                                                                : choose_bf16_mode(dtype, request);
  compute_ = Params();
  if (!has_compute_copy_) return;
  refresh_compute_weights();
}

void Model::set_compute_dtype_in_place(DType dtype, Bf16Request request) {
  TESSERA_CHECK(dtype == DType::kF32 || dtype == DType::kBF16 || dtype == DType::kF16,
                "compute dtype must be f32, bf16 or f16, not ", dtype_name(dtype));
  TESSERA_CHECK(dtype_ == DType::kF32, "in-place compute precision needs f32 weight storage");
  compute_dtype_ = dtype;
  bf16_mode_ = choose_bf16_mode(dtype, request);
  compute_ = Params();
  // Native bf16 needs bf16 operands: copies of the matmul weights, per unit.
  has_compute_copy_ = bf16_mode_ == Bf16Mode::kNative;
  if (!has_compute_copy_) return;
  refresh_compute_weights();
}

namespace {

// Writes w in the compute precision into dst, reusing dst's storage when it already has
// the shape: a refresh after every optimizer step then allocates (and page-faults in)
// nothing, where a fresh copy of a 124M model costs 250-500 MB of new pages per step.
void convert_weight(const Tensor& w, Bf16Mode mode, DType compute, Tensor& dst) {
  const DType dt = mode == Bf16Mode::kNative ? compute : DType::kF32;
  if (!dst.defined() || dst.shape() != w.shape() || dst.dtype() != dt || !dst.is_contiguous())
    dst = Tensor::empty(w.shape(), dt);
  dst.copy_from(w);
  if (mode == Bf16Mode::kEmulated) round_bf16_in_place(dst);
  if (mode == Bf16Mode::kEmulatedF16) round_f16_in_place(dst);
}

// f(source, its compute copy) for every weight of a layer that has one.
template <typename Src, typename Dst, typename F>
void for_each_converted(Src& src, Dst& dst, F&& f) {
  f(src.qkv.weight, dst.qkv.weight);
  f(src.o.weight, dst.o.weight);
  f(src.up.weight, dst.up.weight);
  f(src.down.weight, dst.down.weight);
  f(src.moe.router, dst.moe.router);
  f(src.moe.gate_up, dst.moe.gate_up);
  f(src.moe.down, dst.moe.down);
  f(src.moe.shared_gate, dst.moe.shared_gate);
}

}  // namespace

Tensor Model::compute_copy_of(const Tensor& weight) const {
  if (!has_compute_copy_ || !weight.defined()) return Tensor();
  Tensor found;
  const auto match = [&](const Tensor& src, const Tensor& copy) {
    if (!found.defined() && src.defined() && copy.defined() && src.raw_data() == weight.raw_data() &&
        src.numel() == weight.numel())
      found = copy;
  };
  for (size_t l = 0; l < weights_.layers.size() && l < compute_.layers.size(); ++l)
    for_each_converted(weights_.layers[l], compute_.layers[l], match);
  match(weights_.lm_head, compute_.lm_head);
  return found;
}

bool Model::unit_holds_lm_head(int unit) const {
  // A tied lm_head is the embedding (unit 0); an untied one, or a pipeline's last-stage
  // copy of a tied one, belongs to the head unit.
  return config_.tie_word_embeddings && stage_.holds_embed() ? unit == 0
                                                             : unit == config_.num_layers + 1;
}

std::vector<int64_t> Model::unit_layers(int unit) const {
  const int64_t L = config_.num_layers;
  if (unit >= 1 && unit <= L) return {unit - 1};
  std::vector<int64_t> out;
  if (unit == L + 1)
    for (int64_t l = L; l < static_cast<int64_t>(weights_.layers.size()); ++l) out.push_back(l);
  return out;
}

void Model::refresh_compute_unit(int unit) {
  if (!has_compute_copy_) return;
  const int64_t L = config_.num_layers;
  TESSERA_CHECK(unit >= 0 && unit <= L + 1, "refresh_compute_unit: unit ", unit, " out of range");
  if (compute_.layers.size() != weights_.layers.size()) {  // the first refresh: the layouts
    compute_.layers.resize(weights_.layers.size());
    for (size_t l = 0; l < weights_.layers.size(); ++l) {
      const auto& src = weights_.layers[l];
      auto& dst = compute_.layers[l];
      dst.qkv.in_out = src.qkv.in_out;
      dst.o.in_out = src.o.in_out;
      dst.up.in_out = src.up.in_out;
      dst.down.in_out = src.down.in_out;
    }
  }
  auto convert = [&](const Tensor& w, Tensor& dst) {
    // A wrapper may hold only some units' weights (ZeRO-3): the others have no copy.
    if (w.defined())
      convert_weight(w, bf16_mode_, compute_dtype_, dst);
    else
      dst = Tensor();
  };
  // The unit's layers: its block, or (the head) the multi-token prediction layer.
  for (int64_t l : unit_layers(unit)) {
    const auto& src = weights_.layers[l];
    auto& dst = compute_.layers[l];
    for_each_converted(src, dst, convert);
    dst.moe.bias = src.moe.bias;  // (chooses experts in f32; shared like the biases below)
    dst.qkv.quant = src.qkv.quant;  // quantized linears are their own compute form
    dst.o.quant = src.o.quant;
    dst.up.quant = src.up.quant;
    dst.down.quant = src.down.quant;
    // Biases are added in f32: the copy shares the master's (rebound by a ZeRO-3 gather).
    dst.qkv.bias = src.qkv.bias;
    dst.o.bias = src.o.bias;
    dst.up.bias = src.up.bias;
    dst.down.bias = src.down.bias;
    pack_layer(l);
  }
  if (unit_holds_lm_head(unit)) {
    if (quant_lm_head_)
      compute_.lm_head = Tensor();  // the quantized head is its own compute form (tied: embed stays as it is)
    else
      convert(weights_.lm_head, compute_.lm_head);
  }
}

void Model::pack_layer(int64_t l) {
  LayerParams& d = compute_.layers[l];
  const bool on = packed_weights_ && has_compute_copy_ && bf16_mode_ == Bf16Mode::kNative &&
                  kernels::packed_products_supported();
  for (Linear* lin : {&d.qkv, &d.o, &d.up, &d.down}) {
    if (!on || !lin->weight.defined() || lin->quant || lin->weight.dtype() != DType::kBF16) {
      lin->packed_fwd = lin->packed_dx = kernels::PackedB();
      continue;
    }
    // (out, in): x W^T reads it as (N, K); dy W as (K, N). GPT-2's (in, out) the other way.
    kernels::pack_b(lin->weight, !lin->in_out, lin->packed_fwd);
    kernels::pack_b(lin->weight, lin->in_out, lin->packed_dx);
  }
  MoeWeights& m = d.moe;
  pack_expert_weights(m, on && m.gate_up.defined() && m.gate_up.dtype() == DType::kBF16 && m.down.defined());
}

void Model::set_packed_weights(bool on) {
  packed_weights_ = on;
  for (size_t l = 0; l < compute_.layers.size(); ++l) pack_layer(static_cast<int64_t>(l));
}

std::shared_ptr<const kernels::PackTargets> Model::packed_targets_of(const Tensor& weight) {
  if (!packed_weights_ || !weight.defined() || weight.dim() < 2) return nullptr;
  const auto same = [&](const Tensor& t) {
    return t.defined() && t.raw_data() == weight.raw_data() && t.numel() == weight.numel();
  };
  auto t = std::make_shared<kernels::PackTargets>();
  t->rows = weight.size(weight.dim() - 2), t->cols = weight.size(weight.dim() - 1);
  for (size_t l = 0; l < weights_.layers.size() && l < compute_.layers.size(); ++l) {
    const LayerParams& src = weights_.layers[l];
    LayerParams& dst = compute_.layers[l];
    for (int which = 0; which < 4; ++which) {
      Linear& lin = dst.linear(which);
      if (!same(src.linear(which).weight) || !lin.packed_fwd.defined()) continue;
      t->fwd = {&lin.packed_fwd};
      t->dx = {&lin.packed_dx};
      return t;
    }
    for (const auto& [w, fwd, dx] : {std::tuple{&src.moe.gate_up, &dst.moe.gate_up_fwd, &dst.moe.gate_up_dx},
                                     std::tuple{&src.moe.down, &dst.moe.down_fwd, &dst.moe.down_dx}}) {
      if (!same(*w) || fwd->empty()) continue;
      for (size_t e = 0; e < fwd->size(); ++e) t->fwd.push_back(&(*fwd)[e]), t->dx.push_back(&(*dx)[e]);
      return t;
    }
  }
  return nullptr;
}

void Model::release_compute_unit(int unit) {
  if (!has_compute_copy_) return;
  const int64_t L = config_.num_layers;
  TESSERA_CHECK(unit >= 0 && unit <= L + 1, "release_compute_unit: unit ", unit, " out of range");
  for (int64_t l : unit_layers(unit)) {
    auto& dst = compute_.layers[l];
    dst.qkv.weight = dst.o.weight = dst.up.weight = dst.down.weight = Tensor();
    dst.qkv.bias = dst.o.bias = dst.up.bias = dst.down.bias = Tensor();
    for (Linear* lin : {&dst.qkv, &dst.o, &dst.up, &dst.down}) lin->packed_fwd = lin->packed_dx = kernels::PackedB();
    dst.moe = MoeWeights();
  }
  if (unit_holds_lm_head(unit)) compute_.lm_head = Tensor();
}

void Model::refresh_compute_weights() {
  if (!has_compute_copy_) return;
  for (int u = 0; u < num_units(); ++u) refresh_compute_unit(u);
}

const Linear& Model::compute_linear(int64_t layer, int which) const {
  return (has_compute_copy_ ? compute_.layers[layer] : weights_.layers[layer]).linear(which);
}

std::vector<int64_t> Model::expert_load() const {
  return expert_load_ ? expert_load_->counts() : std::vector<int64_t>();
}

std::shared_ptr<ExpertLoad> Model::expert_counter() const {
  static std::mutex mu;
  std::lock_guard<std::mutex> lock(mu);
  if (!expert_load_) expert_load_ = std::make_shared<ExpertLoad>(config_.num_experts);
  return expert_load_;
}

void Model::count_expert_load(const MoeRouting& r) const { expert_counter()->add(r); }
void Model::count_expert_load(const std::vector<int64_t>& load) const { expert_counter()->add(load); }

const MoeWeights& Model::compute_moe(int64_t layer) const {
  return (has_compute_copy_ ? compute_.layers[layer] : weights_.layers[layer]).moe;
}

const Tensor& Model::compute_lm_head() const {
  return has_compute_copy_ ? compute_.lm_head : weights_.lm_head;
}

}  // namespace tessera::model
