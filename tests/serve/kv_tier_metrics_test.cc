// The tiered KV cache's Prometheus metrics follow the engine's cumulative counts (counters add
// the increase) and its gauges.
#include <gtest/gtest.h>

#include <string>

#include "tessera/infer/engine.h"
#include "tessera/serve/metrics.h"

namespace tessera::serve {
namespace {

TEST(ServerMetrics, KvTierCountersAndGauges) {
  ServerMetrics m("m");
  infer::EngineStats s;
  s.kv_host_hit_blocks = 5;
  s.kv_disk_hit_blocks = 2;
  s.kv_offloaded_blocks = 9;
  s.swapped_preemptions = 1;
  s.kv_swap_out_blocks = 4;
  s.kv_swap_in_blocks = 3;
  s.kv_bytes_to_tiers = 1000;
  s.kv_bytes_from_tiers = 700;
  s.kv_host_blocks_total = 8;
  s.kv_host_blocks_used = 2;
  s.kv_disk_files = 11;
  m.update_engine(s);
  s.kv_host_hit_blocks = 7;  // cumulative: +2
  m.update_engine(s);
  const std::string text = m.render();
  for (const char* line :
       {"tessera_kv_host_tier_hits_total{model_name=\"m\"} 7", "tessera_kv_disk_tier_hits_total{model_name=\"m\"} 2",
        "tessera_kv_offloaded_blocks_total{model_name=\"m\"} 9",
        "tessera_num_swapped_preemptions_total{model_name=\"m\"} 1",
        "tessera_kv_swapped_out_blocks_total{model_name=\"m\"} 4",
        "tessera_kv_swapped_in_blocks_total{model_name=\"m\"} 3",
        "tessera_kv_tier_bytes_out_total{model_name=\"m\"} 1000", "tessera_kv_tier_bytes_in_total{model_name=\"m\"} 700",
        "tessera_kv_host_tier_blocks_total{model_name=\"m\"} 8", "tessera_kv_host_tier_usage_perc{model_name=\"m\"} 0.25",
        "tessera_kv_disk_tier_blocks{model_name=\"m\"} 11"})
    EXPECT_NE(text.find(line), std::string::npos) << line << "\n" << text;
}

}  // namespace
}  // namespace tessera::serve
