// KV transfer between prefill and decode workers (kv_transfer.h): the framed socket, the tcp and
// shm transports, the sender and the decode worker's receiver.
#include "tessera/serve/kv_transfer.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>
#include <xxhash.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include "tessera/base/logging.h"

namespace tessera::serve {
namespace {

using nlohmann::json;
using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x314b5654;                // "TVK1"
constexpr uint64_t kMaxJsonFrame = 64ull << 20;        // hello: token ids and hashes
constexpr uint64_t kMaxLayerFrame = 4ull << 30;        // one layer of a long prompt's blocks
constexpr double kPrefillWait = 900;                   // seconds a reservation waits for its bytes

struct FrameHeader {
  uint32_t magic = kMagic;
  uint32_t type = 0;
  uint64_t length = 0;
  uint64_t checksum = 0;
};
static_assert(sizeof(FrameHeader) == 24);

struct LayerHeader {  // at the start of a kLayer payload
  uint32_t layer = 0, first = 0, count = 0, pad = 0;
};

const char* type_name(uint32_t t) {
  switch (t) {
    case KvSocket::kHello: return "hello";
    case KvSocket::kReply: return "reply";
    case KvSocket::kLayer: return "layer";
    case KvSocket::kCommit: return "commit";
    case KvSocket::kAck: return "ack";
    case KvSocket::kError: return "error";
  }
  return "unknown";
}

void set_timeouts(int fd, double timeout_s) {
  timeval tv{};
  tv.tv_sec = static_cast<time_t>(timeout_s);
  tv.tv_usec = static_cast<suseconds_t>((timeout_s - static_cast<double>(tv.tv_sec)) * 1e6);
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

// The bytes of block b of one cache tensor (K or V of one layer).
const uint8_t* cache_block(const Tensor& t, int64_t num_blocks, BlockId b) {
  return static_cast<const uint8_t*>(t.raw_data()) + static_cast<size_t>(b) * (t.nbytes() / num_blocks);
}

class TcpTransport final : public KvTransport {
 public:
  const char* name() const override { return "tcp"; }
  void send_blocks(KvSocket& s, const infer::KvPool& pool, const std::vector<BlockId>& from, int64_t first,
                   const json&) override {
    const int64_t n = static_cast<int64_t>(from.size()) - first;
    if (n <= 0) return;
    std::vector<uint8_t> buf;
    for (int64_t l = 0; l < pool.num_layers(); ++l) {  // one frame per layer: the receiver writes as they come
      const int64_t lb = pool.layer_block_bytes(l);
      buf.resize(sizeof(LayerHeader) + static_cast<size_t>(n * lb));
      LayerHeader h{static_cast<uint32_t>(l), static_cast<uint32_t>(first), static_cast<uint32_t>(n), 0};
      std::memcpy(buf.data(), &h, sizeof h);
      for (int64_t i = 0; i < n; ++i)
        pool.read_block_layer(from[first + i], l, buf.data() + sizeof h + i * lb);
      s.send_frame(KvSocket::kLayer, buf.data(), buf.size());
    }
  }
  void receive_blocks(KvSocket& s, infer::KvPool& pool, const std::vector<BlockId>& to, int64_t first,
                      int64_t n) override {
    if (n - first <= 0) return;
    for (int64_t l = 0; l < pool.num_layers(); ++l) {
      const std::vector<uint8_t> f = s.recv_frame(KvSocket::kLayer);
      const int64_t lb = pool.layer_block_bytes(l);
      LayerHeader h;
      if (f.size() < sizeof h) throw KvTransferError("protocol", s.peer() + ": a layer frame of " + std::to_string(f.size()) + " bytes");
      std::memcpy(&h, f.data(), sizeof h);
      const uint64_t want = sizeof h + static_cast<uint64_t>((n - first) * lb);
      if (h.layer != l || h.first != first || h.count != n - first || f.size() != want)
        throw KvTransferError("protocol", s.peer() + ": layer frame (layer " + std::to_string(h.layer) + ", blocks " +
                                              std::to_string(h.first) + "+" + std::to_string(h.count) + ", " +
                                              std::to_string(f.size()) + " bytes) where layer " + std::to_string(l) +
                                              ", blocks " + std::to_string(first) + "+" + std::to_string(n - first) +
                                              ", " + std::to_string(want) + " bytes were due");
      for (int64_t i = 0; i < n - first; ++i)
        pool.write_block_layer(to[i], l, f.data() + sizeof h + i * lb);  // decode may use layer l's now
    }
  }
};

class ShmTransport final : public KvTransport {
 public:
  const char* name() const override { return "shm"; }
  void send_blocks(KvSocket&, const infer::KvPool& pool, const std::vector<BlockId>& from, int64_t first,
                   const json& reply) override {
    const int64_t n = static_cast<int64_t>(from.size()) - first;
    if (n <= 0) return;
    const json& L = reply.at("shm");
    const infer::KvShmMapping& map = mapping(L.at("name").get<std::string>(), L.at("bytes").get<int64_t>());
    const auto& to = reply.at("blocks");
    const int64_t remote_blocks = L.at("num_blocks").get<int64_t>();
    for (int64_t l = 0; l < pool.num_layers(); ++l) {
      for (int kv = 0; kv < 2; ++kv) {
        const Tensor& t = kv == 0 ? pool.k[l] : pool.v[l];
        if (!t.defined()) continue;
        const int64_t bb = static_cast<int64_t>(t.nbytes()) / pool.num_blocks;
        const int64_t off = L.at(kv == 0 ? "k_offset" : "v_offset").at(l).get<int64_t>();
        const int64_t rbb = L.at(kv == 0 ? "k_block_bytes" : "v_block_bytes").at(l).get<int64_t>();
        if (rbb != bb)
          throw KvTransferError("refused", "shm segment " + map.name() + ": layer " + std::to_string(l) + " blocks of " +
                                               std::to_string(rbb) + " bytes, here " + std::to_string(bb));
        for (int64_t i = 0; i < n; ++i) {
          const int64_t dst = to.at(i).get<int64_t>();
          if (dst < 0 || dst >= remote_blocks || off + (dst + 1) * bb > map.size())
            throw KvTransferError("protocol", "shm segment " + map.name() + ": block " + std::to_string(dst) + " out of range");
          // The one copy: this pool's block straight into the decode worker's block.
          std::memcpy(map.data() + off + dst * bb, cache_block(t, pool.num_blocks, from[first + i]),
                      static_cast<size_t>(bb));
        }
      }
    }
  }
  void receive_blocks(KvSocket&, infer::KvPool&, const std::vector<BlockId>&, int64_t, int64_t) override {}

 private:
  const infer::KvShmMapping& mapping(const std::string& name, int64_t bytes) {
    static std::mutex m;
    static std::map<std::string, std::unique_ptr<infer::KvShmMapping>> maps;  // kept for the process
    std::lock_guard<std::mutex> lock(m);
    auto& slot = maps[name];
    if (!slot || slot->size() < bytes) slot = std::make_unique<infer::KvShmMapping>(name, bytes);
    return *slot;
  }
};

}  // namespace

// ---- KvSocket -------------------------------------------------------------------------------

KvSocket::KvSocket(int fd, std::string peer) : fd_(fd), peer_(std::move(peer)) {}
KvSocket::KvSocket(KvSocket&& o) noexcept : fd_(o.fd_), peer_(std::move(o.peer_)) { o.fd_ = -1; }
KvSocket::~KvSocket() {
  if (fd_ >= 0) ::close(fd_);
}

KvSocket KvSocket::connect(const std::string& host, int port, double timeout_s, const std::string& peer) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  const std::string service = std::to_string(port);
  if (getaddrinfo(host.c_str(), service.c_str(), &hints, &res) != 0 || !res)
    throw KvTransferError("connect", peer + ": cannot resolve " + host);
  int fd = -1;
  std::string why = "no address";
  for (addrinfo* a = res; a; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype, a->ai_protocol);
    if (fd < 0) continue;
    set_timeouts(fd, timeout_s);
    if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) break;
    why = std::strerror(errno);
    ::close(fd);
    fd = -1;
  }
  freeaddrinfo(res);
  if (fd < 0) throw KvTransferError("connect", peer + ": cannot connect to " + host + ":" + service + ": " + why);
  return KvSocket(fd, peer);
}

