// Multi-LoRA serving at the model layer (Model::set_lora_bank + forward_tokens' row adapters):
// one batch mixing the rows of three adapters (of different ranks, scales and target modules)
// and of the base model gives each sequence the logits of that sequence run alone with
// set_lora(its adapter), or with no adapter for the base rows; and what the bank refuses.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "test_util/lora_adapters.h"
#include "test_util/throws.h"
#include "tessera/model/lora.h"
#include "tessera/model/model.h"

namespace tessera {
namespace {

using model::LoraConfig;
using model::LoraModule;
using model::LoraWeights;
using model::Model;

// Causal attention of whole sequences laid out one after another (each prefilled from
// position 0 in one call): the plain loops, so the batched and the per-sequence passes run
// the same arithmetic per sequence.
class DenseSeqAttention : public model::KvAttention {
 public:
  DenseSeqAttention(std::vector<int64_t> lengths, float scale) : lengths_(std::move(lengths)), scale_(scale) {}
  void attend(int64_t, const Tensor& q, const Tensor& k, const Tensor& v, Tensor& out) override {
    const int64_t Hq = q.size(1), Hkv = k.size(1), D = q.size(2), group = Hq / Hkv;
    int64_t b = 0;
    for (const int64_t len : lengths_) {
      for (int64_t i = 0; i < len; ++i)
        for (int64_t h = 0; h < Hq; ++h) {
          const float* qi = q.data<float>() + (b + i) * q.stride(0) + h * q.stride(1);
          std::vector<double> s(static_cast<size_t>(i + 1));
          double mx = -1e30;
          for (int64_t j = 0; j <= i; ++j) {
            const float* kj = k.data<float>() + (b + j) * k.stride(0) + (h / group) * k.stride(1);
            double dot = 0;
            for (int64_t d = 0; d < D; ++d) dot += static_cast<double>(qi[d]) * kj[d];
            s[j] = dot * scale_;
            mx = std::max(mx, s[j]);
          }
          double sum = 0;
          for (auto& x : s) sum += (x = std::exp(x - mx));
          float* o = out.data<float>() + (b + i) * out.stride(0) + h * out.stride(1);
          for (int64_t d = 0; d < D; ++d) {
            double acc = 0;
            for (int64_t j = 0; j <= i; ++j)
              acc += s[j] * v.data<float>()[(b + j) * v.stride(0) + (h / group) * v.stride(1) + d];
            o[d] = static_cast<float>(acc / sum);
          }
        }
      b += len;
    }
  }

