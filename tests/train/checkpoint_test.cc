// Tests for the checkpoint manager: round trip, copy-before-return, pruning, checksum
// fallback on corrupt / truncated files, bad input, and SIGKILL at random moments.
#include "tessera/train/checkpoint.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tessera/base/thread_pool.h"
#include "tessera/io/json_file.h"
#include "tessera/io/safetensors.h"

namespace tessera::train {
namespace {

namespace fs = std::filesystem;
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = (fs::temp_directory_path() /
             ("tessera_ckpt_" + std::string(info->name()) + "_" + std::to_string(::getpid())))
                .string();
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::set<std::string> list_dir(const fs::path& dir) {
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.insert(e.path().filename().string());
  return names;
}

std::string read_text(const fs::path& p) { return io::read_file_bytes(p.string()); }

// XXH3-64 of a file as the xxhsum tool (Debian package xxhash) prints it.
std::string xxhsum_h3(const std::string& path) {
  FILE* p = ::popen(("xxhsum -H3 '" + path + "' 2>/dev/null").c_str(), "r");
  if (!p) return "";
  char buf[4096];
  std::string out;
  while (size_t n = std::fread(buf, 1, sizeof buf, p)) out.append(buf, n);
  ::pclose(p);
  const size_t eq = out.rfind("= ");
  if (eq == std::string::npos) return "";
  std::string hex = out.substr(eq + 2);
  while (!hex.empty() && (hex.back() == '\n' || hex.back() == ' ')) hex.pop_back();
  return hex;
}

Tensor filled(int64_t n, float v) {
  Tensor t = Tensor::empty({n}, DType::kF32);
  t.fill(v);
  return t;
}

// A small checkpoint whose every value is `step`, so its contents tell which step it is.
CheckpointFiles step_files(int64_t step, int64_t n = 1000) {
  CheckpointFiles f;
  f.safetensors.push_back({"model.safetensors", {{"w", filled(n, float(step))},
                                                 {"b", filled(7, float(step))}}});
  f.texts.push_back({"trainer_state.json", "{\"step\": " + std::to_string(step) + "}\n"});
  return f;
}

// Checks every tensor of dir/model.safetensors holds `step` and the text agrees.
void expect_consistent(const std::string& dir, int64_t step) {
  auto file = io::SafetensorsFile::open((fs::path(dir) / "model.safetensors").string());
  for (const auto& info : file->header().tensors) {
    const std::vector<float> v = file->get(info.name).to_f32_vector();
    for (float x : v) ASSERT_EQ(x, float(step)) << dir << " tensor " << info.name;
  }
  const auto state = io::read_json_file((fs::path(dir) / "trainer_state.json").string());
  EXPECT_EQ(state["step"].get<int64_t>(), step) << dir;
}

void flip_byte(const fs::path& p, int64_t from_end) {
  std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(-from_end, std::ios::end);
  char c;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x20);
  f.seekp(-from_end, std::ios::end);
  f.write(&c, 1);
}

TEST(Checkpoint, RoundTripWritesExactFilesAndChecksums) {
  TempDir tmp;
  CheckpointFiles f;
  std::vector<float> wv(3 * 5), mv(3 * 5);
  for (size_t i = 0; i < wv.size(); ++i) wv[i] = 0.25f * float(i) - 1.0f, mv[i] = 1e-3f * float(i);
  Tensor w = Tensor::from_vector(wv, {3, 5});
  const std::vector<float> lnv = {1.0f, 2.5f, -3.0f, 0.5f};  // exact in bf16
  Tensor ln = Tensor::from_vector(lnv, {4}).to(DType::kBF16);
  Tensor wt = w.transpose(0, 1);  // (5, 3) non-contiguous view
  f.safetensors.push_back({"model.safetensors", {{"wte.weight", w}, {"ln_f.weight", ln}}});
  f.safetensors.push_back({"optimizer.safetensors",
                           {{"exp_avg.wte", Tensor::from_vector(mv, {3, 5})}, {"wt", wt}}});
  const std::string config = "{\"model_type\": \"gpt2\"}\n";
  f.texts.push_back({"config.json", config});
  f.texts.push_back({"rng_state.txt", std::string("\x00\x01" "binary" "\xff", 9)});
  CheckpointManager mgr(tmp.path());
  mgr.save(100, f);

  const fs::path root = fs::path(tmp.path()) / "checkpoints";
  const fs::path dir = root / "step_00000100";
  EXPECT_EQ(list_dir(root), (std::set<std::string>{"latest", "step_00000100"}));
  EXPECT_EQ(read_text(root / "latest"), "step_00000100\n");
  EXPECT_EQ(list_dir(dir), (std::set<std::string>{"checksums.json", "config.json",
                                                   "model.safetensors", "optimizer.safetensors",
                                                   "rng_state.txt"}));
  auto model = io::SafetensorsFile::open((dir / "model.safetensors").string());
  EXPECT_EQ(model->get("wte.weight").to_f32_vector(), wv);
  EXPECT_EQ(model->get("ln_f.weight").dtype(), DType::kBF16);
  EXPECT_EQ(model->get("ln_f.weight").to_f32_vector(), lnv);
  auto opt = io::SafetensorsFile::open((dir / "optimizer.safetensors").string());
  EXPECT_EQ(opt->get("exp_avg.wte").to_f32_vector(), mv);
  const Tensor got_t = opt->get("wt");
  ASSERT_EQ(got_t.shape(), (Shape{5, 3}));
  for (int64_t i = 0; i < 5; ++i)
    for (int64_t j = 0; j < 3; ++j) EXPECT_EQ(got_t.item_f32(i * 3 + j), wv[j * 5 + i]);
  EXPECT_EQ(read_text(dir / "config.json"), config);
  EXPECT_EQ(read_text(dir / "rng_state.txt"), std::string("\x00\x01" "binary" "\xff", 9));

  // checksums.json: every file with its size on disk and the checksum xxhsum computes.
  const auto sums = io::read_json_file((dir / "checksums.json").string());
  EXPECT_EQ(sums["step"], 100);
  ASSERT_EQ(sums["files"].size(), 4u);
  for (const auto& [name, e] : sums["files"].items()) {
    EXPECT_EQ(e["size"].get<uint64_t>(), fs::file_size(dir / name)) << name;
    const std::string ref = xxhsum_h3((dir / name).string());
    ASSERT_FALSE(ref.empty()) << "xxhsum not found: run scripts/install-deps (package xxhash)";
    EXPECT_EQ(e["xxh3_64"].get<std::string>(), ref) << name;
  }
  std::string why;
  EXPECT_TRUE(CheckpointManager::verify(dir.string(), &why)) << why;
  const auto found = mgr.find_latest();
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->step, 100);
  EXPECT_EQ(found->dir, dir.string());
}

