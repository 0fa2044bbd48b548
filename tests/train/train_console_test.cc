// `tessera train`'s console through the real CLI (issue 22): the progress line has an ETA,
// MFU and the latest validation loss; its rate after --resume counts only the steps this
// invocation ran; --resume of a finished run says so and leaves the model alone; Ctrl-C
// says how to resume.
#include <gtest/gtest.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <regex>
#include <string>
#include <thread>

#include "tessera/io/safetensors.h"
#include "test_util/run_command.h"
#include "train/trainer_test_util.h"

namespace tessera::train {
namespace {

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Runs `tessera train ARGS`, stderr into a file; returns {exit code, stderr, stdout}.
struct Out {
  int code;
  std::string err, out;
};
Out train_cli(const std::string& args, const std::string& dir) {
  const auto r = testing::run_command(std::string(TESSERA_CLI_PATH) + " train " + args + " 2>" + dir + "/err.txt",
                                      /*merge_stderr=*/false);
  return {r.code, read_text(dir + "/err.txt"), r.out};
}

TEST(TrainConsole, EtaMfuValLossAndResumeOfAFinishedRun) {
  const std::string dir = temp_dir("console");
  const std::string data = make_data(dir, 20000);
  std::string cfg = base_config(dir + "/run", data, 6, "[checkpoint]\nevery = 3\n");
  cfg.replace(cfg.find("progress = false"), 16, "progress = true");
  cfg.replace(cfg.find("eval_batches = 2"), 16, "eval_batches = 2\neval_every = 2");
  io_write(dir + "/run.toml", cfg);
  const Out first = train_cli("--config " + dir + "/run.toml --stop-after 3", dir);
  ASSERT_EQ(first.code, 0) << first.err;
  EXPECT_NE(first.err.find("ETA "), std::string::npos) << first.err;
  EXPECT_NE(first.err.find(" MFU "), std::string::npos) << first.err;
  EXPECT_NE(first.err.find(" val "), std::string::npos) << first.err;  // evaluated at step 2

  const Out rest = train_cli("--config " + dir + "/run.toml --resume", dir);
  ASSERT_EQ(rest.code, 0) << rest.err;
  // The final line: 6/6 with its elapsed time (the rate's arithmetic: ProgressBar's test).
  EXPECT_TRUE(std::regex_search(rest.err, std::regex("6/6 [0-9.]+ it/s in [0-9]+s"))) << rest.err;

  const auto model_time = fs::last_write_time(dir + "/run/model/config.json");
  const Out again = train_cli("--config " + dir + "/run.toml --resume", dir);
  EXPECT_EQ(again.code, 0) << again.err;
  EXPECT_NE(again.out.find("already finished its 6 steps; nothing to do"), std::string::npos) << again.out;
  EXPECT_EQ(again.out.find("final loss"), std::string::npos) << again.out;
  EXPECT_EQ(fs::last_write_time(dir + "/run/model/config.json"), model_time);
  fs::remove_all(dir);
}

TEST(TrainConsole, CtrlCSaysHowToResume) {
  const std::string dir = temp_dir("console_int");
  const std::string data = make_data(dir, 20000);
  io_write(dir + "/run.toml", base_config(dir + "/run", data, 100000, "[checkpoint]\nevery = 1\n"));
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = ::open((dir + "/err.txt").c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    dup2(fd, 2);
    execl(TESSERA_CLI_PATH, TESSERA_CLI_PATH, "train", "--config", (dir + "/run.toml").c_str(), nullptr);
    _exit(127);
  }
  // Wait for the first checkpoint, then interrupt as a terminal's Ctrl-C does.
  for (int i = 0; i < 600 && !fs::exists(dir + "/run/checkpoints/latest"); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  ASSERT_TRUE(fs::exists(dir + "/run/checkpoints/latest"));
  kill(pid, SIGINT);
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 130);
  const std::string err = read_text(dir + "/err.txt");
  EXPECT_NE(err.find("interrupted; continue from the latest checkpoint in " + dir + "/run/checkpoints"),
            std::string::npos) << err;
  EXPECT_NE(err.find("tessera train --config " + dir + "/run.toml --resume"), std::string::npos) << err;
  fs::remove_all(dir);
}

// [run] save_dtype = "bf16": the final model holds bf16 weights, each the f32 run's weight
// rounded to nearest even (the same seed and data train the same f32 weights), and
// config.json says torch_dtype bfloat16.
TEST(TrainConsole, SaveDtypeBf16WritesTheRoundedWeights) {
  const std::string dir = temp_dir("save_bf16");
  const std::string data = make_data(dir, 20000);
  io_write(dir + "/f32.toml", base_config(dir + "/f32", data, 2));
  io_write(dir + "/bf16.toml", "[run]\nsave_dtype = \"bf16\"\n" + base_config(dir + "/bf16", data, 2).substr(6));
  ASSERT_EQ(train_cli("--config " + dir + "/f32.toml", dir).code, 0);
  const Out b = train_cli("--config " + dir + "/bf16.toml", dir);
  ASSERT_EQ(b.code, 0) << b.err;
  const auto f32 = io::SafetensorsModel::open(dir + "/f32/model");
  const auto half = io::SafetensorsModel::open(dir + "/bf16/model");
  ASSERT_EQ(f32.names(), half.names());
  for (const auto& name : f32.names()) {
    ASSERT_EQ(half.info(name).dtype, DType::kBF16) << name;
    const Tensor a = f32.get(name), h = half.get(name);
    for (int64_t i = 0; i < a.numel(); ++i) {
      uint32_t bits;
      std::memcpy(&bits, a.data<float>() + i, 4);
      const uint16_t want = static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
      ASSERT_EQ(h.data<bf16>()[i].bits, want) << name << "[" << i << "]";
    }
  }
  EXPECT_NE(read_text(dir + "/bf16/model/config.json").find("\"torch_dtype\": \"bfloat16\""), std::string::npos);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace tessera::train
