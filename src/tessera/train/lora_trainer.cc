// The LoRA fine-tuning loop (lora_trainer.h).
#include "tessera/base/mix64.h"
#include "tessera/train/lora_trainer.h"

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/base/logging.h"
#include "tessera/base/memory.h"
#include "tessera/base/timer.h"
#include "tessera/base/trace.h"
#include "tessera/io/json_file.h"
#include "tessera/io/safetensors.h"
#include "tessera/model/lora_io.h"
#include "tessera/model/params.h"
#include "tessera/model/quantize.h"
#include "tessera/parallel/data_parallel.h"
#include "tessera/train/checkpoint.h"
#include "tessera/train/data_loader.h"
#include "tessera/train/grad_utils.h"
#include "tessera/train/metrics.h"
#include "tessera/train/optimizer.h"
#include "tessera/train/plot.h"
#include "tessera/train/schedule.h"
#include "tessera/train/trainer_layout.h"
#include "tessera/train/trainer_setup.h"

namespace tessera::train {
namespace fs = std::filesystem;
namespace {

using base::mix64;

int64_t bytes_of(const std::vector<std::pair<std::string, Tensor>>& named) {
  int64_t n = 0;
  for (const auto& [name, t] : named) n += static_cast<int64_t>(t.nbytes());
  return n;
}

// What LoRA cannot run with yet, as one-line errors before any work.
void check_lora_run(const TrainConfig& c, int world) {
  const auto& p = c.parallel;
  const std::string src = c.source_name();
  TESSERA_CHECK(p.tp == 1 && p.pp == 1 && p.cp == 1 && p.ep == 1, src, ": [lora] with tensor, pipeline, context or "
                "expert parallelism is not supported yet (data parallelism is: tp = pp = cp = ep = 1)");
  TESSERA_CHECK(p.dp == 0 || p.dp == world, src, ": parallel.dp = ", p.dp, " but ", world, " ranks run");
  TESSERA_CHECK(p.zero_stage == 0 && !p.offload, src, ": [lora] keeps no base optimizer state to shard: set "
                "parallel.zero_stage = 0 and offload = false");
  TESSERA_CHECK(c.training.precision != "fp16", src, ": [lora] with precision fp16 is not supported yet (bf16 or fp32)");
  TESSERA_CHECK(c.optimizer.name != "muon", src, ": [lora] trains with adamw (Muon orthogonalises whole matrices)");
  TESSERA_CHECK(c.data.batch_size % world == 0, src, ": data.batch_size ", c.data.batch_size,
                " does not split over ", world, " data-parallel ranks");
}

class LoraRun {
 public:
  LoraRun(const TrainConfig& c, const TrainOptions& o, comm::Communicator& comm)
      : c_(c), o_(o), comm_(comm), rank_(comm.rank()), world_(comm.size()),
        meta_((check_lora_run(c, comm.size()), read_run_data_meta(c))),
        model_(build_model(c, meta_.vocab_size, meta_.eos_id)),
        loader_(c.data.dir, "train", c.data.seq_len, c.data.seed),
        ckpt_(c.out_dir, c.checkpoint.keep) {
    ckpt_.set_ranks(rank_, world_, [this] { comm_.barrier(); }, c.parallel.timeout_s);
    apply_training_options(c, model_);
    step_state_ = std::make_unique<LoraStep>(model_, c);
    lora_ = step_state_->weights.get();
    grads_ = step_state_->grads.get();
    opt_ = step_state_->opt.get();
    mem_ = lora_memory(model_, *lora_, c);
    if (meta_.val_tokens > (meta_.chat ? 0 : c.data.seq_len) && c.training.eval_batches > 0) {
      auto all = eval_batches(c.data.dir, "val", c.data.seq_len, c.data.batch_size, c.training.eval_batches);
      for (size_t i = 0; i < all.size(); ++i)
        if (static_cast<int>(i % world_) == rank_) val_.push_back(std::move(all[i]));
      has_val_ = !all.empty();
    }
    tokenizer_texts_ = tokenizer_files(c.data.tokenizer.empty() ? meta_.tokenizer : c.data.tokenizer);
  }

