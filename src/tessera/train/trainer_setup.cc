// Model construction, parameter flags, the spike detector and tokenizer files for the
// trainer.
#include "tessera/train/trainer_setup.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <set>
#include <tuple>

#include "tessera/base/error.h"
#include "tessera/base/trace.h"
#include "tessera/io/json_file.h"
#include "tessera/kernels/packed_b.h"
#include "tessera/parallel/pipeline_schedule.h"
#include "tessera/train/token_shard.h"
#include "tessera/train/sharded_state.h"

namespace tessera::train {

namespace {

// Sequences may not be longer than the model's context (max_position_embeddings, times the
// rope_scaling factor where it extends it): learned position embeddings end there, and
// generate / serve refuse positions past it in the model this run saves, RoPE or not.
void check_seq_len(const TrainConfig& c, const model::ModelConfig& cfg, const char* fix) {
  const int64_t ctx = model::max_context(cfg);
  TESSERA_CHECK(c.data.seq_len <= ctx, c.source_name(), ": data.seq_len ", c.data.seq_len,
                " exceeds the model's ", ctx == cfg.max_position_embeddings ? "max_position_embeddings " : "context ",
                ctx, " (", fix, ")");
}

// The mixture-of-experts training options against the model: a selection bias to move
// when the bias update is on.
model::ModelConfig with_moe_training(const TrainConfig& c, model::ModelConfig cfg) {
  const auto& tr = c.training;
  for (const auto& [key, v] : {std::pair<const char*, double>{"moe_capacity_factor", tr.moe_capacity_factor},
                               std::pair<const char*, double>{"moe_bias_update_rate", tr.moe_bias_update_rate}})
    TESSERA_CHECK(v == 0.0 || cfg.is_moe(), c.source_name(), ": [training] ", key, " = ", v,
                  " needs a mixture-of-experts model; ", cfg.model_type, " has no experts");
  if (tr.moe_bias_update_rate > 0) cfg.router_bias = true;
  return cfg;
}

model::ModelConfig base_model_config(const TrainConfig& c, int64_t data_vocab, int32_t data_eos);

}  // namespace

namespace {

// The vocabulary a tokenizer.json defines (its model's vocab / merges and its added tokens),
// or null when `path` (a file or a directory holding tokenizer.json) has none readable.
nlohmann::json tokenizer_vocabulary(const std::string& path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::path p = fs::is_directory(path, ec) ? fs::path(path) / "tokenizer.json" : fs::path(path);
  if (path.empty() || !fs::is_regular_file(p, ec)) return nullptr;
  try {
    const nlohmann::json j = io::read_json_file(p.string());
    nlohmann::json added = nlohmann::json::array();
    if (j.contains("added_tokens") && j["added_tokens"].is_array())
      for (const auto& t : j["added_tokens"])
        if (t.is_object()) added.push_back({t.value("id", -1), t.value("content", "")});
    return {{"model", j.value("model", nlohmann::json())}, {"added", added}};
  } catch (const std::exception&) {
    return nullptr;
  }
}

}  // namespace

DataMeta read_run_data_meta(const TrainConfig& c) {
  DataMeta m = read_data_meta(c.data.dir);
  const std::string& f = c.data.format;
  TESSERA_CHECK(f.empty() || (f == "chat") == m.chat, c.source_name(), ": data.format is \"", f, "\" but ",
                c.data.dir, " holds ", m.chat ? "chat data (data.format = \"chat\")" : "token shards (data.format = \"tokens\")");
  // Fine-tuning: ids of one tokenizer fed to a model trained on another's are garbage, even
  // when the vocabulary sizes agree.
  if (!c.model.init_from.empty() && !m.tokenizer.empty()) {
    const nlohmann::json data_vocab = tokenizer_vocabulary(m.tokenizer);
    const nlohmann::json model_vocab = tokenizer_vocabulary(c.model.init_from);
    TESSERA_CHECK(data_vocab.is_null() || model_vocab.is_null() || data_vocab == model_vocab, c.source_name(),
                  ": the data in ", c.data.dir, " was encoded with the tokenizer of ", m.tokenizer,
                  ", which is not the tokenizer of model.init_from ", c.model.init_from,
                  " (different tokens); prepare the data again with --tokenizer ", c.model.init_from);
  }
  return m;
}

std::string trace_path(const std::string& path, int rank, int world) {
  if (world == 1) return path;
  const std::filesystem::path p(path);
  return (p.parent_path() / (p.stem().string() + ".rank" + std::to_string(rank) + p.extension().string())).string();
}

int64_t params_bytes(const model::ModelConfig& c, model::Params& p) {
  int64_t n = 0;
  for (int unit = 0; unit < static_cast<int>(c.num_layers) + 2; ++unit)
    for (const auto& [name, t] : p.unit_tensors(c, unit)) n += static_cast<int64_t>(t->nbytes());
  return n;
}

model::TokenBatch batch_rows(const model::TokenBatch& b, int64_t r0, int64_t r1) {
  const auto rows = [&](const Tensor& t) { return t.defined() ? t.slice(0, r0, r1) : t; };
  return {rows(b.ids), rows(b.targets), rows(b.positions)};
}

model::TokenBatch cp_tokens(const model::TokenBatch& b, model::CpComm* cp, model::CpMethod method) {
  if (!cp) return b;
  TESSERA_CHECK(!b.positions.defined(), "packed chat rows with context parallelism are not supported yet");
  const int r = cp->rank(), n = cp->size();
  return {model::cp_local_tokens(b.ids, method, r, n), model::cp_local_tokens(b.targets, method, r, n), Tensor()};
}

std::string describe_packing(const DataLoader& loader) {
  const PackedRows* p = loader.packed_rows();
  if (!p) return "";
  char buf[320];
  std::snprintf(buf, sizeof buf,
                "train: chat data: %lld conversations packed into %lld rows of %lld tokens (%.1f%% filled), "
                "%lld assistant tokens trained on per epoch; %lld truncated to seq_len, %lld without a target dropped\n",
                static_cast<long long>(p->documents), static_cast<long long>(p->rows),
                static_cast<long long>(p->seq_len), 100 * p->fill(), static_cast<long long>(p->targets_counted),
                static_cast<long long>(p->truncated), static_cast<long long>(p->dropped));
  return buf;
}

model::ModelConfig build_model_config(const TrainConfig& c, int64_t data_vocab, int32_t data_eos) {
  return with_moe_training(c, base_model_config(c, data_vocab, data_eos));
}

namespace {

model::ModelConfig base_model_config(const TrainConfig& c, int64_t data_vocab, int32_t data_eos) {
  const auto& m = c.model;
  if (!m.init_from.empty()) {
    TESSERA_CHECK(std::filesystem::is_directory(m.init_from), "model directory '", m.init_from,
                  "' does not exist");
    const auto cfg = model::ModelConfig::load(m.init_from);
    TESSERA_CHECK(cfg.vocab_size >= data_vocab, "model.init_from: ", m.init_from,
                  " has vocab_size ", cfg.vocab_size, ", smaller than the data's vocabulary of ",
                  data_vocab);
    check_seq_len(c, cfg, "the limit of model.init_from's config.json; lower data.seq_len");
    return cfg;
  }
  model::ModelConfig cfg = m.config.empty()
                               ? model::ModelConfig::named_shape(m.shape)
                               : model::ModelConfig::from_json(io::read_json_file(m.config), m.config);
  if (!m.arch.empty()) {
    cfg.model_type = m.arch;
    cfg.arch = m.arch == "gpt2" ? model::Arch::kGpt2
               : m.arch == "qwen2" ? model::Arch::kQwen2
                                   : model::Arch::kLlama;
    cfg.qkv_bias = cfg.arch == model::Arch::kQwen2;
    if (cfg.arch == model::Arch::kGpt2) cfg.num_kv_heads = cfg.num_heads;
  }
  const bool shape_changed = m.hidden_size || m.num_heads;
  if (m.hidden_size) cfg.hidden_size = m.hidden_size;
  if (m.num_layers) cfg.num_layers = m.num_layers;
  if (m.num_heads) cfg.num_heads = m.num_heads;
  if (m.num_kv_heads) cfg.num_kv_heads = m.num_kv_heads;
  else if (m.num_heads && cfg.num_kv_heads > cfg.num_heads) cfg.num_kv_heads = cfg.num_heads;
  if (m.intermediate_size) cfg.intermediate_size = m.intermediate_size;
  if (m.max_position_embeddings) cfg.max_position_embeddings = m.max_position_embeddings;
  if (m.tie_word_embeddings >= 0) cfg.tie_word_embeddings = m.tie_word_embeddings == 1;
  if (shape_changed) {
    TESSERA_CHECK(cfg.num_heads > 0 && cfg.hidden_size % cfg.num_heads == 0,
                  "model.hidden_size ", cfg.hidden_size, " is not a multiple of model.num_heads ",
                  cfg.num_heads);
    cfg.head_dim = cfg.hidden_size / cfg.num_heads;
  }
  TESSERA_CHECK(cfg.num_kv_heads > 0 && cfg.num_heads % cfg.num_kv_heads == 0,
                "model.num_heads ", cfg.num_heads, " is not a multiple of model.num_kv_heads ",
                cfg.num_kv_heads);
  cfg.vocab_size = m.vocab_size ? m.vocab_size : data_vocab;
  TESSERA_CHECK(cfg.vocab_size >= data_vocab, "model.vocab_size ", cfg.vocab_size,
                " is smaller than the data's vocabulary of ", data_vocab);
  check_seq_len(c, cfg, "raise model.max_position_embeddings or lower data.seq_len");
  if (m.config.empty()) {  // a named shape's bos/eos ids mean nothing for this data
    cfg.bos_token_id = -1;
    cfg.eos_token_id = data_eos;
  }
  if (cfg.bos_token_id >= cfg.vocab_size) cfg.bos_token_id = -1;
  if (cfg.eos_token_id >= cfg.vocab_size) cfg.eos_token_id = -1;
  cfg.validate("[model] in the training config");
  return cfg;
}

}  // namespace

model::Model build_model(const TrainConfig& c, int64_t data_vocab, int32_t data_eos) {
  return build_model(c, build_model_config(c, data_vocab, data_eos));
}

model::Model build_model(const TrainConfig& c, const model::ModelConfig& cfg, model::TpShard shard,
                         const model::PpStage& stage) {
  if (!c.model.init_from.empty())
    return model::Model::load(c.model.init_from, DType::kF32, shard, stage);
  return model::Model::random(cfg, DType::kF32, c.model.seed, shard, stage);
}

std::map<std::string, ParamFlags> param_flags(const model::Model& m) {
  const auto& w = m.weights();
  std::map<std::string, ParamFlags> flags;
  for (const auto& piece : w.pieces(m.config(), m.tp_shard())) {
    const Tensor& p = piece.view;
    auto same = [&](const Tensor& t) { return t.defined() && t.raw_data() == p.raw_data(); };
    // (A pipeline's last-stage copy of a tied table is the embedding too: no decay.)
    const bool tied_copy = m.config().tie_word_embeddings && piece.name == "lm_head.weight";
    const bool embedding = same(w.embed) || same(w.pos_embed) || tied_copy;
    const bool head = same(w.lm_head);
    flags[piece.name] = {p.dim() == 2 && !embedding, p.dim() == 2 && !embedding && !head,
                         piece.copies, tied_copy};
  }
  return flags;
}

std::vector<ParamRef> make_param_refs(const model::Model& m, model::Params& grads) {
  const auto weights = m.weights().named(m.config());
  const auto grad_views = grads.named(m.config());
  TESSERA_CHECK(weights.size() == grad_views.size(), "trainer: gradient layout mismatch");
  const auto flags = param_flags(m);
  std::vector<ParamRef> refs;
  for (size_t i = 0; i < weights.size(); ++i) {
    ParamRef r;
    r.name = weights[i].first;
    r.param = weights[i].second;
    r.grad = grad_views[i].second;
    r.decay = flags.at(r.name).decay;
    r.muon = flags.at(r.name).muon;
    refs.push_back(std::move(r));
  }
  return refs;
}

bool SpikeDetector::is_spike(double loss) const {
  if (!s_.enabled) return false;
  if (!std::isfinite(loss)) return true;
  if (static_cast<int64_t>(losses_.size()) < s_.min_history) return false;
  return loss > mean() + s_.sigma * stddev();
}

void SpikeDetector::add(double loss) {
  if (!std::isfinite(loss)) return;
  losses_.push_back(loss);
  while (static_cast<int64_t>(losses_.size()) > s_.window) losses_.pop_front();
}

double SpikeDetector::mean() const {
  double s = 0;
  for (double l : losses_) s += l;
  return losses_.empty() ? 0 : s / static_cast<double>(losses_.size());
}

double SpikeDetector::stddev() const {
  if (losses_.size() < 2) return 0;
  const double mu = mean();
  double s = 0;
  for (double l : losses_) s += (l - mu) * (l - mu);
  return std::sqrt(s / static_cast<double>(losses_.size() - 1));
}

nlohmann::json SpikeDetector::to_json() const {
  return nlohmann::json(std::vector<double>(losses_.begin(), losses_.end()));
}

void SpikeDetector::load_json(const nlohmann::json& j) {
  TESSERA_CHECK(j.is_array(), "trainer_state.json: spike_window must be an array");
  losses_.clear();
  for (const auto& v : j) losses_.push_back(v.get<double>());
}

std::vector<std::pair<std::string, std::string>> tokenizer_files(const std::string& dir) {
  std::vector<std::pair<std::string, std::string>> files;
  if (dir.empty()) return files;
  for (const char* name : {"tokenizer.json", "tokenizer_config.json"}) {
    const std::string path = dir + "/" + name;
    if (std::filesystem::exists(path)) files.emplace_back(name, io::read_file_bytes(path));
  }
  TESSERA_CHECK(!files.empty(), "data.tokenizer: no tokenizer.json in ", dir);
  return files;
}

parallel::DataParallelConfig dp_config(const TrainConfig& c) {
  parallel::DataParallelConfig d;
  d.zero_stage = c.parallel.zero_stage;
  d.bucket_bytes = std::max<int64_t>(4, static_cast<int64_t>(c.parallel.bucket_mb * (1 << 20)));
  d.offload = c.parallel.offload;
  d.prefetch = c.parallel.prefetch;
  d.algorithm = comm::parse_algorithm(c.parallel.algorithm);
  const auto& p = c.training.precision;
  d.compute_dtype = p == "bf16" ? DType::kBF16 : p == "fp16" ? DType::kF16 : DType::kF32;
  d.bf16_request = model::parse_bf16_request(c.training.bf16_mode, "training.bf16_mode");
  d.packed_weights = kernels::packed_weights_enabled();
  return d;
}

std::vector<ParamRef> dp_param_refs(const parallel::DataParallel& dp,
                                    const std::map<std::string, ParamFlags>& flags,
                                    const std::string& optimizer_name,
                                    comm::Communicator* tp_group) {
  std::vector<ParamRef> refs;
  for (const auto& piece : dp.pieces()) {
    const ParamFlags f = flags.at(piece.name);
    const bool muon = f.muon && optimizer_name == "muon";
    TESSERA_CHECK(!(muon && !piece.whole() && dp.config().zero_stage > 0),
                  "optimizer.name = \"muon\" needs whole matrices on each rank, but "
                  "parallel.zero_stage = ", dp.config().zero_stage, " splits ", piece.name,
                  " over ", dp.world_size(),
                  " ranks; use zero_stage = 0 with Muon");
    TESSERA_CHECK(!(muon && !piece.whole()), "optimizer.name = \"muon\" under tensor parallelism ",
                  "needs each rank's block of ", piece.name, " as one matrix, but it holds it as "
                  "rows of a fused tensor (GPT-2's c_attn); use optimizer.name = \"adamw\"");
    ParamRef r;
    r.name = piece_key(piece.key, piece.offset, piece.whole());
    r.param = piece.master;
    r.grad = piece.grad;
    r.decay = f.decay;
    r.muon = f.muon;
    std::tie(r.chunk_align, r.chunk_phase) =
        dp.piece_chunk_alignment(static_cast<size_t>(&piece - dp.pieces().data()));
    // (Summed over the data-parallel ranks too when their pieces differ: each copy counts
    // its share.)
    r.norm_share = f.tied_copy ? 0.0
                               : 1.0 / static_cast<double>(f.tp_copies * (dp.sharded() ? piece.copies : 1));
    if (muon && tp_group && tp_group->size() > 1) {
      r.tp_group = tp_group;
      r.block_offset = piece.block_offset;
      r.full_shape = piece.full_shape;
    }
    refs.push_back(std::move(r));
  }
  return refs;
}

std::vector<std::pair<std::string, Tensor>> master_tensors(
    const std::vector<ParamRef>& refs, const std::vector<std::pair<std::string, Tensor>>& in_model) {
  std::map<const void*, const Tensor*> by_address;
  for (const auto& [name, t] : in_model) by_address[t.raw_data()] = &t;
  std::vector<std::pair<std::string, Tensor>> out;
  for (const ParamRef& r : refs) {
    const auto it = by_address.find(r.param.raw_data());
    const bool same = it != by_address.end() && it->second->dtype() == r.param.dtype() &&
                      it->second->numel() == r.param.numel();
    if (!same) out.emplace_back("master." + r.name, r.param);
  }
  return out;
}

void apply_training_options(const TrainConfig& c, model::Model& m) {
  const auto& tr = c.training;
  m.set_recompute(model::parse_recompute(tr.activation_checkpointing));
  m.set_moe_capacity_factor(tr.moe_capacity_factor);
  const bool mtp = m.config().mtp_layers > 0 && m.pp_stage().whole();
  m.set_mtp_loss_weight(tr.mtp_loss_weight >= 0 ? tr.mtp_loss_weight : mtp ? 0.1 : 0.0);
}

void add_mtp_metrics(nlohmann::json& rec, const GradientPass& gp, parallel::DataParallel& dp) {
  rec["mtp_loss"] = dp.sum_over_ranks(gp.mtp_loss_sum) / std::max(1.0, dp.sum_over_ranks(gp.mtp_passes));
}

void add_moe_metrics(nlohmann::json& rec, const GradientPass& gp, parallel::DataParallel& dp,
                     int64_t micro_batches) {
  const std::vector<double> load = dp.sum_over_ranks(gp.expert_load);
  double total = 0;
  for (double v : load) total += v;
  std::vector<double> share;
  for (double v : load) share.push_back(total > 0 ? v / total : 0.0);
  rec["moe_expert_load"] = share;
  rec["moe_load_imbalance"] = model::moe_load_imbalance(load);
  rec["moe_aux_loss"] = dp.sum_over_ranks(gp.aux_loss_sum) / static_cast<double>(micro_batches);
  nlohmann::json layers = nlohmann::json::array();  // per layer: slots per expert, whole batch
  for (const auto& l : gp.layer_load) layers.push_back(dp.sum_over_ranks(l));
  rec["moe_layer_load"] = layers;
  const double dropped = dp.sum_over_ranks(static_cast<double>(gp.dropped));
  rec["moe_dropped_slots"] = dropped;
  rec["moe_dropped_fraction"] = total + dropped > 0 ? dropped / (total + dropped) : 0.0;
}

std::vector<std::pair<std::string, Tensor>> shard_file_tensors(
    const std::vector<parallel::ShardPiece>& pieces, const std::vector<ParamRef>& refs,
    std::vector<std::pair<std::string, Tensor>> state, const std::vector<std::pair<std::string, Tensor>>& in_model) {
  std::vector<ParamRef> mine;
  for (size_t i = 0; i < refs.size(); ++i)
    if (pieces[i].primary) mine.push_back(refs[i]);
  auto out = master_tensors(mine, in_model);
  std::set<std::string> names;
  for (const ParamRef& r : mine) names.insert(r.name);
  for (auto& [name, t] : state)
    if (names.count(name.substr(name.find('.') + 1))) out.emplace_back(name, std::move(t));
  return out;
}

void check_memory_limit(const nlohmann::json& rec, double limit_mb, comm::Communicator& world,
                        const std::string& source) {
  const double mb = 1024.0 * 1024.0;
  const double p = rec.at("mem_params").get<double>() / mb, g = rec.at("mem_grads").get<double>() / mb,
               o = rec.at("mem_optimizer").get<double>() / mb, a = rec.at("mem_activations").get<double>() / mb;
  const bool over = p + g + o + a > limit_mb;
  const double ranks_over = parallel::exact_sum(world, over ? 1.0 : 0.0);
  if (ranks_over == 0) return;
  char buf[512];
  std::snprintf(buf, sizeof buf,
                "%s: %g of %d rank(s) need more than [training] memory_limit_mb = %g; rank %d needs %.1f MiB "
                "(parameters %.1f, gradients %.1f, optimizer %.1f, activations %.1f); spread it: [parallel] cp "
                "splits the sequence, zero_stage the states, tp / pp the model",
                source.c_str(), ranks_over, world.size(), limit_mb, world.rank(), p + g + o + a, p, g, o, a);
  fail(buf);
}

void update_router_bias(parallel::DataParallel& dp, const GradientPass& gp, double rate, const model::ModelConfig& c) {
  // The global batch's load per layer and expert (every rank calls this: a sum over dp).
  std::vector<double> flat;
  for (const auto& l : gp.layer_load) flat.insert(flat.end(), l.begin(), l.end());
  flat = dp.sum_over_ranks(flat);
  const size_t E = gp.layer_load.empty() ? 0 : gp.layer_load[0].size();
  const std::string suffix = ".gate.e_score_correction_bias";
  for (auto& piece : dp.pieces()) {
    const std::string& n = piece.name;
    if (n.size() < suffix.size() || n.compare(n.size() - suffix.size(), suffix.size(), suffix) != 0) continue;
    const size_t at = n.find("layers.") + 7;
    const size_t layer = std::stoul(n.substr(at, n.find('.', at) - at));
    size_t index = 0;  // the MoE layers before it (deepseek's first layers are dense)
    for (size_t l = 0; l < layer; ++l) index += c.layer_is_moe(static_cast<int64_t>(l)) || l >= size_t(c.num_layers);
    if (layer >= size_t(c.num_layers) && (index + 1) * E > flat.size()) continue;  // the module did not run
    TESSERA_CHECK((index + 1) * E <= flat.size(), "moe bias update: no load for layer ", layer);
    const double* load = flat.data() + index * E;
    double mean = 0;
    for (size_t e = 0; e < E; ++e) mean += load[e];
    mean /= static_cast<double>(E);
    float* b = piece.master.data<float>();
    for (int64_t i = 0; i < piece.master.numel(); ++i) {
      const double d = mean - load[piece.offset + i];
      b[i] += static_cast<float>(d > 0 ? rate : d < 0 ? -rate : 0.0);
    }
    dp.publish_piece(static_cast<size_t>(&piece - dp.pieces().data()));
  }
}

void update_weights(Optimizer& opt, parallel::DataParallel& dp, double lr_scale, float clip_coef,
                    const std::function<void()>& between) {
  const std::vector<ParamCopies> copies = dp.piece_copies();
  StepOptions o;
  o.grad_scale = clip_coef;
  if (!copies.empty()) o.copies = &copies;
  {
    base::TraceScope scope("optimizer_update");
    opt.step(lr_scale, o);
  }
  if (between) between();
  dp.publish_params(/*copies_written=*/!copies.empty());
}

GradientPass accumulate_gradients(model::Model& model, parallel::DataParallel& dp, int64_t accum,
                                  float scale,
                                  const std::function<model::TokenBatch(int64_t)>& batch) {
  GradientPass r;
  dp.start_step(/*first_micro_batch_assigns=*/true);
  for (int64_t micro = 0; micro < accum; ++micro) {
    const model::TokenBatch b = batch(micro);
    dp.set_sync(micro + 1 == accum);  // no gradient traffic before the last micro-batch
    base::TraceScope fb("forward_backward");
    const auto fr = model.forward_backward(b.ids, b.targets, dp.grads(), scale / static_cast<float>(accum),
                                           micro == 0 ? model::Model::GradWrite::kAssign
                                                      : model::Model::GradWrite::kAccumulate,
                                           b.positions);
    r.loss_sum += fr.loss;
    r.count += fr.count;
    r.activation_bytes = std::max(r.activation_bytes, fr.activation_bytes);
    if (r.expert_load.empty()) r.expert_load.assign(fr.expert_load.size(), 0.0);
    for (size_t e = 0; e < fr.expert_load.size(); ++e) r.expert_load[e] += fr.expert_load[e];
    r.aux_loss_sum += fr.aux_loss;
    if (fr.mtp_count > 0) r.mtp_loss_sum += fr.mtp_loss, r.mtp_passes += 1;
    if (r.layer_load.empty()) r.layer_load.assign(fr.layer_load.size(), std::vector<double>());
    for (size_t l = 0; l < fr.layer_load.size(); ++l) {
      r.layer_load[l].resize(fr.layer_load[l].size(), 0.0);
      for (size_t e = 0; e < fr.layer_load[l].size(); ++e) r.layer_load[l][e] += fr.layer_load[l][e];
    }
    r.dropped += fr.dropped;
  }
  dp.finish_gradients();
  return r;
}

std::string pipeline_schedule_text(const TrainConfig& c) {
  const auto& pa = c.parallel;
  const auto schedule = parallel::parse_pipe_schedule(pa.pp_schedule);
  const parallel::PipeShape shape{static_cast<int>(pa.pp), static_cast<int>(c.data.grad_accum),
                                  static_cast<int>(pa.pp_virtual_stages)};
  const std::string src = c.source_name();
  std::string out;
  try {
    const auto actions = parallel::pipe_schedule(schedule, shape);
    // The data's vocabulary (it sizes the embeddings the cut balances) when the data is there.
    int64_t vocab = 32000;
    try {
      vocab = read_data_meta(c.data.dir).vocab_size;
    } catch (const Error&) {
    }
    const model::ModelConfig m = build_model_config(c, vocab, -1);
    char buf[256];
    std::snprintf(buf, sizeof buf, "pipeline: %s, pp %d, %d micro-batches, %d chunk%s per rank, %lld layers\n",
                  parallel::pipe_schedule_name(schedule), shape.pp, shape.micro_batches,
                  shape.virtual_stages, shape.virtual_stages == 1 ? "" : "s",
                  static_cast<long long>(m.num_layers));
    out += buf;
    if (shape.pp > 1 || shape.virtual_stages > 1)
      for (int r = 0; r < shape.pp; ++r)
        out += "stage " + std::to_string(r) + ": " +
               model::pipeline_stage(m, r, shape.pp, shape.virtual_stages, pa.pp_layers).describe() + "\n";
    out += parallel::format_pipe_schedule(actions, shape);
    const auto t = parallel::simulate_schedule(actions, shape, 1.0 / shape.virtual_stages,
                                               2.0 / shape.virtual_stages);
    std::snprintf(buf, sizeof buf,
                  "bubble (replay, backward = 2 x forward): %.1f%%; formula (pp-1)/(v m+pp-1): %.1f%%; "
                  "at most %d micro-batches in flight per rank\n",
                  100 * t.bubble, 100 * parallel::ideal_bubble(shape), t.max_in_flight);
    out += buf;
  } catch (const Error& e) {
    fail(src, ": [parallel] ", e.what());
  }
  return out;
}

}  // namespace tessera::train
