// Crash-safe, asynchronous training checkpoints: one directory per step holding the files
// the trainer hands over (safetensors + text), checksummed, committed by atomic renames.
// Model-agnostic: the trainer decides which files a checkpoint holds; see docs/checkpoints.md.
#pragma once
#include <atomic>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <future>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "tessera/tensor/tensor.h"

namespace tessera::train {

// What one checkpoint holds. File names are plain names inside the step directory (no '/').
struct CheckpointFiles {
  // file name (e.g. "model.safetensors") -> named tensors, written in this order. The
  // manager copies them (into the file's exact bytes in memory) before save_async returns.
  std::vector<std::pair<std::string, std::vector<std::pair<std::string, Tensor>>>> safetensors;
  // file name -> contents (config.json, trainer_state.json, config.toml, ...)
  std::vector<std::pair<std::string, std::string>> texts;
};

// A checkpoint that verified; the trainer opens the files in `dir` itself.
struct LoadedCheckpoint {
  int64_t step = 0;
  std::string dir;  // RUN_DIR/checkpoints/step_XXXXXXXX
};

// Name of the step directory: "step_00000100" (8 digits, more when the step needs them).
std::string checkpoint_dir_name(int64_t step);

// Writes checkpoints under RUN_DIR/checkpoints/. At most one write is in flight; only the
// thread that owns the manager calls its methods (find_latest/verify are safe anywhere).
class CheckpointManager {
 public:
  explicit CheckpointManager(std::string run_dir, int keep_last = 3);
  // Several ranks writing one checkpoint (a shared file system): every rank calls save
  // with the files it owns (distinct names); rank 0 prepares the step directory, waits for
  // every rank's files (each rank leaves a digest marker), then writes checksums and
  // commits. `barrier` is a collective over the ranks; it runs inside save_async.
  void set_ranks(int rank, int world_size, std::function<void()> barrier,
                 double shard_timeout_s = 600);
  ~CheckpointManager();  // waits for a pending write; logs (never throws) its error
  CheckpointManager(const CheckpointManager&) = delete;
  CheckpointManager& operator=(const CheckpointManager&) = delete;

  // Waits for the previous save (rethrowing its error), copies the tensors into an image
  // of each safetensors file (parallel memcpy; the caller may change its tensors as soon
  // as this returns), then writes in a background thread: .tmp-step_X/ <files> (each
  // image with O_DIRECT, no page cache) + checksums.json, fsync files and directory,
  // rename to step_X, fsync checkpoints/, `latest` via tmp + fsync + rename, prune to
  // the newest keep_last step directories. Stale .tmp-* directories are removed first.
  void save_async(int64_t step, CheckpointFiles files);
  void save(int64_t step, CheckpointFiles files);
  // Allocates and faults in the snapshot memory for saves of files shaped like `files`
  // (the tensors' contents are not read), so the first save costs what later ones do.
  // The memory is kept for the manager's lifetime and reused by every save. Optional:
  // a save without it allocates on first use.
  void reserve(const CheckpointFiles& files);
  double last_reserve_seconds() const { return last_reserve_seconds_; }
  // Like save_async, but the copy itself runs on the background thread, so the
  // caller does not wait for it: the caller must leave the tensors unchanged until
  // wait_snapshot() returns (a trainer calls it just before its optimizer step, so the
  // copy overlaps the next forward and backward, which only read the weights).
  void save_async_deferred(int64_t step, CheckpointFiles files);
  // Returns once the pending deferred copy is done (at once when there is none); the
  // time waited is added to last_blocking_seconds().
  void wait_snapshot();
  bool writing() const;  // a save is in flight  // save_async + wait
  // Waits for the write in flight; rethrows its error (one line naming the file) once.
  void wait();

  // Seconds the last save_async blocked its caller (waiting for the previous write plus
  // the copy), and seconds its background write took (valid after wait()).
  double last_blocking_seconds() const { return last_blocking_seconds_; }
  double last_write_seconds() const { return last_write_seconds_.load(); }

  const std::string& run_dir() const { return run_dir_; }
  std::string checkpoints_dir() const;  // RUN_DIR/checkpoints

  // The newest checkpoint that verifies: `latest` first (the highest step directory when
  // `latest` is missing or bad), then older ones, warning on stderr about each one
  // skipped and why. nullopt when there is no checkpoint; throws tessera::Error naming
  // every directory and fault when some exist but none verifies.
  std::optional<LoadedCheckpoint> find_latest() const { return find_latest_in(run_dir_); }
  static std::optional<LoadedCheckpoint> find_latest_in(const std::string& run_dir);

  // True when step_dir/checksums.json exists and every file it lists has its size and
  // XXH3-64 checksum; otherwise false with *why (if given) naming the file at fault.
  static bool verify(const std::string& step_dir, std::string* why);

 private:
  struct Job;
  struct Buffers;
  void run_job(Job& job);
  void start_save(int64_t step, CheckpointFiles files, bool deferred);

  std::string run_dir_;
  int keep_last_;
  int rank_ = 0, world_ = 1;
  std::function<void()> barrier_;
  double shard_timeout_s_ = 600;
  std::unique_ptr<Buffers> buffers_;  // snapshot memory, one block per safetensors file
  std::thread worker_;
  std::exception_ptr error_;  // set by the worker, read after join
  std::future<void> snapshot_done_;  // ready once the worker holds its copies
  bool snapshot_pending_ = false;    // a deferred copy not yet waited for
  std::atomic<bool> write_finished_{true};
  double last_blocking_seconds_ = 0.0;
  double last_reserve_seconds_ = 0.0;
  std::atomic<double> last_write_seconds_{0.0};
};

}  // namespace tessera::train
