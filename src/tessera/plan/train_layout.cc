// tessera train --layout (train_layout.h).
#include "tessera/plan/train_layout.h"

#include <sstream>

#include "tessera/base/error.h"

namespace tessera::plan {

void apply_layout(const Layout& l, train::TrainConfig& c) {
  auto& p = c.parallel;
  // The planner's dp counts every data-parallel rank, its ep ranks included; the trainer's
  // mesh has ep as its own axis inside dp, so [parallel] dp is the replicas of each expert.
  TESSERA_CHECK(l.dp % l.ep == 0, "--layout ", l.str(), ": ep = ", l.ep, " does not divide dp = ", l.dp,
                " (tessera train runs ep inside dp, not across the cp ranks)");
  p.dp = l.dp / l.ep, p.tp = l.tp, p.pp = l.pp, p.cp = l.cp, p.ep = l.ep;
  p.zero_stage = l.zero;
  p.sequence_parallel = l.sp;
  p.offload = l.offload;
  p.pp_schedule = schedule_name(l.schedule);
  p.pp_virtual_stages = l.vpp;
  c.training.activation_checkpointing = recompute_name(l.recompute);
  const int64_t global = c.data.batch_size * c.data.grad_accum;
  const int64_t micro = static_cast<int64_t>(l.dp) * l.micro_batch;
  TESSERA_CHECK(global % micro == 0, "--layout ", l.str(), ": the global batch of ", global,
                " sequences (data.batch_size x grad_accum) does not split into micro-batches of dp x mb = ",
                micro);
  c.data.batch_size = micro;
  c.data.grad_accum = global / micro;
}

int64_t layout_devices(const std::string& spec, int64_t world) {
  if (world > 0) return world;
  int64_t product = 1;  // one process: the axes the spelling gives (parse_layout checks them)
  std::stringstream ss(spec);
  for (std::string item; std::getline(ss, item, ',');) {
    const size_t eq = item.find('=');
    if (eq == std::string::npos) continue;  // parse_layout names the bad item
    const std::string key = item.substr(0, eq);
    if (key != "dp" && key != "tp" && key != "pp" && key != "cp") continue;
    try {
      const int64_t v = std::stoll(item.substr(eq + 1));
      if (v >= 1 && v <= (int64_t{1} << 20)) product *= v;
    } catch (...) {
    }
  }
  return product;
}

}  // namespace tessera::plan
