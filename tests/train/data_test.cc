// Token shards and the DataLoader: header bytes checked by hand, corruption detection,
// exact window order (against a Python transcription of the documented shuffle), resume.
#include <gtest/gtest.h>
#include <xxhash.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iterator>
#include <random>
#include <set>
#include <sstream>

#include "../io/io_test_util.h"
#include "data_test_util.h"
#include "tessera/base/error.h"
#include "tessera/train/data_loader.h"
#include "tessera/train/token_shard.h"

namespace tessera::train {
namespace {

using io::testing::read_bytes;
using io::testing::TempDir;
using io::testing::write_bytes;
using testing::expect_error;
using testing::iota_tokens;
using testing::make_dataset;

template <typename T>
T load_le(const std::string& bytes, size_t off) {
  T v;
  std::memcpy(&v, bytes.data() + off, sizeof v);
  return v;
}

TEST(TokenShard, TokenBytesChoice) {
  EXPECT_EQ(token_bytes_for_vocab(1), 2);
  EXPECT_EQ(token_bytes_for_vocab(65536), 2);
  EXPECT_EQ(token_bytes_for_vocab(65537), 4);
  EXPECT_EQ(token_bytes_for_vocab(151936), 4);
  expect_error([] { token_bytes_for_vocab(0); }, {"vocab_size 0"});
}

TEST(TokenShard, Uint16HeaderAndPayloadBytes) {
  TempDir d;
  const std::string path = d.file("a.bin");
  const std::vector<int32_t> toks = {0, 1, 65535, 300, 7};
  write_token_shard(path, toks.data(), 5, 65536);
  const std::string b = read_bytes(path);
  ASSERT_EQ(b.size(), 32u + 10u);
  EXPECT_EQ(std::memcmp(b.data(), "TSRTOKS\0", 8), 0);
  EXPECT_EQ(load_le<uint32_t>(b, 8), 1u);
  EXPECT_EQ(load_le<uint32_t>(b, 12), 2u);
  EXPECT_EQ(load_le<uint64_t>(b, 16), 5u);
  const std::string payload("\x00\x00\x01\x00\xff\xff\x2c\x01\x07\x00", 10);
  EXPECT_EQ(b.substr(32), payload);
  EXPECT_EQ(load_le<uint64_t>(b, 24), XXH64(payload.data(), payload.size(), 0));
  EXPECT_FALSE(std::filesystem::exists(path + ".tmp"));

  const auto s = TokenShard::open(path);
  EXPECT_EQ(s->count(), 5);
  EXPECT_EQ(s->token_bytes(), 2);
  std::vector<int32_t> back(3);
  s->read(2, 3, back.data());
  EXPECT_EQ(back, (std::vector<int32_t>{65535, 300, 7}));
}

TEST(TokenShard, Uint32HeaderAndPayloadBytes) {
  TempDir d;
  const std::string path = d.file("b.bin");
  const std::vector<int32_t> toks = {99999, 0, 70000};
  write_token_shard(path, toks.data(), 3, 100000);
  const std::string b = read_bytes(path);
  ASSERT_EQ(b.size(), 32u + 12u);
  EXPECT_EQ(load_le<uint32_t>(b, 12), 4u);
  EXPECT_EQ(load_le<uint64_t>(b, 16), 3u);
  const std::string payload("\x9f\x86\x01\x00\x00\x00\x00\x00\x70\x11\x01\x00", 12);
  EXPECT_EQ(b.substr(32), payload);
  const auto s = TokenShard::open(path);
  std::vector<int32_t> back(3);
  s->read(0, 3, back.data());
  EXPECT_EQ(back, toks);
}

TEST(TokenShard, EmptyShardHasXxh64OfNothing) {
  TempDir d;
  write_token_shard(d.file("e.bin"), nullptr, 0, 10);
  // Published XXH64 of the empty input with seed 0.
  EXPECT_EQ(load_le<uint64_t>(read_bytes(d.file("e.bin")), 24), 0xEF46DB3751D8E999ull);
  EXPECT_EQ(TokenShard::open(d.file("e.bin"))->count(), 0);
}

TEST(TokenShard, OutOfVocabularyTokenIsAnError) {
  TempDir d;
  const std::vector<int32_t> toks = {1, 2, 50};
  expect_error([&] { write_token_shard(d.file("x.bin"), toks.data(), 3, 50); },
               {d.file("x.bin"), "token 2", "id 50"});
  const std::vector<int32_t> neg = {-1};
  expect_error([&] { write_token_shard(d.file("x.bin"), neg.data(), 1, 50); }, {"id -1"});
  EXPECT_FALSE(std::filesystem::exists(d.file("x.bin")));
}

TEST(TokenShard, CorruptionIsDetectedAndNamesTheFile) {
  TempDir d;
  const auto toks = iota_tokens(100);
  const std::string good_path = d.file("good.bin");
  write_token_shard(good_path, toks.data(), 100, 1000);
  const std::string good = read_bytes(good_path);
  ASSERT_NO_THROW(TokenShard::open(good_path));

  auto check = [&](const std::string& name, std::string bytes, std::initializer_list<std::string> parts) {
    const std::string p = d.file(name);
    write_bytes(p, bytes);
    std::vector<std::string> all(parts);
    all.push_back(p);
    try {
      TokenShard::open(p);
      ADD_FAILURE() << name << ": no error";
    } catch (const Error& e) {
      for (const auto& s : all) EXPECT_NE(std::string(e.what()).find(s), std::string::npos) << e.what();
    }
  };
  std::string b = good;
  b[3] = 'X';
  check("magic.bin", b, {"bad magic"});
  b = good;
  b[8] = 2;
  check("version.bin", b, {"version 2"});
  b = good;
  b[12] = 3;
  check("tb.bin", b, {"token_bytes 3"});
  check("trunc.bin", good.substr(0, good.size() - 1), {"100 tokens", "199 bytes", "truncated"});
  check("pad.bin", good + "x", {"201 bytes"});
  check("tiny.bin", good.substr(0, 10), {"10 bytes", "too small"});
  b = good;
  b[32 + 77] ^= 0x10;  // one payload bit
  check("flip.bin", b, {"checksum mismatch"});
  b = good;
  b[24] ^= 1;  // the stored checksum itself
  check("sum.bin", b, {"checksum mismatch"});
  expect_error([&] { TokenShard::open(d.file("missing.bin")); }, {d.file("missing.bin")});
}

TEST(TokenShard, SplitsIntoNumberedShards) {
  TempDir d;
  const auto toks = iota_tokens(35);
  const auto names = write_token_shards(d.path(), "train", toks, 100, 10);
  EXPECT_EQ(names, (std::vector<std::string>{"train_00000.bin", "train_00001.bin",
                                             "train_00002.bin", "train_00003.bin"}));
  const int64_t counts[] = {10, 10, 10, 5};
  for (int i = 0; i < 4; ++i) {
    const auto s = TokenShard::open(d.file(names[i]));
    ASSERT_EQ(s->count(), counts[i]);
    int32_t first;
    s->read(0, 1, &first);
    EXPECT_EQ(first, 10 * i);
  }
  EXPECT_TRUE(write_token_shards(d.path(), "val", {}, 100, 10).empty());
}

TEST(TokenShard, MetaMismatchesAreErrors) {
  TempDir d;
  make_dataset(d.path(), iota_tokens(30), iota_tokens(5), 100, 10);
  EXPECT_EQ(TokenStream(d.path(), "train").size(), 30);
  EXPECT_EQ(TokenStream(d.path(), "val").size(), 5);
  expect_error([&] { TokenStream(d.path(), "test"); }, {"unknown split \"test\""});

  std::string meta = read_bytes(d.file("meta.json"));
  const std::string good_meta = meta;
  meta.replace(meta.find("\"train_tokens\": 30"), 18, "\"train_tokens\": 31");
  write_bytes(d.file("meta.json"), meta);
  expect_error([&] { TokenStream(d.path(), "train"); }, {"train shards hold 30", "says 31"});
  write_bytes(d.file("meta.json"), good_meta);
  std::filesystem::remove(d.file("train_00001.bin"));
  expect_error([&] { TokenStream(d.path(), "train"); }, {d.file("train_00001.bin")});
  std::filesystem::remove(d.file("meta.json"));
  expect_error([&] { TokenStream(d.path(), "train"); }, {d.file("meta.json")});
  expect_error([&] { TokenStream(d.file("nowhere"), "train"); }, {"nowhere", "not found"});
}

TEST(TokenShard, StreamReadsAcrossShardBoundaries) {
  TempDir d;
  make_dataset(d.path(), iota_tokens(23), {}, 100, 4);
  const TokenStream s(d.path(), "train");
  for (int64_t begin = 0; begin < 23; ++begin)
    for (int64_t n = 0; begin + n <= 23; ++n) {
      std::vector<int32_t> got(static_cast<size_t>(n));
      s.read(begin, n, got.data());
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], begin + i) << begin << "+" << n;
    }
}