void KvSocket::send_all(const void* data, size_t n) {
  const auto* p = static_cast<const uint8_t*>(data);
  while (n > 0) {
    const ssize_t w = ::send(fd_, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) throw KvTransferError("io", peer_ + ": send failed: " + (w < 0 ? std::strerror(errno) : "closed"));
    p += w;
    n -= static_cast<size_t>(w);
  }
}

void KvSocket::recv_all(void* data, size_t n) {
  auto* p = static_cast<uint8_t*>(data);
  while (n > 0) {
    const ssize_t r = ::recv(fd_, p, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) throw KvTransferError("io", peer_ + ": the connection closed mid-transfer");
    if (r < 0)
      throw KvTransferError("io", peer_ + ": receive failed: " +
                                      (errno == EAGAIN || errno == EWOULDBLOCK ? std::string("timed out") : std::strerror(errno)));
    p += r;
    n -= static_cast<size_t>(r);
  }
}

void KvSocket::send_frame(Type type, const void* data, size_t n) {
  FrameHeader h;
  h.type = type;
  h.length = n;
  h.checksum = XXH3_64bits(data, n);
  send_all(&h, sizeof h);
  if (n > 0) send_all(data, n);
}

void KvSocket::send_json(Type type, const json& j) {
  const std::string s = j.dump();
  send_frame(type, s.data(), s.size());
}

