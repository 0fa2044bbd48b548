// The training loop (one process): micro-batches with gradient accumulation, fp16 loss
// scaling, clipping, the optimizer, the spike guard, metrics, and async checkpoints
// that carry everything an exact resume needs.
#include "tessera/train/trainer.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>

#include "tessera/base/error.h"
#include "tessera/base/logging.h"
#include "tessera/base/memory.h"
#include "tessera/base/timer.h"
#include "tessera/base/trace.h"
#include "tessera/io/json_file.h"
#include "tessera/io/safetensors.h"
#include "tessera/kernels/cross_entropy.h"
#include "tessera/kernels/peak.h"
#include "tessera/model/benchmark.h"
#include "tessera/train/checkpoint.h"
#include "tessera/train/data_loader.h"
#include "tessera/train/grad_utils.h"
#include "tessera/train/loss_scaler.h"
#include "tessera/train/metrics.h"
#include "tessera/train/plot.h"
#include "tessera/train/schedule.h"
#include "tessera/train/trainer_setup.h"

namespace tessera::train {
namespace {

namespace fs = std::filesystem;

double mean_loss(const model::Model& m, const std::vector<std::pair<Tensor, Tensor>>& batches) {
  double sum = 0;
  int64_t count = 0;
  for (const auto& [ids, targets] : batches) {
    const Tensor logits = m.forward_batch(ids);
    const int64_t n = ids.numel();
    const auto ce = kernels::cross_entropy(logits.view({n, logits.size(2)}),
                                           targets.contiguous().view({n}), nullptr, nullptr, 1.f);
    sum += ce.loss_sum;
    count += ce.count;
  }
  return count ? sum / static_cast<double>(count) : -1.0;
}

// Everything of a run that a checkpoint saves besides the tensors.
struct RunState {
  int64_t step = 0;  // optimizer steps completed
  LoaderState loader;
  SkipRanges skip;
  int64_t spikes = 0, rollbacks = 0, skipped_steps = 0;
  uint64_t tokens_seen = 0;
};

class Run {
 public:
  Run(const TrainConfig& c, const TrainOptions& o)
      : c_(c), o_(o), meta_(read_data_meta(c.data.dir)),
        model_(build_model(c, meta_.vocab_size, meta_.eos_id)),
        grads_(model::Params::allocate(model_.config(), DType::kF32)),
        refs_(make_param_refs(model_, grads_)),
        opt_(c.optimizer, refs_),
        scaler_(c.fp16_init_scale, 2.0, 0.5, c.fp16_growth_interval,
                c.training.precision == "fp16"),
        loader_(c.data.dir, "train", c.data.seq_len, c.data.seed),
        spikes_(c.spike_guard),
        ckpt_(c.out_dir, c.checkpoint.keep) {
    tokenizer_dir_ = c.data.tokenizer.empty() ? meta_.tokenizer : c.data.tokenizer;
    if (!tokenizer_dir_.empty() && !fs::exists(tokenizer_dir_ + "/tokenizer.json")) {
      TESSERA_CHECK(c.data.tokenizer.empty(), "data.tokenizer: no tokenizer.json in ",
                    tokenizer_dir_);
      tokenizer_dir_.clear();  // meta.json names a tokenizer that has since moved
    }
    tokenizer_texts_ = tokenizer_files(tokenizer_dir_);
    const auto& tr = c.training;
    if (tr.precision == "bf16") model_.set_compute_dtype(DType::kBF16);
    if (tr.precision == "fp16") model_.set_compute_dtype(DType::kF16);
    model_.set_recompute(model::parse_recompute(tr.activation_checkpointing));
    if (meta_.val_tokens > c.data.seq_len && tr.eval_batches > 0)
      val_ = eval_batches(c.data.dir, "val", c.data.seq_len, c.data.batch_size, tr.eval_batches);
    const auto& mc = model_.config();
    flops_per_token_ = 3.0 * model::forward_flops(mc, c.data.seq_len, 0) /
                       static_cast<double>(c.data.seq_len);
  }

