// The mixture-of-experts layer (model/moe.h) against PyTorch: transformers'
// MixtralSparseMoeBlock and load_balancing_loss_func transcribed in
// tests/parity/moe_reference.py, in float64. Two layers share one balancing loss (it is
// taken over every layer's tokens together), so its cross-layer form is checked too.
#include "tessera/model/moe.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <random>
#include <string>

#include "tessera/io/safetensors.h"
#include "test_util/run_command.h"
#include "test_util/tensor_diff.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;

Tensor randn(const Shape& shape, std::mt19937& rng, float sd) { return testing::random_normal(shape, rng, sd); }
using testing::max_rel_diff;

struct Case {
  int64_t experts, top_k, hidden, ffn, tokens;
  bool norm_topk_prob;
  double coef;
  bool bias = false;      // a selection bias (DeepSeek-V3's noaux_tc)
  double capacity = 0.0;  // MoeSpec::capacity_factor
  // DeepSeek's gate: sigmoid scores, groups (n_group, topk_group, top-2 sums), scaling.
  bool sigmoid = false;
  int64_t n_group = 1, topk_group = 1;
  bool top2 = false;
  double scaling = 1.0;
  // DeepSeek-V2's per-layer balancing loss (MoeBalance::group_loss): alpha > 0 trains it over
  // ds_groups sequences (sequence-wise), or the whole batch (ds_groups 1, batch-wise).
  double ds_alpha = 0.0;
  int64_t ds_groups = 1;
  bool ds_seq_aux = true;
  bool zero_dout = false;  // the loss is the balancing loss alone: its gradient is all there is
  // bf16 experts (products in bf16, each expert's rows in a padded block; moe.h MoeSaved)
  // against the reference on the same bf16-rounded weights.
  bool bf16 = false;
};