std::vector<uint8_t> KvSocket::recv_frame(Type expect) {
  FrameHeader h;
  recv_all(&h, sizeof h);
  if (h.magic != kMagic) throw KvTransferError("protocol", peer_ + ": not a KV transfer frame (bad magic)");
  const uint64_t limit = h.type == kLayer ? kMaxLayerFrame : kMaxJsonFrame;
  if (h.length > limit)
    throw KvTransferError("protocol", peer_ + ": a " + type_name(h.type) + " frame of " + std::to_string(h.length) +
                                          " bytes exceeds the limit " + std::to_string(limit));
  std::vector<uint8_t> payload(static_cast<size_t>(h.length));
  if (h.length > 0) recv_all(payload.data(), payload.size());
  if (XXH3_64bits(payload.data(), payload.size()) != h.checksum)
    throw KvTransferError("protocol", peer_ + ": checksum mismatch in a " + std::string(type_name(h.type)) + " frame");
  if (h.type == kError && expect != kError) {
    std::string msg(payload.begin(), payload.end());
    try {
      msg = json::parse(msg).at("error").get<std::string>();
    } catch (const std::exception&) {
    }
    throw KvTransferError("refused", peer_ + " refused the transfer: " + msg);
  }
  if (h.type != expect)
    throw KvTransferError("protocol", peer_ + ": got a " + std::string(type_name(h.type)) + " frame where a " +
                                          type_name(expect) + " frame was due");
  return payload;
}

json KvSocket::recv_json(Type expect) {
  const std::vector<uint8_t> p = recv_frame(expect);
  try {
    return json::parse(p.begin(), p.end());
  } catch (const std::exception&) {
    throw KvTransferError("protocol", peer_ + ": a " + std::string(type_name(expect)) + " frame is not JSON");
  }
}

std::unique_ptr<KvTransport> make_kv_transport(const std::string& name) {
  if (name == "tcp") return std::make_unique<TcpTransport>();
  if (name == "shm") return std::make_unique<ShmTransport>();
  fail("KV transport must be tcp or shm, got '", name, "'");
}

json shm_layout_json(const infer::KvShmLayout& L) {
  return {{"name", L.name},           {"bytes", L.bytes},         {"num_blocks", L.num_blocks},
          {"k_offset", L.k_offset},   {"v_offset", L.v_offset},   {"k_block_bytes", L.k_block_bytes},
          {"v_block_bytes", L.v_block_bytes}};
}

// ---- the sender -----------------------------------------------------------------------------

KvSendSession::KvSendSession(const KvTarget& target, const infer::KvPool& pool, int64_t transfer_id, int32_t adapter,
                             const std::vector<int32_t>& tokens, const std::vector<uint64_t>& hashes, double timeout_s)
    : target_(target), pool_(pool) {
  const auto t0 = Clock::now();
  const std::string peer = "decode worker " + target.worker;
  transport_ = make_kv_transport(target.transport);
  socket_ = std::make_unique<KvSocket>(KvSocket::connect(target.host, target.port, timeout_s, peer));
  n_ = static_cast<int64_t>(hashes.size());
  std::vector<int64_t> layer_bytes;
  for (int64_t l = 0; l < pool.num_layers(); ++l) layer_bytes.push_back(pool.layer_block_bytes(l));
  socket_->send_json(KvSocket::kHello,
                     {{"transfer_id", transfer_id},
                      {"transport", target.transport},
                      {"block_size", pool.block_size},
                      {"dtype", kernels::kv_cache_dtype_name(pool.dtype)},
                      {"layer_block_bytes", layer_bytes},
                      {"adapter", adapter},
                      {"tokens", std::vector<int32_t>(tokens.begin(), tokens.begin() + n_ * pool.block_size)},
                      {"hashes", hashes}});
  reply_ = socket_->recv_json(KvSocket::kReply);
  try {
    have_ = reply_.at("have").get<int64_t>();
    if (have_ < 0 || have_ > n_ || static_cast<int64_t>(reply_.at("blocks").size()) != n_ - have_)
      throw std::runtime_error("block counts");
  } catch (const std::exception&) {
    throw KvTransferError("protocol", peer + ": a malformed reply");
  }
  handshake_s_ = std::chrono::duration<double>(Clock::now() - t0).count();
}

