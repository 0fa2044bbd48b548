// Shared by the trainer tests: a temp run directory, a tiny learnable corpus as token
// shards, and a minimal run config over them.
#pragma once
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include <cmath>

#include "tessera/comm/communicator.h"
#include "tessera/train/metrics.h"
#include "tessera/train/token_shard.h"
#include "tessera/train/trainer.h"
#include "test_util/scratch_dir.h"

namespace tessera::train {

namespace fs = std::filesystem;

inline void io_write(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
}

// Removed when the test process exits (test_util/scratch_dir.h).
inline std::string temp_dir(const std::string& name) {
  return testing::scratch_dir("tessera_trainer_" + name + "_");
}

// A learnable synthetic corpus: a noisy first-order pattern over 64 of 256 token ids.
inline std::string make_data(const std::string& root, int64_t tokens = 40000) {
  const std::string dir = root + "/data";
  fs::create_directories(dir);
  std::mt19937 rng(7);
  std::vector<int32_t> t(tokens);
  t[0] = 1, t[1] = 2;
  for (int64_t i = 2; i < tokens; ++i)
    t[i] = rng() % 8 == 0 ? static_cast<int32_t>(rng() % 64) : (t[i - 1] * 5 + 3) % 64;
  const int64_t val = tokens / 10;
  DataMeta meta;
  meta.vocab_size = 256;
  meta.token_bytes = token_bytes_for_vocab(256);
  meta.train_tokens = tokens - val;
  meta.val_tokens = val;
  meta.train_shards = write_token_shards(dir, "train", {t.begin(), t.end() - val}, 256, 1 << 30);
  meta.val_shards = write_token_shards(dir, "val", {t.end() - val, t.end()}, 256, 1 << 30);
  write_data_meta(dir, meta);
  return dir;
}

inline std::string base_config(const std::string& out, const std::string& data, int64_t steps,
                        const std::string& extra = "") {
  return "[run]\nout_dir = \"" + out + "\"\n"
         "[model]\nshape = \"tiny\"\nseed = 3\n" +
         "[data]\ndir = \"" + data + "\"\nseq_len = 32\nbatch_size = 4\n" +
         "[training]\nsteps = " + std::to_string(steps) + "\nprecision = \"fp32\"\n"
         "eval_batches = 2\n"
         "[logging]\nprogress = false\npeak_gflops = 100.0\nplot = false\n" + extra;
}


// A run's per-step losses and gradient norms (rank 0's), its metrics records and val loss.
struct RunOut {
  std::vector<double> losses, grad_norms;
  std::vector<nlohmann::json> records;
  double val_loss = -1;
};

// Trains `cfg_text` on n local ranks (n == 0: the plain single-process path).
inline RunOut train(const std::string& cfg_text, int n, TrainOptions opts = {}) {
  const TrainConfig c = TrainConfig::parse(cfg_text, "test.toml");
  TrainResult r0;
  if (n == 0) {
    r0 = run_training(c, opts);
  } else {
    comm::run_local(n, [&](comm::Communicator& comm) {
      TrainOptions o = opts;
      o.comm = &comm;
      TrainResult r = run_training(c, o);
      if (comm.rank() == 0) r0 = r;
    });
  }
  RunOut out;
  out.losses = r0.losses;
  out.val_loss = r0.val_loss;
  for (const auto& rec : read_metrics(c.out_dir + "/metrics.jsonl")) {
    if (!rec.contains("loss")) continue;
    out.records.push_back(rec);
    out.grad_norms.push_back(rec.at("grad_norm").get<double>());
  }
  return out;
}

inline void expect_close(const std::vector<double>& got, const std::vector<double>& want, double rel,
                  const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < want.size(); ++i)
    EXPECT_LE(std::abs(got[i] - want[i]), rel * std::abs(want[i])) << what << " step " << i + 1
                                                                   << ": " << got[i] << " vs "
                                                                   << want[i];
}

}  // namespace tessera::train