void check_against_pytorch(const Case& c) {
  SCOPED_TRACE("E " + std::to_string(c.experts) + " k " + std::to_string(c.top_k) +
               (c.norm_topk_prob ? " renormalised" : " raw") + " coef " + std::to_string(c.coef) +
               (c.bias ? " biased" : "") + " capacity " + std::to_string(c.capacity) + (c.sigmoid ? " sigmoid" : "") +
               " groups " + std::to_string(c.topk_group) + "/" + std::to_string(c.n_group) + " scaling " +
               std::to_string(c.scaling) + (c.bf16 ? " bf16 experts" : ""));
  const int layers = 2;
  std::mt19937 rng(static_cast<uint32_t>(c.experts * 131 + c.top_k * 7 + c.tokens));
  model::MoeSpec spec;
  spec.num_experts = c.experts;
  spec.top_k = c.top_k;
  spec.norm_topk_prob = c.norm_topk_prob;
  spec.capacity_factor = c.capacity;
  spec.scoring = c.sigmoid ? model::MoeScoring::kSigmoid : model::MoeScoring::kSoftmax;
  spec.n_group = c.n_group;
  spec.topk_group = c.topk_group;
  spec.group_score = c.top2 ? model::MoeGroupScore::kTop2Sum : model::MoeGroupScore::kMax;
  spec.routed_scaling_factor = c.scaling;
  const int64_t E = c.experts, H = c.hidden, F = c.ffn, N = c.tokens;
  std::vector<model::MoeWeights> w(layers);
  std::vector<Tensor> h(layers), dout(layers);
  std::vector<std::pair<std::string, Tensor>> in;
  for (int L = 0; L < layers; ++L) {
    const std::string p = std::to_string(L) + ".";
    w[L].router = randn({E, H}, rng, c.sigmoid ? 0.1f : 0.5f);  // (sigmoid: scores away from 0 and 1)
    Tensor w1 = randn({E, F, H}, rng, 0.2f), w3 = randn({E, F, H}, rng, 0.2f);
    w[L].down = randn({E, H, F}, rng, 0.2f);
    if (c.bf16)
      for (Tensor* t : {&w1, &w3, &w[L].down}) *t = t->to(DType::kBF16).to(DType::kF32);
    w[L].gate_up = Tensor::empty({E, 2 * F, H}, DType::kF32);
    for (int64_t e = 0; e < E; ++e) {
      w[L].gate_up.select(0, e).slice(0, 0, F).copy_from(w1.select(0, e));
      w[L].gate_up.select(0, e).slice(0, F, 2 * F).copy_from(w3.select(0, e));
    }
    h[L] = randn({N, H}, rng, 1.f);
    dout[L] = randn({N, H}, rng, 1.f);
    if (c.zero_dout) dout[L].zero();
    in.insert(in.end(), {{p + "h", h[L]}, {p + "gate", w[L].router}, {p + "w1", w1}, {p + "w3", w3},
                         {p + "w2", w[L].down}, {p + "dout", dout[L]}});
    if (c.bf16) {  // the reference has the rounded values in f32
      w[L].gate_up = w[L].gate_up.to(DType::kBF16);
      w[L].down = w[L].down.to(DType::kBF16);
    }
    if (c.bias) {  // large enough to overrule the scores now and then (sigmoid: keeps them > 0)
      w[L].bias = randn({E}, rng, c.sigmoid ? 0.03f : 0.3f);
      in.emplace_back(p + "bias", w[L].bias);
    }
  }
  const fs::path dir = fs::temp_directory_path() / ("tessera_moe_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const std::string in_path = (dir / "in.safetensors").string(), out_path = (dir / "out.safetensors").string();
  io::save_safetensors(in_path, in,
                       {{"top_k", std::to_string(c.top_k)},
                        {"norm_topk_prob", c.norm_topk_prob ? "true" : "false"},
                        {"coef", std::to_string(c.coef)},
                        {"capacity", std::to_string(c.capacity)},
                        {"scoring", c.sigmoid ? "sigmoid" : "softmax"},
                        {"n_group", std::to_string(c.n_group)},
                        {"topk_group", std::to_string(c.topk_group)},
                        {"group_score", c.top2 ? "top2" : "max"},
                        {"scaling", std::to_string(c.scaling)},
                        {"layers", std::to_string(layers)},
                        {"ds_alpha", std::to_string(c.ds_alpha)},
                        {"ds_groups", std::to_string(c.ds_groups)},
                        {"ds_seq_aux", c.ds_seq_aux ? "true" : "false"}});
  const auto r = testing::run_command(std::string(TESSERA_PYTHON) + " " + TESSERA_SOURCE_DIR +
                                      "/tests/parity/moe_reference.py " + in_path + " " + out_path);
  ASSERT_EQ(r.code, 0) << r.out;
  const auto ref = io::SafetensorsFile::open(out_path);

  // Forward both layers, the balance over both, then backward. bf16 experts: their inputs
  // and activations are rounded to bf16 before each product, as autocast's are.
  const float tol = c.bf16 ? 2e-2f : 1e-5f;
  std::vector<model::MoeSaved> saved(layers);
  model::MoeBalance balance(E);
  for (int L = 0; L < layers; ++L) {
    const std::string p = std::to_string(L) + ".";
    Tensor out = Tensor::empty({N, H}, DType::kF32);
    model::moe_forward(spec, w[L], h[L], out, &saved[L]);
    EXPECT_LT(max_rel_diff(out, ref->get(p + "out")), tol) << "layer " << L;
    // The same experts, in the same order of preference.
    const Tensor experts = ref->get(p + "experts");
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < c.top_k; ++j)
        ASSERT_EQ(saved[L].routing.expert[n * c.top_k + j], experts.data<int32_t>()[n * c.top_k + j])
            << "layer " << L << " token " << n << " choice " << j;
    if (c.capacity > 0) {
      EXPECT_EQ(saved[L].routing.dropped(), ref->get(p + "dropped").data<int32_t>()[0]) << "layer " << L;
      EXPECT_GT(saved[L].routing.dropped(), 0) << "layer " << L;  // the limit is in play
    }
    if (c.ds_alpha > 0)
      balance.add(saved[L].routing, c.ds_seq_aux ? c.ds_groups : 1);
    else
      balance.add(saved[L].routing);
  }
  if (c.ds_alpha > 0) {
    EXPECT_NEAR(c.ds_alpha * balance.group_loss(), ref->get("ds_aux").data<float>()[0], 1e-6);
  }
  const bool plain = !c.bias && c.capacity == 0 && !c.sigmoid && c.n_group == 1 && c.scaling == 1.0;
  if (plain) {
    EXPECT_NEAR(balance.loss(), ref->get("aux").data<float>()[0], 1e-5);
  }
  const std::vector<float> mixtral_aux = balance.score_grad(c.coef);
  for (int L = 0; L < layers; ++L) {
    const std::string p = std::to_string(L) + ".";
    model::MoeWeights g;
    g.router = Tensor::zeros({E, H}, DType::kF32);
    g.gate_up = Tensor::zeros({E, 2 * F, H}, DType::kF32);
    g.down = Tensor::zeros({E, H, F}, DType::kF32);
    Tensor dh = Tensor::empty({N, H}, DType::kF32);
    const std::vector<float> aux = c.ds_alpha > 0 ? balance.group_score_grad(L, c.ds_alpha) : mixtral_aux;
    model::moe_backward(spec, w[L], h[L], saved[L], dout[L], dh, g, &aux);
    EXPECT_LT(max_rel_diff(dh, ref->get(p + "dh")), tol) << "layer " << L;
    EXPECT_LT(max_rel_diff(g.router, ref->get(p + "dgate")), tol) << "layer " << L;
    EXPECT_LT(max_rel_diff(g.gate_up.slice(1, 0, F), ref->get(p + "dw1")), tol) << "layer " << L;
    EXPECT_LT(max_rel_diff(g.gate_up.slice(1, F, 2 * F), ref->get(p + "dw3")), tol) << "layer " << L;
    EXPECT_LT(max_rel_diff(g.down, ref->get(p + "dw2")), tol) << "layer " << L;
  }
  fs::remove_all(dir);
}