  TrainResult run() {
    TrainResult result;
    base::Timer total;
    prepare_out_dir();
    const bool lead = rank_ == 0;
    std::unique_ptr<MetricsWriter> metrics;
    if (lead) {
      metrics = std::make_unique<MetricsWriter>(c_.out_dir + "/metrics.jsonl", o_.resume);
      if (o_.resume) metrics->truncate_from_step(step_ + 1);
    }
    const auto& tr = c_.training;
    const int64_t B = c_.data.batch_size, T = c_.data.seq_len, accum = c_.data.grad_accum, local_b = B / world_;
    if (lead) print_start();
    result.start_step = step_;
    result.world_size = world_;
    result.rank = rank_;
    std::optional<base::ProgressBar> bar;
    if (c_.logging.progress && lead) bar.emplace("train", tr.steps);
    if (!c_.logging.trace.empty()) base::start_trace(result.trace_path = trace_path(c_.logging.trace, rank_, world_));
    model::TokenBatch batch;
    while (step_ < tr.steps) {
      base::TraceScope step_scope("step");
      base::Timer timer;
      step_state_->zero_grads();
      double loss_sum = 0;
      int64_t count = 0, activation_bytes = 0;
      for (int64_t micro = 0; micro < accum; ++micro) {
        loader_.next_batch(B, batch);
        const model::TokenBatch mine = batch_rows(batch, rank_ * local_b, (rank_ + 1) * local_b);
        base::TraceScope fb("forward_backward");
        const auto r = step_state_->micro_batch(
            mine, 1.f / static_cast<float>(accum),
            mix64(c_.lora.seed ^ mix64(static_cast<uint64_t>(step_ * accum + micro) * 4096 + static_cast<uint64_t>(rank_) + 1)));
        loss_sum += r.loss;
        count += r.count;
        activation_bytes = std::max(activation_bytes, r.activation_bytes);
      }
      if (world_ > 1) {  // the adapters' gradients, averaged over the ranks
        base::TraceScope reduce("all_reduce_adapters");
        for (Tensor* t : grads_->tensors()) {
          comm_.all_reduce(*t);
          float* g = t->data<float>();
          for (int64_t i = 0; i < t->numel(); ++i) g[i] /= static_cast<float>(world_);
        }
      }
      const double loss = parallel::exact_sum(comm_, loss_sum) / static_cast<double>(accum * world_);
      count = static_cast<int64_t>(parallel::exact_sum(comm_, static_cast<double>(count)));
      const GradClip clip = grad_clip(step_state_->refs, tr.max_grad_norm);  // applied by the step
      const double grad_norm = clip.norm;
      const double lr_scale = lr_multiplier(c_.schedule, step_);
      const bool finite = std::isfinite(loss) && std::isfinite(grad_norm);
      if (finite) {
        base::TraceScope opt("optimizer_step");
        step_state_->update(lr_scale, clip.coef);
      } else {
        ++result.skipped_steps;
        TESSERA_LOG(kWarn, "step ", step_ + 1, ": non-finite loss or gradient; the step is skipped");
      }
      ++step_;
      tokens_seen_ += static_cast<uint64_t>(B * T * accum);
      const double secs = timer.seconds();
      result.losses.push_back(loss);
      result.final_loss = loss;
      ++result.steps_run;
      nlohmann::json rec = {{"step", step_},         {"loss", loss},
                            {"lr", c_.optimizer.lr * lr_scale}, {"grad_norm", grad_norm},
                            {"targets", count},       {"tokens_per_s", static_cast<double>(B * T * accum) / secs},
                            {"step_time_s", secs},    {"tokens_seen", tokens_seen_},
                            {"lora_trainable_params", mem_.adapter_params}};
      int64_t quantized = 0;  // QLoRA: the base's quantized linears (not among named())
      for (const auto& layer : model_.weights().layers)
        for (const model::Linear* lin : {&layer.qkv, &layer.o, &layer.up, &layer.down})
          if (lin->quant) quantized += lin->quant->nbytes();
      rec["mem_params"] = bytes_of(model_.weights().named(model_.config())) + quantized;
      rec["mem_grads"] = params_bytes(model_.config(), step_state_->frozen) + bytes_of(grads_->named(model_.config()));
      int64_t moments = 0;
      for (const auto& [name, t] : opt_->state_tensors()) moments += static_cast<int64_t>(t.nbytes());
      rec["mem_optimizer"] = moments;
      rec["mem_activations"] = activation_bytes;
      rec["mem_full_finetune_grads_optimizer"] = mem_.full_bytes;
      if (c_.training.memory_limit_mb > 0) check_memory_limit(rec, c_.training.memory_limit_mb, comm_, c_.source_name());
      const bool eval = has_val_ && ((tr.eval_every > 0 && step_ % tr.eval_every == 0) || step_ == tr.steps);
      if (eval) {
        result.val_loss = validation_loss();
        rec["val_loss"] = result.val_loss;
      }
      if (metrics) metrics->write(rec);
      if (bar) {
        char suffix[96];
        std::snprintf(suffix, sizeof suffix, "loss %.4f lr %.2e %.0f tok/s", loss, c_.optimizer.lr * lr_scale,
                      static_cast<double>(B * T * accum) / secs);
        bar->update(step_, suffix);
      }
      if (o_.stop_after >= 0 && step_ >= o_.stop_after) break;
      if ((c_.checkpoint.every > 0 && step_ % c_.checkpoint.every == 0) || step_ == tr.steps) {
        base::TraceScope save("checkpoint");
        if (c_.checkpoint.async)
          ckpt_.save_async(step_, checkpoint_files());
        else
          ckpt_.save(step_, checkpoint_files());
      }
    }
    ckpt_.wait();
    if (bar) bar->finish();
    if (!c_.logging.trace.empty()) base::stop_trace();
    if (o_.stop_after >= 0 && step_ < tr.steps) return result;  // as if killed: no final save
    result.model_dir = c_.out_dir + "/adapter";
    if (lead) {
      model::save_peft_adapter(result.model_dir, model_.config(), *lora_, c_.model.init_from);
      for (const auto& [name, text] : tokenizer_texts_) io::write_file_atomic(result.model_dir + "/" + name, text);
      if (c_.logging.plot) {
        result.svg_path = c_.out_dir + "/loss_curve.svg";
        write_training_svg(read_metrics(c_.out_dir + "/metrics.jsonl"), result.svg_path,
                           "Tessera LoRA fine-tuning: " + c_.out_dir);
      }
    }
    comm_.barrier();
    result.seconds = total.seconds();
    return result;
  }

