// The training metrics log: one JSON object per line in RUN_DIR/metrics.jsonl
// (fields in docs/metrics.md), written by the trainer and read back by `tessera plot`.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace tessera::train {

// One optimizer step as the trainer logs it; to_record() gives the JSON line with the
// key names docs/metrics.md documents. Non-finite values are written as null.
struct StepMetrics {
  int64_t step = 0;           // optimizer steps done, counting this one
  double loss = 0;            // mean token cross-entropy of the step, nats
  double lr = 0;              // learning rate used for this step
  double grad_norm = 0;       // global L2 norm of the gradients before clipping
  double loss_scale = 1;      // dynamic loss scale (1 without fp16 loss scaling)
  double tokens_per_s = 0;    // training tokens processed per wall-clock second
  double mfu = 0;             // model FLOPs utilization, 0..1 (see model_flops_utilization)
  double peak_rss_mb = 0;     // peak resident memory, MiB (base::peak_rss_bytes() / 2^20)
  bool skipped = false;       // the optimizer step was skipped (loss-scale overflow)
  bool spike = false;         // the loss-spike detector fired on this step
  std::optional<double> val_loss;  // validation loss, on steps that ran an evaluation
  nlohmann::json to_record() const;
};

// Achieved model FLOP/s over a peak FLOP/s (the one `tessera bench gemm` measures):
// flops_per_token (6 * params + attention for forward + backward) * tokens_per_s / peak.
// Returns 0 when peak_flops <= 0.
double model_flops_utilization(double flops_per_token, double tokens_per_s, double peak_flops);

// Appends JSON lines to a metrics file. Each line goes to the kernel in one write() as
// soon as it is written, so a crash of the process loses at most the line being written.
// One writer per file; not thread-safe.
class MetricsWriter {
 public:
  // append=false starts a new log (truncates); append=true continues one (a resumed run)
  // and first drops a torn last line left by a crash, so the next line starts clean.
  MetricsWriter(const std::string& path, bool append);
  ~MetricsWriter();
  MetricsWriter(const MetricsWriter&) = delete;
  MetricsWriter& operator=(const MetricsWriter&) = delete;

  // Writes `record` (must be a JSON object) as one line.
  void write(const nlohmann::json& record);

  // Rewrites the file atomically keeping only records whose "step" < step (and records
  // with no "step"); a torn last line is dropped. Called on resume from a checkpoint at
  // `step`, so the log holds no step twice. Malformed lines elsewhere throw.
  void truncate_from_step(int64_t step);

  const std::string& path() const { return path_; }

 private:
  void open_for_append();
  std::string path_;
  int fd_ = -1;
};

// All records of a metrics file in order. A last line that does not parse (torn by a
// crash) is skipped with a warning; a malformed line elsewhere, or a line that is not a
// JSON object, throws tessera::Error naming "PATH:LINE". Blank lines are ignored.
std::vector<nlohmann::json> read_metrics(const std::string& path);

}  // namespace tessera::train
