// A mixture-of-experts MLP layer (Mixtral's MixtralSparseMoeBlock; the routed experts of
// Qwen2-MoE and DeepSeek-V2/V3): a linear router scores every expert per token, the top k
// are kept (their softmax probabilities, renormalised to sum to 1 where the config says),
// and the token's output is the weighted sum of those experts' SwiGLU MLPs.
//
// The experts run as grouped GEMMs: the (token, choice) slots are sorted by expert once
// per layer, each expert's rows are gathered into one block and multiplied by its weights
// in one GEMM per linear (never a matmul per token), and the outputs are scattered back
// with their weights. Forward, backward, and the Switch / Mixtral load-balancing loss
// (transformers' load_balancing_loss_func, over the tokens of every MoE layer together).
// Internal to model/ (the block calls it where a layer is sparse).
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

#include "tessera/kernels/packed_b.h"
#include "tessera/tensor/tensor.h"

namespace tessera::model {

// How the router turns logits into scores: softmax over the experts (Mixtral, Qwen2-MoE,
// DeepSeek-V2) or each expert's sigmoid (DeepSeek-V3).
enum class MoeScoring { kSoftmax, kSigmoid };
// Group-limited routing (DeepSeek): the experts fall in n_group equal groups, each token
// keeps its topk_group best groups and chooses its top k inside them. A group's score is
// its best expert's (DeepSeek-V2 group_limited_greedy) or its two best experts' sum
// (DeepSeek-V3 noaux_tc), on the scores the choice is made on (biased, when a bias is).
enum class MoeGroupScore { kMax, kTop2Sum };

struct MoeSpec {
  int64_t num_experts = 8;
  int64_t top_k = 2;
  bool norm_topk_prob = true;  // renormalise the top-k probabilities (Mixtral: always)
  MoeScoring scoring = MoeScoring::kSoftmax;
  int64_t n_group = 1, topk_group = 1;
  MoeGroupScore group_score = MoeGroupScore::kMax;
  // The combine weights are multiplied by it (after the renormalisation), DeepSeek's
  // routed_scaling_factor.
  double routed_scaling_factor = 1.0;
  // Training only (inference never drops): each expert takes at most
  // ceil(capacity_factor x N k / E) of the N tokens' slots, first come (token order, then
  // choice) first served; the rest are dropped: computed by no expert, their share of the
  // token's output 0 (the residual carries the token on), as GShard / Switch do. 0: no
  // limit. Under expert parallelism each rank applies it to its own tokens.
  double capacity_factor = 0.0;
};

// One layer's experts, in Hugging Face's shapes stacked over the experts.
struct MoeWeights {
  Tensor router;   // (E, H): block_sparse_moe.gate.weight
  Tensor gate_up;  // (E, 2F, H): rows [0, F) experts.e.w1 (gate), [F, 2F) experts.e.w3 (up)
  Tensor down;     // (E, H, F): experts.e.w2
  // qwen2_moe: (1, H) shared_expert_gate (the shared expert itself is the layer's dense MLP,
  // run by the block); undefined otherwise. moe_forward does not read it.
  Tensor shared_gate;
  // (E) f32, optional: a per-expert bias added to the scores to choose the top k and
  // nowhere else (DeepSeek-V3's auxiliary-loss-free balancing, gate.e_score_correction_bias);
  // the combine weights stay the unbiased probabilities. Not trained by gradients.
  Tensor bias;
  // Native bf16 with packed weights (Model::set_packed_weights): each expert's gate_up and
  // down also in the layout oneDNN multiplies from, for the forward (x W^T) and the input
  // gradient (dy W). Empty otherwise.
  std::vector<kernels::PackedB> gate_up_fwd, gate_up_dx, down_fwd, down_dx;
};
// Fills those packed copies from gate_up and down (bf16), or drops them (on = false).
void pack_expert_weights(MoeWeights& w, bool on);

// Which experts each token went to, and how the slots are grouped by expert.
struct MoeRouting {
  int64_t tokens = 0, top_k = 0;
  Tensor scores;                  // (N, E) f32: softmax (or sigmoid) of the router logits
  std::vector<int32_t> expert;    // (N k): slot n k + j's expert (j-th best for token n)
  std::vector<float> weight;      // (N k): its combine weight
  // (N k): the kept slots sorted by expert (stable: by token), then the dropped ones.
  std::vector<int32_t> order;
  std::vector<int64_t> offsets;   // (E + 1): expert e's slots are order[offsets[e], offsets[e + 1])
  int64_t load(int64_t e) const { return offsets[e + 1] - offsets[e]; }
  int64_t kept() const { return offsets.empty() ? 0 : offsets.back(); }
  int64_t dropped() const { return tokens * top_k - kept(); }  // over capacity (MoeSpec)
};

// Expert parallelism: the experts are split over the ranks of an `ep` group (rank r holds
// experts [r E / ep, (r + 1) E / ep)); each rank routes its own tokens, sends each slot's
// row to the rank holding its expert and gets the expert's output back (an all-to-all of
// variable sizes each way, forward and backward). Implemented by parallel/ over a
// communicator (model/ does not see comm/).
class EpComm {
 public:
  virtual ~EpComm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  // in's first send_rows[0] rows to rank 0, the next send_rows[1] to rank 1, ...; returns
  // the rows this rank receives, in rank order, and their counts per rank.
  virtual Tensor all_to_allv(const Tensor& in, const std::vector<int64_t>& send_rows,
                             std::vector<int64_t>* recv_rows) = 0;
  // in (n_r, C) on each rank -> (sum of n_r, C): every rank's rows in rank order (an
  // all_to_allv sending this rank's rows to each).
  Tensor all_gather_rows(const Tensor& in);
};

// Inference under expert parallelism when every rank of the group holds the same tokens
// (lockstep serving): each rank routes its 1/ep of the rows through moe_forward (so each
// slot is computed once, by its expert's rank), and the outputs are all-gathered. `load`
// (E, optional) += the slots routed to each expert over all the rows.
void moe_forward_replicated(const MoeSpec& spec, const MoeWeights& w, const Tensor& h, Tensor& out,
                            EpComm& ep, std::vector<int64_t>* load);

// What moe_backward needs of its forward.
struct MoeSaved {
  MoeRouting routing;
  // x, u and a hold each local expert's rows as one block. With bf16 experts every block
  // starts on a multiple of kMoeRowPad rows and is padded with zero rows up to one
  // (pad_offsets), so the expert products have a few fixed row counts: oneDNN's AMX
  // kernels for a fixed shape run them 1.5-1.9x faster than its kernels for sizes given at
  // run time, and the primitives of a few padded counts stay cached.
  Tensor x;  // (Rp, H): the rows this rank's experts ran on, grouped by expert
  Tensor u;  // (Rp, 2F): gate | up
  Tensor a;  // (Rp, F): silu(gate) * up
  // Each of this rank's slots' expert output, before its weight: one process, the padded
  // blocks (kept sorted slot i's row is padded_row[i]); under expert parallelism, (N k, H)
  // in sorted-slot order.
  Tensor y;
  // Expert parallelism: rows sent to / received from each rank, the received rows' local
  // experts' block offsets, and which received row each grouped row is.
  std::vector<int64_t> send_rows, recv_rows, local_offsets;
  std::vector<int32_t> group;
  std::vector<int64_t> pad_offsets;  // local expert e's padded block: [pad_offsets[e], pad_offsets[e+1])
  std::vector<int32_t> padded_row;   // grouped row i (local_offsets' numbering) -> its row in x, u, a
  int64_t row_capacity = 0;          // rows allocated for each padded buffer (>= pad_offsets.back())
};
constexpr int64_t kMoeRowPad = 16;  // bf16 experts' row blocks (MoeSaved)

// out (N, H) = sum_j weight(n, j) * expert_{e(n, j)}(h[n]); h (N, H) f32. With `save`, what
// backward needs (else scratch). Weights f32 or bf16 (multiplied as kernels::matmul does).
// With `ep`, w holds this rank's E / ep experts (the router whole) and every rank of the
// group calls this together.
void moe_forward(const MoeSpec& spec, const MoeWeights& w, const Tensor& h, Tensor& out, MoeSaved* save,
                 EpComm* ep = nullptr);

// The busiest expert's load over the mean load (1: balanced); 0 when nothing was routed.
template <typename T>
double moe_load_imbalance(const std::vector<T>& load) {
  double total = 0, most = 0;
  for (T v : load) total += static_cast<double>(v), most = std::max(most, static_cast<double>(v));
  return total > 0 ? most * static_cast<double>(load.size()) / total : 0.0;
}

// Slots routed to each expert, counted across threads (serving: the engine reports them).
class ExpertLoad {
 public:
  explicit ExpertLoad(int64_t experts);
  void add(const MoeRouting& r);
  void add(const std::vector<int64_t>& load);  // slots per expert
  std::vector<int64_t> counts() const;

