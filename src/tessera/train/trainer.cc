// The training loop on one or N data-parallel ranks: micro-batches with gradient
// accumulation, fp16 loss scaling, clipping, the optimizer on this rank's shard, the spike
// guard, metrics, and async sharded checkpoints that carry everything an exact resume needs.
#include "tessera/train/trainer.h"

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <map>
#include <optional>

#include "tessera/base/aligned_alloc.h"
#include "tessera/base/error.h"
#include "tessera/base/logging.h"
#include "tessera/base/memory.h"
#include "tessera/base/timer.h"
#include "tessera/base/trace.h"
#include "tessera/comm/communicator.h"
#include "tessera/io/json_file.h"
#include "tessera/io/safetensors.h"
#include "tessera/kernels/cross_entropy.h"
#include "tessera/kernels/peak.h"
#include "tessera/model/benchmark.h"
#include "tessera/parallel/data_parallel.h"
#include "tessera/parallel/device_mesh.h"
#include "tessera/parallel/pipeline_parallel.h"
#include "tessera/parallel/tensor_parallel.h"
#include "tessera/train/checkpoint.h"
#include "tessera/train/data_loader.h"
#include "tessera/train/grad_utils.h"
#include "tessera/train/heartbeat.h"
#include "tessera/train/loss_scaler.h"
#include "tessera/train/metrics.h"
#include "tessera/train/plot.h"
#include "tessera/train/schedule.h"
#include "tessera/train/sharded_state.h"
#include "tessera/train/trainer_layout.h"
#include "tessera/train/lora_trainer.h"
#include "tessera/train/trainer_setup.h"

