// Context parallelism: each sequence split over the ranks of a `cp` group, every rank
// running the whole model on its own tokens, the attention the only place where tokens
// meet. Two methods (as in Megatron-LM / torchtitan):
//
//   ring     (Liu et al., Ring Attention): the queries stay; the key/value blocks travel
//            around the ring, each rank attending its queries to every block that reaches
//            it, the partial results combined with their log-sum-exp (the online softmax).
//            Causal load balancing: of 2 cp chunks per sequence, rank r holds chunks r and
//            2 cp - 1 - r, so every rank does the same work. The next block's transfer runs
//            while the current one is attended. Backward sends dK / dV around the ring
//            with the blocks, back to the rank that owns them.
//   ulysses  (DeepSpeed-Ulysses): an all-to-all turns the sequence split into a head split
//            (each rank: the whole sequence, heads / cp of the heads), attention runs as
//            usual, and a second all-to-all turns it back. Needs the (kv) heads divisible
//            by cp. Rank r holds the contiguous chunk r of each sequence.
//
// The model layer sees the group through CpComm (parallel/ implements it over a
// communicator). Internal to model/ and the trainer (which cuts the batch).
#pragma once
#include <cstdint>
#include <memory>
#include <string>

#include "tessera/kernels/attention.h"
#include "tessera/tensor/tensor.h"

namespace tessera::model {

enum class CpMethod { kRing, kUlysses };
CpMethod parse_cp_method(const std::string& name, const std::string& where);
const char* cp_method_name(CpMethod m);

class CpComm {
 public:
  virtual ~CpComm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // Ulysses: in (size x k) f32 contiguous -> out (size x k): block j of in goes to rank j,
  // block j of out came from rank j.
  virtual void all_to_all(const Tensor& in, Tensor& out) = 0;
  // Ring: sends `send` to rank + 1 and receives as many bytes from rank - 1 into `recv`
  // (both contiguous) in the background; `channel` (0-7) keeps concurrent shifts apart.
  class Pending {
   public:
    virtual ~Pending() = default;
    virtual void wait() = 0;
  };
  virtual std::unique_ptr<Pending> ring_shift(const Tensor& send, Tensor& recv, int channel) = 0;

  // Accounting the attention fills in (reset by whoever reads it): seconds computing
  // attention, seconds waiting for transfers (the exposed communication), bytes sent.
  double attention_s = 0, wait_s = 0;
  int64_t bytes_sent = 0;
};

// The global position of each of this rank's T_local tokens in a sequence of
// size x T_local tokens (the order the rank holds them in).
std::vector<int64_t> cp_positions(CpMethod method, int rank, int size, int64_t local_tokens);
// This rank's tokens of a (B, T) batch: (B, T / size), contiguous (ring: chunks r and
// 2 size - 1 - r side by side). T must divide by size (ulysses) or 2 size (ring).
Tensor cp_local_tokens(const Tensor& batch, CpMethod method, int rank, int size);

// What the backward needs beyond the layer's own q, k, v, out and lse.
struct CpSaved {
  // Ulysses: the head-split whole-sequence q, k, v (B, T, heads / cp, D) and the lse
  // (B, heads / cp, T). The layer then keeps no q, k, v of its own (its backward reads
  // these), and the head-split output comes back from the layer's own output (one more
  // tensor in the backward's all-to-all): the same bytes as one process's / cp.
  // Ring: nothing (the rank's own lse is the layer's).
  Tensor q, k, v, lse;
  int64_t bytes() const;
};

// Causal attention over this rank's tokens: q (B, Tl, Hq, D), k, v (B, Tl, Hkv, D) in
// this rank's token order (views as kernels::attention_forward takes them, RoPE applied
// at the global positions); out (B, Tl, Hq, D) written; lse (B, Hq, Tl) set (ring) for
// the backward; `saved` filled (ulysses). Every rank of the group calls it together.
void cp_attention_forward(CpComm& cp, CpMethod method, const Tensor& q, const Tensor& k, const Tensor& v,
                          Tensor& out, Tensor& lse, CpSaved& saved, float scale);
// The gradients dq, dk, dv (overwritten; views like q, k, v) from dout (B, Tl, Hq, D).
// Ulysses reads q, k, v for their shapes only (`saved` holds the values).
void cp_attention_backward(CpComm& cp, CpMethod method, const Tensor& q, const Tensor& k, const Tensor& v,
                           const Tensor& out, const Tensor& lse, const CpSaved& saved, const Tensor& dout,
                           Tensor& dq, Tensor& dk, Tensor& dv, float scale);

}  // namespace tessera::model