TEST(Checkpoint, AsyncSaveCopiesBeforeReturning) {
  TempDir tmp;
  constexpr int64_t kN = 4 << 20;  // 16 MiB, so the write takes a while
  Tensor w = filled(kN, 1.0f);
  Tensor m = filled(kN / 2, 3.0f);
  CheckpointManager mgr(tmp.path());
  CheckpointFiles f;
  f.safetensors.push_back({"model.safetensors", {{"w", w}, {"m", m}}});
  mgr.save_async(7, f);
  w.fill(2.0f);  // the step loop moves on at once
  m.fill(4.0f);
  f.safetensors.clear();
  mgr.wait();
  auto file = io::SafetensorsFile::open(mgr.checkpoints_dir() + "/step_00000007/model.safetensors");
  const std::vector<float> got_w = file->get("w").to_f32_vector();
  const std::vector<float> got_m = file->get("m").to_f32_vector();
  EXPECT_EQ(got_w, std::vector<float>(kN, 1.0f));
  EXPECT_EQ(got_m, std::vector<float>(kN / 2, 3.0f));
  EXPECT_GT(mgr.last_blocking_seconds(), 0.0);
  EXPECT_GT(mgr.last_write_seconds(), 0.0);
}

TEST(Checkpoint, DeferredSaveCopiesBeforeWaitSnapshotReturns) {
  TempDir tmp;
  constexpr int64_t kN = 4 << 20;
  Tensor w = filled(kN, 1.0f);
  CheckpointManager mgr(tmp.path());
  CheckpointFiles f;
  f.safetensors.push_back({"model.safetensors", {{"w", w}}});
  f.texts.push_back({"note.txt", "deferred\n"});
  mgr.save_async_deferred(9, f);
  f.safetensors.clear();
  EXPECT_TRUE(mgr.writing());
  mgr.wait_snapshot();  // from here the caller may change its tensors
  w.fill(5.0f);
  mgr.wait();
  EXPECT_FALSE(mgr.writing());
  auto file = io::SafetensorsFile::open(mgr.checkpoints_dir() + "/step_00000009/model.safetensors");
  EXPECT_EQ(file->get("w").to_f32_vector(), std::vector<float>(kN, 1.0f));
  EXPECT_TRUE(CheckpointManager::verify(mgr.checkpoints_dir() + "/step_00000009", nullptr));
  mgr.wait_snapshot();  // nothing pending: returns at once
}

