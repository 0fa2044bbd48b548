// Fine-tuning from the command line on the serve fixture (a model directory with a ChatML
// chat template): `tessera train` with data.format = "chat" renders the JSONL, trains on
// packed rows and resumes with the rendering reused; with [lora] it writes a PEFT adapter that
// `tessera export --merge-lora` merges into a model that generates; `tessera data prepare
// --format chat` writes the same data; bad conversations are one-line errors naming file:line.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "tessera/model/lora_io.h"
#include "tessera/model/model.h"
#include "tessera/train/chat_data.h"
#include "test_util/run_command.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using testing::run_cli;

struct Dir {
  std::string path = (fs::temp_directory_path() / ("tessera_sft_cli_" + std::to_string(::getpid()))).string();
  Dir() {
    fs::remove_all(path);
    fs::create_directories(path);
  }
  ~Dir() { fs::remove_all(path); }
};

void write_chats(const std::string& path, int n) {
  std::ofstream f(path);
  for (int i = 0; i < n; ++i)
    f << R"({"messages": [{"role": "user", "content": "Say number )" << i << R"("}, {"role": "assistant", "content": "Number )"
      << i << R"( it is."}]})" << "\n";
}

std::string config(const std::string& out, const std::string& jsonl, int steps, const std::string& extra = "") {
  return "[run]\nout_dir = \"" + out + "\"\n[model]\ninit_from = \"" + std::string(TESSERA_SERVE_MODEL) + "\"\n" +
         "[data]\nformat = \"chat\"\npath = \"" + jsonl + "\"\nseq_len = 64\nbatch_size = 4\nval_fraction = 0.1\n" +
         "[training]\nsteps = " + std::to_string(steps) + "\nprecision = \"fp32\"\neval_batches = 2\n" +
         "[checkpoint]\nevery = 2\n[logging]\nprogress = false\nplot = false\n" + extra;
}

TEST(SftCli, ChatDataTrainsResumesAndLoraExportsAMergedModel) {
  Dir d;
  const std::string jsonl = d.path + "/chats.jsonl";
  write_chats(jsonl, 40);
  std::ofstream(d.path + "/sft.toml") << config(d.path + "/run", jsonl, 4);
  auto r = run_cli("train --config " + d.path + "/sft.toml --stop-after 2");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("wrote chat data"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("36 train conversations"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("packed into"), std::string::npos) << r.out;
  ASSERT_TRUE(train::is_chat_data(d.path + "/run/chat_data"));
  r = run_cli("train --config " + d.path + "/sft.toml --resume");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.find("wrote chat data"), std::string::npos) << "the rendering was redone on resume: " << r.out;
  EXPECT_NE(r.out.find("resumed from"), std::string::npos) << r.out;
  EXPECT_TRUE(fs::exists(d.path + "/run/model/model.safetensors"));
  EXPECT_TRUE(fs::exists(d.path + "/run/model/tokenizer_config.json"));  // the chat template travels along

  // `tessera data prepare --format chat`: the same documents.
  r = run_cli("data prepare --format chat --tokenizer " + std::string(TESSERA_SERVE_MODEL) + " --input " + jsonl +
              " --out " + d.path + "/prepared --val-fraction 0.1");
  ASSERT_EQ(r.code, 0) << r.out;
  const auto a = train::read_chat_split(d.path + "/prepared", "train"),
             b = train::read_chat_split(d.path + "/run/chat_data", "train");
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(a[i].tokens == b[i].tokens && a[i].mask == b[i].mask) << i;

  // LoRA: an adapter directory, merged by export into a model that loads and generates.
  std::ofstream(d.path + "/lora.toml") << config(d.path + "/lora", jsonl, 3,
                                                "[lora]\nrank = 4\nalpha = 8\ntarget_modules = [\"all-linear\"]\n");
  r = run_cli("train --config " + d.path + "/lora.toml");
  ASSERT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("trainable"), std::string::npos) << r.out;
  ASSERT_TRUE(fs::exists(d.path + "/lora/adapter/adapter_config.json"));
  r = run_cli("export --merge-lora " + d.path + "/lora/adapter --model " + std::string(TESSERA_SERVE_MODEL) +
              " --out " + d.path + "/merged");
  ASSERT_EQ(r.code, 0) << r.out;
  r = run_cli("generate --model " + d.path + "/merged --prompt \"Say\" --max-tokens 4");
  EXPECT_EQ(r.code, 0) << r.out;
}

TEST(SftCli, BadConversationsAreOneLineErrors) {
  Dir d;
  const std::string jsonl = d.path + "/chats.jsonl";
  write_chats(jsonl, 5);
  std::ofstream(jsonl, std::ios::app) << R"({"messages": [{"role": "user", "content": "no reply"}]})" << "\n";
  std::ofstream(d.path + "/sft.toml") << config(d.path + "/run", jsonl, 2);
  const auto r = run_cli("train --config " + d.path + "/sft.toml");
  EXPECT_NE(r.code, 0);
  EXPECT_NE(r.out.find("chats.jsonl:6: no assistant message"), std::string::npos) << r.out;
  EXPECT_FALSE(fs::exists(d.path + "/run/chat_data/meta.json"));
  // data.path without format = "chat", and a chat directory read as token shards.
  std::ofstream(d.path + "/bad.toml") << "[run]\nout_dir = \"x\"\n[data]\npath = \"" + jsonl + "\"\ndir = \"y\"\n";
  const auto r2 = run_cli("train --config " + d.path + "/bad.toml");
  EXPECT_NE(r2.code, 0);
  EXPECT_NE(r2.out.find("data.path"), std::string::npos) << r2.out;
}

}  // namespace
}  // namespace tessera