  TrainResult run() {
    TrainResult result;
    base::Timer total;
    prepare_out_dir();
    const double peak = peak_flops();
    auto metrics = std::make_unique<MetricsWriter>(c_.out_dir + "/metrics.jsonl", o_.resume);
    if (o_.resume) metrics->truncate_from_step(st_.step + 1);
    result.start_step = st_.step;
    const auto& tr = c_.training;
    const int64_t B = c_.data.batch_size, T = c_.data.seq_len, accum = c_.data.grad_accum;
    std::fprintf(stderr,
                 "train: %s %.1fM params, %lld steps of %lld x %lld x %lld tokens, %s, "
                 "checkpointing %s, out %s\n",
                 model_.config().model_type.c_str(), model_.config().num_parameters() / 1e6,
                 static_cast<long long>(tr.steps), static_cast<long long>(accum),
                 static_cast<long long>(B), static_cast<long long>(T), tr.precision.c_str(),
                 tr.activation_checkpointing.c_str(), c_.out_dir.c_str());
    std::optional<base::ProgressBar> bar;
    if (c_.logging.progress) bar.emplace("train", tr.steps);
    Tensor ids, targets;
    if (!c_.logging.trace.empty()) base::start_trace(c_.logging.trace);
    while (st_.step < tr.steps) {
      base::TraceScope step_scope("step");
      base::Timer step_timer;
      const LoaderState before = loader_.state();
      grads_.zero();
      double loss_sum = 0;
      int64_t count = 0;
      const float scale = scaler_.enabled() ? static_cast<float>(scaler_.scale()) : 1.f;
      for (int64_t micro = 0; micro < accum; ++micro) {
        next_batch(B, ids, targets);
        base::TraceScope fb("forward_backward");
        const auto r = model_.forward_backward(ids, targets, grads_, scale / accum);
        loss_sum += r.loss;
        count += r.count;
      }
      const double loss = loss_sum / static_cast<double>(accum);
      const LoaderState after = loader_.state();
      bool finite = true;
      if (scaler_.enabled())
        finite = scaler_.unscale_and_check(refs_);
      double grad_norm = 0;
      {
        base::TraceScope clip("clip_grad_norm");
        grad_norm = clip_grad_norm(refs_, tr.max_grad_norm);
      }
      finite = finite && std::isfinite(grad_norm);  // a non-finite gradient makes the norm so
      const bool spike = finite && spikes_.is_spike(loss);
      if (spike && c_.spike_guard.policy == "rollback" && try_rollback(before, after, loss, *metrics)) {
        ++result.rollbacks;
        continue;
      }
      const double lr_scale = lr_multiplier(c_.schedule, st_.step);
      const bool apply = finite && !spike;
      if (apply) {
        {
          base::TraceScope wait("checkpoint_wait_snapshot");
          ckpt_.wait_snapshot();  // an async checkpoint may still be copying the weights
        }
        base::TraceScope opt("optimizer_step");
        opt_.step(lr_scale);
        model_.refresh_compute_weights();
        spikes_.add(loss);
      } else if (!finite) {
        ++st_.skipped_steps;
      }
      if (spike) {
        ++st_.spikes;
        TESSERA_LOG(kWarn, "step ", st_.step + 1, ": loss ", loss, " is a spike (mean ",
                    spikes_.mean(), ", std ", spikes_.stddev(), "); batch skipped");
      }
      scaler_.update(!finite);
      ++st_.step;
      st_.tokens_seen += static_cast<uint64_t>(count);
      const double secs = step_timer.seconds();
      StepMetrics sm;
      sm.step = st_.step;
      sm.loss = loss;
      sm.lr = c_.optimizer.lr * lr_scale;
      sm.grad_norm = grad_norm;
      sm.loss_scale = scaler_.enabled() ? scale : 1.0;
      sm.tokens_per_s = static_cast<double>(B * T * accum) / secs;
      sm.mfu = model_flops_utilization(flops_per_token_, sm.tokens_per_s, peak);
      sm.peak_rss_mb = static_cast<double>(base::peak_rss_bytes()) / (1 << 20);
      sm.skipped = !finite;
      sm.spike = spike;
      const bool last = st_.step == tr.steps;
      if (!val_.empty() && ((tr.eval_every > 0 && st_.step % tr.eval_every == 0) || last)) {
        base::TraceScope eval("eval");
        sm.val_loss = mean_loss(model_, val_);
        result.val_loss = *sm.val_loss;
      }
      nlohmann::json rec = sm.to_record();
      if (scaler_.enabled()) rec["skipped_steps"] = st_.skipped_steps;
      metrics->write(rec);
      result.losses.push_back(loss);
      result.final_loss = loss;
      ++result.steps_run;
      if (bar) {
        char suffix[160];
        std::snprintf(suffix, sizeof suffix, "loss %.4f lr %.2e %.0f tok/s%s", loss, sm.lr,
                      sm.tokens_per_s,
                      sm.val_loss ? (" val " + std::to_string(*sm.val_loss)).c_str() : "");
        bar->update(st_.step, suffix);
      }
      if (o_.stop_after >= 0 && st_.step >= o_.stop_after) {
        if (c_.checkpoint.every > 0 && st_.step % c_.checkpoint.every == 0) save_checkpoint(false);
        ckpt_.wait();
        result.skipped_steps = st_.skipped_steps;
        result.spikes = st_.spikes;
        result.seconds = total.seconds();
        return result;
      }
      if (last || (c_.checkpoint.every > 0 && st_.step % c_.checkpoint.every == 0))
        save_checkpoint(!last && c_.checkpoint.async);
    }
    ckpt_.wait();
    base::stop_trace();
    if (bar) bar->finish();
    result.skipped_steps = st_.skipped_steps;
    result.spikes = st_.spikes;
    result.model_dir = c_.out_dir + "/model";
    model_.save(result.model_dir);
    for (const auto& [name, text] : tokenizer_texts_)
      io::write_file_atomic(result.model_dir + "/" + name, text);
    metrics.reset();
    if (c_.logging.plot) {
      result.svg_path = c_.out_dir + "/loss_curve.svg";
      write_training_svg(read_metrics(c_.out_dir + "/metrics.jsonl"), result.svg_path,
                         "Tessera training: " + c_.out_dir);
    }
    result.seconds = total.seconds();
    return result;
  }