TEST(Moe, ForwardRoutingAndEveryGradientMatchTransformersMixtral) {
  // Mixtral's top-2 of 8 with the balancing loss; a wider top-k; Qwen2-MoE's unnormalised
  // weights (norm_topk_prob false); more experts than some get tokens.
  for (const Case& c : {Case{8, 2, 32, 48, 40, true, 0.02}, Case{8, 3, 24, 40, 33, true, 0.5},
                        Case{6, 2, 32, 24, 17, false, 0.0}, Case{16, 2, 16, 24, 5, true, 0.1}})
    check_against_pytorch(c);
}

// DeepSeek's gate against a transcription of its MoEGate: V2's group-limited greedy
// (softmax, 8 experts in 4 groups, the 2 best groups by their best expert, scaled weights
// unnormalised) and V3's noaux_tc (sigmoid, selection bias, groups by their two best
// experts' sum, renormalised then scaled).
TEST(Moe, DeepSeekGatesMatchTheReference) {
  Case v2{8, 2, 32, 48, 40, false, 0.0};
  v2.n_group = 4, v2.topk_group = 2, v2.scaling = 16.0;
  Case v3{16, 4, 32, 24, 37, true, 0.0, true};
  v3.sigmoid = true, v3.n_group = 4, v3.topk_group = 2, v3.top2 = true, v3.scaling = 2.5;
  Case v3_capacity = v3;
  v3_capacity.capacity = 1.0;
  for (const Case& c : {v2, v3, v3_capacity}) check_against_pytorch(c);
}

