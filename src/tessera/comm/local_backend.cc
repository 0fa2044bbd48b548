// The `local` backend (local_backend.h): mailboxes matched by (src, dst, tag) in posting
// order, one copy per message (by whichever side waits first), waits that block on condition
// variables under the watchdog, split through point to point, and gather-to-all backend
// collectives.
#include "tessera/comm/local_backend.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "tessera/base/error.h"
#include "tessera/comm/algorithms.h"
#include "tessera/comm/watchdog.h"

namespace tessera::comm {

namespace {

constexpr int kSplitTag = 1 << 30;  // above the collectives' tags

// One message. It lives in the destination's mailbox until both sides are posted; then
// the first side to wait copies send buffer -> receive buffer (kCopying), once.
struct Transfer {
  enum State { kPosted, kMatched, kCopying, kDone, kFailed };
  int src = 0, tag = 0;
  const void* send_data = nullptr;
  int64_t send_bytes = 0;
  void* recv_data = nullptr;
  int64_t recv_bytes = 0;
  State state = kPosted;
  std::string error;
};

struct Mailbox {  // messages to one rank; guards every Transfer addressed to it
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::shared_ptr<Transfer>> sends;  // posted sends not yet received
  std::deque<std::shared_ptr<Transfer>> recvs;  // posted receives not yet matched
};

struct Group;

// Every group of one run_local; a rank that throws fails the world, waking every wait.
struct World {
  std::mutex mu;
  std::atomic<bool> failed{false};
  std::string reason;
  std::vector<std::weak_ptr<Group>> groups;

  void add(const std::shared_ptr<Group>& g) {
    std::lock_guard<std::mutex> lk(mu);
    groups.push_back(g);
  }
  void fail(const std::string& why);
  std::string why() {
    std::lock_guard<std::mutex> lk(mu);
    return reason;
  }
};

struct Group {
  Group(std::shared_ptr<World> w, int n) : world(std::move(w)), node_ids(n, 0), boxes(n) {}
  std::shared_ptr<World> world;
  std::vector<int> node_ids;
  std::vector<Mailbox> boxes;
};

void World::fail(const std::string& why) {
  std::vector<std::shared_ptr<Group>> live;
  {
    std::lock_guard<std::mutex> lk(mu);
    if (failed) return;
    reason = why;
    failed = true;
    for (auto& w : groups)
      if (auto g = w.lock()) live.push_back(g);
  }
  for (auto& g : live)
    for (Mailbox& b : g->boxes) {
      std::lock_guard<std::mutex> lk(b.mu);  // a waiter is either asleep or sees `failed`
      b.cv.notify_all();
    }
}

void erase_from(std::deque<std::shared_ptr<Transfer>>& q, const Transfer* t) {
  for (auto it = q.begin(); it != q.end(); ++it)
    if (it->get() == t) {
      q.erase(it);
      return;
    }
}

class LocalRequest : public Request {
 public:
  // rank: the caller's rank; peer: the other side.
  LocalRequest(std::shared_ptr<Group> g, int box, std::shared_ptr<Transfer> t, bool is_recv,
               int rank, int peer, int tag, int64_t bytes, double timeout)
      : g_(std::move(g)),
        box_(box),
        t_(std::move(t)),
        is_recv_(is_recv),
        rank_(rank),
        peer_(peer),
        tag_(tag),
        bytes_(bytes),
        timeout_(timeout) {}

  ~LocalRequest() override {
    if (finished_) return;
    Mailbox& b = g_->boxes[box_];
    std::unique_lock<std::mutex> lk(b.mu);
    withdraw(lk);
  }

  // Either side completes a matched message: the first to wait (or test) copies, so a
  // rank never depends on its peer calling wait() to make progress.
  void wait() override {
    if (!finished_) {
      Mailbox& b = g_->boxes[box_];
      std::unique_lock<std::mutex> lk(b.mu);
      World& w = *g_->world;
      block(lk, [&] { return t_->state != Transfer::kPosted || w.failed; });
      if (t_->state == Transfer::kMatched) {
        copy(lk);
      } else if (t_->state == Transfer::kCopying) {  // the other side is copying: brief
        b.cv.wait(lk, [&] { return t_->state != Transfer::kCopying; });
      } else if (t_->state == Transfer::kPosted) {  // the world failed before a match
        withdraw(lk);
        error_ = "local backend: " + w.why();
      }
      if (t_->state == Transfer::kFailed && error_.empty()) error_ = t_->error;
      finished_ = true;
    }
    if (!error_.empty()) throw Error(error_);
  }

  bool test() override {
    if (finished_) return true;
    Mailbox& b = g_->boxes[box_];
    std::unique_lock<std::mutex> lk(b.mu);
    if (t_->state == Transfer::kMatched) copy(lk);
    return t_->state == Transfer::kDone || t_->state == Transfer::kFailed;
  }

