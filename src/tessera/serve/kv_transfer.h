// KV transfer between a prefill worker and a decode worker (prefill/decode disaggregation,
// docs/serving.md). One TCP connection per transfer carries a framed protocol: the prefill
// side's hello (token ids, chain hashes, the pool's geometry), the decode side's reply (which
// blocks it caches already, the blocks it reserved for the rest), the block bytes, a commit and
// an ack. How the bytes move is the transport's: "tcp" streams them in the connection, one frame
// per layer; "shm" writes them straight into the decode worker's pool, which lives in POSIX
// shared memory (same host). A bad frame, a short read or a dead peer fails that transfer only.
#pragma once
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/infer/kv_pool.h"
#include "tessera/infer/block_manager.h"
#include "tessera/infer/kv_shm.h"

namespace tessera::serve {

using infer::BlockId;

// A failed transfer. kind: "connect" (the decode worker cannot be reached), "io" (the connection
// broke or timed out mid-transfer), "protocol" (a bad frame), "refused" (the decode worker said
// no: incompatible pools, no room); the message names the decode worker.
class KvTransferError : public Error {
 public:
  KvTransferError(std::string kind, const std::string& msg) : Error(msg), kind(std::move(kind)) {}
  std::string kind;
};

// A connected TCP socket with framed messages. Frames: {magic, type, payload length, XXH3-64 of
// the payload} then the payload; lengths are bounded and checksums verified on receipt.
class KvSocket {
 public:
  enum Type : uint32_t { kHello = 1, kReply = 2, kLayer = 3, kCommit = 4, kAck = 5, kError = 6 };
  explicit KvSocket(int fd, std::string peer);
  static KvSocket connect(const std::string& host, int port, double timeout_s, const std::string& peer);
  ~KvSocket();
  KvSocket(KvSocket&& o) noexcept;
  KvSocket(const KvSocket&) = delete;
  KvSocket& operator=(const KvSocket&) = delete;

  void send_frame(Type type, const void* data, size_t n);
  void send_json(Type type, const nlohmann::json& j);
  // Receives one frame of `expect` type (an error frame from the peer throws "refused" with its
  // message); throws KvTransferError on a bad magic, length or checksum, or a short read.
  std::vector<uint8_t> recv_frame(Type expect);
  nlohmann::json recv_json(Type expect);
  const std::string& peer() const { return peer_; }
  int fd() const { return fd_; }  // the socket (tests write raw bytes through it)

 private:
  void send_all(const void* data, size_t n);
  void recv_all(void* data, size_t n);
  int fd_ = -1;
  std::string peer_;  // what error messages call the other side
};

// How block bytes travel once the handshake reserved the receiver's blocks.
class KvTransport {
 public:
  virtual ~KvTransport() = default;
  virtual const char* name() const = 0;  // "tcp" | "shm"
  // Sender: blocks from[i] of `pool`, i in [first, from.size()), into the receiver's blocks
  // reply["blocks"][i - first], layer by layer.
  virtual void send_blocks(KvSocket& s, const infer::KvPool& pool, const std::vector<BlockId>& from, int64_t first,
                           const nlohmann::json& reply) = 0;
  // Receiver: the same blocks into `to` (to[i - first] for block i) of `pool`.
  virtual void receive_blocks(KvSocket& s, infer::KvPool& pool, const std::vector<BlockId>& to, int64_t first,
                              int64_t n) = 0;
};
// "tcp" or "shm"; throws naming the value otherwise.
std::unique_ptr<KvTransport> make_kv_transport(const std::string& name);

// The prefill side of one transfer.
struct KvTarget {
  std::string host;
  int port = 0;
  std::string transport = "tcp";
  std::string worker;  // the decode worker's URL, for messages
};
struct KvExport {
  int64_t transfer_id = 0;
  int32_t adapter = -1;
  std::vector<int32_t> tokens;   // the prompt (at least blocks.size() * block_size ids)
  std::vector<uint64_t> hashes;  // chain hashes of the full blocks
  std::vector<BlockId> blocks;   // their blocks in the sender's pool (held while sending)
};
struct KvSendResult {
  int64_t blocks = 0;         // blocks whose bytes moved
  int64_t bytes = 0;          // their bytes (blocks x KvPool::block_bytes())
  int64_t remote_cached = 0;  // leading blocks the decode worker had cached already
  double seconds = 0;         // hello to ack
  std::string transport;
};
// One transfer in two halves, so that the handshake (the decode worker reserves blocks between
// two of its engine steps) overlaps the prefill: the constructor connects, sends the hello for
// the chain of `hashes` over `tokens` and reads the reply; send() moves the blocks once they hold
// their K/V. Destroyed without send(): the decode worker is told to release its reservation.
// Any thread; `pool` is only read at blocks the caller holds. Throws KvTransferError.
class KvSendSession {
 public:
  KvSendSession(const KvTarget& target, const infer::KvPool& pool, int64_t transfer_id, int32_t adapter,
                const std::vector<int32_t>& tokens, const std::vector<uint64_t>& hashes, double timeout_s = 30);
  ~KvSendSession();
  KvSendSession(const KvSendSession&) = delete;
  KvSendSession& operator=(const KvSendSession&) = delete;
  // blocks: the chain's blocks in the pool, hashes.size() of them. seconds in the result: this
  // call (the bytes, commit and ack); handshake_seconds(): the constructor's part.
  KvSendResult send(const std::vector<BlockId>& blocks);
  double handshake_seconds() const { return handshake_s_; }