// DeepSeek-V2's balancing loss, per layer, against its MoEGate's training branch: over 4
// sequences of 10 tokens (seq_aux), over the whole batch (seq_aux false), and with the
// plain greedy gate over 5 sequences; then the first two with the layers' outputs out of
// the loss, so that the router's and the inputs' gradients are the balancing loss's alone.
TEST(Moe, DeepSeekV2BalancingLossMatchesTheReference) {
  Case seq{8, 2, 32, 48, 40, false, 0.0};
  seq.n_group = 4, seq.topk_group = 2, seq.scaling = 16.0;
  seq.ds_alpha = 0.3, seq.ds_groups = 4;
  Case batch = seq;
  batch.ds_seq_aux = false;
  Case greedy{6, 2, 24, 32, 40, true, 0.0};
  greedy.ds_alpha = 0.3, greedy.ds_groups = 5;
  Case seq_alone = seq, batch_alone = batch;
  seq_alone.zero_dout = batch_alone.zero_dout = true;
  for (const Case& c : {seq, batch, greedy, seq_alone, batch_alone}) check_against_pytorch(c);
}

// DeepSeek-V3's selection bias (chooses, does not weigh) and an expert capacity (training:
// the slots past it dropped, first come first served) against the PyTorch reference.
TEST(Moe, SelectionBiasAndCapacityMatchTheReference) {
  for (const Case& c : {Case{8, 2, 32, 48, 40, true, 0.0, true, 0.0}, Case{8, 2, 32, 48, 40, true, 0.0, false, 1.0},
                        Case{6, 3, 24, 40, 33, false, 0.0, true, 1.25}, Case{4, 1, 16, 24, 9, false, 0.0, false, 0.5}})
    check_against_pytorch(c);
}

// bf16 experts run in padded row blocks (moe.h MoeSaved): row counts that are not
// multiples of the padding, dropped slots (capacity), experts without tokens, a wide top-k.
TEST(Moe, Bf16ExpertsInPaddedBlocksMatchTheReference) {
  Case mixtral{8, 2, 32, 48, 40, true, 0.02}, capacity{8, 2, 32, 48, 40, true, 0.0, false, 1.0},
      sparse{16, 2, 16, 24, 5, true, 0.1}, wide{8, 3, 24, 40, 33, true, 0.5};
  for (Case* c : {&mixtral, &capacity, &sparse, &wide}) {
    c->bf16 = true;
    check_against_pytorch(*c);
  }
}

TEST(Moe, ExpertsWithoutTokensAndBadShapesAreHandled) {
  std::mt19937 rng(3);
  model::MoeSpec spec;
  spec.num_experts = 4;
  spec.top_k = 1;
  model::MoeWeights w;
  w.router = Tensor::zeros({4, 8}, DType::kF32);
  w.router.data<float>()[2 * 8] = 10.f;  // expert 2 wins for tokens with positive first feature
  w.gate_up = randn({4, 12, 8}, rng, 0.3f);
  w.down = randn({4, 8, 6}, rng, 0.3f);
  Tensor h = randn({5, 8}, rng, 1.f);
  for (int64_t n = 0; n < 5; ++n) h.data<float>()[n * 8] = 1.f + static_cast<float>(n);
  Tensor out = Tensor::empty({5, 8}, DType::kF32);
  model::MoeSaved saved;
  model::moe_forward(spec, w, h, out, &saved);
  EXPECT_EQ(saved.routing.load(2), 5);
  EXPECT_EQ(saved.routing.load(0) + saved.routing.load(1) + saved.routing.load(3), 0);
  for (int64_t n = 0; n < 5; ++n) EXPECT_FLOAT_EQ(saved.routing.weight[n], 1.f);
  spec.top_k = 5;
  EXPECT_THROW(model::moe_forward(spec, w, h, out, nullptr), Error);
  spec.top_k = 1;
  w.down = Tensor::zeros({4, 8, 5}, DType::kF32);
  EXPECT_THROW(model::moe_forward(spec, w, h, out, nullptr), Error);
}

}  // namespace
}  // namespace tessera
