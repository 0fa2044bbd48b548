// Chat data directories and packing: a packing checked slot by slot by hand, the split files'
// round trip and corruption errors, and the loader's packed rows (order, positions, resume).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "../io/io_test_util.h"
#include "data_test_util.h"
#include "tessera/kernels/cross_entropy.h"
#include "tessera/train/chat_data.h"
#include "tessera/train/data_loader.h"
#include "tessera/train/token_shard.h"

namespace tessera::train {
namespace {

using io::testing::TempDir;
using testing::expect_error;
constexpr int32_t X = kernels::kIgnoreIndex;

ChatDocument doc(std::vector<int32_t> tokens, std::vector<uint8_t> mask) { return {std::move(tokens), std::move(mask)}; }

TEST(ChatPacking, BestFitDecreasingByHand) {
  // Lengths 3, 5, 2, 4 into rows of 6: 5 -> row 0 (room 1), 4 -> row 1 (room 2), 3 -> row 2
  // (room 3: rows 0 and 1 are too full), 2 -> row 1 (the least room that holds it: 2).
  const std::vector<ChatDocument> docs = {
      doc({10, 11, 12}, {0, 1, 1}),
      doc({20, 21, 22, 23, 24}, {0, 0, 1, 1, 0}),
      doc({30, 31}, {0, 1}),
      doc({40, 41, 42, 43}, {0, 0, 0, 1}),
  };
  const PackedRows p = pack_documents(docs, 6, /*pad_id=*/7);
  ASSERT_EQ(p.rows, 3);
  EXPECT_EQ(p.documents, 4);
  EXPECT_EQ(p.truncated, 0);
  EXPECT_EQ(p.dropped, 0);
  EXPECT_EQ(p.slots_used, 14);
  EXPECT_NEAR(p.fill(), 14.0 / 18.0, 1e-12);
  // A target is the next token when that token is trained on (mask 1), else ignored.
  const std::vector<int32_t> ids = {20, 21, 22, 23, 24, 7,   //
                                    40, 41, 42, 43, 30, 31,  //
                                    10, 11, 12, 7, 7, 7};
  const std::vector<int32_t> targets = {X, 22, 23, X, X, X,  //
                                        X, X, 43, X, 31, X,  //
                                        11, 12, X, X, X, X};
  const std::vector<int32_t> positions = {0, 1, 2, 3, 4, 0,  //
                                          0, 1, 2, 3, 0, 1,  //
                                          0, 1, 2, 0, 1, 2};
  EXPECT_EQ(p.ids, ids);
  EXPECT_EQ(p.targets, targets);
  EXPECT_EQ(p.positions, positions);
  EXPECT_EQ(p.targets_counted, 6);
}

TEST(ChatPacking, TruncatesLongAndDropsUntrainedDocuments) {
  const std::vector<ChatDocument> docs = {
      doc({1, 2, 3, 4, 5, 6}, {0, 0, 0, 0, 1, 1}),  // truncated to 4: its trained tokens are cut -> dropped
      doc({1, 2, 3, 4, 5}, {0, 1, 1, 1, 1}),        // truncated to 4, kept
      doc({8, 9}, {0, 0}),                          // nothing to train on -> dropped
  };
  const PackedRows p = pack_documents(docs, 4, 0);
  EXPECT_EQ(p.truncated, 2);
  EXPECT_EQ(p.dropped, 2);
  ASSERT_EQ(p.rows, 1);
  EXPECT_EQ(p.ids, (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(p.targets, (std::vector<int32_t>{2, 3, 4, X}));
  EXPECT_EQ(p.positions, (std::vector<int32_t>{0, 1, 2, 3}));
  expect_error([] { pack_documents({doc({1}, {1, 0})}, 4, 0); }, {"document 0", "1 tokens but 2 mask"});
  expect_error([] { pack_documents({}, 1, 0); }, {"seq_len 1"});
}

void write_example(const std::string& dir, int64_t vocab = 100) {
  ChatDataMeta m;
  m.vocab_size = vocab;
  m.eos_id = 2;
  m.pad_id = 2;
  m.tokenizer = "tok";
  m.source = "chats.jsonl";
  m.source_digest = "0123";
  std::vector<ChatDocument> train;
  for (int i = 0; i < 10; ++i) {
    ChatDocument d;
    for (int t = 0; t < 3 + i; ++t) {
      d.tokens.push_back(10 + i * 5 + t);
      d.mask.push_back(t >= 2);
    }
    train.push_back(d);
  }
  write_chat_data(dir, m, train, {doc({5, 6, 7}, {0, 1, 1})});
}

TEST(ChatData, RoundTripAndMeta) {
  TempDir d;
  write_example(d.path());
  EXPECT_TRUE(is_chat_data(d.path()));
  const ChatDataMeta m = read_chat_meta(d.path());
  EXPECT_EQ(m.train_docs, 10);
  EXPECT_EQ(m.val_docs, 1);
  EXPECT_EQ(m.train_tokens, 3 * 10 + 45);
  EXPECT_EQ(m.train_trained, 1 * 10 + 45);
  EXPECT_EQ(m.val_trained, 2);
  EXPECT_EQ(m.source_digest, "0123");
  const auto train = read_chat_split(d.path(), "train");
  ASSERT_EQ(train.size(), 10u);
  EXPECT_EQ(train[4].tokens, (std::vector<int32_t>{30, 31, 32, 33, 34, 35, 36}));
  EXPECT_EQ(train[4].mask, (std::vector<uint8_t>{0, 0, 1, 1, 1, 1, 1}));
  // read_data_meta understands the directory; a token stream over it is a clear error.
  const DataMeta dm = read_data_meta(d.path());
  EXPECT_TRUE(dm.chat);
  EXPECT_EQ(dm.vocab_size, 100);
  EXPECT_EQ(dm.val_tokens, 3);
  expect_error([&] { TokenStream(d.path(), "train"); }, {"chat data directory has no token stream"});
}

TEST(ChatData, CorruptionIsAnError) {
  TempDir d;
  write_example(d.path());
  const std::string file = d.path().string() + "/train.chat";
  std::filesystem::resize_file(file, std::filesystem::file_size(file) - 1);
  expect_error([&] { read_chat_split(d.path(), "train"); }, {"train.chat", "bytes"});
  std::ofstream(d.path().string() + "/meta.json") << "{\"format\": \"tessera-chat\", \"version\": 7}";
  expect_error([&] { read_chat_meta(d.path()); }, {"meta.json", "version 7"});
}

TEST(ChatData, TokenOutsideVocabularyIsAnErrorOnWrite) {
  TempDir d;
  ChatDataMeta m;
  m.vocab_size = 10;
  expect_error([&] { write_chat_data(d.path(), m, {doc({1, 12}, {0, 1})}, {}); }, {"token id 12", "vocabulary of 10"});
}

TEST(ChatData, LoaderDrawsPackedRowsAndResumesExactly) {
  TempDir d;
  write_example(d.path());
  DataLoader a(d.path(), "train", 16, 5);
  ASSERT_TRUE(a.packed());
  const PackedRows& rows = *a.packed_rows();
  EXPECT_EQ(a.windows_per_epoch(), rows.rows);
  // Each epoch visits every row once, in epoch_permutation's order, with its positions.
  std::set<int64_t> seen;
  model::TokenBatch b;
  for (int64_t k = 0; k < rows.rows; ++k) {
    a.next_batch(1, b);
    ASSERT_TRUE(b.positions.defined());
    const int64_t w = epoch_permutation(5, 0, rows.rows)[k];
    seen.insert(w);
    for (int64_t t = 0; t < 16; ++t) {
      EXPECT_EQ(b.ids.data<int32_t>()[t], rows.ids[w * 16 + t]);
      EXPECT_EQ(b.targets.data<int32_t>()[t], rows.targets[w * 16 + t]);
      EXPECT_EQ(b.positions.data<int32_t>()[t], rows.positions[w * 16 + t]);
    }
  }
  EXPECT_EQ(static_cast<int64_t>(seen.size()), rows.rows);
  // Resume: a loader set to a saved state draws what the first draws next.
  model::TokenBatch x, y;
  const LoaderState s = a.state();
  a.next_batch(3, x);
  DataLoader c(d.path(), "train", 16, 5);
  c.set_state(s);
  c.next_batch(3, y);
  for (int64_t i = 0; i < 48; ++i) {
    EXPECT_EQ(x.ids.data<int32_t>()[i], y.ids.data<int32_t>()[i]);
    EXPECT_EQ(x.targets.data<int32_t>()[i], y.targets.data<int32_t>()[i]);
    EXPECT_EQ(x.positions.data<int32_t>()[i], y.positions.data<int32_t>()[i]);
  }
  // Evaluation batches: the val split's rows in order.
  const auto val = eval_batches(d.path(), "val", 16, 4, 0);
  ASSERT_EQ(val.size(), 1u);
  EXPECT_EQ(val[0].ids.data<int32_t>()[0], 5);
  EXPECT_EQ(val[0].targets.data<int32_t>()[0], 6);
  EXPECT_EQ(val[0].targets.data<int32_t>()[1], 7);
  EXPECT_EQ(val[0].positions.data<int32_t>()[3], 0);  // the pad document starts
}

}  // namespace
}  // namespace tessera::train