 private:
  // Waits for pred under the watchdog: the current collective's deadline, or a scope of
  // this wait's own for point to point called outside collectives.
  template <typename Pred>
  void block(std::unique_lock<std::mutex>& lk, Pred pred) {
    if (pred()) return;
    std::optional<WatchdogScope> own;
    WatchdogScope* watch = WatchdogScope::current();
    if (!watch) watch = &own.emplace("wait on " + what(), timeout_);
    if (g_->boxes[box_].cv.wait_until(lk, watch->deadline(), pred)) return;
    withdraw(lk);
    finished_ = true;
    lk.unlock();
    watch->expire();  // logs, runs the timeout handler (abort by default), throws
  }

  // Checks sizes, then copies from the send buffer to the receive buffer without
  // holding the lock (both stay valid: neither side can withdraw while kCopying).
  void copy(std::unique_lock<std::mutex>& lk) {
    Transfer& t = *t_;
    if (t.send_bytes != t.recv_bytes) {
      t.state = Transfer::kFailed;
      t.error = tessera::detail::concat("local backend: message from rank ", t.src, " to rank ",
                                        box_, " (tag ", t.tag, "): send of ", t.send_bytes,
                                        " bytes, receive of ", t.recv_bytes,
                                        " bytes (ranks disagree on a message size)");
      g_->boxes[box_].cv.notify_all();
      return;
    }
    t.state = Transfer::kCopying;
    lk.unlock();
    if (t.recv_bytes > 0) std::memcpy(t.recv_data, t.send_data, t.recv_bytes);
    lk.lock();
    t.state = Transfer::kDone;
    g_->boxes[box_].cv.notify_all();
  }

  // Takes this side out of the exchange (timeout, failure, destroyed unfinished) so that
  // no one touches its buffer afterwards.
  void withdraw(std::unique_lock<std::mutex>& lk) {
    Mailbox& b = g_->boxes[box_];
    Transfer& t = *t_;
    if (t.state == Transfer::kPosted) {
      erase_from(is_recv_ ? b.recvs : b.sends, &t);
    } else if (t.state == Transfer::kCopying) {  // the other side is using our buffer
      b.cv.wait(lk, [&] { return t.state != Transfer::kCopying; });
    }
    if (t.state == Transfer::kPosted || t.state == Transfer::kMatched) {
      t.state = Transfer::kFailed;  // the peer's wait reports the root cause if there is one
      t.error = g_->world->failed ? "local backend: " + g_->world->why()
                                  : "local backend: the other side of " + what() + " gave up";
      b.cv.notify_all();
    }
  }

  // Formatted only when needed (a timeout or a failure), not per message.
  std::string what() const {
    return std::string(is_recv_ ? "recv from" : "send to") + " rank " + std::to_string(peer_) +
           " (tag " + std::to_string(tag_) + ", " + std::to_string(bytes_) + " bytes) on rank " +
           std::to_string(rank_) + "/" + std::to_string(g_->boxes.size()) + " (backend local)";
  }

  std::shared_ptr<Group> g_;
  int box_;
  std::shared_ptr<Transfer> t_;
  bool is_recv_;
  int rank_, peer_, tag_;
  int64_t bytes_;
  double timeout_;
  bool finished_ = false;
  std::string error_;
};

class LocalCommunicator : public Communicator {
 public:
  LocalCommunicator(std::shared_ptr<Group> g, int rank) : g_(std::move(g)), rank_(rank) {}
  ~LocalCommunicator() override { drain_async(); }

  int rank() const override { return rank_; }
  int size() const override { return static_cast<int>(g_->boxes.size()); }
  std::string backend() const override { return "local"; }
  int node_id() const override { return g_->node_ids[rank_]; }

  RequestPtr isend(const void* data, int64_t bytes, int dst, int tag) override {
    check_peer("isend", dst, bytes, tag);
    Mailbox& b = g_->boxes[dst];
    std::shared_ptr<Transfer> t;
    {
      std::lock_guard<std::mutex> lk(b.mu);
      for (auto it = b.recvs.begin(); it != b.recvs.end(); ++it)
        if ((*it)->src == rank_ && (*it)->tag == tag) {
          t = *it;
          b.recvs.erase(it);
          break;
        }
      if (!t) {
        t = std::make_shared<Transfer>();
        t->src = rank_;
        t->tag = tag;
        b.sends.push_back(t);
      }
      t->send_data = data;
      t->send_bytes = bytes;
      if (t->state == Transfer::kPosted && t->recv_data != nullptr) {
        t->state = Transfer::kMatched;
        b.cv.notify_all();
      }
    }
    return std::make_shared<LocalRequest>(g_, dst, t, false, rank_, dst, tag, bytes,
                                          timeout_seconds_);
  }