// ---- the shuffle ----

// The documented algorithm transcribed to Python (arbitrary-precision ints, so no shared
// code or shared overflow behaviour with the C++).
const char* kPermutationPy = R"(
import sys
M = (1 << 64) - 1
def mix(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M
    return z ^ (z >> 31)
def perm(seed, epoch, n):
    s = seed ^ mix(epoch + 1)
    p = list(range(n))
    for i in range(n - 1, 0, -1):
        bound = i + 1
        threshold = (2**64 - bound) % bound
        while True:
            s = (s + 0x9E3779B97F4A7C15) & M
            r = mix(s)
            if r >= threshold:
                break
        j = r % bound
        p[i], p[j] = p[j], p[i]
    return p
for line in sys.stdin:
    seed, epoch, n = map(int, line.split())
    print(" ".join(map(str, perm(seed, epoch, n))))
)";

std::vector<std::vector<int64_t>> python_permutations(
    const std::vector<std::array<uint64_t, 3>>& cases) {
  TempDir d;
  write_bytes(d.file("perm.py"), kPermutationPy);
  std::string input;
  for (const auto& c : cases)
    input += std::to_string(c[0]) + " " + std::to_string(c[1]) + " " + std::to_string(c[2]) + "\n";
  write_bytes(d.file("in.txt"), input);
  const std::string cmd = std::string(TESSERA_PYTHON) + " " + d.file("perm.py") + " < " +
                          d.file("in.txt") + " > " + d.file("out.txt");
  EXPECT_EQ(std::system(cmd.c_str()), 0) << cmd;
  std::istringstream out(read_bytes(d.file("out.txt")));
  std::vector<std::vector<int64_t>> perms;
  std::string line;
  while (std::getline(out, line)) {
    std::istringstream ls(line);
    perms.emplace_back(std::istream_iterator<int64_t>(ls), std::istream_iterator<int64_t>());
  }
  return perms;
}

