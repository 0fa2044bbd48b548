// Run-config values are validated exactly (issue 16): integers outside the field's range
// are errors, never truncated; nan / inf are errors; data.seq_len is checked against the
// model; the malformed text on which toml++ 3.3.0 asserts or has undefined behaviour is
// rejected before it gets there. Each error is one line naming the file and the key,
// through TrainConfig::parse and through `tessera train`.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tessera/base/error.h"
#include "tessera/io/toml_text.h"
#include "tessera/model/model.h"
#include "tessera/plan/hardware.h"
#include "tessera/train/config.h"
#include "tessera/train/trainer_setup.h"
#include "test_util/run_command.h"
#include "train/trainer_test_util.h"

namespace tessera::train {
namespace {

const std::string kOk = base_config("/tmp/x", "/tmp/d", 10);

// kOk with `key = value` in [table] (replacing base_config's line for that key, if any).
std::string with(const std::string& table, const std::string& key, const std::string& value,
                 std::string text = kOk) {
  const std::string head = "[" + table + "]\n", line = key + " = " + value + "\n";
  const size_t at = text.find(head);
  if (at == std::string::npos) return text + head + line;
  const size_t body = at + head.size();
  const size_t end = std::min(text.find("\n[", body), text.size());
  const size_t k = text.find("\n" + key + " = ", body - 1);
  if (k != std::string::npos && k < end) {
    const size_t eol = text.find('\n', k + 1);
    return text.replace(k + 1, eol - k, line);
  }
  return text.insert(body, line);
}

// The message of the tessera::Error that parsing `text` as bad.toml throws.
std::string error_of(const std::string& text) {
  try {
    TrainConfig::parse(text, "bad.toml");
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error for:\n" << text;
  return "";
}

void expect_error(const std::string& text, const std::string& needle) {
  const std::string e = error_of(text);
  EXPECT_NE(e.find(needle), std::string::npos) << "expected '" << needle << "' in: " << e;
  EXPECT_EQ(e.rfind("bad.toml", 0), 0u) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
}

TEST(ConfigValidation, IntegersOutsideTheFieldsRangeAreErrorsNotTruncated) {
  ASSERT_NO_THROW(TrainConfig::parse(kOk, "ok.toml"));
  // int fields: 2^32 + 1 used to keep 1 checkpoint, 2^32 ran ZeRO stage 0, 2^32 + 5 ran 5.
  expect_error(with("checkpoint", "keep", "4294967297"),
               "bad.toml: checkpoint.keep must be in [1, 2147483647], got 4294967297");
  expect_error(with("parallel", "zero_stage", "4294967296"),
               "bad.toml: parallel.zero_stage must be in [0, 3], got 4294967296");
  expect_error(with("optimizer", "muon_ns_steps", "4294967301"),
               "bad.toml: optimizer.muon_ns_steps must be in [1, 20], got 4294967301");
  expect_error(with("checkpoint", "keep", "-2147483649"), "checkpoint.keep must be in [1, ");
  // uint64 fields: a negative seed is not a huge one.
  expect_error(with("model", "seed", "-1"),
               "bad.toml: model.seed must be in [0, 9223372036854775807], got -1");
  expect_error(with("data", "seed", "-1"), "bad.toml: data.seed must be in [0, ");
  // int64 fields with bounds of their own.
  expect_error(with("data", "batch_size", "2147483648"),
               "bad.toml: data.batch_size must be in [1, 2147483647], got 2147483648");
  expect_error(with("data", "grad_accum", "0"), "bad.toml: data.grad_accum must be in [1, ");
  expect_error(with("data", "seq_len", "1048577"),
               "bad.toml: data.seq_len must be in [1, 1048576], got 1048577");
  expect_error(with("training", "steps", "0"), "bad.toml: training.steps must be in [1, ");
  expect_error(with("model", "hidden_size", "-64"), "bad.toml: model.hidden_size must be in [0, ");
  expect_error(with("model", "max_position_embeddings", "4294967296"),
               "bad.toml: model.max_position_embeddings must be in [0, 2147483647]");
  expect_error(with("spike_guard", "max_rollbacks", "-1"), "bad.toml: spike_guard.max_rollbacks");
  expect_error(with("checkpoint", "every", "-1"), "bad.toml: checkpoint.every");
  expect_error(with("training", "fp16_growth_interval", "0"), "bad.toml: training.fp16_growth_interval");
  expect_error(with("checkpoint", "keep", "3.0"), "bad.toml: checkpoint.keep must be an integer");
  // Past int64 toml++ itself refuses the literal (a line:col error, not a wrapped value).
  const std::string e = error_of(with("checkpoint", "keep", "9223372036854775808"));
  EXPECT_NE(e.find("invalid TOML"), std::string::npos) << e;
  // The ends of each range are accepted and kept exactly.
  const auto c = TrainConfig::parse(
      with("parallel", "zero_stage", "3",
           with("checkpoint", "keep", "2147483647",
                with("model", "seed", "9223372036854775807",
                     with("data", "batch_size", "2147483647")))),
      "ok.toml");
  EXPECT_EQ(c.parallel.zero_stage, 3);
  EXPECT_EQ(c.checkpoint.keep, 2147483647);
  EXPECT_EQ(c.model.seed, 9223372036854775807ull);
  EXPECT_EQ(c.data.batch_size, 2147483647);
}

TEST(ConfigValidation, NanAndInfAreErrorsForEveryFloatKey) {
  const std::pair<const char*, const char*> keys[] = {
      {"training", "max_grad_norm"},    {"training", "fp16_init_scale"},
      {"parallel", "timeout_s"},        {"parallel", "bucket_mb"},
      {"spike_guard", "sigma"},         {"optimizer", "lr"},
      {"optimizer", "beta1"},           {"optimizer", "beta2"},
      {"optimizer", "eps"},             {"optimizer", "weight_decay"},
      {"optimizer", "muon_lr"},         {"optimizer", "muon_momentum"},
      {"optimizer", "muon_weight_decay"}, {"schedule", "min_lr_ratio"},
      {"schedule", "decay_fraction"},   {"logging", "peak_gflops"},
  };
  for (const auto& [table, key] : keys)
    for (const char* v : {"nan", "inf", "-inf", "+nan"})
      expect_error(with(table, key, v),
                   "bad.toml: " + std::string(table) + "." + key + " must be a finite number");
}

TEST(ConfigValidation, FloatKeysHaveRanges) {
  expect_error(with("optimizer", "eps", "0.0"), "bad.toml: optimizer.eps must be in [1e-30, 1], got 0");
  expect_error(with("optimizer", "eps", "1e8"), "bad.toml: optimizer.eps must be in [1e-30, 1]");
  expect_error(with("optimizer", "eps", "1e-300"), "bad.toml: optimizer.eps");
  expect_error(with("optimizer", "beta2", "1.0"), "bad.toml: optimizer.beta2 must be in [0, 1), got 1");
  expect_error(with("optimizer", "lr", "10"), "bad.toml: optimizer.lr must be in (0, 10), got 10");
  expect_error(with("optimizer", "weight_decay", "-0.1"), "bad.toml: optimizer.weight_decay must be >= 0");
  expect_error(with("optimizer", "weight_decay", "4", with("optimizer", "lr", "0.5")),
               "bad.toml: optimizer.weight_decay * optimizer.lr must be below 1");
  expect_error(with("optimizer", "muon_weight_decay", "100"),
               "bad.toml: optimizer.muon_weight_decay * optimizer.muon_lr must be below 1");
  expect_error(with("parallel", "bucket_mb", "1e300"), "bad.toml: parallel.bucket_mb must be in (0, 1048576], got 1e+300");
  expect_error(with("parallel", "timeout_s", "0"), "bad.toml: parallel.timeout_s must be > 0, got 0");
  expect_error(with("spike_guard", "sigma", "-1"), "bad.toml: spike_guard.sigma must be > 0");
  expect_error(with("training", "fp16_init_scale", "1e39"), "bad.toml: training.fp16_init_scale");
  expect_error(with("schedule", "min_lr_ratio", "1.5"), "bad.toml: schedule.min_lr_ratio must be in [0, 1]");
  expect_error(with("training", "max_grad_norm", "\"1\""), "bad.toml: training.max_grad_norm must be a number");
  // Legitimate values still pass: clipping off (<= 0), integers for floats, eps of 1e-30.
  const auto c = TrainConfig::parse(
      with("training", "max_grad_norm", "-1.0",
           with("optimizer", "lr", "1", with("optimizer", "eps", "1e-30"))),
      "ok.toml");
  EXPECT_EQ(c.training.max_grad_norm, -1.0);
  EXPECT_EQ(c.optimizer.lr, 1.0);
  EXPECT_EQ(c.optimizer.eps, 1e-30);
  // An integer a double cannot hold exactly (the fuzzer's find: toml++'s value<double>() is
  // empty for it) is converted, then range-checked like any other number.
  expect_error(with("optimizer", "lr", "655777777777777777"), "bad.toml: optimizer.lr must be in (0, 10), got 6.55");
  EXPECT_EQ(TrainConfig::parse(with("training", "fp16_init_scale", "655777777777777777"), "ok.toml")
                .fp16_init_scale,
            655777777777777777.0);
}

TEST(ConfigValidation, SeqLenIsCheckedAgainstTheModelsMaxPositionEmbeddings) {
  // tiny: Llama (RoPE), max_position_embeddings 256.
  auto parse = [](const std::string& text) { return TrainConfig::parse(text, "bad.toml"); };
  auto build_error = [](const TrainConfig& c) -> std::string {
    try {
      build_model(c, 256, 0);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NO_THROW(build_model(parse(with("data", "seq_len", "256")), 256, 0));
  std::string e = build_error(parse(with("data", "seq_len", "257")));
  EXPECT_EQ(e.rfind("bad.toml: data.seq_len 257 exceeds the model's max_position_embeddings 256", 0), 0u) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  // The run config's own override is the limit; learned (GPT-2) positions too.
  EXPECT_NO_THROW(build_model(parse(with("model", "max_position_embeddings", "512",
                                         with("data", "seq_len", "512"))), 256, 0));
  e = build_error(parse(with("model", "arch", "\"gpt2\"", with("model", "max_position_embeddings", "16"))));
  EXPECT_NE(e.find("bad.toml: data.seq_len 32 exceeds the model's max_position_embeddings 16"),
            std::string::npos) << e;
  e = build_error(parse(with("model", "max_position_embeddings", "16")));
  EXPECT_NE(e.find("bad.toml: data.seq_len 32 exceeds the model's max_position_embeddings 16"),
            std::string::npos) << e;
  // A model to fine-tune brings its limit.
  const std::string dir = temp_dir("seq_len_init");
  model::Model::random(model::ModelConfig::named_shape("tiny"), DType::kF32, 1).save(dir + "/init");
  std::string text = with("data", "seq_len", "300");
  text.replace(text.find("shape = \"tiny\""), 14, "init_from = \"" + dir + "/init\"");
  e = build_error(parse(text));
  EXPECT_NE(e.find("bad.toml: data.seq_len 300 exceeds the model's max_position_embeddings 256"),
            std::string::npos) << e;
  EXPECT_NE(e.find("init_from"), std::string::npos) << e;
  fs::remove_all(dir);
}

// The text on which toml++ 3.3.0 asserts or reaches undefined behaviour (io/toml_text.cc);
// each is an error naming file:line:col before toml++ sees it.
TEST(ConfigValidation, MalformedTomlThatTomlppMishandlesIsAnErrorLine) {
  struct Case {
    std::string text, needle;
  };
  const std::string deep_key = "a" + [] { std::string s; for (int i = 0; i < 300000; ++i) s += ".a"; return s; }();
  const Case cases[] = {
      // parse_key()'s TOML_ASSERT_ASSUME: a header '[' not followed by a key.
      {"[&", "bad.toml:1:2: invalid TOML: expected a table name after '[', saw '&'"},
      {"[run]\nout_dir = \"x\"\n[[#]]\n", "bad.toml:3:3: invalid TOML: expected a table name after '[['"},
      {"[\n", "bad.toml:1:2: invalid TOML: expected a table name after '[', saw the end of the line"},
      {"[ \t%]", "bad.toml:1:4: invalid TOML: expected a table name after '[', saw '%'"},
      // marzer/tomlplusplus#190: TOML_UNREACHABLE in is_non_ascii_horizontal_whitespace.
      {"s = \"\"\"\\\n\xc2\xa7\"\"\"\n", "bad.toml:2:1: invalid TOML: non-ASCII character U+00A7 first after a line-ending backslash"},
      {"s = \"\"\"a\\\xc3\xa9\"\"\"\n", "bad.toml:1:10: invalid TOML: non-ASCII character U+00E9 after a backslash"},
      {"[\xc3\xa9]\n", "bad.toml:1:2: invalid TOML: expected a table name after '[', saw U+00E9"},
      {"[run]\nout_dir = 1\xc3\xa9\n", "bad.toml:2:12: invalid TOML: non-ASCII character U+00E9 outside a string or comment"},
      {"a\xe3\x81\x82 = 1\n", "bad.toml:1:2: invalid TOML: non-ASCII character U+3042"},
      // parse_value()'s assumption, broken by an array's element loop.
      {"a = [}\n", "bad.toml:1:6: invalid TOML: '}' inside an array"},
      {"a = [1, }\n", "bad.toml:1:9: invalid TOML: '}' inside an array"},
      // parse_time()'s TOML_ASSERT_ASSUME(is_decimal_digit): chosen from the traits of
      // the characters, the rest unchecked.
      {"t = 1979-05-27T'07:32:00\n", "bad.toml:1:5: invalid TOML: invalid value '1979-05-27T'07:32:00'"},
      {"t = [1979-05-27Tx7:00:00]\n", "bad.toml:1:6: invalid TOML: invalid value '1979-05-27Tx7:00:00'"},
      {"[run]\nout_dir = 0x1p3\n", "bad.toml:2:11: invalid TOML: invalid value '0x1p3'"},
      // Recursion per level: 300000 key parts overflowed the stack.
      {deep_key + " = 1\n", "bad.toml:1:64: invalid TOML: a dotted key or table name of more than 32 parts"},
      {"[" + deep_key + "]\n", "invalid TOML: a dotted key or table name of more than 32 parts"},
      {"a = " + std::string(40, '[') + std::string(40, ']') + "\n", "bad.toml:1:37: invalid TOML: arrays and inline tables nested more than 32 deep"},
      {"a = {b = {c = {d = " + std::string(40, '[') + "\n", "nested more than 32 deep"},
      // Bytes no TOML file has.
      {std::string("[run]\nout_dir = \"x\0\"\n", 20), "bad.toml:2:13: invalid TOML: NUL byte"},
      {"# caf\xe9\n", "bad.toml:1:6: invalid TOML: invalid UTF-8 (byte 0xE9)"},
      {"a = \"\xed\xa0\x80\"\n", "bad.toml:1:6: invalid TOML: invalid UTF-8 (byte 0xED)"},
      {"a = \"\xc0\xaf\"\n", "invalid UTF-8 (byte 0xC0)"},
      {"#" + std::string(io::kMaxTomlBytes, 'x'), "bad.toml: invalid TOML: 4194305 bytes, more than the limit of 4194304"},
  };
  for (const auto& c : cases) {
    const std::string e = error_of(c.text);
    EXPECT_NE(e.find(c.needle), std::string::npos) << "expected '" << c.needle << "' in: " << e;
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  }
}

// What the scan must not reject: valid TOML whose strings, comments and arrays look like
// the cases above. toml++ parses each; the run config reader is not involved.
TEST(ConfigValidation, ValidTomlPassesTheTextChecks) {
  const std::string texts[] = {
      "s = \"\"\"\n[&\n\"\"\"\nt = '''\n[\xc3\xa9 ]] }\n'''\n",
      "s = \"caf\xc3\xa9 [ } \\\" \xc2\xa7\"  # comment \xc2\xa7 \xe3\x81\x82 [&\n",
      "s = \"\"\"a\\\n   b\"\"\"\nt = \"\"\"\\\n  \\u00A7\"\"\"\nu = \"\"\"x\"\"\"\"\nv = '''y'''''\n",
      "a = [\n  [1.5, 2.5],  # row\n  [3.5, 4.5],\n]\nb = { c = [1, {d = 2}], e = \"\xc3\xa9\" }\n",
      "\"a.b\".'c.d'.e = 1\n[ x . \"y\" ]\nz = 1979-05-27T07:32:00.5Z\n[[arr]]\nf = -inf\n",
      "\xef\xbb\xbf[run]\r\nout_dir = \"r\"\r\n",
      "a = " + std::string(32, '[') + std::string(32, ']') + "\n" +
          "b" + [] { std::string s; for (int i = 1; i < 32; ++i) s += ".b"; return s; }() + " = 1\n",
      "a = \"\"\nb = ''\nc = [\"]\", '[', \"}\"]\n",
      "n = [+1_000, -0, 0xDEAD_beef, 0o17, 0b1010, 3.14, -1e-3, 6.02E+23, 1_0.0_1e1_0, inf, -nan]\n"
      "b = [true, false]\nd = [1979-05-27, 07:32:00.999, 1979-05-27 07:32:00, 1979-05-27t07:32:00+05:30,"
      " 1979-05-27T00:00:00.5-07:00, 1979-05-27 07:32:00Z]\n",
  };
  for (const auto& t : texts) {
    EXPECT_NO_THROW(io::check_toml_text(t, "ok.toml")) << t;
    EXPECT_NO_THROW(io::parse_toml_text(t, "ok.toml")) << t;
  }
  std::ifstream f(std::string(TESSERA_SOURCE_DIR) + "/configs/example.toml");
  const std::string example((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  ASSERT_FALSE(example.empty());
  EXPECT_NO_THROW(TrainConfig::parse(example, "configs/example.toml"));
}

// The other TOML reader, hardware files (`--gpu FILE.toml`, plan calibrate's output), takes
// the same text checks and refuses nan / inf and an int-overflowing devices_per_node.
TEST(ConfigValidation, HardwareTomlNumbersAreFinite) {
  auto error_of_hw = [](const std::string& text) -> std::string {
    try {
      plan::hardware_from_toml("base = \"h100-80g\"\n" + text, "hw.toml");
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  EXPECT_EQ(error_of_hw("memory_gib = 80\n"), "no error");
  EXPECT_EQ(error_of_hw("memory_gib = nan\n"), "hw.toml: 'memory_gib' must be a finite number, got nan");
  EXPECT_EQ(error_of_hw("intra_node_latency_us = inf\n"),
            "hw.toml: 'intra_node_latency_us' must be a finite number, got inf");
  EXPECT_EQ(error_of_hw("devices_per_node = 1e300\n"),
            "hw.toml: 'devices_per_node' must be an integer in [1, 65536], got 1e+300");
  EXPECT_EQ(error_of_hw("[gemm.fp32]\nk = [1, inf]\nmn = [1]\ngflops = [[1], [2]]\n"),
            "hw.toml: gemm.fp32.k must be a list of finite numbers, got inf");
  EXPECT_EQ(error_of_hw("[gemm.fp32]\nk = [1]\nmn = [1]\ngflops = [[-nan]]\n")
                .rfind("hw.toml: gemm.fp32.gflops must be a list of lists of finite numbers, got ", 0),
            0u);
  EXPECT_EQ(error_of_hw("[&\n"), "hw.toml:2:2: invalid TOML: expected a table name after '[', saw '&'");
}

// `tessera train --config bad.toml`: exit status 1 (no signal), one line on stderr naming
// the key.
TEST(ConfigValidation, TrainCliReportsBadConfigsAsOneLine) {
  const std::string dir = temp_dir("cli_bad_config");
  const std::string data = make_data(dir, 4000);
  const std::string ok = base_config(dir + "/run", data, 2);
  struct Case {
    std::string text, needle;
  };
  const Case cases[] = {
      {with("checkpoint", "keep", "4294967297", ok), "checkpoint.keep must be in [1, 2147483647], got 4294967297"},
      {with("parallel", "zero_stage", "4294967296", ok), "parallel.zero_stage must be in [0, 3]"},
      {with("training", "max_grad_norm", "nan", ok), "training.max_grad_norm must be a finite number"},
      {with("data", "seq_len", "257", ok), "data.seq_len 257 exceeds the model's max_position_embeddings 256"},
      {"[&\n", "invalid TOML: expected a table name after '['"},
      {"s = \"\"\"\\\n\xc2\xa7\"\"\"\n", "U+00A7"},
      // The device mesh: checked against the world (1 rank here) before anything loads.
      {with("parallel", "tp", "2", ok), "[parallel] pp 1 x tp 2 = 2 does not divide the 1 ranks"},
      {with("parallel", "dp", "2", ok), "[parallel] dp 2 x pp 1 x tp 1 = 2 ranks, but the job has 1"},
      {with("parallel", "cp", "2", with("parallel", "dp", "1", ok)), "[parallel] dp 1 x pp 1 x tp 1 x cp 2 = 2 ranks, but the job has 1"},
      {with("parallel", "tp", "0", ok), "parallel.tp must be in [1, 65536], got 0"},
      // The planner's memory model before anything loads: tens of GiB of activations.
      {with("data", "batch_size", "400000", ok), "GiB available for each of its 1 rank; lower [data] batch_size (now 400000)"},
  };
  int i = 0;
  for (const auto& c : cases) {
    const std::string cfg = dir + "/bad" + std::to_string(i++) + ".toml";
    io_write(cfg, c.text);
    const auto r = testing::run_command(std::string(TESSERA_CLI_PATH) + " train --config " + cfg +
                                            " 2>" + dir + "/stderr.txt",
                                        /*merge_stderr=*/false);
    std::ifstream in(dir + "/stderr.txt");
    const std::string err((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_EQ(r.code, 1) << c.needle << "\n" << err;  // -1 would be a signal
    EXPECT_EQ(std::count(err.begin(), err.end(), '\n'), 1) << err;
    EXPECT_NE(err.find(cfg), std::string::npos) << err;
    EXPECT_NE(err.find(c.needle), std::string::npos) << err;
  }
  fs::remove_all(dir);
}

}  // namespace
}  // namespace tessera::train