 private:
  KvTarget target_;
  const infer::KvPool& pool_;
  std::unique_ptr<KvSocket> socket_;
  std::unique_ptr<KvTransport> transport_;
  nlohmann::json reply_;
  int64_t have_ = 0, n_ = 0;
  double handshake_s_ = 0;
  bool sent_ = false;
};

// Chain hashes of tokens' full blocks under an adapter's salt (BlockManager's).
std::vector<uint64_t> chain_hashes(const std::vector<int32_t>& tokens, int64_t block_size, int32_t adapter);

// Runs one transfer at once (a KvSendSession and its send).
KvSendResult send_kv(const KvTarget& target, const infer::KvPool& pool, const KvExport& e, double timeout_s = 30);

// The decode worker's engine as the receiver sees it (calls may block on its engine thread).
class KvImportSink {
 public:
  virtual ~KvImportSink() = default;
  // Reserves blocks for a hello; returns the blocks of the chain (have = leading ones already
  // cached). Throws (the message goes back to the sender) when it cannot.
  struct Reservation {
    int64_t have = 0;
    std::vector<BlockId> blocks;
  };
  virtual Reservation reserve(int64_t transfer_id, const std::vector<int32_t>& tokens, int32_t adapter,
                              const std::vector<uint64_t>& hashes) = 0;
  virtual void commit(int64_t transfer_id, int64_t blocks, int64_t bytes, double seconds) = 0;
  // Releases what reserve took (unknown id: no-op); failed is false when the sender cancelled
  // (its request ended at the first token and needed no transfer).
  virtual void abort(int64_t transfer_id, bool failed) = 0;
  virtual infer::KvPool& pool() = 0;            // written only at reserved blocks
};

// The decode worker's listener: one thread accepts, one thread per connection.
class KvReceiver {
 public:
  // shm: the layout of the pool's segment when it lives in shared memory (transport shm
  // accepted), else null (tcp only). Binds host:port (0 = any free port); throws naming them.
  KvReceiver(const std::string& host, int port, KvImportSink& sink, const infer::KvShmLayout* shm,
             int64_t block_size);
  ~KvReceiver();
  int port() const { return port_; }
  void stop();

 private:
  void accept_loop();
  void serve(int fd, std::string peer);
  KvImportSink& sink_;
  const infer::KvShmLayout* shm_;
  int64_t block_size_;
  int listen_fd_ = -1;
  int port_ = 0;
  std::atomic<bool> stopping_{false};
  std::thread acceptor_;
  std::mutex m_;
  struct Conn {
    std::thread thread;
    std::shared_ptr<std::atomic<bool>> done;
  };
  std::vector<Conn> conns_;  // under m_; finished ones are joined at the next accept
};

nlohmann::json shm_layout_json(const infer::KvShmLayout& L);

}  // namespace tessera::serve