TEST(Shuffle, MatchesPythonTranscriptionOfTheDocumentedAlgorithm) {
  const std::vector<std::array<uint64_t, 3>> cases = {
      {0, 0, 10}, {1234, 0, 37}, {1234, 1, 37}, {1234, 5, 37}, {0xFFFFFFFFFFFFFFFFull, 3, 100}, {42, 0, 1000}};
  const auto ref = python_permutations(cases);
  ASSERT_EQ(ref.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i)
    EXPECT_EQ(epoch_permutation(cases[i][0], static_cast<int64_t>(cases[i][1]),
                                static_cast<int64_t>(cases[i][2])),
              ref[i])
        << "seed " << cases[i][0] << " epoch " << cases[i][1];
}

TEST(Shuffle, SeedsAndEpochsGiveDifferentOrders) {
  const auto a = epoch_permutation(1, 0, 200), b = epoch_permutation(2, 0, 200),
             c = epoch_permutation(1, 1, 200);
  EXPECT_NE(a, b);
  EXPECT_NE(a, c);
  EXPECT_EQ(a, epoch_permutation(1, 0, 200));
  auto sorted = a;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 200; ++i) ASSERT_EQ(sorted[i], i);
  EXPECT_EQ(epoch_permutation(9, 4, 1), std::vector<int64_t>{0});
}