TEST(Checkpoint, KeepLastPrunesOldStepsAndLeftovers) {
  TempDir tmp;
  const fs::path root = fs::path(tmp.path()) / "checkpoints";
  fs::create_directories(root / ".tmp-step_00000007");  // a save killed halfway
  std::ofstream(root / ".tmp-step_00000007" / "model.safetensors") << "partial";
  std::ofstream(root / "latest.tmp") << "step_0000";
  fs::create_directories(root / "notes");  // not ours: left alone
  fs::create_directories(root / "step_123");  // not a canonical step name: left alone
  {
    CheckpointManager mgr(tmp.path(), 2);
    for (int64_t s : {10, 20, 30, 40}) mgr.save_async(s, step_files(s));
  }  // the destructor waits for the last write
  EXPECT_EQ(list_dir(root), (std::set<std::string>{"latest", "notes", "step_123",
                                                    "step_00000030", "step_00000040"}));
  EXPECT_EQ(read_text(root / "latest"), "step_00000040\n");

  TempDir tmp2;
  CheckpointManager mgr3(tmp2.path() + "/run");  // default keep_last = 3
  for (int64_t s = 1; s <= 5; ++s) mgr3.save(s, step_files(s));
  EXPECT_EQ(list_dir(mgr3.checkpoints_dir()),
            (std::set<std::string>{"latest", "step_00000003", "step_00000004", "step_00000005"}));
  for (int64_t s = 3; s <= 5; ++s)
    expect_consistent(mgr3.checkpoints_dir() + "/" + checkpoint_dir_name(s), s);
}

TEST(Checkpoint, SavingTheSameStepAgainReplacesIt) {
  TempDir tmp;
  CheckpointManager mgr(tmp.path());
  mgr.save(5, step_files(1));
  mgr.save(5, step_files(2));
  EXPECT_EQ(list_dir(mgr.checkpoints_dir()), (std::set<std::string>{"latest", "step_00000005"}));
  const std::string dir = mgr.checkpoints_dir() + "/step_00000005";
  std::string why;
  EXPECT_TRUE(CheckpointManager::verify(dir, &why)) << why;
  expect_consistent(dir, 2);
}

class CheckpointFallback : public ::testing::Test {
 protected:
  void SetUp() override {
    tmp_ = std::make_unique<TempDir>();
    CheckpointManager mgr(tmp_->path());
    mgr.save(1, step_files(1));
    mgr.save(2, step_files(2));
    root_ = mgr.checkpoints_dir();
  }
  // find_latest, returning what it warned about in *warnings.
  std::optional<LoadedCheckpoint> find(std::string* warnings) {
    ::testing::internal::CaptureStderr();
    std::optional<LoadedCheckpoint> r;
    try {
      r = CheckpointManager::find_latest_in(tmp_->path());
    } catch (...) {
      *warnings = ::testing::internal::GetCapturedStderr();
      throw;
    }
    *warnings = ::testing::internal::GetCapturedStderr();
    return r;
  }
  std::unique_ptr<TempDir> tmp_;
  std::string root_;
};

TEST_F(CheckpointFallback, FlippedByteInNewestFallsBackWithWarning) {
  flip_byte(root_ + "/step_00000002/model.safetensors", 3);  // inside tensor data
  std::string warn;
  const auto found = find(&warn);
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->step, 1);
  expect_consistent(found->dir, 1);
  EXPECT_NE(warn.find("step_00000002/model.safetensors"), std::string::npos) << warn;
  EXPECT_NE(warn.find("checksum"), std::string::npos) << warn;
}

TEST_F(CheckpointFallback, TruncatedNewestFallsBackWithWarning) {
  const fs::path p = root_ + "/step_00000002/model.safetensors";
  fs::resize_file(p, fs::file_size(p) - 10);
  std::string warn;
  const auto found = find(&warn);
  ASSERT_TRUE(found.has_value());
  EXPECT_EQ(found->step, 1);
  EXPECT_NE(warn.find("step_00000002/model.safetensors"), std::string::npos) << warn;
  EXPECT_NE(warn.find("truncated"), std::string::npos) << warn;
}

