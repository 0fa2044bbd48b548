// The serving metrics of mixture-of-experts models: tokens routed to each expert (a
// Prometheus counter per expert, following the engine's cumulative counts) and the
// busiest expert's load over the mean.
#include <gtest/gtest.h>

#include <string>

#include "tessera/infer/engine.h"
#include "tessera/serve/metrics.h"

namespace tessera::serve {
namespace {

TEST(ServerMetrics, ExpertLoadAndImbalanceOfMixtureOfExpertsModels) {
  ServerMetrics m("moe");
  infer::EngineStats s;
  EXPECT_EQ(m.render().find("tessera_moe_load_imbalance"), std::string::npos) << "dense models have none";
  s.expert_tokens = {3, 1, 0, 4};
  m.update_engine(s);
  std::string text = m.render();
  EXPECT_NE(text.find("tessera_moe_expert_tokens_total{expert=\"3\",model_name=\"moe\"} 4"), std::string::npos) << text;
  EXPECT_NE(text.find("tessera_moe_expert_tokens_total{expert=\"2\",model_name=\"moe\"} 0"), std::string::npos) << text;
  EXPECT_NE(text.find("tessera_moe_load_imbalance{model_name=\"moe\"} 2"), std::string::npos) << text;  // 4 / (8 / 4)
  s.expert_tokens = {5, 3, 2, 6};  // cumulative: the counters add the increase
  m.update_engine(s);
  text = m.render();
  EXPECT_NE(text.find("tessera_moe_expert_tokens_total{expert=\"0\",model_name=\"moe\"} 5"), std::string::npos) << text;
  EXPECT_NE(text.find("tessera_moe_load_imbalance{model_name=\"moe\"} 1.5"), std::string::npos) << text;  // 6 / 4
}

}  // namespace
}  // namespace tessera::serve