// ---- the loader ----

// The window index of each row of ids, for a stream whose token i is i, checking that the
// row is exactly that window and targets are the same window shifted by one.
std::vector<int64_t> windows_of_batch(const Tensor& ids, const Tensor& targets, int64_t T) {
  EXPECT_EQ(ids.dtype(), DType::kI32);
  const int64_t B = ids.size(0);
  EXPECT_EQ(ids.shape(), (Shape{B, T}));
  EXPECT_EQ(targets.shape(), (Shape{B, T}));
  std::vector<int64_t> w;
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* x = ids.data<int32_t>() + b * T;
    const int32_t* y = targets.data<int32_t>() + b * T;
    EXPECT_EQ(x[0] % T, 0) << "row " << b << " does not start a window";
    for (int64_t t = 0; t < T; ++t) {
      EXPECT_EQ(x[t], x[0] + t);
      EXPECT_EQ(y[t], x[0] + t + 1);
    }
    w.push_back(x[0] / T);
  }
  return w;
}

TEST(DataLoader, FirstEpochFollowsThePermutationAndCoversEveryWindow) {
  TempDir d;
  make_dataset(d.path(), iota_tokens(101), {}, 1000, 1000);
  DataLoader dl(d.path(), "train", 8, 77);
  EXPECT_EQ(dl.windows_per_epoch(), 12);  // (101 - 1) / 8
  EXPECT_EQ(dl.vocab_size(), 1000);
  Tensor ids, targets;
  dl.next_batch(12, ids, targets);
  const auto w = windows_of_batch(ids, targets, 8);
  EXPECT_EQ(w, epoch_permutation(77, 0, 12));
  EXPECT_EQ(dl.epoch(), 1);
  EXPECT_EQ(dl.state().sequences_drawn, 12u);
  // Window 11 ends at token 96 (ids 88..95, last target 96); tokens 97..100 are never read.
  EXPECT_NE(std::find(w.begin(), w.end(), 11), w.end());
}

TEST(DataLoader, EveryEpochVisitsEveryWindowOnceRandomised) {
  std::mt19937_64 rng(5);  // picks shapes only; the checks do not depend on its output
  for (int trial = 0; trial < 8; ++trial) {
    TempDir d;
    const bool big = trial == 7;  // uint32 tokens
    const int64_t N = big ? 70001 : 20 + static_cast<int64_t>(rng() % 400);
    const int64_t T = big ? 1000 : 1 + static_cast<int64_t>(rng() % 9);
    const int64_t shard = 1 + static_cast<int64_t>(rng() % 60);
    make_dataset(d.path(), iota_tokens(N), {}, big ? 100000 : N, big ? 30000 : shard);
    DataLoader dl(d.path(), "train", T, rng());
    const int64_t W = dl.windows_per_epoch();
    ASSERT_EQ(W, (N - 1) / T);
    const int64_t B = 1 + static_cast<int64_t>(rng() % 7);
    std::vector<int64_t> drawn;
    Tensor ids, targets;
    while (static_cast<int64_t>(drawn.size()) < 3 * W) {
      dl.next_batch(B, ids, targets);
      for (int64_t w : windows_of_batch(ids, targets, T)) drawn.push_back(w);
      ASSERT_EQ(dl.state().sequences_drawn, drawn.size());
      ASSERT_EQ(dl.epoch(), static_cast<int64_t>(drawn.size()) / W);
    }
    for (int64_t e = 0; e < 3; ++e) {
      std::vector<int64_t> ep(drawn.begin() + e * W, drawn.begin() + (e + 1) * W);
      std::sort(ep.begin(), ep.end());
      for (int64_t i = 0; i < W; ++i) ASSERT_EQ(ep[i], i) << "trial " << trial << " epoch " << e;
    }
  }
}