TEST_F(CheckpointFallback, MissingOrBadChecksumsFileFallsBack) {
  fs::remove(root_ + "/step_00000002/checksums.json");
  std::string warn, why;
  EXPECT_FALSE(CheckpointManager::verify(root_ + "/step_00000002", &why));
  EXPECT_NE(why.find("step_00000002/checksums.json"), std::string::npos) << why;
  EXPECT_EQ(find(&warn)->step, 1);
  std::ofstream(root_ + "/step_00000002/checksums.json") << "{\"format\": ";
  EXPECT_FALSE(CheckpointManager::verify(root_ + "/step_00000002", &why));
  EXPECT_NE(why.find("checksums.json"), std::string::npos) << why;
  EXPECT_EQ(find(&warn)->step, 1);
}

TEST_F(CheckpointFallback, LatestPointerIsFollowedOrRepaired) {
  std::string warn;
  io::write_file_atomic(root_ + "/latest", "step_00000001\n");  // latest is the authority
  EXPECT_EQ(find(&warn)->step, 1);
  EXPECT_EQ(warn, "");
  io::write_file_atomic(root_ + "/latest", "step_00000099\n");  // points to a missing dir
  EXPECT_EQ(find(&warn)->step, 2);
  EXPECT_NE(warn.find("latest: points to step_00000099, which does not exist"), std::string::npos)
      << warn;
  io::write_file_atomic(root_ + "/latest", "garbage");
  EXPECT_EQ(find(&warn)->step, 2);
  EXPECT_NE(warn.find("latest: does not name a step directory"), std::string::npos) << warn;
  fs::remove(root_ + "/latest");
  EXPECT_EQ(find(&warn)->step, 2);
  EXPECT_NE(warn.find("latest: missing"), std::string::npos) << warn;
}

TEST_F(CheckpointFallback, AllCorruptIsAnErrorNamingEachAndChangesNothing) {
  flip_byte(root_ + "/step_00000002/model.safetensors", 1);
  fs::resize_file(root_ + "/step_00000001/trainer_state.json", 3);
  const std::string before2 = read_text(root_ + "/step_00000002/model.safetensors");
  std::string warn;
  try {
    find(&warn);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
    EXPECT_NE(msg.find("step_00000002/model.safetensors"), std::string::npos) << msg;
    EXPECT_NE(msg.find("step_00000001/trainer_state.json"), std::string::npos) << msg;
  }
  EXPECT_EQ(read_text(root_ + "/step_00000002/model.safetensors"), before2);
  EXPECT_EQ(list_dir(root_), (std::set<std::string>{"latest", "step_00000001", "step_00000002"}));
}

TEST(Checkpoint, NoCheckpointIsNullopt) {
  TempDir tmp;
  EXPECT_FALSE(CheckpointManager::find_latest_in(tmp.path()).has_value());
  fs::create_directories(tmp.path() + "/checkpoints/.tmp-step_00000001");
  EXPECT_FALSE(CheckpointManager::find_latest_in(tmp.path()).has_value());
  std::ofstream(tmp.path() + "/checkpoints/latest") << "step_00000001\n";
  EXPECT_THROW(CheckpointManager::find_latest_in(tmp.path()), Error);
}