KvSendSession::~KvSendSession() {
  if (sent_ || !socket_) return;
  try {  // best effort: the decode worker releases the reservation either way when we close
    socket_->send_json(KvSocket::kError, {{"error", "cancelled: the request needs no transfer"}});
  } catch (const std::exception&) {
  }
}

KvSendResult KvSendSession::send(const std::vector<BlockId>& blocks) {
  const auto t0 = Clock::now();
  const std::string peer = "decode worker " + target_.worker;
  if (static_cast<int64_t>(blocks.size()) != n_)
    throw KvTransferError("protocol", peer + ": " + std::to_string(blocks.size()) + " blocks to send for a hello of " +
                                          std::to_string(n_));
  sent_ = true;
  try {
    transport_->send_blocks(*socket_, pool_, blocks, have_, reply_);
  } catch (const KvTransferError&) {
    throw;
  } catch (const std::exception& ex) {
    throw KvTransferError("protocol", peer + ": " + ex.what());
  }
  const int64_t moved = n_ - have_;
  socket_->send_json(KvSocket::kCommit, {{"blocks", moved}, {"bytes", moved * pool_.block_bytes()}});
  socket_->recv_json(KvSocket::kAck);
  KvSendResult r;
  r.blocks = moved;
  r.bytes = moved * pool_.block_bytes();
  r.remote_cached = have_;
  r.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  r.transport = target_.transport;
  return r;
}

std::vector<uint64_t> chain_hashes(const std::vector<int32_t>& tokens, int64_t block_size, int32_t adapter) {
  std::vector<uint64_t> out;
  uint64_t parent = infer::BlockManager::root_hash(static_cast<uint64_t>(adapter + 1));
  for (int64_t b = 0; (b + 1) * block_size <= static_cast<int64_t>(tokens.size()); ++b) {
    parent = infer::BlockManager::hash_block(parent, tokens.data() + b * block_size, block_size);
    out.push_back(parent);
  }
  return out;
}

KvSendResult send_kv(const KvTarget& target, const infer::KvPool& pool, const KvExport& e, double timeout_s) {
  KvSendSession session(target, pool, e.transfer_id, e.adapter, e.tokens, e.hashes, timeout_s);
  KvSendResult r = session.send(e.blocks);
  r.seconds += session.handshake_seconds();
  return r;
}

// ---- the receiver ---------------------------------------------------------------------------

KvReceiver::KvReceiver(const std::string& host, int port, KvImportSink& sink, const infer::KvShmLayout* shm,
                       int64_t block_size)
    : sink_(sink), shm_(shm), block_size_(block_size) {
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  const std::string service = std::to_string(port);
  TESSERA_CHECK(getaddrinfo(host.c_str(), service.c_str(), &hints, &res) == 0 && res, "--kv-port: cannot resolve ",
                host);
  listen_fd_ = ::socket(res->ai_family, res->ai_socktype, res->ai_protocol);
  int one = 1;
  setsockopt(listen_fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  const bool ok = listen_fd_ >= 0 && ::bind(listen_fd_, res->ai_addr, res->ai_addrlen) == 0 &&
                  ::listen(listen_fd_, SOMAXCONN) == 0;
  freeaddrinfo(res);
  if (!ok) {
    const int e = errno;
    if (listen_fd_ >= 0) ::close(listen_fd_);
    fail("--kv-port: cannot listen on ", host, ":", port, ": ", std::strerror(e));
  }
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len);
  port_ = ntohs(ss.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port
                                         : reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  acceptor_ = std::thread([this] { accept_loop(); });
}

KvReceiver::~KvReceiver() { stop(); }

void KvReceiver::stop() {
  if (stopping_.exchange(true)) return;
  ::shutdown(listen_fd_, SHUT_RDWR);
  if (acceptor_.joinable()) acceptor_.join();
  ::close(listen_fd_);
  std::vector<Conn> conns;
  {
    std::lock_guard<std::mutex> lock(m_);
    conns.swap(conns_);
  }
  for (auto& c : conns) c.thread.join();
}

void KvReceiver::accept_loop() {
  while (!stopping_) {
    sockaddr_storage ss{};
    socklen_t len = sizeof ss;
    const int fd = ::accept(listen_fd_, reinterpret_cast<sockaddr*>(&ss), &len);
    if (fd < 0) {
      if (stopping_) break;
      if (errno == EINTR || errno == ECONNABORTED) continue;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    char addr[INET6_ADDRSTRLEN] = "?";
    if (ss.ss_family == AF_INET) inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&ss)->sin_addr, addr, sizeof addr);
    set_timeouts(fd, 30);
    std::lock_guard<std::mutex> lock(m_);
    for (auto it = conns_.begin(); it != conns_.end();) {  // join the finished ones
      if (it->done->load()) {
        it->thread.join();
        it = conns_.erase(it);
      } else {
        ++it;
      }
    }
    auto done = std::make_shared<std::atomic<bool>>(false);
    conns_.push_back({std::thread([this, fd, done, peer = std::string("prefill worker at ") + addr] {
                        serve(fd, peer);
                        *done = true;
                      }),
                      done});
  }
}