TEST(DataLoader, ResumeReadsExactlyTheBatchesOfAnUninterruptedRun) {
  TempDir d;
  make_dataset(d.path(), iota_tokens(50), {}, 100, 9);  // 12 windows of T=4 over 6 shards
  const int64_t T = 4, B = 3;
  DataLoader full(d.path(), "train", T, 2024);
  std::vector<std::vector<int64_t>> reference;  // batches 1..12 (3 epochs)
  Tensor ids, targets;
  for (int i = 0; i < 12; ++i) {
    full.next_batch(B, ids, targets);
    reference.push_back(windows_of_batch(ids, targets, T));
  }
  DataLoader first(d.path(), "train", T, 2024);
  for (int i = 0; i < 7; ++i) {
    first.next_batch(B, ids, targets);
    ASSERT_EQ(windows_of_batch(ids, targets, T), reference[i]);
  }
  // Through JSON, as a checkpoint stores it.
  const std::string saved = nlohmann::json(first.state()).dump();
  EXPECT_EQ(saved, "{\"sequences_drawn\":21}");
  DataLoader resumed(d.path(), "train", T, 2024);
  resumed.set_state(nlohmann::json::parse(saved).get<LoaderState>());
  EXPECT_EQ(resumed.epoch(), 1);
  for (int i = 7; i < 12; ++i) {
    resumed.next_batch(B, ids, targets);
    EXPECT_EQ(windows_of_batch(ids, targets, T), reference[i]) << "batch " << i + 1;
  }
  // Exactly once per epoch across the interruption: 3 epochs of 12 windows.
  std::vector<int64_t> all;
  for (const auto& b : reference) all.insert(all.end(), b.begin(), b.end());
  for (int e = 0; e < 3; ++e)
    EXPECT_EQ(std::set<int64_t>(all.begin() + 12 * e, all.begin() + 12 * (e + 1)).size(), 12u);
}

TEST(DataLoader, DifferentSeedsGiveDifferentOrders) {
  TempDir d;
  make_dataset(d.path(), iota_tokens(401), {}, 1000, 1000);
  DataLoader a(d.path(), "train", 4, 1), b(d.path(), "train", 4, 2);
  Tensor ia, ta, ib, tb;
  a.next_batch(100, ia, ta);
  b.next_batch(100, ib, tb);
  EXPECT_NE(windows_of_batch(ia, ta, 4), windows_of_batch(ib, tb, 4));
}

TEST(DataLoader, TargetsAreIdsShiftedOnArbitraryTokens) {
  TempDir d;
  std::mt19937 rng(3);
  std::vector<int32_t> toks(300);
  for (auto& t : toks) t = static_cast<int32_t>(rng() % 50);
  make_dataset(d.path(), toks, {}, 50, 64);
  DataLoader dl(d.path(), "train", 16, 9);
  Tensor ids, targets;
  dl.next_batch(20, ids, targets);  // 18 windows per epoch: crosses into epoch 1
  const auto perm0 = epoch_permutation(9, 0, 18), perm1 = epoch_permutation(9, 1, 18);
  for (int64_t b = 0; b < 20; ++b) {
    const int64_t w = b < 18 ? perm0[b] : perm1[b - 18];
    for (int64_t t = 0; t < 16; ++t) {
      ASSERT_EQ(ids.data<int32_t>()[b * 16 + t], toks[w * 16 + t]);
      ASSERT_EQ(targets.data<int32_t>()[b * 16 + t], toks[w * 16 + t + 1]);
    }
  }
}