  RequestPtr irecv(void* data, int64_t bytes, int src, int tag) override {
    check_peer("irecv", src, bytes, tag);
    Mailbox& b = g_->boxes[rank_];
    std::shared_ptr<Transfer> t;
    {
      std::lock_guard<std::mutex> lk(b.mu);
      for (auto it = b.sends.begin(); it != b.sends.end(); ++it)
        if ((*it)->src == src && (*it)->tag == tag) {
          t = *it;
          b.sends.erase(it);
          break;
        }
      const bool matched = t != nullptr;
      if (!t) {
        t = std::make_shared<Transfer>();
        t->src = src;
        t->tag = tag;
        b.recvs.push_back(t);
      }
      static char empty;  // a non-null destination marks the receive as posted
      t->recv_data = data ? data : &empty;
      t->recv_bytes = bytes;
      if (matched) {
        t->state = Transfer::kMatched;
        b.cv.notify_all();  // the sender may be waiting to copy
      }
    }
    return std::make_shared<LocalRequest>(g_, rank_, t, true, rank_, src, tag, bytes,
                                          timeout_seconds_);
  }

  std::unique_ptr<Communicator> split(int colour, int key) override;

 protected:
  void backend_all_reduce(Tensor& t, ReduceOp op) override;
  void backend_reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) override;
  void backend_all_gather(const Tensor& in, Tensor& out) override;

 private:
  void check_peer(const char* what, int peer, int64_t bytes, int tag) {
    TESSERA_CHECK(peer >= 0 && peer < size(), what, ": rank ", peer,
                  " out of range for a group of ", size(), " ranks");
    TESSERA_CHECK(bytes >= 0 && tag >= 0, what, ": bytes ", bytes, " and tag ", tag,
                  " must be >= 0");
    if (g_->world->failed) fail("local backend: ", g_->world->why());
  }

