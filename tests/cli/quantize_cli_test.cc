// `tessera quantize` end to end: a random model quantized to int4 and int8 saves an
// AutoGPTQ-layout directory that `generate` runs and `bench decode` measures, with the
// same greedy tokens as quantizing on load; bad flags are one-line errors that write
// nothing.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>

#include "tessera/model/model.h"
#include "test_util/run_command.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using testing::run_cli;

std::string tokens_of(const std::string& out) { return out.substr(0, out.find('\n')); }
// stdout only.
testing::CommandResult run_quiet(const std::string& args) {
  return testing::run_command(std::string(TESSERA_CLI_PATH) + " " + args + " 2>/dev/null", false);
}

TEST(QuantizeCli, QuantizedDirectoryRunsLikeQuantizingOnLoad) {
  const fs::path root = fs::temp_directory_path() / ("tessera_quantize_cli_" + std::to_string(::getpid()));
  fs::remove_all(root);
  const std::string src = (root / "float").string();
  model::Model::random(model::ModelConfig::named_shape("tiny"), DType::kF32, 5).save(src);
  for (const char* bits : {"8", "4"}) {
    const std::string q = (root / (std::string("q") + bits)).string();
    const std::string group = std::string(bits) == "4" ? " --group-size 32" : "";
    auto r = run_cli("quantize --model " + src + " --out " + q + " --bits " + bits + group + " --dtype f32");
    ASSERT_EQ(r.code, 0) << r.out;
    EXPECT_NE(r.out.find(std::string(bits) == "4" ? "int4 g32 (rtn)" : "int8 (rtn)"), std::string::npos) << r.out;
    auto saved = run_quiet("generate --model " + q + " --prompt-ids 1,2,3 --max-tokens 6");
    ASSERT_EQ(saved.code, 0) << saved.out;
    // The on-load path quantizes with the checkpoint's group size only for int8's
    // per-channel default; int4 g32 is checked against the saved directory reloaded.
    if (std::string(bits) == "8") {
      auto onload = run_quiet("generate --model " + src + " --prompt-ids 1,2,3 --max-tokens 6 --quantization int8");
      ASSERT_EQ(onload.code, 0) << onload.out;
      EXPECT_EQ(tokens_of(saved.out), tokens_of(onload.out));
    }
    auto again = run_cli("generate --model " + q + " --prompt-ids 1,2,3 --max-tokens 6 --quantization int8");
    EXPECT_NE(again.code, 0);
    EXPECT_NE(again.out.find("already quantized"), std::string::npos) << again.out;
  }
  auto bench = run_cli("bench decode --model " + src + " --weights int4 --tokens 4 --repeats 1");
  EXPECT_NE(bench.code, 0) << "tiny's 64 features are not a multiple of the default group 128";
  EXPECT_NE(bench.out.find("group size 128"), std::string::npos) << bench.out;
  bench = run_cli("bench decode --model " + src + " --weights int8 --tokens 4 --repeats 1");
  ASSERT_EQ(bench.code, 0) << bench.out;
  EXPECT_NE(bench.out.find("weights int8"), std::string::npos) << bench.out;

  EXPECT_NE(bench.out.find("stream read:"), std::string::npos) << bench.out;
  // 4 tokens: one window, paired with a triad trial before and after it.
  EXPECT_NE(bench.out.find("paired ratio achieved/stream: "), std::string::npos) << bench.out;
  EXPECT_NE(bench.out.find("(median of 1 windows of 8 tokens"), std::string::npos) << bench.out;
  // The same windows against the triad on huge-page arrays, as the weights ask for.
  EXPECT_NE(bench.out.find("stream triad on huge pages: "), std::string::npos) << bench.out;
  EXPECT_NE(bench.out.find("memory on transparent huge pages before the probes: "), std::string::npos) << bench.out;

  // --quantize-lm-head: the saved directory (GPTQModel's lm_head) runs like quantizing on
  // load with the flag, the bench reads fewer bytes, and what cannot hold it says so.
  const std::string qh = (root / "q8_head").string();
  auto rh = run_cli("quantize --model " + src + " --out " + qh + " --bits 8 --quantize-lm-head --dtype f32");
  ASSERT_EQ(rh.code, 0) << rh.out;
  EXPECT_NE(rh.out.find("int8 (rtn), lm_head int8"), std::string::npos) << rh.out;
  auto saved_h = run_quiet("generate --model " + qh + " --prompt-ids 1,2,3 --max-tokens 6");
  auto onload_h = run_quiet("generate --model " + src + " --prompt-ids 1,2,3 --max-tokens 6 --quantization int8 "
                            "--quantize-lm-head");
  ASSERT_EQ(saved_h.code, 0) << saved_h.out;
  ASSERT_EQ(onload_h.code, 0) << onload_h.out;
  EXPECT_EQ(tokens_of(saved_h.out), tokens_of(onload_h.out));
  auto bench_h = run_cli("bench decode --model " + src + " --weights int8 --quantize-lm-head --tokens 4 --repeats 1");
  ASSERT_EQ(bench_h.code, 0) << bench_h.out;
  EXPECT_NE(bench_h.out.find(", lm_head int8"), std::string::npos) << bench_h.out;
  for (const std::string& flags : {std::string("generate --model " + src + " --prompt-ids 1 --quantize-lm-head"),
                                   std::string("generate --model " + src + " --prompt-ids 1 --quantization fp8 "
                                               "--quantize-lm-head")}) {
    auto r = run_cli(flags);
    EXPECT_NE(r.code, 0) << flags;
    EXPECT_NE(r.out.find("lm_head"), std::string::npos) << r.out;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << flags << ": " << r.out;
  }

  // fp8 weights save as compressed-tensors and run like fp8 quantized on load.
  const std::string f8 = (root / "fp8").string();
  auto r8 = run_cli("quantize --model " + src + " --out " + f8 + " --type fp8 --dtype f32");
  ASSERT_EQ(r8.code, 0) << r8.out;
  EXPECT_NE(r8.out.find("fp8"), std::string::npos) << r8.out;
  auto saved8 = run_quiet("generate --model " + f8 + " --prompt-ids 1,2,3 --max-tokens 6");
  auto onload8 = run_quiet("generate --model " + src + " --prompt-ids 1,2,3 --max-tokens 6 --quantization fp8");
  ASSERT_EQ(saved8.code, 0) << saved8.out;
  ASSERT_EQ(onload8.code, 0) << onload8.out;
  EXPECT_EQ(tokens_of(saved8.out), tokens_of(onload8.out));

  // Bad input: one line, non-zero, nothing written.
  const std::string out = (root / "bad").string();
  for (const std::string& flags : {std::string(" --bits 3"), std::string(" --method awq --bits 8"),
                                   std::string(" --bits 4 --group-size 48"),
                                   std::string(" --method gptq --bits 4"), std::string(" --type fp4"),
                                   std::string(" --type fp8 --bits 4"), std::string(" --type fp8 --method awq --bits 4"),
                                   std::string(" --method awq --bits 4 --group-size 32 --quantize-lm-head --calib /dev/null"),
                                   std::string(" --type fp8 --quantize-lm-head"),
                                   std::string(" --bits 4 --awq-clip-qk"),
                                   std::string(" --method gptq --bits 4 --calib /dev/null --awq-inspect-tokens 64")}) {
    auto r = run_cli("quantize --model " + src + " --out " + out + flags);
    EXPECT_NE(r.code, 0) << flags;
    EXPECT_EQ(std::count(r.out.begin(), r.out.end(), '\n'), 1) << flags << ": " << r.out;
    EXPECT_FALSE(fs::exists(out)) << flags;
  }
  auto same = run_cli("quantize --model " + src + " --out " + src + " --bits 8");
  EXPECT_NE(same.code, 0);
  EXPECT_NE(same.out.find("is the input model directory"), std::string::npos) << same.out;
  fs::remove_all(root);
}

}  // namespace
}  // namespace tessera
