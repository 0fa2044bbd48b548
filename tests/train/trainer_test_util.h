// Shared by the trainer tests: a temp run directory, a tiny learnable corpus as token
// shards, and a minimal run config over them.
#pragma once
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "tessera/train/token_shard.h"

namespace tessera::train {

namespace fs = std::filesystem;

inline void io_write(const std::string& path, const std::string& text) {
  std::ofstream(path) << text;
}

inline std::string temp_dir(const std::string& name) {
  const std::string d = fs::temp_directory_path() / ("tessera_trainer_" + name + "_" +
                                                     std::to_string(::getpid()));
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
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


}  // namespace tessera::train