  std::shared_ptr<Group> g_;
  int rank_;
};

std::unique_ptr<Communicator> LocalCommunicator::split(int colour, int key) {
  drain_async();
  const int N = size();
  WatchdogScope watch(tessera::detail::concat("split (colour ", colour, ", key ", key, ") on rank ",
                                              rank_, "/", N, " (backend local)"),
                      timeout_seconds_);
  std::vector<int64_t> ck(2 * N);  // (colour, key) of every rank
  ck[2 * rank_] = colour;
  ck[2 * rank_ + 1] = key;
  algo::ring_all_gather(*this, kSplitTag, ck.data(), N, 2 * sizeof(int64_t));
  if (colour < 0) return nullptr;
  std::vector<int> members;
  for (int j = 0; j < N; ++j)
    if (ck[2 * j] == colour) members.push_back(j);
  std::stable_sort(members.begin(), members.end(),
                   [&](int a, int b) { return ck[2 * a + 1] < ck[2 * b + 1]; });
  const int index =
      static_cast<int>(std::find(members.begin(), members.end(), rank_) - members.begin());
  // The first member makes the new group and hands every other member a reference.
  std::shared_ptr<Group> g;
  if (index == 0) {
    g = std::make_shared<Group>(g_->world, static_cast<int>(members.size()));
    for (size_t i = 0; i < members.size(); ++i) g->node_ids[i] = g_->node_ids[members[i]];
    g_->world->add(g);
    std::vector<uintptr_t> handles(members.size());
    std::vector<RequestPtr> sends;
    for (size_t i = 1; i < members.size(); ++i) {
      handles[i] = reinterpret_cast<uintptr_t>(new std::shared_ptr<Group>(g));
      sends.push_back(isend(&handles[i], sizeof(uintptr_t), members[i], kSplitTag));
    }
    for (auto& s : sends) s->wait();
  } else {
    uintptr_t handle = 0;
    recv(&handle, sizeof handle, members[0], kSplitTag);
    auto* held = reinterpret_cast<std::shared_ptr<Group>*>(handle);
    g = *held;
    delete held;
  }
  auto c = std::make_unique<LocalCommunicator>(g, index);
  c->set_timeout(timeout_seconds_);
  return c;
}

// The backend's own collectives: every rank sends its data straight to every other rank
// (one round of messages) and reduces in rank order, so all ranks get identical bits.
void LocalCommunicator::backend_all_reduce(Tensor& t, ReduceOp op) {
  const int N = size(), tag = collective_tag();
  const int64_t n = t.numel(), bytes = static_cast<int64_t>(t.nbytes());
  std::vector<RequestPtr> sends;
  for (int j = 0; j < N; ++j)
    if (j != rank_) sends.push_back(isend(t.raw_data(), bytes, j, tag));
  std::vector<char> acc(bytes), scratch(bytes);
  for (int j = 0; j < N; ++j) {
    const void* src = t.raw_data();
    if (j != rank_) {
      recv(j == 0 ? acc.data() : scratch.data(), bytes, j, tag);
      src = j == 0 ? acc.data() : scratch.data();
    }
    if (j == 0) {
      if (src != acc.data() && bytes > 0) std::memcpy(acc.data(), src, bytes);
    } else {
      algo::reduce_into(acc.data(), src, n, t.dtype(), op);
    }
  }
  for (auto& s : sends) s->wait();
  if (bytes > 0) std::memcpy(t.raw_data(), acc.data(), bytes);
}

void LocalCommunicator::backend_reduce_scatter(const Tensor& in, Tensor& out, ReduceOp op) {
  const int N = size(), tag = collective_tag();
  const int64_t elem = dtype_size(in.dtype());
  const char* src = static_cast<const char*>(in.raw_data());
  std::vector<RequestPtr> sends;
  for (int j = 0; j < N; ++j) {
    const ChunkRange ch = chunk_range(in.numel(), N, j);
    if (j != rank_) sends.push_back(isend(src + ch.begin * elem, ch.size() * elem, j, tag));
  }
  const ChunkRange mine = chunk_range(in.numel(), N, rank_);
  const int64_t bytes = mine.size() * elem;
  std::vector<char> scratch(bytes);
  char* acc = static_cast<char*>(out.raw_data());
  for (int j = 0; j < N; ++j) {
    const char* part = src + mine.begin * elem;
    if (j != rank_) {
      recv(scratch.data(), bytes, j, tag);
      part = scratch.data();
    }
    if (j == 0) {
      if (bytes > 0) std::memcpy(acc, part, bytes);
    } else {
      algo::reduce_into(acc, part, mine.size(), in.dtype(), op);
    }
  }
  for (auto& s : sends) s->wait();
}

void LocalCommunicator::backend_all_gather(const Tensor& in, Tensor& out) {
  const int N = size(), tag = collective_tag();
  const int64_t elem = dtype_size(in.dtype());
  char* dst = static_cast<char*>(out.raw_data());
  std::vector<RequestPtr> reqs;
  for (int j = 0; j < N; ++j) {
    if (j == rank_) continue;
    const ChunkRange ch = chunk_range(out.numel(), N, j);
    reqs.push_back(irecv(dst + ch.begin * elem, ch.size() * elem, j, tag));
    reqs.push_back(isend(in.raw_data(), in.numel() * elem, j, tag));
  }
  const ChunkRange mine = chunk_range(out.numel(), N, rank_);
  if (mine.size() > 0) std::memcpy(dst + mine.begin * elem, in.raw_data(), mine.size() * elem);
  for (auto& r : reqs) r->wait();
}

}  // namespace

void run_local(int n, int ranks_per_node, const std::function<void(Communicator&)>& fn) {
  TESSERA_CHECK(n >= 1, "run_local: need at least 1 rank, got ", n);
  TESSERA_CHECK(ranks_per_node >= 1, "run_local: ranks_per_node must be >= 1, got ",
                ranks_per_node);
  auto world = std::make_shared<World>();
  auto g = std::make_shared<Group>(world, n);
  for (int i = 0; i < n; ++i) g->node_ids[i] = i / ranks_per_node;
  world->add(g);
  std::mutex mu;
  std::exception_ptr first, first_root;
  std::vector<std::thread> threads;
  for (int i = 0; i < n; ++i)
    threads.emplace_back([&, i] {
      try {
        LocalCommunicator c(g, i);
        fn(c);
      } catch (const std::exception& e) {
        {
          // A peer's "gave up" can land before the failing rank's own error: report the
          // root cause when one exists.
          std::lock_guard<std::mutex> lk(mu);
          if (!first) first = std::current_exception();
          const std::string what = e.what();
          const bool secondary = what.find(" gave up") != std::string::npos ||
                                 what.rfind("local backend: rank ", 0) == 0;
          if (!first_root && !secondary) first_root = std::current_exception();
        }
        world->fail(tessera::detail::concat("rank ", i, " failed: ", e.what()));
      }
    });
  for (auto& t : threads) t.join();
  if (first_root) std::rethrow_exception(first_root);
  if (first) std::rethrow_exception(first);
}

void run_local(int n, const std::function<void(Communicator&)>& fn) { run_local(n, n, fn); }

std::unique_ptr<Communicator> self_communicator() {
  auto world = std::make_shared<World>();
  auto g = std::make_shared<Group>(world, 1);
  g->node_ids[0] = 0;
  world->add(g);
  return std::make_unique<LocalCommunicator>(g, 0);
}

}  // namespace tessera::comm