void KvReceiver::serve(int fd, std::string peer) {
  KvSocket s(fd, peer);
  int64_t id = -1;
  try {
    const json hello = s.recv_json(KvSocket::kHello);
    id = hello.at("transfer_id").get<int64_t>();
    const std::string transport_name = hello.at("transport").get<std::string>();
    infer::KvPool& pool = sink_.pool();
    auto refuse = [&](const std::string& why) {
      s.send_json(KvSocket::kError, {{"error", why}});
      id = -1;  // nothing reserved
      throw KvTransferError("refused", why);
    };
    if (transport_name == "shm" && !shm_) refuse("this worker's KV pool is not in shared memory (start it with --kv-transport shm)");
    if (transport_name != "shm" && transport_name != "tcp") refuse("unknown transport '" + transport_name + "'");
    if (hello.at("block_size").get<int64_t>() != block_size_)
      refuse("block size " + hello.at("block_size").dump() + " differs from this worker's " + std::to_string(block_size_));
    const auto layer_bytes = hello.at("layer_block_bytes").get<std::vector<int64_t>>();
    bool same = static_cast<int64_t>(layer_bytes.size()) == pool.num_layers();
    for (int64_t l = 0; same && l < pool.num_layers(); ++l) same = layer_bytes[l] == pool.layer_block_bytes(l);
    if (!same)
      refuse("KV block geometry differs (" + hello.at("dtype").get<std::string>() + ", " + std::to_string(layer_bytes.size()) +
             " layers): the workers must serve the same model with the same --kv-cache-dtype");
    const auto tokens = hello.at("tokens").get<std::vector<int32_t>>();
    const auto hashes = hello.at("hashes").get<std::vector<uint64_t>>();
    KvImportSink::Reservation r;
    try {
      r = sink_.reserve(id, tokens, hello.at("adapter").get<int32_t>(), hashes);
    } catch (const std::exception& e) {
      refuse(e.what());
    }
    const int64_t n = static_cast<int64_t>(r.blocks.size());
    std::vector<BlockId> fresh(r.blocks.begin() + r.have, r.blocks.end());
    json reply = {{"have", r.have}, {"blocks", fresh}};
    if (transport_name == "shm") reply["shm"] = shm_layout_json(*shm_);
    s.send_json(KvSocket::kReply, reply);
    const auto t_bytes = Clock::now();
    // The hello comes when the request arrives, the bytes once its prompt ran (queueing and
    // prefill): wait that long for them. A prefill worker that dies closes the connection,
    // which ends the wait at once.
    set_timeouts(s.fd(), kPrefillWait);
    make_kv_transport(transport_name)->receive_blocks(s, pool, fresh, r.have, n);
    s.recv_json(KvSocket::kCommit);
    const int64_t moved = n - r.have;
    sink_.commit(id, moved, moved * pool.block_bytes(), std::chrono::duration<double>(Clock::now() - t_bytes).count());
    id = -1;
    s.send_json(KvSocket::kAck, {{"blocks", moved}});
  } catch (const std::exception& e) {
    const bool cancelled = std::string(e.what()).find("cancelled:") != std::string::npos;  // needed none
    if (id >= 0) sink_.abort(id, !cancelled);
    if (!cancelled) TESSERA_LOG(kWarn, "KV transfer from ", peer, " failed: ", e.what());
  }
}

}  // namespace tessera::serve