 private:
  void print_start() const {
    const auto& mc = model_.config();
    std::string targets;
    for (auto m : lora_->config.targets) targets += std::string(targets.empty() ? "" : ", ") + model::lora_module_name(m);
    std::fprintf(stderr,
                 "train: LoRA r %lld alpha %g%s on %s of %s (%s) %.1fM params: %.3fM trainable (%.2f%%); gradients + "
                 "optimizer state %.1f MiB instead of %.1f MiB for full fine-tuning\n",
                 static_cast<long long>(lora_->config.rank), lora_->config.alpha,
                 lora_->config.dropout > 0 ? (", dropout " + std::to_string(lora_->config.dropout).substr(0, 4)).c_str() : "",
                 targets.c_str(), mc.model_type.c_str(), model_.weights_description().c_str(), mem_.base_params / 1e6, mem_.adapter_params / 1e6,
                 100.0 * static_cast<double>(mem_.adapter_params) / static_cast<double>(mem_.base_params),
                 mem_.lora_bytes / 1048576.0, mem_.full_bytes / 1048576.0);
    std::fprintf(stderr, "train: %lld steps of %lld x %lld x %lld tokens, %s, %d rank%s, out %s\ntrain: compute %s\n%s",
                 static_cast<long long>(c_.training.steps), static_cast<long long>(c_.data.grad_accum),
                 static_cast<long long>(c_.data.batch_size), static_cast<long long>(c_.data.seq_len),
                 c_.training.precision.c_str(), world_, world_ > 1 ? "s" : "", c_.out_dir.c_str(),
                 model::describe_compute(model_.compute_dtype(), model_.bf16_mode()).c_str(),
                 describe_packing(loader_).c_str());
  }

  double validation_loss() {
    auto [sum, count] = eval_loss_sums(model_, nullptr, val_);
    const double n = parallel::exact_sum(comm_, static_cast<double>(count));
    return n > 0 ? parallel::exact_sum(comm_, sum) / n : -1.0;
  }