 private:
  void prepare_out_dir() {
    fs::create_directories(c_.out_dir);
    const auto latest = CheckpointManager::find_latest_in(c_.out_dir);
    if (!o_.resume) {
      TESSERA_CHECK(!latest, c_.out_dir, " already holds checkpoints of a run (",
                    latest ? latest->dir : "", "); pass --resume to continue it or choose "
                    "another [run] out_dir");
      return;
    }
    if (!latest) {
      TESSERA_LOG(kWarn, "--resume: no checkpoint in ", c_.out_dir, "; starting from step 0");
      return;
    }
    load_checkpoint(*latest);
    std::fprintf(stderr, "train: resumed from %s (step %lld)\n", latest->dir.c_str(),
                 static_cast<long long>(st_.step));
  }

  double peak_flops() const {
    if (c_.logging.peak_gflops > 0) return c_.logging.peak_gflops * 1e9;
    const DType dt = c_.training.precision == "fp32" ? DType::kF32 : DType::kBF16;
    const auto g = kernels::measure_matmul_gflops(1024, 1024, 1024, dt,
                                                  kernels::MatmulBackend::kAuto, 0.3);
    return g.gflops * 1e9;
  }

  void next_batch(int64_t B, Tensor& ids, Tensor& targets) {
    for (bool moved = true; moved;) {  // jump over data a rollback marked as bad
      moved = false;
      const uint64_t k = loader_.state().sequences_drawn;
      for (const auto& [a, b] : st_.skip)
        if (k >= a && k < b) {
          loader_.set_state({b});
          moved = true;
        }
    }
    loader_.next_batch(B, ids, targets);
  }

  bool try_rollback(const LoaderState& before, const LoaderState& after, double loss,
                    MetricsWriter& metrics) {
    if (st_.rollbacks >= c_.spike_guard.max_rollbacks) return false;
    ckpt_.wait();
    const auto latest = ckpt_.find_latest();
    if (!latest) {
      TESSERA_LOG(kWarn, "loss spike at step ", st_.step + 1, " but no checkpoint to roll back to;"
                  " skipping the batch instead");
      return false;
    }
    SkipRanges skip = st_.skip;
    skip.emplace_back(before.sequences_drawn, after.sequences_drawn);
    const int64_t rollbacks = st_.rollbacks + 1, spikes = st_.spikes + 1;
    TESSERA_LOG(kWarn, "step ", st_.step + 1, ": loss ", loss, " is a spike; rolling back to ",
                latest->dir, " and skipping sequences [", before.sequences_drawn, ", ",
                after.sequences_drawn, ")");
    const int64_t spike_step = st_.step + 1;
    load_checkpoint(*latest);
    st_.skip = skip;  // the rollback's memory survives the restore
    st_.rollbacks = rollbacks;
    st_.spikes = spikes;
    metrics.truncate_from_step(st_.step + 1);
    metrics.write({{"event", "rollback"}, {"step", st_.step}, {"spike_step", spike_step},
                   {"loss", loss}});
    return true;
  }