namespace tessera::train {
namespace {

namespace fs = std::filesystem;

// The data-parallel settings; under expert parallelism the experts are reduced over the
// dp axis (the ranks that hold the same experts).
parallel::DataParallelConfig dp_config_on(const TrainConfig& c, parallel::DeviceMesh& mesh) {
  parallel::DataParallelConfig d = dp_config(c);
  if (mesh.size(parallel::Axis::kEp) > 1) d.expert_comm = &mesh.expert_data_group();
  return d;
}

comm::Communicator& with_timeout(comm::Communicator& c, double seconds) {
  c.set_timeout(seconds);
  return c;
}

constexpr const char* kShardIndexName = "optimizer_index.json";
std::string shard_file_name(int rank) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "optimizer-rank%05d.safetensors", rank);
  return buf;
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
  Run(const TrainConfig& c, const TrainOptions& o, comm::Communicator& comm)
      : c_(c), o_(o), comm_(with_timeout(comm, c.parallel.timeout_s)), rank_(comm.rank()),
        world_(comm.size()),
        mesh_shape_(run_mesh_shape(c, world_)),
        meta_(read_run_data_meta(c)),
        model_config_(build_model_config(c, meta_.vocab_size, meta_.eos_id)),
        tp_shard_(checked_tp_shard(c, mesh_shape_, model_config_, rank_)),
        pp_stage_(checked_pp_stage(c, mesh_shape_, model_config_, rank_)),
        model_(build_model(c, model_config_, tp_shard_, pp_stage_)),
        mesh_(make_mesh(mesh_shape_, comm_)),
        tp_(make_tp(*mesh_, model_, c.parallel.sequence_parallel, c.parallel.sp_overlap)),
        ep_(make_ep(*mesh_, model_)),
        cp_(make_cp(*mesh_, model_, c.parallel.cp_method)),
        dp_group_(mesh_->data_group()),
        dp_rank_(dp_group_.rank()),
        dp_size_(dp_group_.size()),
        row_rank_(dp_rank_ / static_cast<int>(mesh_shape_.cp)),
        row_size_(dp_size_ / static_cast<int>(mesh_shape_.cp)),
        flags_(param_flags(model_)),
        dp_(model_, dp_group_, dp_config_on(c, *mesh_)),
        embed_group_(make_embed_group(mesh_shape_, model_config_, comm_)),
        pipe_(mesh_shape_.pp > 1 ? std::make_unique<parallel::Pipeline>(
                                       model_, mesh_->group(parallel::Axis::kPp),
                                       parallel::parse_pipe_schedule(c.parallel.pp_schedule),
                                       static_cast<int>(c.data.grad_accum))
                                 : nullptr),
        refs_(dp_param_refs(dp_, flags_, c.optimizer.name,
                            tp_ ? &mesh_->group(parallel::Axis::kTp) : nullptr)),
        opt_(c.optimizer, refs_),
        scaler_(c.fp16_init_scale, 2.0, 0.5, c.fp16_growth_interval,
                c.training.precision == "fp16"),
        loader_(c.data.dir, "train", c.data.seq_len, c.data.seed),
        spikes_(c.spike_guard),
        ckpt_(c.out_dir, c.checkpoint.keep) {
    ckpt_.set_ranks(rank_, world_, [this] { comm_.barrier(); }, c.parallel.timeout_s);
    tokenizer_dir_ = c.data.tokenizer.empty() ? meta_.tokenizer : c.data.tokenizer;
    if (!tokenizer_dir_.empty() && !fs::exists(tokenizer_dir_ + "/tokenizer.json")) {
      TESSERA_CHECK(c.data.tokenizer.empty(), "data.tokenizer: no tokenizer.json in ",
                    tokenizer_dir_);
      tokenizer_dir_.clear();  // meta.json names a tokenizer that has since moved
    }
    tokenizer_texts_ = tokenizer_files(tokenizer_dir_);
    const auto& tr = c.training;
    apply_training_options(c, model_);
    if (meta_.val_tokens > (meta_.chat ? 0 : c.data.seq_len) && tr.eval_batches > 0) {
      // Each data-parallel replica evaluates every dp-th batch (its tp ranks together);
      // the sums are added over the replicas.
      auto all = eval_batches(c.data.dir, "val", c.data.seq_len, c.data.batch_size, tr.eval_batches);
      // (Context parallelism: the cp ranks of a replica evaluate its batches together,
      // each its tokens of them.)
      for (size_t i = 0; i < all.size(); ++i)
        if (static_cast<int>(i % row_size_) == row_rank_) val_.push_back(my_tokens(all[i]));
      has_val_ = !all.empty();
      // Expert parallelism: the ep ranks exchange tokens in every MoE layer, so each runs
      // as many batches as the busiest rank (a repeat whose sums are not counted).
      val_counted_ = val_.size();
      if (ep_ && !all.empty())
        while (static_cast<int64_t>(val_.size()) < (static_cast<int64_t>(all.size()) + row_size_ - 1) / row_size_)
          val_.push_back(my_tokens(all[0]));
    }
    for (const auto& [name, t] : opt_.state_tensors()) moment_bytes_ += static_cast<int64_t>(t.nbytes());
    const auto& mc = model_.config();
    flops_per_token_ = 3.0 * model::forward_flops(mc, c.data.seq_len, 0) /
                       static_cast<double>(c.data.seq_len);
    // The set-up's one-off buffers (weights drawn, then copied into the data-parallel flat
    // layout) go back to the OS rather than idling in the allocator's cache for the run.
    base::trim_cached();
  }