  CheckpointFiles checkpoint_files() const {
    CheckpointFiles f;
    if (rank_ != 0) return f;
    const auto& mc = model_.config();
    f.safetensors.push_back({"adapter_model.safetensors", lora_->named(mc)});
    f.safetensors.push_back({"optimizer.safetensors", opt_->state_tensors()});
    f.texts.emplace_back("adapter_config.json", model::peft_adapter_config_json(lora_->config, c_.model.init_from));
    nlohmann::json s;
    s["format"] = "tessera-lora-trainer-state";
    s["version"] = 1;
    s["step"] = step_;
    s["optimizer_step"] = opt_->step_count();
    s["loader"] = loader_.state();
    s["tokens_seen"] = tokens_seen_;
    s["world_size"] = world_;
    f.texts.emplace_back("trainer_state.json", s.dump(2) + "\n");
    f.texts.emplace_back("config.toml", c_.source_text);
    return f;
  }

  void prepare_out_dir() {
    fs::create_directories(c_.out_dir);
    const auto latest = CheckpointManager::find_latest_in(c_.out_dir);
    if (!o_.resume) {
      TESSERA_CHECK(!latest, c_.out_dir, " already holds checkpoints of a run (", latest ? latest->dir : "",
                    "); pass --resume to continue it or choose another [run] out_dir");
      return;
    }
    if (!latest) {
      TESSERA_LOG(kWarn, "--resume: no checkpoint in ", c_.out_dir, "; starting from step 0");
      return;
    }
    const std::string dir = latest->dir;
    const auto state = io::read_json_file(dir + "/trainer_state.json");
    try {
      TESSERA_CHECK(state.at("format") == "tessera-lora-trainer-state", dir, ": not a LoRA run's checkpoint "
                    "(resume it without [lora], or choose another [run] out_dir)");
      const auto saved = model::load_peft_adapter(dir, model_.config());
      TESSERA_CHECK(saved.config.rank == lora_->config.rank && saved.config.targets == lora_->config.targets, dir,
                    ": the checkpoint's adapters (r ", saved.config.rank, ") differ from [lora]'s (r ",
                    lora_->config.rank, ", or other target_modules)");
      for (size_t l = 0; l < saved.layers.size(); ++l)
        for (int m = 0; m < model::kLoraModules; ++m)
          if (saved.layers[l][m].a.defined()) {
            lora_->layers[l][m].a.copy_from(saved.layers[l][m].a);
            lora_->layers[l][m].b.copy_from(saved.layers[l][m].b);
          }
      const auto file = io::SafetensorsFile::open(dir + "/optimizer.safetensors");
      std::vector<std::pair<std::string, Tensor>> st;
      for (const auto& [name, t] : opt_->state_tensors()) st.emplace_back(name, file->get(name));
      opt_->load_state(st, state.at("optimizer_step").get<int64_t>());
      loader_.set_state(state.at("loader").get<LoaderState>());
      step_ = state.at("step").get<int64_t>();
      tokens_seen_ = state.at("tokens_seen").get<uint64_t>();
    } catch (const nlohmann::json::exception& e) {
      fail(dir, ": ", e.what());
    }
    TESSERA_CHECK(step_ <= c_.training.steps, dir, " is at step ", step_, ", past training.steps = ",
                  c_.training.steps);
    if (rank_ == 0)
      std::fprintf(stderr, "train: resumed from %s (step %lld)\n", dir.c_str(), static_cast<long long>(step_));
  }