TEST(Checkpoint, BadInputIsRejectedWithOneLine) {
  TempDir tmp;
  CheckpointManager mgr(tmp.path());
  auto expect_error = [&](CheckpointFiles f, const std::string& needle) {
    try {
      mgr.save_async(1, std::move(f));
      mgr.wait();
      ADD_FAILURE() << "expected an error containing " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  CheckpointFiles f = step_files(1);
  f.texts.push_back({"../escape.json", "{}"});
  expect_error(f, "'../escape.json'");
  f = step_files(1);
  f.texts.push_back({"model.safetensors", "{}"});
  expect_error(f, "'model.safetensors' given twice");
  f = step_files(1);
  f.texts.push_back({"checksums.json", "{}"});
  expect_error(f, "reserved");
  f = step_files(1);
  f.texts.push_back({"trainer_state.json.tmp", "{}"});
  expect_error(f, "'trainer_state.json.tmp' must not end in .tmp");
  expect_error(CheckpointFiles{}, "no files");
  EXPECT_THROW(CheckpointManager(tmp.path(), 0), Error);
  EXPECT_FALSE(fs::exists(mgr.checkpoints_dir()));  // nothing was written

  // A failure in the background thread comes back from wait(), naming the path, once.
  std::ofstream(tmp.path() + "/not_a_dir") << "x";
  CheckpointManager bad(tmp.path() + "/not_a_dir");
  bad.save_async(1, step_files(1));
  try {
    bad.wait();
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not_a_dir/checkpoints"), std::string::npos) << e.what();
  }
  EXPECT_NO_THROW(bad.wait());
}

// The child saves checkpoints in a loop and reports each step once it is committed.
// Runs single-threaded: OpenMP's team does not survive fork().
[[noreturn]] void run_saver(const std::string& run_dir, int64_t first_step, bool async, int fd) {
  base::set_num_threads(1);
  try {
    CheckpointManager mgr(run_dir, 2);
    for (int64_t step = first_step;; ++step) {
      CheckpointFiles f;
      f.safetensors.push_back({"model.safetensors", {{"w", filled(256 << 10, float(step))},
                                                     {"b", filled(100, float(step))}}});
      f.safetensors.push_back({"optimizer.safetensors", {{"m", filled(512 << 10, float(step))}}});
      f.texts.push_back({"trainer_state.json", "{\"step\": " + std::to_string(step) + "}\n"});
      int64_t committed = step;
      if (async) {
        mgr.save_async(step, std::move(f));  // returns once step - 1 is committed
        committed = step - 1;
      } else {
        mgr.save(step, std::move(f));
      }
      if (committed >= first_step && ::write(fd, &committed, sizeof committed) != sizeof committed)
        ::_exit(4);
    }
  } catch (...) {
    ::_exit(3);
  }
}

TEST(CheckpointKill, SigkillAtRandomMomentsLeavesALoadableCheckpoint) {
  TempDir tmp;
  std::mt19937 rng(20240611);
  std::uniform_int_distribution<int> delay_ms(5, 150);
  int64_t best_committed = -1;
  int saved_rounds = 0;
  for (int round = 0; round < 10; ++round) {
    const bool async = round % 2 == 1;
    // Half the rounds start the clock at fork (kills land in the first save too, with
    // the previous round's leftovers to clean), half once a first save is committed.
    const bool after_first = (round / 2) % 2 == 1;
    int fds[2];
    ASSERT_EQ(::pipe(fds), 0);
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::close(fds[0]);
      run_saver(tmp.path(), 1000 * (round + 1), async, fds[1]);
    }
    ::close(fds[1]);
    int64_t v;
    int64_t committed = -1;
    if (after_first && ::read(fds[0], &v, sizeof v) == sizeof v) committed = v;
    std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms(rng)));
    ::kill(pid, SIGKILL);
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the saver exited by itself, status " << status;
    while (::read(fds[0], &v, sizeof v) == sizeof v) committed = v;
    ::close(fds[0]);
    best_committed = std::max(best_committed, committed);

    ::testing::internal::CaptureStderr();  // "latest: missing" is expected after some kills
    const auto found = CheckpointManager::find_latest_in(tmp.path());
    ::testing::internal::GetCapturedStderr();
    if (best_committed < 0) continue;  // killed before the first checkpoint finished
    ++saved_rounds;
    ASSERT_TRUE(found.has_value()) << "round " << round;
    // Never older than what the child saw committed, never newer than what it had begun.
    EXPECT_GE(found->step, best_committed) << "round " << round;
    if (committed >= 0) {
      EXPECT_LE(found->step, committed + 2) << "round " << round;
    }
    expect_consistent(found->dir, found->step);
    // Renames make every step_ directory complete at every moment, not just the newest.
    for (const auto& e : fs::directory_iterator(fs::path(tmp.path()) / "checkpoints")) {
      if (e.path().filename().string().rfind("step_", 0) != 0) continue;
      std::string why;
      EXPECT_TRUE(CheckpointManager::verify(e.path().string(), &why)) << why;
    }
  }
  EXPECT_GE(saved_rounds, 4);
  // The next completed save clears every leftover and prunes back to keep_last.
  CheckpointManager mgr(tmp.path(), 2);
  mgr.save(99999, step_files(99999));
  std::set<std::string> names = list_dir(mgr.checkpoints_dir());
  ASSERT_EQ(names.size(), 3u) << ::testing::PrintToString(names);
  EXPECT_EQ(names.count("latest"), 1u);
  EXPECT_EQ(names.count("step_00099999"), 1u);
  EXPECT_EQ(*names.rbegin(), "step_00099999");
}

}  // namespace
}  // namespace tessera::train
