// The KV transfer protocol (serve/kv_transfer.h) between a sender and a KvReceiver in one
// process: block bytes arrive intact over tcp and shm; a corrupt or short frame, a vanished
// sender or a vanished receiver fail that transfer only (the receiver releases what it reserved,
// the sender's error names the decode worker); incompatible pools are refused.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <unistd.h>
#include <xxhash.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <thread>

#include "tessera/infer/kv_shm.h"
#include "tessera/model/config.h"
#include "tessera/serve/kv_transfer.h"

namespace tessera::serve {
namespace {

using nlohmann::json;

model::ModelConfig tiny() { return model::ModelConfig::named_shape("tiny"); }

infer::KvPool filled_pool(uint8_t seed) {
  infer::KvPool p = infer::KvPool::create(tiny(), 8, 16, 0, kernels::KvCacheDtype::kBF16);
  std::vector<uint8_t> bytes(static_cast<size_t>(p.block_bytes()));
  for (int32_t b = 0; b < 8; ++b) {
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(seed + b * 31 + i * 7);
    p.write_block(b, bytes.data());
  }
  return p;
}

std::vector<uint8_t> block(const infer::KvPool& p, int32_t b) {
  std::vector<uint8_t> out(static_cast<size_t>(p.block_bytes()));
  p.read_block(b, out.data());
  return out;
}

struct FakeSink : KvImportSink {
  explicit FakeSink(infer::KvPool& p) : p(p) {}
  infer::KvPool& p;
  std::atomic<int> reserved{0}, committed{0}, aborted{0};
  Reservation reserve(int64_t, const std::vector<int32_t>& tokens, int32_t, const std::vector<uint64_t>& hashes) override {
    EXPECT_EQ(tokens.size(), hashes.size() * 16);
    ++reserved;
    Reservation r;
    for (size_t i = 0; i < hashes.size(); ++i) r.blocks.push_back(static_cast<BlockId>(5 + i));
    return r;
  }
  void commit(int64_t, int64_t, int64_t, double) override { ++committed; }
  void abort(int64_t, bool) override { ++aborted; }
  infer::KvPool& pool() override { return p; }
};

KvExport export_of(std::vector<BlockId> blocks) {
  KvExport e;
  e.transfer_id = 42;
  e.tokens.assign(blocks.size() * 16, 7);
  e.hashes.assign(blocks.size(), 99);
  e.blocks = std::move(blocks);
  return e;
}

bool wait_for(const std::atomic<int>& v, int want) {
  for (int i = 0; i < 500 && v.load() < want; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  return v.load() >= want;
}

TEST(KvTransfer, BlocksArriveIntactOverTcpAndShm) {
  for (const std::string transport : {"tcp", "shm"}) {
    SCOPED_TRACE(transport);
    const infer::KvPool a = filled_pool(1);
    infer::KvPool b = filled_pool(100);
    std::unique_ptr<infer::KvShmLayout> shm;
    if (transport == "shm")
      shm = std::make_unique<infer::KvShmLayout>(infer::place_pool_in_shm(b, "/tessera-kv-" + std::to_string(getpid()) + "-test"));
    FakeSink sink(b);
    KvReceiver rx("127.0.0.1", 0, sink, shm.get(), 16);
    const KvSendResult r = send_kv({"127.0.0.1", rx.port(), transport, "decode-under-test"}, a, export_of({1, 2, 3}));
    EXPECT_EQ(r.blocks, 3);
    EXPECT_EQ(r.bytes, 3 * a.block_bytes());
    ASSERT_TRUE(wait_for(sink.committed, 1));
    for (int i = 0; i < 3; ++i) EXPECT_EQ(block(b, 5 + i), block(a, 1 + i)) << "block " << i;
    EXPECT_NE(block(b, 4), block(a, 0));  // nothing else written
    EXPECT_EQ(sink.aborted.load(), 0);
  }
}

TEST(KvTransfer, BadOrShortFramesFailThatTransferOnly) {
  const infer::KvPool a = filled_pool(1);
  infer::KvPool b = filled_pool(100);
  const auto before = block(b, 5);
  FakeSink sink(b);
  KvReceiver rx("127.0.0.1", 0, sink, nullptr, 16);
  const json hello = {{"transfer_id", 1}, {"transport", "tcp"}, {"block_size", 16}, {"dtype", "bf16"},
                      {"layer_block_bytes", {a.layer_block_bytes(0), a.layer_block_bytes(1)}}, {"adapter", -1},
                      {"tokens", std::vector<int32_t>(16, 7)}, {"hashes", {99}}};
  const size_t layer_payload = 16 + static_cast<size_t>(a.layer_block_bytes(0));
  {  // a layer frame whose checksum does not match its bytes
    KvSocket s = KvSocket::connect("127.0.0.1", rx.port(), 5, "rx");
    s.send_json(KvSocket::kHello, hello);
    s.recv_json(KvSocket::kReply);
    std::vector<uint8_t> payload(layer_payload, 0);
    const uint32_t first[4] = {0, 0, 1, 0};  // layer 0, blocks 0 + 1
    std::memcpy(payload.data(), first, sizeof first);
    struct {
      uint32_t magic = 0x314b5654, type = KvSocket::kLayer;
      uint64_t length = 0, checksum = 0;
    } h;
    h.length = payload.size();
    h.checksum = XXH3_64bits(payload.data(), payload.size()) ^ 1;  // one bit off
    ASSERT_EQ(::send(s.fd(), &h, sizeof h, MSG_NOSIGNAL), static_cast<ssize_t>(sizeof h));
    ASSERT_EQ(::send(s.fd(), payload.data(), payload.size(), MSG_NOSIGNAL), static_cast<ssize_t>(payload.size()));
    ASSERT_TRUE(wait_for(sink.aborted, 1));
  }
  {  // a well-formed frame for the wrong layer
    KvSocket s = KvSocket::connect("127.0.0.1", rx.port(), 5, "rx");
    s.send_json(KvSocket::kHello, hello);
    s.recv_json(KvSocket::kReply);
    std::vector<uint8_t> payload(layer_payload, 0);
    const uint32_t wrong[4] = {1, 0, 1, 0};
    std::memcpy(payload.data(), wrong, sizeof wrong);
    s.send_frame(KvSocket::kLayer, payload.data(), payload.size());
    ASSERT_TRUE(wait_for(sink.aborted, 2));
  }
  {  // the sender vanishes after the reply
    KvSocket s = KvSocket::connect("127.0.0.1", rx.port(), 5, "rx");
    s.send_json(KvSocket::kHello, hello);
    s.recv_json(KvSocket::kReply);
  }
  ASSERT_TRUE(wait_for(sink.aborted, 3));
  EXPECT_EQ(sink.committed.load(), 0);
  EXPECT_EQ(block(b, 5), before);
  // The receiver still serves the next transfer.
  EXPECT_EQ(send_kv({"127.0.0.1", rx.port(), "tcp", "decode-under-test"}, a, export_of({2})).blocks, 1);
  ASSERT_TRUE(wait_for(sink.committed, 1));
  EXPECT_EQ(block(b, 5), block(a, 2));
}

TEST(KvTransfer, AVanishedOrRefusingReceiverIsAnErrorNamingTheWorker) {
  const infer::KvPool a = filled_pool(1);
  // A "decode worker" that answers the hello, then closes mid-transfer.
  const int lfd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(lfd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ::listen(lfd, 4);
  socklen_t len = sizeof addr;
  getsockname(lfd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int port = ntohs(addr.sin_port);
  std::thread fake([lfd] {
    KvSocket s(::accept(lfd, nullptr, nullptr), "prefill");
    s.recv_json(KvSocket::kHello);
    s.send_json(KvSocket::kReply, {{"have", 0}, {"blocks", {5, 6, 7}}});
  });  // the socket closes here
  try {
    send_kv({"127.0.0.1", port, "tcp", "http://decode-7:8000"}, a, export_of({1, 2, 3}), 5);
    ADD_FAILURE() << "no error";
  } catch (const KvTransferError& e) {
    EXPECT_TRUE(e.kind == "io") << e.kind << ": " << e.what();
    EXPECT_NE(std::string(e.what()).find("http://decode-7:8000"), std::string::npos) << e.what();
  }
  fake.join();
  ::close(lfd);
  // Nobody listening: "connect".
  try {
    send_kv({"127.0.0.1", port, "tcp", "http://decode-7:8000"}, a, export_of({1}), 5);
    ADD_FAILURE() << "no error";
  } catch (const KvTransferError& e) {
    EXPECT_EQ(e.kind, "connect") << e.what();
  }
  // A receiver with another block size refuses, naming why; shm without a segment likewise.
  infer::KvPool b = filled_pool(100);
  FakeSink sink(b);
  KvReceiver rx("127.0.0.1", 0, sink, nullptr, 32);
  for (const std::string transport : {"tcp", "shm"}) {
    try {
      send_kv({"127.0.0.1", rx.port(), transport, "d"}, a, export_of({1}), 5);
      ADD_FAILURE() << "no error";
    } catch (const KvTransferError& e) {
      EXPECT_EQ(e.kind, "refused") << e.what();
      EXPECT_NE(std::string(e.what()).find(transport == "tcp" ? "block size" : "shared memory"), std::string::npos)
          << e.what();
    }
  }
  EXPECT_EQ(sink.reserved.load(), 0);
}

}  // namespace
}  // namespace tessera::serve