 private:
  std::unique_ptr<std::atomic<int64_t>[]> counts_;
  int64_t n_ = 0;
};

// The load-balancing loss over the T tokens of several layers, as transformers computes it:
// E * sum_e f_e P_e, f_e = (slots routed to e) / T (summed over the k choices), P_e the
// mean router probability of e over the T tokens.
struct MoeBalance {
  explicit MoeBalance(int64_t num_experts) : routed(num_experts, 0.0), prob(num_experts, 0.0) {}
  void add(const MoeRouting& r);  // one layer's forward
  double loss() const;
  // Per add() (each MoE layer in order): the slots routed to each expert; and the slots
  // dropped over capacity, all layers.
  std::vector<std::vector<double>> layer_routed;
  int64_t dropped = 0;
  // d(coef * loss) / d scores[n][e] for every token of every layer added: the same for
  // all n, coef E f_e / T.
  std::vector<float> score_grad(double coef) const;
  std::vector<double> routed, prob;  // per expert: slots routed, summed probability
  int64_t tokens = 0;

  // DeepSeek-V2's per-layer balancing loss (ModelConfig::aux_loss_alpha): each layer's
  // tokens in `groups` consecutive equal groups (seq_aux: the batch's sequences; else one
  // group), per group g and expert e the top-k slots choosing e (all of them, before any
  // capacity) and the summed scores. Filled by add(r, groups) with groups > 0.
  struct GroupStats {
    int64_t groups = 0, tokens_per_group = 0, top_k = 0;
    std::vector<double> slots, prob;  // (groups, E)
    // ce[g][e] at i = g E + e: the slots choosing e over their expected share, slots E / (T k).
    double ce(size_t i) const;
  };
  std::vector<GroupStats> layer_groups;
  void add(const MoeRouting& r, int64_t groups);
  // sum_layers mean_g sum_e ce[g][e] P[g][e], P = prob / tokens_per_group (modeling_deepseek.py
  // MoEGate's loss, seq_aux or not, before its alpha).
  double group_loss() const;
  // d(coef * that loss) / d scores[n][e] for layer i's tokens: (groups, E), the same for
  // every token of a group: coef ce[g][e] / (groups tokens_per_group).
  std::vector<float> group_score_grad(size_t layer, double coef) const;
};

// dh (N, H) = d out / d h (overwritten); grads' tensors (shaped as w's, f32) += the weight
// gradients. aux_score_grad (optional): added to each token's score gradient, (E) for every
// token (MoeBalance::score_grad) or (G, E) for G consecutive equal groups of the N tokens
// (MoeBalance::group_score_grad).
// With `ep` (as in the forward), grads holds this rank's experts' gradients from every
// rank's tokens routed to them.
void moe_backward(const MoeSpec& spec, const MoeWeights& w, const Tensor& h, const MoeSaved& saved,
                  const Tensor& dout, Tensor& dh, MoeWeights& grads,
                  const std::vector<float>* aux_score_grad = nullptr, EpComm* ep = nullptr);

}  // namespace tessera::model