  CheckpointFiles checkpoint_files() const {
    CheckpointFiles f;
    f.safetensors.push_back({"model.safetensors", model_.weights().named(model_.config())});
    f.safetensors.push_back({"optimizer.safetensors", opt_.state_tensors()});
    f.texts = model_.hf_json_files();
    for (const auto& t : tokenizer_texts_) f.texts.push_back(t);
    nlohmann::json s;
    s["format"] = "tessera-trainer-state";
    s["version"] = 1;
    s["step"] = st_.step;
    s["optimizer_step"] = opt_.step_count();
    s["loss_scaler"] = scaler_.to_json();
    s["loader"] = loader_.state();
    s["spike_window"] = spikes_.to_json();
    s["skip_ranges"] = st_.skip;
    s["spikes"] = st_.spikes;
    s["rollbacks"] = st_.rollbacks;
    s["skipped_steps"] = st_.skipped_steps;
    s["tokens_seen"] = st_.tokens_seen;
    // No random numbers are drawn during training (no dropout); the data order is a
    // function of (data.seed, sequences_drawn) and the initial weights of model.seed.
    s["rng"] = {{"data_seed", c_.data.seed}, {"model_seed", c_.model.seed}};
    f.texts.emplace_back("trainer_state.json", s.dump(2) + "\n");
    f.texts.emplace_back("config.toml", c_.source_text);
    return f;
  }

  void save_checkpoint(bool async) {
    base::TraceScope scope("checkpoint_save");
    if (async)  // copied in the background while the next step's forward/backward runs
      ckpt_.save_async_deferred(st_.step, checkpoint_files());
    else
      ckpt_.save(st_.step, checkpoint_files());
  }

  void load_checkpoint(const LoadedCheckpoint& ck) {
    const std::string dir = ck.dir;
    const auto state = io::read_json_file(dir + "/trainer_state.json");
    try {
      auto weights = io::SafetensorsFile::open(dir + "/model.safetensors");
      for (auto& [name, t] : model_.weights().named(model_.config())) {
        TESSERA_CHECK(weights->has(name), dir, "/model.safetensors: missing tensor ", name);
        const Tensor src = weights->get(name);
        TESSERA_CHECK(src.shape() == t.shape(), dir, "/model.safetensors: ", name, " has shape ",
                      src.describe(), ", the configured model needs ", t.describe());
        t.copy_from(src);
      }
      model_.refresh_compute_weights();
      auto optf = io::SafetensorsFile::open(dir + "/optimizer.safetensors");
      std::vector<std::pair<std::string, Tensor>> opt_state;
      for (const auto& [name, t] : opt_.state_tensors()) {
        TESSERA_CHECK(optf->has(name), dir, "/optimizer.safetensors: missing tensor ", name);
        opt_state.emplace_back(name, optf->get(name));
      }
      opt_.load_state(opt_state, state.at("optimizer_step").get<int64_t>());
      scaler_.load_json(state.at("loss_scaler"));
      loader_.set_state(state.at("loader").get<LoaderState>());
      spikes_.load_json(state.at("spike_window"));
      st_.step = state.at("step").get<int64_t>();
      st_.skip = state.at("skip_ranges").get<SkipRanges>();
      st_.spikes = state.at("spikes").get<int64_t>();
      st_.rollbacks = state.at("rollbacks").get<int64_t>();
      st_.skipped_steps = state.at("skipped_steps").get<int64_t>();
      st_.tokens_seen = state.at("tokens_seen").get<uint64_t>();
    } catch (const nlohmann::json::exception& e) {
      fail(dir, "/trainer_state.json: ", e.what());
    }
    TESSERA_CHECK(st_.step <= c_.training.steps, dir, " is at step ", st_.step,
                  ", past training.steps = ", c_.training.steps);
  }

  const TrainConfig& c_;
  TrainOptions o_;
  DataMeta meta_;
  model::Model model_;
  model::Params grads_;
  std::vector<ParamRef> refs_;
  Optimizer opt_;
  LossScaler scaler_;
  DataLoader loader_;
  SpikeDetector spikes_;
  CheckpointManager ckpt_;
  std::vector<std::pair<Tensor, Tensor>> val_;
  std::string tokenizer_dir_;
  std::vector<std::pair<std::string, std::string>> tokenizer_texts_;
  double flops_per_token_ = 0;
  RunState st_;
};

}  // namespace

TrainResult run_training(const TrainConfig& config, const TrainOptions& options) {
  Run run(config, options);
  return run.run();
}

}  // namespace tessera::train
