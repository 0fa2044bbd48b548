// Context parallelism's transfers (context_parallel.h).
#include "tessera/parallel/context_parallel.h"

#include "tessera/base/error.h"

namespace tessera::parallel {
namespace {

constexpr int kRingTag = 0x7c000;  // + channel; callers' tags are below 2^20

class RingPending : public model::CpComm::Pending {
 public:
  RingPending(comm::RequestPtr s, comm::RequestPtr r) : send_(std::move(s)), recv_(std::move(r)) {}
  ~RingPending() override {
    try {
      wait();
    } catch (...) {  // reported where it was waited for
    }
  }
  void wait() override {
    if (send_) send_->wait();
    if (recv_) recv_->wait();
    send_ = recv_ = nullptr;
  }

 private:
  comm::RequestPtr send_, recv_;
};

}  // namespace

std::unique_ptr<model::CpComm::Pending> CommCp::ring_shift(const Tensor& send, Tensor& recv, int channel) {
  TESSERA_CHECK(send.is_contiguous() && recv.is_contiguous() && send.nbytes() == recv.nbytes(),
                "context parallelism: ring_shift needs contiguous buffers of equal size");
  TESSERA_CHECK(channel >= 0 && channel < 8, "context parallelism: ring channel ", channel, " outside [0, 8)");
  const int P = group_.size(), r = group_.rank();
  const auto bytes = static_cast<int64_t>(send.nbytes());
  auto rq = group_.irecv(recv.raw_data(), bytes, (r - 1 + P) % P, kRingTag + channel);
  auto sq = group_.isend(send.raw_data(), bytes, (r + 1) % P, kRingTag + channel);
  return std::make_unique<RingPending>(std::move(sq), std::move(rq));
}

}  // namespace tessera::parallel