  const TrainConfig& c_;
  TrainOptions o_;
  comm::Communicator& comm_;
  int rank_, world_;
  DataMeta meta_;
  model::Model model_;
  DataLoader loader_;
  CheckpointManager ckpt_;
  std::unique_ptr<LoraStep> step_state_;
  model::LoraWeights *lora_ = nullptr, *grads_ = nullptr;  // step_state_'s
  Optimizer* opt_ = nullptr;
  LoraMemory mem_;
  std::vector<model::TokenBatch> val_;
  bool has_val_ = false;
  std::vector<std::pair<std::string, std::string>> tokenizer_texts_;
  int64_t step_ = 0;
  uint64_t tokens_seen_ = 0;
};

}  // namespace

LoraStep::LoraStep(model::Model& m, const TrainConfig& c) : model(m) {
  const auto& mc = m.config();
  if (!c.lora.quantize_base.empty()) {  // QLoRA, round-to-nearest (a quantized checkpoint is used as stored)
    TESSERA_CHECK(!m.quantized(), c.source_name(), ": lora.quantize_base = \"", c.lora.quantize_base, "\" but ",
                  c.model.init_from, " is quantized already (", m.weights_description(), ")");
    int64_t group = 0;  // int4: the largest of 128, 64, 32 that divides every linear's input features
    if (c.lora.quantize_base == "int4")
      for (int64_t g : {128, 64, 32})
        if (group == 0 && mc.hidden_size % g == 0 && (mc.num_heads * mc.head_dim) % g == 0 && mc.intermediate_size % g == 0)
          group = g;
    model::QuantizeOptions qo = model::quantize_options_for_scheme(c.lora.quantize_base);
    if (group > 0) qo.group_size = group;
    model::quantize_model(m, qo);
  }
  if (c.training.precision == "bf16") {
    for (auto& [name, t] : m.weights().named(mc)) t.copy_from(t.to(DType::kBF16).to(DType::kF32));
    m.set_compute_dtype_in_place(DType::kBF16, model::parse_bf16_request(c.training.bf16_mode, "training.bf16_mode"));
    m.refresh_compute_weights();
  }
  const model::LoraConfig lc = lora_config(c.lora);
  if (c.lora.init_from.empty()) {
    weights = std::make_unique<model::LoraWeights>(model::LoraWeights::init(mc, lc, c.lora.seed));
  } else {
    weights = std::make_unique<model::LoraWeights>(model::load_peft_adapter(c.lora.init_from, mc));
    weights->config.dropout = lc.dropout;  // the run's dropout, whatever the adapter trained with
  }
  grads = std::make_unique<model::LoraWeights>(model::LoraWeights::zeros_like(*weights));
  m.set_lora(weights.get(), grads.get());
  frozen = model::Params::allocate_frozen(mc);
  const auto named = weights->named(mc);
  const auto w = weights->tensors(), g = grads->tensors();
  for (size_t i = 0; i < w.size(); ++i) {
    ParamRef r;
    r.name = named[i].first, r.param = *w[i], r.grad = *g[i], r.decay = true;
    refs.push_back(std::move(r));
  }
  opt = std::make_unique<Optimizer>(c.optimizer, refs);
}

LoraStep::~LoraStep() { model.set_lora(nullptr); }

void LoraStep::update(double lr_scale, float clip_coef) {
  StepOptions so;
  so.grad_scale = clip_coef;
  opt->step(lr_scale, so);
}

void LoraStep::zero_grads() {
  for (Tensor* t : grads->tensors()) t->zero();
}

model::Model::LossResult LoraStep::micro_batch(const model::TokenBatch& b, float scale, uint64_t dropout_seed) {
  model.set_lora_seed(dropout_seed);
  return model.forward_backward(b.ids, b.targets, frozen, scale, model::Model::GradWrite::kAccumulate, b.positions);
}

model::LoraConfig lora_config(const LoraSection& s) {
  model::LoraConfig c;
  c.rank = s.rank;
  c.alpha = s.alpha;
  c.dropout = s.dropout;
  c.rslora = s.rslora;
  for (const auto& name : s.target_modules) {
    if (name == "all-linear") {
      for (int m = 0; m < model::kLoraModules; ++m)
        if (!c.targets_module(static_cast<model::LoraModule>(m))) c.targets.push_back(static_cast<model::LoraModule>(m));
      continue;
    }
    const auto m = model::parse_lora_module(name);
    TESSERA_CHECK(m, "lora.target_modules: '", name, "' is not a module LoRA can adapt");
    if (!c.targets_module(*m)) c.targets.push_back(*m);
  }
  return c;
}

LoraMemory lora_memory(const model::Model& m, const model::LoraWeights& w, const TrainConfig& c) {
  LoraMemory r;
  const auto& mc = m.config();
  r.base_params = 0;
  for (const auto& [name, t] : m.weights().named(mc)) r.base_params += t.numel();
  if (m.quantized()) r.base_params = mc.num_parameters();  // (named() lists no quantized linear)
  r.adapter_params = w.num_parameters();
  const int64_t master = c.training.precision == "fp32" ? 0 : 4;  // full fine-tuning's f32 master copy
  r.full_bytes = r.base_params * (4 + 8 + master);
  model::Params frozen = model::Params::allocate_frozen(mc);
  r.lora_bytes = r.adapter_params * (4 + 8) + params_bytes(mc, frozen);
  return r;
}

TrainResult run_lora_training(const TrainConfig& c, const TrainOptions& o, comm::Communicator& comm) {
  LoraRun run(c, o, comm);
  return run.run();
}

}  // namespace tessera::train
