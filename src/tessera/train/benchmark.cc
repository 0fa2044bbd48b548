// Full training-step benchmark, with the async-checkpoint stall measured on real steps.
#include "tessera/train/benchmark.h"

#include <filesystem>
#include <random>

#include "tessera/base/memory.h"
#include "tessera/base/timer.h"
#include "tessera/kernels/peak.h"
#include "tessera/model/benchmark.h"
#include "tessera/train/checkpoint.h"
#include "tessera/train/grad_utils.h"
#include "tessera/train/optimizer.h"
#include "tessera/train/trainer_setup.h"

namespace tessera::train {

StepBench bench_train_step(model::Model& model, const StepBenchOptions& o) {
  const auto& c = model.config();
  model::Params grads = model::Params::allocate(c, DType::kF32);
  auto refs = make_param_refs(model, grads);
  Optimizer opt(OptimizerConfig{}, refs);
  std::mt19937 rng(11);
  Tensor ids = Tensor::empty({o.batch, o.seq}, DType::kI32);
  Tensor targets = Tensor::empty({o.batch, o.seq}, DType::kI32);
  for (int64_t i = 0; i < o.batch * o.seq; ++i) {
    ids.data<int32_t>()[i] = static_cast<int32_t>(rng() % c.vocab_size);
    targets.data<int32_t>()[i] = static_cast<int32_t>(rng() % c.vocab_size);
  }
  CheckpointManager* pending = nullptr;  // a save whose copy must finish before the update
  auto step = [&] {
    // One micro-batch per step: the backward pass writes the gradients (no zeroing pass).
    model.forward_backward(ids, targets, grads, 1.f, model::Model::GradWrite::kAssign);
    if (!o.optimizer) return;
    if (pending) pending->wait_snapshot();
    clip_grad_norm(refs, o.max_grad_norm);
    opt.step(1e-3);  // a tiny lr keeps the weights sane over the repeats
    model.refresh_compute_weights();
  };
  StepBench r;
  std::vector<double> secs;
  for (int i = 0; i < o.repeats + 1; ++i) {
    base::Timer t;
    step();
    if (i > 0) secs.push_back(t.seconds());
  }
  r.step_seconds = base::median(secs);
  r.tokens_per_second = static_cast<double>(o.batch * o.seq) / r.step_seconds;
  const double flops = 3.0 * model::forward_flops(c, o.seq, 0) * static_cast<double>(o.batch);
  r.model_gflops = flops / r.step_seconds / 1e9;
  r.peak_rss_mb = static_cast<double>(base::peak_rss_bytes()) / (1 << 20);
  // The peak right after the steps, before a checkpoint's writeback competes with it.
  if (o.measure_peak) {
    const DType dt = model.compute_dtype() == DType::kF32 ? DType::kF32 : DType::kBF16;
    r.peak_gflops = kernels::measure_matmul_gflops(2048, 2048, 2048, dt,
                                                   kernels::MatmulBackend::kAuto, 1.0)
                        .gflops;
    r.mfu = r.model_gflops / r.peak_gflops;
  }

  if (o.checkpoint) {
    // The state a trainer checkpoint holds: weights and optimizer moments.
    CheckpointFiles files;
    files.safetensors.push_back({"model.safetensors", model.weights().named(c)});
    files.safetensors.push_back({"optimizer.safetensors", opt.state_tensors()});
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
