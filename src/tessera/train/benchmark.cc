// Full training-step benchmark through the trainer's own objects, with the async-checkpoint
// stall measured on real steps.
#include "tessera/train/benchmark.h"

#include <filesystem>
#include <random>

#include "tessera/base/memory.h"
#include "tessera/base/timer.h"
#include "tessera/base/trace.h"
#include "tessera/comm/communicator.h"
#include "tessera/kernels/peak.h"
#include "tessera/model/benchmark.h"
#include "tessera/parallel/data_parallel.h"
#include "tessera/train/checkpoint.h"
#include "tessera/base/error.h"
#include "tessera/train/grad_utils.h"
#include "tessera/train/lora_trainer.h"
#include "tessera/train/optimizer.h"
#include "tessera/train/trainer_setup.h"

namespace tessera::train {

StepBench bench_train_step(model::Model& model, const TrainConfig& config, const StepBenchOptions& o) {
  const auto& c = model.config();
  const int64_t accum = config.data.grad_accum;
  model.set_recompute(model::parse_recompute(config.training.activation_checkpointing));
  const auto self = comm::self_communicator();
  // What `tessera train` wraps every model in (one process too), from the same config: the
  // DataParallel wrapper and its optimizer, or with [lora] the LoRA trainer's step objects.
  std::unique_ptr<LoraStep> lora;
  std::unique_ptr<parallel::DataParallel> dp;
  std::vector<ParamRef> refs;
  std::unique_ptr<Optimizer> own_opt;
  if (config.lora.enabled) {
    TESSERA_CHECK(!o.checkpoint, "bench train: --checkpoint with [lora] is not supported");
    lora = std::make_unique<LoraStep>(model, config);
    refs = lora->refs;
  } else {
    dp = std::make_unique<parallel::DataParallel>(model, *self, dp_config(config));
    refs = dp_param_refs(*dp, param_flags(model), config.optimizer.name);
    own_opt = std::make_unique<Optimizer>(config.optimizer, refs);
  }
  Optimizer& opt = lora ? *lora->opt : *own_opt;
  std::mt19937 rng(11);
  Tensor ids = Tensor::empty({o.batch, o.seq}, DType::kI32);
  Tensor targets = Tensor::empty({o.batch, o.seq}, DType::kI32);
  for (int64_t i = 0; i < o.batch * o.seq; ++i) {
    ids.data<int32_t>()[i] = static_cast<int32_t>(rng() % c.vocab_size);
    targets.data<int32_t>()[i] = static_cast<int32_t>(rng() % c.vocab_size);
  }
  CheckpointManager* pending = nullptr;  // a save whose copy must finish before the update
  auto step = [&] {
    const model::TokenBatch batch{ids, targets, Tensor()};
    if (lora) {  // as LoraRun's step (one process)
      lora->zero_grads();
      for (int64_t i = 0; i < accum; ++i) lora->micro_batch(batch, 1.f / static_cast<float>(accum), 1 + i);
    } else {
      accumulate_gradients(model, *dp, accum, 1.f, [&](int64_t) { return batch; });
    }
    if (!o.optimizer) return;
    if (pending) pending->wait_snapshot();
    // As the trainer's step: the clip and the update (one process), a tiny lr keeping the
    // weights sane over the repeats.
    const GradClip clip = grad_clip(refs, config.training.max_grad_norm);
    if (dp)
      update_weights(opt, *dp, 1e-3, clip.coef);
    else
      lora->update(1e-3, clip.coef);
  };
  StepBench r;
  r.compute = model::describe_compute(model.compute_dtype(), model.bf16_mode());
  r.peak_dtype = model::matmul_peak_dtype(model.bf16_mode());
  std::vector<double> secs;
  for (int i = 0; i < o.repeats + 1; ++i) {
    if (i == 1 && !o.trace.empty()) base::start_trace(o.trace);  // the timed steps only
    base::Timer t;
    {
      const base::TraceScope span("train_step", "step");
      step();
    }
    if (i > 0) secs.push_back(t.seconds());
  }
  if (!o.trace.empty()) base::stop_trace();
  r.step_seconds = base::median(secs);
  const double tokens = static_cast<double>(o.batch * o.seq * accum);
  r.tokens_per_second = tokens / r.step_seconds;
  const double flops = 3.0 * model::forward_flops(c, o.seq, 0) * static_cast<double>(o.batch * accum);
  r.model_gflops = flops / r.step_seconds / 1e9;
  r.peak_rss_mb = static_cast<double>(base::peak_rss_bytes()) / (1 << 20);
  // The peak right after the steps, before a checkpoint's writeback competes with it.
  if (o.measure_peak) {
    r.peak_gflops = kernels::measure_gemm_peak(r.peak_dtype).gflops;
    r.mfu = r.model_gflops / r.peak_gflops;
    const auto nominal = kernels::nominal_gemm_peak(r.peak_dtype);
    r.nominal_gflops = nominal.gflops;
    r.nominal_how = nominal.how;
    r.nominal_mfu = nominal.gflops > 0 ? r.model_gflops / nominal.gflops : 0;
  }

  if (o.checkpoint) {
    // The state a trainer checkpoint holds: weights, separate masters, optimizer moments.
    CheckpointFiles files;
    const auto weights = model.weights().named(c);
    auto state = master_tensors(refs, weights);
    for (auto& t : opt.state_tensors()) state.push_back(std::move(t));
    files.safetensors.push_back({"model.safetensors", weights});
    files.safetensors.push_back({"optimizer-rank00000.safetensors", std::move(state)});
    for (const auto& [name, list] : files.safetensors)
      for (const auto& [n, t] : list) r.ckpt_bytes += t.nbytes();
    {
      CheckpointManager ckpt(o.checkpoint_dir, 1);
      ckpt.reserve(files);  // as the trainer does before its first step
      r.ckpt_reserve_seconds = ckpt.last_reserve_seconds();
      for (int save = 1; save <= 2; ++save) {
        // As the trainer does: the copy runs beside the next forward/backward and the
        // optimizer step waits for it. Every step that overlaps the save (blocking part,
        // copy, write) carries part of the stall: the sum of their excess over the median.
        CheckpointStall s;
        ckpt.save_async_deferred(save, files);
        pending = &ckpt;
        double extra = 0;
        while (ckpt.writing() || s.step_seconds.empty()) {
          base::Timer t;
          step();
          s.step_seconds.push_back(t.seconds());
          extra += t.seconds() - r.step_seconds;
        }
        s.blocking_seconds = ckpt.last_blocking_seconds();
        ckpt.wait();
        pending = nullptr;
        s.write_seconds = ckpt.last_write_seconds();
        s.stall_fraction = std::max(0.0, extra) / r.step_seconds;
        r.ckpt.push_back(std::move(s));
      }
    }
    std::filesystem::remove_all(o.checkpoint_dir);
  }
  return r;
}

}  // namespace tessera::train