 private:
  std::vector<int64_t> lengths_;
  float scale_;
};

// Logits of every token of `seqs`, run as one flattened batch.
Tensor run_batch(const Model& m, const std::vector<std::vector<int32_t>>& seqs,
                 const std::vector<int32_t>* seq_adapters) {
  std::vector<int64_t> lengths;
  std::vector<int32_t> ids, pos, rows_adapter;
  for (size_t s = 0; s < seqs.size(); ++s) {
    lengths.push_back(static_cast<int64_t>(seqs[s].size()));
    for (size_t i = 0; i < seqs[s].size(); ++i) {
      ids.push_back(seqs[s][i]);
      pos.push_back(static_cast<int32_t>(i));
      if (seq_adapters) rows_adapter.push_back((*seq_adapters)[s]);
    }
  }
  const auto N = static_cast<int64_t>(ids.size());
  Tensor t_ids = Tensor::empty({N}, DType::kI32), t_pos = Tensor::empty({N}, DType::kI32);
  std::copy(ids.begin(), ids.end(), t_ids.data<int32_t>());
  std::copy(pos.begin(), pos.end(), t_pos.data<int32_t>());
  std::vector<int64_t> rows(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) rows[i] = i;
  DenseSeqAttention kv(lengths, m.config().attention_scale());
  return m.forward_tokens(t_ids, t_pos, kv, rows, false, nullptr, seq_adapters ? &rows_adapter : nullptr);
}

// Largest |a - b| over the largest |b|.
double rel_err(const Tensor& a, const Tensor& b) {
  double d = 0, s = 0;
  for (int64_t i = 0; i < b.numel(); ++i) {
    d = std::max(d, static_cast<double>(std::fabs(a.data<float>()[i] - b.data<float>()[i])));
    s = std::max(s, static_cast<double>(std::fabs(b.data<float>()[i])));
  }
  return d / s;
}

Model tiny_llama() {
  auto c = model::ModelConfig::named_shape("tiny");
  c.num_layers = 3;
  return Model::random(c, DType::kF32, 11);
}

std::vector<LoraWeights> three_adapters(const model::ModelConfig& c) {
  LoraConfig a, b, d;
  a.rank = 4, a.alpha = 8;
  a.targets = {LoraModule::kQ, LoraModule::kK, LoraModule::kV, LoraModule::kO,
               LoraModule::kGate, LoraModule::kUp, LoraModule::kDown};
  b.rank = 8, b.alpha = 16;
  b.targets = {LoraModule::kQ, LoraModule::kV};
  d.rank = 2, d.alpha = 4, d.rslora = true;
  d.targets = {LoraModule::kO, LoraModule::kGate, LoraModule::kDown};
  std::vector<LoraWeights> out;
  out.push_back(testing::trained_lora(c, a, 1, 0.2f));
  out.push_back(testing::trained_lora(c, b, 2, 0.2f));
  out.push_back(testing::trained_lora(c, d, 3, 0.2f));
  return out;
}

TEST(MultiLora, MixedBatchEqualsEachAdapterAlone) {
  Model m = tiny_llama();
  const auto& c = m.config();
  const std::vector<LoraWeights> adapters = three_adapters(c);
  // Sequences in an order that leaves adapter 0's rows apart (gathered) and the others'
  // contiguous (in place), with base rows in between.
  const std::vector<int32_t> seq_adapter = {0, -1, 1, 2, 2, 0, -1};
  std::mt19937 rng(7);
  std::vector<std::vector<int32_t>> seqs;
  for (size_t s = 0; s < seq_adapter.size(); ++s) {
    // Sequence 2 has more than 64 rows: its products keep the matmuls' own threading; the
    // others' run as one task each per module (lora_ops.cc).
    std::vector<int32_t> t(s == 2 ? 70 : 3 + s % 4 * 2);
    for (auto& x : t) x = static_cast<int32_t>(rng() % c.vocab_size);
    seqs.push_back(t);
  }
  m.set_lora_bank({&adapters[0], &adapters[1], &adapters[2]});
  const Tensor mixed = run_batch(m, seqs, &seq_adapter);
  m.set_lora_bank({});

  int64_t row = 0;
  for (size_t s = 0; s < seqs.size(); ++s) {
    const int32_t a = seq_adapter[s];
    m.set_lora(a >= 0 ? &adapters[a] : nullptr);
    const Tensor alone = run_batch(m, {seqs[s]}, nullptr);
    m.set_lora(nullptr);
    const auto n = static_cast<int64_t>(seqs[s].size());
    const Tensor got = mixed.slice(0, row, row + n).contiguous();
    EXPECT_LT(rel_err(got, alone), 1e-5) << "sequence " << s << " (adapter " << a << ")";
    // The adapter changes the logits: the comparison could fail.
    if (a >= 0) {
      const Tensor base = run_batch(m, {seqs[s]}, nullptr);
      EXPECT_GT(rel_err(base, alone), 1e-3) << "sequence " << s;
    }
    row += n;
  }
}

TEST(MultiLora, BankOfOneEqualsSetLoraAndRowsWithoutAdapterAreTheBase) {
  Model m = tiny_llama();
  const std::vector<LoraWeights> adapters = three_adapters(m.config());
  const std::vector<std::vector<int32_t>> seqs = {{5, 9, 2, 77, 31}};
  m.set_lora(&adapters[1]);
  const Tensor single = run_batch(m, seqs, nullptr);
  m.set_lora(nullptr);
  const Tensor base = run_batch(m, seqs, nullptr);
  m.set_lora_bank({&adapters[1]});
  const std::vector<int32_t> one = {0}, none = {-1};
  EXPECT_LT(rel_err(run_batch(m, seqs, &one), single), 1e-6);
  EXPECT_LT(rel_err(run_batch(m, seqs, &none), base), 1e-6);
}

TEST(MultiLora, RefusesBadIndicesAndMismatchedAdapters) {
  Model m = tiny_llama();
  const std::vector<LoraWeights> adapters = three_adapters(m.config());
  m.set_lora_bank({&adapters[0]});
  const std::vector<std::vector<int32_t>> seqs = {{1, 2, 3}};
  const std::vector<int32_t> bad = {1};
  EXPECT_TRUE(testing::throws_error([&] { run_batch(m, seqs, &bad); }, {"names adapter 1; the bank holds 1"}));
  // An adapter made for another shape of model.
  auto other = model::ModelConfig::named_shape("tiny");
  const LoraWeights wrong = LoraWeights::init(other, adapters[0].config, 1);  // 2 layers, not 3
  EXPECT_TRUE(testing::throws_error([&] { m.set_lora_bank({&adapters[0], &wrong}); },
                                    {"LoRA bank adapter 1: LoRA adapters for 2 layers"}));
  // Row adapters and set_lora's adapter at once.
  m.set_lora(&adapters[0]);
  const std::vector<int32_t> zero = {0};
  EXPECT_TRUE(testing::throws_error([&] { run_batch(m, seqs, &zero); }, {"use one or the other"}));
}

}  // namespace
}  // namespace tessera