  TrainResult run() {
    TrainResult result;
    base::Timer total;
    prepare_out_dir();
    result.start_step = st_.step;
    if ((result.already_finished = st_.step >= c_.training.steps)) return result;  // nothing to redo
    const bool lead = rank_ == 0;  // writes metrics, the progress bar and models
    const double peak = lead ? peak_flops() : 0.0;
    std::unique_ptr<MetricsWriter> metrics;
    if (lead) {
      metrics = std::make_unique<MetricsWriter>(c_.out_dir + "/metrics.jsonl", o_.resume);
      if (o_.resume) metrics->truncate_from_step(st_.step + 1);
    }
    result.start_step = st_.step;
    result.world_size = world_;
    result.rank = rank_;
    // Under an elastic supervisor (TESSERA_HEARTBEAT_DIR set): liveness and progress.
    const auto heartbeat = Heartbeat::from_env(rank_);
    const auto& tr = c_.training;
    const int64_t B = c_.data.batch_size, T = c_.data.seq_len, accum = c_.data.grad_accum;
    if (lead)
      std::fprintf(stderr,
                   "train: %s %.1fM params, %lld steps of %lld x %lld x %lld tokens, %s, "
                   "checkpointing %s, %d rank%s (ZeRO stage %d%s), out %s\n",
                   model_.config().model_type.c_str(), model_.config().num_parameters() / 1e6,
                   static_cast<long long>(tr.steps), static_cast<long long>(accum),
                   static_cast<long long>(B), static_cast<long long>(T), tr.precision.c_str(),
                   tr.activation_checkpointing.c_str(), world_, world_ > 1 ? "s" : "",
                   c_.parallel.zero_stage, c_.parallel.offload ? ", CPU offload" : "",
                   c_.out_dir.c_str());
    if (lead)
      std::fprintf(stderr, "train: compute %s\n%s", model::describe_compute(model_.compute_dtype(), model_.bf16_mode()).c_str(),
                   describe_packing(loader_).c_str());
    std::optional<base::ProgressBar> bar;
    if (c_.logging.progress && lead) bar.emplace("train", tr.steps, st_.step);
    std::string last_val;  // the latest validation loss, shown until the next
    const int64_t local_b = B / row_size_;  // the tp (and cp) ranks of a replica share its rows
    model::TokenBatch batch;
    if (!c_.logging.trace.empty()) {
      result.trace_path = trace_path(c_.logging.trace, rank_, world_);
      base::start_trace(result.trace_path);
    }
    if (c_.checkpoint.every > 0 && c_.checkpoint.async && c_.parallel.zero_stage != 3) {
      // The snapshot memory is faulted in now rather than inside the first save. (ZeRO-3
      // gathers its weights only to save them; its first save allocates.)
      base::TraceScope reserve("checkpoint_reserve");
      ckpt_.reserve(checkpoint_files());
    }
    while (st_.step < tr.steps) {
      base::TraceScope step_scope("step");
      base::Timer step_timer;
      const LoaderState before = loader_.state();
      const float scale = scaler_.enabled() ? static_cast<float>(scaler_.scale()) : 1.f;
      const auto rows = [&](int64_t) {
        next_batch(B, batch);  // the global batch; this rank takes its rows
        return my_tokens(batch_rows(batch, row_rank_ * local_b, (row_rank_ + 1) * local_b));
      };
      const GradientPass gp = pipe_ ? pipeline_gradients(accum, scale, rows)
                                    : accumulate_gradients(model_, dp_, accum, scale, rows);
      // The loss lives on the last pipeline stage: summed over the stages, then replicas.
      const double loss_sum = over_pp(gp.loss_sum);
      int64_t count = static_cast<int64_t>(over_pp(static_cast<double>(gp.count)));
      const int64_t activation_bytes = gp.activation_bytes;
      // Every rank holds the same number of targets, so the mean of the ranks' means is
      // the global batch's mean (and the gradients were averaged the same way).
      const double loss = dp_.sum_over_ranks(loss_sum) / static_cast<double>(accum * dp_size_);
      count = static_cast<int64_t>(dp_.sum_over_ranks(static_cast<double>(count)));
      const LoaderState after = loader_.state();
      bool finite = true;
      if (scaler_.enabled()) {
        finite = scaler_.unscale_and_check(refs_);
        if (dp_.sharded()) finite = dp_.sum_over_ranks(finite ? 0.0 : 1.0) == 0.0;
        if (tp_) finite = parallel::exact_sum(mesh_->group(parallel::Axis::kTp), finite ? 0.0 : 1.0) == 0.0;
        if (pipe_) finite = over_pp(finite ? 0.0 : 1.0) == 0.0;
      }
      GradClip clip;
      {
        base::TraceScope clip_scope("clip_grad_norm");
        // The squares summed over what the ranks hold apart: the tp blocks (replicated
        // tensors count 1/tp each, ParamRef::norm_share), the pipeline stages, then the
        // ZeRO shards.
        std::function<double(double)> across;
        if (dp_.sharded() || tp_ || pipe_)
          across = [this](double x) {
            if (tp_) x = parallel::exact_sum(mesh_->group(parallel::Axis::kTp), x);
            x = over_pp(x);
            return dp_.sharded() ? dp_.sum_over_ranks(x) : x;
          };
        clip = grad_clip(refs_, tr.max_grad_norm, across);  // applied by the update
      }
      finite = finite && std::isfinite(clip.norm);  // a non-finite gradient makes the norm so
      const bool spike = finite && spikes_.is_spike(loss);
      if (spike && c_.spike_guard.policy == "rollback" && try_rollback(before, after, loss, metrics.get())) {
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
        update_weights(opt_, dp_, lr_scale, clip.coef, [&] {
          if (c_.training.moe_bias_update_rate > 0) update_router_bias(dp_, gp, c_.training.moe_bias_update_rate, model_.config());
        });
        spikes_.add(loss);
      } else if (!finite) {
        ++st_.skipped_steps;
      }
      if (spike) {
        ++st_.spikes;
        if (lead) TESSERA_LOG(kWarn, "step ", st_.step + 1, ": loss ", loss, " is a spike (mean ",
                    spikes_.mean(), ", std ", spikes_.stddev(), "); batch skipped");
      }
      scaler_.update(!finite);
      ++st_.step;
      if (heartbeat) heartbeat->set_step(st_.step);
      st_.tokens_seen += static_cast<uint64_t>(count);
      const double secs = step_timer.seconds();
      StepMetrics sm;
      sm.step = st_.step;
      sm.loss = loss;
      sm.lr = c_.optimizer.lr * lr_scale;
      sm.grad_norm = clip.norm;
      sm.loss_scale = scaler_.enabled() ? scale : 1.0;
      sm.tokens_per_s = static_cast<double>(B * T * accum) / secs;
      sm.mfu = lead ? model_flops_utilization(flops_per_token_, sm.tokens_per_s / world_, peak) : 0;
      sm.peak_rss_mb = static_cast<double>(base::peak_rss_bytes()) / (1 << 20);
      sm.skipped = !finite;
      sm.spike = spike;
      const bool last = st_.step == tr.steps;
      if (has_val_ && ((tr.eval_every > 0 && st_.step % tr.eval_every == 0) || last)) {
        base::TraceScope eval("eval");
        sm.val_loss = validation_loss();
        result.val_loss = *sm.val_loss;
      }
      nlohmann::json rec = sm.to_record();
      if (scaler_.enabled()) rec["skipped_steps"] = st_.skipped_steps;
      add_memory(rec, activation_bytes);
      if (result.steps_run == 0 && tr.memory_limit_mb > 0)
        check_memory_limit(rec, tr.memory_limit_mb, comm_, c_.source_name());
      if (tp_) take_tp_metrics(rec, *tp_);
      if (ep_) {
        rec["ep_comm_bytes"] = ep_->bytes_sent();
        ep_->reset_bytes();
      }
      if (cp_) take_cp_metrics(rec, *cp_, c_.parallel.cp_method);
      if (pipe_) add_pipeline_metrics(rec);
      if (!gp.expert_load.empty()) add_moe_metrics(rec, gp, dp_, accum * dp_size_);
      if (model_.mtp_loss_weight() > 0) add_mtp_metrics(rec, gp, dp_);
      if (metrics) metrics->write(rec);
      result.losses.push_back(loss);
      result.final_loss = loss;
      ++result.steps_run;
      if (bar) {
        char suffix[160];
        if (sm.val_loss) last_val = " val " + std::to_string(*sm.val_loss).substr(0, 6);
        std::snprintf(suffix, sizeof suffix, "loss %.4f lr %.2e %.0f tok/s MFU %.1f%%%s", loss, sm.lr,
                      sm.tokens_per_s, 100 * sm.mfu, last_val.c_str());
        bar->update(st_.step, suffix, sm.val_loss.has_value());
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
    dp_.gather_all();
    const auto weights = tp_ || pipe_ || ep_ ? whole_weights() : decltype(whole_weights()){};
    if (pipe_) write_pipeline_timeline();
    if (lead) {
      model::save_hf_model(result.model_dir, model_.config(), model_.hf_json_files(),
                           tp_ || pipe_ || ep_ ? weights : model_.weights().named(model_.config()), 5'000'000'000ull,
                           c_.save_dtype == "bf16" ? DType::kBF16 : DType::kF32);
      for (const auto& [name, text] : tokenizer_texts_)
        io::write_file_atomic(result.model_dir + "/" + name, text);
    }
    dp_.release_all();
    comm_.barrier();  // every rank returns once the model is on disk
    metrics.reset();
    if (c_.logging.plot && lead) {
      result.svg_path = c_.out_dir + "/loss_curve.svg";
      write_training_svg(read_metrics(c_.out_dir + "/metrics.jsonl"), result.svg_path,
                         "Tessera training: " + c_.out_dir);
    }
    result.seconds = total.seconds();
    return result;
  }

 private:
  double validation_loss() {
    dp_.gather_all();
    auto [sum, count] = eval_loss_sums(
        model_, pipe_.get(), std::vector<model::TokenBatch>(val_.begin(), val_.begin() + val_counted_));
    if (val_counted_ < val_.size())  // the padding repeats (expert parallelism), not counted
      eval_loss_sums(model_, pipe_.get(),
                     std::vector<model::TokenBatch>(val_.begin() + val_counted_, val_.end()));
    dp_.release_all();
    sum = over_pp(sum);
    count = static_cast<int64_t>(over_pp(static_cast<double>(count)));
    const double total = dp_.sum_over_ranks(sum);
    const double n = dp_.sum_over_ranks(static_cast<double>(count));
    return n > 0 ? total / n : -1.0;
  }

  // Context parallelism: this rank's tokens of (ids, targets) rows; the rows at cp 1.
  model::TokenBatch my_tokens(const model::TokenBatch& b) const { return cp_tokens(b, cp_.get(), model_.cp_method()); }

  // The sum over the pipeline stages (exact, the same on every stage); x at pp 1.
  double over_pp(double x) {
    return pipe_ ? parallel::exact_sum(mesh_->group(parallel::Axis::kPp), x) : x;
  }

  // The step's micro-batches through the pipeline (trainer_layout.h).
  GradientPass pipeline_gradients(int64_t accum, float scale,
                                  const std::function<model::TokenBatch(int64_t)>& batch) {
    return run_pipeline_step(model_, dp_, *pipe_, embed_group_.get(), accum, scale, batch, last_pipe_);
  }

  void add_pipeline_metrics(nlohmann::json& rec) {
    last_spans_ = gather_pipeline_spans(last_pipe_, mesh_->group(parallel::Axis::kPp));
    pipeline_metrics(rec, *pipe_, last_pipe_, last_spans_);
  }

  void write_pipeline_timeline() {
    if (rank_ == 0) write_pipeline_svg(c_.out_dir + "/pipeline_timeline.svg", *pipe_, last_spans_);
  }

  // Bytes this rank holds for parameters, gradients, optimizer state (fp32 master weights
  // and moments) and activations: what the ZeRO paper's formulas predict (docs/distributed.md).
  void add_memory(nlohmann::json& rec, int64_t activation_bytes) const {
    const parallel::MemoryUse m = dp_.memory();
    const int64_t moments = moment_bytes_;
    rec["world_size"] = world_;
    if (world_ > 1) rec["mesh"] = mesh_shape_.describe();
    rec["mem_params"] = m.params;
    rec["mem_grads"] = m.grads;
    rec["mem_optimizer"] = m.master + moments;
    rec["mem_activations"] = activation_bytes;
    if (c_.parallel.offload) rec["mem_offloaded"] = m.offloaded + moments;
    if (c_.parallel.zero_stage == 3) rec["mem_gathered_peak"] = m.gathered_peak;
  }

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

  // The MFU denominator: the GEMM peak of the precision the matmuls really run at (bf16
  // for native bf16; f32 for f32 and emulated 16-bit compute), by the shared probe.
  double peak_flops() const {
    if (c_.logging.peak_gflops > 0) return c_.logging.peak_gflops * 1e9;
    return kernels::measure_gemm_peak(model::matmul_peak_dtype(model_.bf16_mode()), 0.15).gflops * 1e9;
  }

  void next_batch(int64_t B, model::TokenBatch& batch) {
    for (bool moved = true; moved;) {  // jump over data a rollback marked as bad
      moved = false;
      const uint64_t k = loader_.state().sequences_drawn;
      for (const auto& [a, b] : st_.skip)
        if (k >= a && k < b) {
          loader_.set_state({b});
          moved = true;
        }
    }
    loader_.next_batch(B, batch);
  }

  bool try_rollback(const LoaderState& before, const LoaderState& after, double loss,
                    MetricsWriter* metrics) {
    if (st_.rollbacks >= c_.spike_guard.max_rollbacks) return false;
    ckpt_.wait();
    comm_.barrier();  // rank 0 has committed the checkpoint every rank is about to read
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
    if (metrics) {
      metrics->truncate_from_step(st_.step + 1);
      metrics->write({{"event", "rollback"}, {"step", st_.step}, {"spike_step", spike_step},
                      {"loss", loss}});
    }
    return true;
  }

  // Rank 0: the model (Hugging Face layout), tokenizer, trainer state, config and the
  // shard index; every rank that owns optimizer state: its shard (master weights and
  // moments by piece). In stage 3 the weights must be gathered while this runs.
  CheckpointFiles checkpoint_files() const {
    CheckpointFiles f;
    const auto weights = whole_weights();
    if (saves_shard(rank_)) {
      // Under tp and ep the masters are always written (the model file holds whole tensors).
      f.safetensors.push_back({shard_file_name(rank_),
                               shard_file_tensors(dp_.pieces(), refs_, opt_.state_tensors(),
                                                  rank_ == 0 && !tp_ && !ep_ ? weights : decltype(weights){})});
    }
    if (rank_ != 0) return f;
    f.safetensors.insert(f.safetensors.begin(), {"model.safetensors", weights});
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
    nlohmann::json index;
    index["format"] = "tessera-optimizer-shards";
    index["version"] = 1;
    index["world_size"] = world_;
    index["zero_stage"] = c_.parallel.zero_stage;
    index["precision"] = c_.training.precision;
    index["bf16_mode"] = model::bf16_mode_name(model_.bf16_mode());
    std::vector<std::string> files;
    index["mesh"] = {{"dp", mesh_shape_.dp}, {"tp", mesh_shape_.tp}, {"pp", mesh_shape_.pp}, {"ep", mesh_shape_.ep}};
    for (int r = 0; r < world_; ++r)
      if (saves_shard(r)) files.push_back(shard_file_name(r));
    index["files"] = files;
    f.texts.emplace_back(kShardIndexName, index.dump(2) + "\n");
    return f;
  }

  // Whether rank r writes an optimizer shard: every rank when ZeRO shards the state,
  // else the ranks of the first data-parallel replica (under ep: one per expert shard).
  bool saves_shard(int r) const {
    if (c_.parallel.zero_stage > 0 && dp_size_ > 1) return true;
    const auto co = parallel::DeviceMesh::coords_of(mesh_shape_, r);
    return co[static_cast<int>(parallel::Axis::kDp)] == 0 && co[static_cast<int>(parallel::Axis::kCp)] == 0;
  }

  // The model's Hugging Face tensors, whole: on rank 0 under tp (gathered from the tp ranks
  // of replica 0, collective over them), this rank's own views otherwise. Under ep the
  // experts are gathered over the ep group (collective over it).
  std::vector<std::pair<std::string, Tensor>> whole_weights() const {
    if (ep_ && !tp_ && !pipe_) return parallel::gather_expert_tensors(model_, mesh_->group(parallel::Axis::kEp));
    if (!tp_ && !pipe_) return model_.weights().named(model_.config());
    if (row_rank_ / static_cast<int>(mesh_shape_.ep) != 0) return {};  // (replica 0: its ep ranks too)
    std::vector<std::pair<std::string, Tensor>> mine;
    if (tp_) {
      mine = parallel::gather_whole_tensors(model_, mesh_->group(parallel::Axis::kTp));
    } else {  // (a stage of an expert shard: its pieces are whole tensors but for the experts)
      for (auto& p : model_.weights().pieces(model_.config(), tp_shard_)) mine.emplace_back(p.name, p.view);
    }
    if (ep_) {  // then every expert, over the ep group of the tp ranks 0
      if (tp_shard_.rank != 0) return {};
      mine = parallel::gather_expert_tensors(mine, model_.config(), mesh_->group(parallel::Axis::kEp));
    }
    if (!pipe_) return mine;
    // The stages' tensors to pipeline rank 0 (from each stage's tp rank 0).
    return parallel::gather_stage_tensors(model_.config(), mesh_->group(parallel::Axis::kPp),
                                          tp_shard_.rank == 0, std::move(mine),
                                          static_cast<int>(c_.parallel.pp_virtual_stages),
                                          c_.parallel.pp_layers);
  }

  void save_checkpoint(bool async) {
    base::TraceScope scope("checkpoint_save");
    if (c_.parallel.zero_stage == 3) {  // the gathered weights go again once copied
      dp_.gather_all();
      if (async)
        ckpt_.save_async(st_.step, checkpoint_files());
      else
        ckpt_.save(st_.step, checkpoint_files());
      dp_.release_all();
      return;
    }
    if (async)  // copied in the background while the next step's forward/backward runs
      ckpt_.save_async_deferred(st_.step, checkpoint_files());
    else
      ckpt_.save(st_.step, checkpoint_files());
  }

  // A run resumes in the bf16 mode it was saved in unless the config or TESSERA_BF16 asks
  // for one: the CPU's default may differ on another machine, and the two modes sum in
  // different orders (a resume is bit-identical only in the same mode).
  void resume_bf16_mode(const std::string& dir, const std::string& saved) {
    const std::string now = model::bf16_mode_name(model_.bf16_mode());
    if (saved == now || (saved != "native" && saved != "emulated")) return;
    const auto request = model::effective_bf16_request(dp_config(c_).bf16_request);
    if (request == model::Bf16Request::kAuto) {
      model_.set_compute_dtype_in_place(model_.compute_dtype(),
                                        model::parse_bf16_request(saved, dir + " bf16_mode"));
      if (rank_ == 0)
        TESSERA_LOG(kInfo, "--resume: ", dir, " was trained with ", saved,
                    " bf16; continuing in it (this CPU's default is ", now, ")");
    } else if (rank_ == 0) {
      TESSERA_LOG(kWarn, "--resume: ", dir, " was trained with ", saved, " bf16, this run asks for ",
                  now, ": the losses follow within bf16 tolerance, not bit for bit");
    }
  }

  // Any world size and stage can load any checkpoint: each rank reads the pieces of the
  // saved shards that overlap its own (resharding). Checkpoints from before sharding
  // (optimizer.safetensors, masters = the model's weights) load the same way.
  void load_checkpoint(const LoadedCheckpoint& ck) {
    const std::string dir = ck.dir;
    const auto state = io::read_json_file(dir + "/trainer_state.json");
    try {
      std::vector<std::string> files;
      int64_t saved_tp = 1;
      if (fs::exists(dir + "/" + kShardIndexName)) {
        const auto index = io::read_json_file(dir + "/" + kShardIndexName);
        if (index.contains("mesh")) saved_tp = index.at("mesh").value("tp", int64_t{1});
        for (const auto& f : index.at("files")) files.push_back(dir + "/" + f.get<std::string>());
        if (index.contains("bf16_mode")) resume_bf16_mode(dir, index.at("bf16_mode").get<std::string>());
      } else {
        files.push_back(dir + "/optimizer.safetensors");
      }
      std::vector<std::pair<std::string, Tensor>> state_names;
      for (auto& [name, t] : opt_.state_tensors()) state_names.emplace_back(name, t);
      const auto opt_state = read_sharded_state(dir, files, saved_tp, model_config_, tp_shard_, mesh_shape_.tp,
                                                dp_.pieces(), refs_, state_names);
      opt_.load_state(opt_state, state.at("optimizer_step").get<int64_t>());
      dp_.publish_params();
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
      fail(dir, ": ", e.what());
    }
    TESSERA_CHECK(st_.step <= c_.training.steps, dir, " is at step ", st_.step,
                  ", past training.steps = ", c_.training.steps);
  }

  const TrainConfig& c_;
  TrainOptions o_;
  comm::Communicator& comm_;
  int rank_, world_;
  parallel::MeshShape mesh_shape_;
  DataMeta meta_;
  model::ModelConfig model_config_;
  model::TpShard tp_shard_;
  model::PpStage pp_stage_;
  model::Model model_;
  std::unique_ptr<parallel::DeviceMesh> mesh_;
  std::unique_ptr<parallel::CommTp> tp_;
  std::unique_ptr<parallel::CommEp> ep_;  // ep > 1: the MoE layers' token exchange
  std::unique_ptr<parallel::CommCp> cp_;  // cp > 1: the attention's transfers
  comm::Communicator& dp_group_;  // the data-parallel ranks (dp x ep) of this rank's shard
  int dp_rank_, dp_size_;
  int row_rank_, row_size_;  // which rows of the batch: dp x ep (the cp ranks share them)
  std::map<std::string, ParamFlags> flags_;
  parallel::DataParallel dp_;
  // pp > 1 with tied embeddings: this rank and its peer at the other end of the pipeline
  // (stage 0 holds the embeddings, the last stage its copy as lm_head).
  std::unique_ptr<comm::Communicator> embed_group_;
  std::unique_ptr<parallel::Pipeline> pipe_;  // pp > 1
  parallel::PipelineStep last_pipe_;          // the last step's (timeline, traffic)
  std::vector<std::vector<parallel::PipeSpan>> last_spans_;  // every pp rank's, last step
  std::vector<ParamRef> refs_;
  Optimizer opt_;
  LossScaler scaler_;
  DataLoader loader_;
  SpikeDetector spikes_;
  CheckpointManager ckpt_;
  std::vector<model::TokenBatch> val_;  // this rank's share of the val batches
  size_t val_counted_ = 0;  // the first ones; the rest repeat one for expert parallelism
  bool has_val_ = false;
  std::string tokenizer_dir_;
  std::vector<std::pair<std::string, std::string>> tokenizer_texts_;
  double flops_per_token_ = 0;
  int64_t moment_bytes_ = 0;  // optimizer moments on this rank (fixed for the run)
  RunState st_;
};

}  // namespace

TrainResult run_training(const TrainConfig& config, const TrainOptions& options) {
  if (config.lora.enabled) {  // LoRA fine-tuning: the frozen base and its adapters (lora_trainer.h)
    if (options.comm) return run_lora_training(config, options, *options.comm);
    if (comm::running_under_mpi()) return run_lora_training(config, options, comm::mpi_world());
    const auto self = comm::self_communicator();
    return run_lora_training(config, options, *self);
  }
  if (options.comm) {
    Run run(config, options, *options.comm);
    return run.run();
  }
  if (comm::running_under_mpi()) {
    Run run(config, options, comm::mpi_world());
    return run.run();
  }
  const auto self = comm::self_communicator();
  Run run(config, options, *self);
  return run.run();
}

}  // namespace tessera::train