TEST(DataLoader, MultiShardStreamEqualsSingleShardStream) {
  TempDir one, many;
  std::mt19937 rng(11);
  std::vector<int32_t> toks(500);
  for (auto& t : toks) t = static_cast<int32_t>(rng() % 30000);
  make_dataset(one.path(), toks, {}, 30000, 1000);
  make_dataset(many.path(), toks, {}, 30000, 7);  // windows of 13 span up to 3 shards
  DataLoader a(one.path(), "train", 13, 5), b(many.path(), "train", 13, 5);
  Tensor ia, ta, ib, tb;
  for (int i = 0; i < 20; ++i) {
    a.next_batch(6, ia, ta);
    b.next_batch(6, ib, tb);
    ASSERT_EQ(std::memcmp(ia.data<int32_t>(), ib.data<int32_t>(), ia.nbytes()), 0) << i;
    ASSERT_EQ(std::memcmp(ta.data<int32_t>(), tb.data<int32_t>(), ta.nbytes()), 0) << i;
  }
}

TEST(DataLoader, CorpusSmallerThanOneSequenceIsAnError) {
  TempDir d;
  make_dataset(d.path(), iota_tokens(8), {}, 100, 100);
  expect_error([&] { DataLoader(d.path(), "train", 8, 0); },
               {"\"train\"", d.path().string(), "corpus of 8 tokens", "sequence of 9"});
  expect_error([&] { DataLoader(d.path(), "val", 8, 0); }, {"\"val\"", "corpus of 0 tokens"});
  DataLoader ok(d.path(), "train", 7, 0);  // 8 tokens = exactly one window of 7 + 1
  EXPECT_EQ(ok.windows_per_epoch(), 1);
  expect_error([&] { DataLoader(d.path(), "train", 0, 0); }, {"seq_len 0"});
}

TEST(DataLoader, StateJsonErrors) {
  expect_error([] { nlohmann::json::parse("{}").get<LoaderState>(); }, {"sequences_drawn"});
  expect_error([] { nlohmann::json::parse("{\"sequences_drawn\": -3}").get<LoaderState>(); },
               {"sequences_drawn", "-3"});
  expect_error([] { nlohmann::json::parse("{\"sequences_drawn\": \"7\"}").get<LoaderState>(); },
               {"sequences_drawn"});
  EXPECT_EQ(nlohmann::json::parse("{\"sequences_drawn\": 18446744073709551615}").get<LoaderState>(),
            LoaderState{18446744073709551615ull});
}

TEST(EvalBatches, ValSplitInOrderWithAShortLastBatch) {
  TempDir d;
  std::vector<int32_t> val(101);
  for (int i = 0; i < 101; ++i) val[i] = 1000 + i;
  make_dataset(d.path(), iota_tokens(50), val, 2000, 30);
  const auto batches = eval_batches(d.path(), "val", 8, 5, 0);  // 12 windows
  ASSERT_EQ(batches.size(), 3u);
  const int64_t rows[] = {5, 5, 2};
  int64_t w = 0;
  for (int i = 0; i < 3; ++i) {
    const auto& [ids, targets, positions] = batches[i];
    EXPECT_FALSE(positions.defined());
    ASSERT_EQ(ids.shape(), (Shape{rows[i], 8}));
    ASSERT_EQ(targets.shape(), (Shape{rows[i], 8}));
    for (int64_t r = 0; r < rows[i]; ++r, ++w)
      for (int64_t t = 0; t < 8; ++t) {
        EXPECT_EQ(ids.data<int32_t>()[r * 8 + t], 1000 + w * 8 + t);
        EXPECT_EQ(targets.data<int32_t>()[r * 8 + t], 1000 + w * 8 + t + 1);
      }
  }
  EXPECT_EQ(eval_batches(d.path(), "val", 8, 5, 2).size(), 2u);
  expect_error([&] { eval_batches(d.path(), "val", 200, 5, 0); }, {"\"val\"", "corpus of 101 tokens"});
}

}  // namespace
}  // namespace tessera::train
