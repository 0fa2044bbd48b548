// Layout parsing and validity checks; bytes per element by precision and optimizer.
#include "tessera/plan/layout.h"

#include <sstream>

#include "tessera/base/error.h"

namespace tessera::plan {

const char* recompute_name(Recompute r) {
  switch (r) {
    case Recompute::kNone: return "none";
    case Recompute::kSelective: return "selective";
    case Recompute::kFull: return "full";
  }
  return "?";
}

const char* schedule_name(Schedule s) {
  switch (s) {
    case Schedule::k1F1B: return "1f1b";
    case Schedule::kGPipe: return "gpipe";
    case Schedule::kInterleaved: return "interleaved";
  }
  return "?";
}

const char* precision_name(Precision p) {
  switch (p) {
    case Precision::kBf16: return "bf16";
    case Precision::kFp16: return "fp16";
    case Precision::kFp8: return "fp8";
    case Precision::kFp32: return "fp32";
  }
  return "?";
}

const char* optimizer_name(Optimizer o) {
  switch (o) {
    case Optimizer::kAdamW: return "adamw";
    case Optimizer::kSgdMomentum: return "sgd";
    case Optimizer::kMuon: return "muon";
  }
  return "?";
}

Precision parse_precision(const std::string& s) {
  if (s == "bf16") return Precision::kBf16;
  if (s == "fp16") return Precision::kFp16;
  if (s == "fp8") return Precision::kFp8;
  if (s == "fp32") return Precision::kFp32;
  fail("--precision: '", s, "' is not one of bf16, fp16, fp8, fp32");
}

Optimizer parse_optimizer(const std::string& s) {
  if (s == "adamw" || s == "adam") return Optimizer::kAdamW;
  if (s == "sgd" || s == "sgd-momentum") return Optimizer::kSgdMomentum;
  if (s == "muon") return Optimizer::kMuon;
  fail("--optimizer: '", s, "' is not one of adamw, sgd, muon");
}

const char* compute_dtype(Precision p) {
  switch (p) {
    case Precision::kBf16: return "bf16";
    case Precision::kFp16: return "fp16";
    case Precision::kFp8: return "fp8";
    case Precision::kFp32: return "fp32";
  }
  return "bf16";
}

void TrainSetup::validate() const {
  TESSERA_CHECK(devices >= 1, "--gpus must be at least 1, got ", devices);
  TESSERA_CHECK(seq >= 1, "--seq must be at least 1, got ", seq);
  TESSERA_CHECK(global_batch >= 1, "--global-batch must be at least 1 sequence, got ", global_batch);
  TESSERA_CHECK(tokens >= 0, "--tokens must not be negative");
  TESSERA_CHECK(device_mtbf_hours > 0, "--mtbf-hours must be positive");
  TESSERA_CHECK(checkpoint_interval_s >= 0 && checkpoint_stall_s >= 0 && restart_s >= 0,
                "checkpoint interval, checkpoint stall and restart time must not be negative");
}

StateBytes state_bytes(const TrainSetup& s, const Hardware& hw) {
  StateBytes b;
  const bool sixteen = s.precision != Precision::kFp32;
  // Mixed precision (Micikevicius et al. 2018; ZeRO paper section 3): 16-bit weights and
  // gradients, fp32 master weights; fp8 training keeps bf16 weights and casts per GEMM.
  b.weight = sixteen ? 2 : 4;
  b.grad = sixteen ? 2 : 4;
  b.master = sixteen ? 4 : 0;
  b.activation = sixteen ? 2 : 4;
  b.matmul_activation = b.activation;
  if (hw.store_16bit_as_f32) {
    b.weight = b.grad = b.activation = 4;
    b.matmul_activation = sixteen && hw.native_bf16_activations ? 2 : 4;
  }
  switch (s.optimizer) {
    case Optimizer::kAdamW: b.moments = 8; break;         // m and v in fp32
    case Optimizer::kSgdMomentum: b.moments = 4; break;   // momentum in fp32
    case Optimizer::kMuon: b.moments = 8; break;          // AdamW for non-matrix params
  }
  b.muon_moments = 4;
  return b;
}

std::string parallel_table_toml(const Layout& l, const TrainSetup& s) {
  std::ostringstream os;
  os << "# tessera plan train: layout " << l.str() << "\n"
     << "# It implies, in [data]: batch_size = " << int64_t{l.dp} * l.micro_batch
     << " (dp x micro-batch), grad_accum = " << l.micro_batches(s) << ", seq_len = " << s.seq
     << "; in [training]: activation_checkpointing = \"" << recompute_name(l.recompute) << "\"";
  if (l.schedule != Schedule::k1F1B || l.vpp > 1)
    os << "; pipeline schedule " << schedule_name(l.schedule) << " with " << l.vpp << " virtual stages";
  os << ".\n";
  if (l.ep > 1 && l.dp % l.ep == 0)
    os << "# [parallel] dp counts the replicas of each expert: the layout's dp " << l.dp << " / ep " << l.ep << ".\n";
  else if (l.ep > 1)
    os << "# ep " << l.ep << " spans the cp ranks (it does not divide dp " << l.dp
       << "): tessera train runs ep inside dp only, so this table does not run yet.\n";
  os << "[parallel]\n"
     << "dp = " << (l.dp % l.ep == 0 ? l.dp / l.ep : l.dp) << "\ntp = " << l.tp << "\npp = " << l.pp << "\ncp = " << l.cp
     << "\nep = " << l.ep << "\nzero_stage = " << l.zero
     << "\nsequence_parallel = " << (l.sp ? "true" : "false")
     << "\noffload = " << (l.offload ? "true" : "false") << "\n";
  if (l.pp > 1)
    os << "pp_schedule = \"" << schedule_name(l.schedule) << "\"\npp_virtual_stages = " << l.vpp << "\n";
  return os.str();
}

std::string Layout::str() const {
  std::ostringstream os;
  os << "dp=" << dp << ",tp=" << tp << ",pp=" << pp << ",cp=" << cp << ",ep=" << ep
     << ",zero=" << zero << ",mb=" << micro_batch << ",recompute=" << recompute_name(recompute)
     << ",sp=" << (sp ? "on" : "off");
  if (schedule != Schedule::k1F1B) os << ",sched=" << schedule_name(schedule);
  if (vpp > 1) os << ",vpp=" << vpp;
  if (offload) os << ",offload=on";
  return os.str();
}

namespace {

int64_t parse_int(const std::string& key, const std::string& v) {
  size_t used = 0;
  int64_t x = 0;
  try {
    x = std::stoll(v, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  TESSERA_CHECK(!v.empty() && used == v.size() && x >= 0, "--layout: ", key, "=", v,
                " is not a non-negative integer");
  return x;
}

bool parse_on_off(const std::string& key, const std::string& v) {
  if (v == "on" || v == "true" || v == "1") return true;
  if (v == "off" || v == "false" || v == "0") return false;
  fail("--layout: ", key, "=", v, " must be on or off");
}

}  // namespace

Layout parse_layout(const std::string& text, int64_t devices) {
  Layout l;
  bool dp_given = false;
  std::stringstream ss(text);
  for (std::string item; std::getline(ss, item, ',');) {
    const size_t eq = item.find('=');
    TESSERA_CHECK(eq != std::string::npos && eq > 0, "--layout: '", item,
                  "' is not key=value (keys: dp tp pp cp ep zero mb recompute sp sched vpp offload)");
    const std::string k = item.substr(0, eq), v = item.substr(eq + 1);
    auto positive = [&]() {
      const int64_t x = parse_int(k, v);
      TESSERA_CHECK(x >= 1 && x <= (int64_t{1} << 30), "--layout: ", k, "=", v, " must be at least 1");
      return x;
    };
    if (k == "dp") l.dp = static_cast<int>(positive()), dp_given = true;
    else if (k == "tp") l.tp = static_cast<int>(positive());
    else if (k == "pp") l.pp = static_cast<int>(positive());
    else if (k == "cp") l.cp = static_cast<int>(positive());
    else if (k == "ep") l.ep = static_cast<int>(positive());
    else if (k == "mb") l.micro_batch = positive();
    else if (k == "vpp") l.vpp = static_cast<int>(positive());
    else if (k == "zero") {
      const int64_t z = parse_int(k, v);
      TESSERA_CHECK(z <= 3, "--layout: zero=", v, " must be 0, 1, 2 or 3");
      l.zero = static_cast<int>(z);
    } else if (k == "recompute") {
      if (v == "none") l.recompute = Recompute::kNone;
      else if (v == "selective") l.recompute = Recompute::kSelective;
      else if (v == "full") l.recompute = Recompute::kFull;
      else fail("--layout: recompute=", v, " must be none, selective or full");
    } else if (k == "sp") {
      l.sp = parse_on_off(k, v);
    } else if (k == "offload") {
      l.offload = parse_on_off(k, v);
    } else if (k == "sched" || k == "schedule") {
      if (v == "1f1b") l.schedule = Schedule::k1F1B;
      else if (v == "gpipe") l.schedule = Schedule::kGPipe;
      else if (v == "interleaved") l.schedule = Schedule::kInterleaved;
      else fail("--layout: sched=", v, " must be 1f1b, gpipe or interleaved");
    } else {
      fail("--layout: unknown key '", k, "' (keys: dp tp pp cp ep zero mb recompute sp sched vpp offload)");
    }
  }
  if (!dp_given) {
    const int64_t rest = int64_t{l.tp} * l.pp * l.cp;
    TESSERA_CHECK(devices % rest == 0, "--layout: tp=", l.tp, " x pp=", l.pp, " x cp=", l.cp,
                  " = ", rest, " does not divide --gpus ", devices);
    l.dp = static_cast<int>(devices / rest);
  }
  if (l.schedule == Schedule::kInterleaved && l.vpp == 1) l.vpp = 2;
  if (l.vpp > 1) l.schedule = Schedule::kInterleaved;
  return l;
}

std::string layout_problem(const ModelSpec& m, const Hardware& hw, const TrainSetup& s,
                           const Layout& l) {
  std::ostringstream os;
  if (l.devices() != s.devices) {
    os << "dp=" << l.dp << " x tp=" << l.tp << " x pp=" << l.pp << " x cp=" << l.cp << " = "
       << l.devices() << " devices, but --gpus is " << s.devices;
    return os.str();
  }
  if (m.heads % l.tp != 0) {
    os << "tp=" << l.tp << " does not divide the " << m.heads << " attention heads of " << m.name;
    return os.str();
  }
  if (!m.mla && m.kv_heads % l.tp != 0) {
    os << "tp=" << l.tp << " does not divide the " << m.kv_heads << " key/value heads of "
       << m.name;
    return os.str();
  }
  const bool has_dense = m.dense_layers > 0 || !m.is_moe();
  if (has_dense && m.ffn % l.tp != 0) {
    os << "tp=" << l.tp << " does not divide the MLP width " << m.ffn << " of " << m.name;
    return os.str();
  }
  if (m.is_moe() && m.moe_ffn % l.tp != 0) {
    os << "tp=" << l.tp << " does not divide the expert MLP width " << m.moe_ffn << " of " << m.name;
    return os.str();
  }
  if (l.pp > m.layers) {
    os << "pp=" << l.pp << " exceeds the " << m.layers << " layers of " << m.name;
    return os.str();
  }
  if (l.vpp > 1 && m.layers < int64_t{l.pp} * l.vpp) {
    os << "pp=" << l.pp << " x vpp=" << l.vpp << " model chunks exceed the " << m.layers
       << " layers of " << m.name;
    return os.str();
  }
  if (l.vpp > 1 && l.pp == 1) return "the interleaved schedule (vpp > 1) needs pp > 1";
  if (l.cp > 1 && s.seq % (2 * l.cp) != 0) {
    os << "cp=" << l.cp << ": --seq " << s.seq << " is not divisible by 2 x cp = " << 2 * l.cp
       << " (load-balanced context parallelism splits each sequence into 2 cp chunks)";
    return os.str();
  }
  if (!m.is_moe() && l.ep > 1) {
    os << "ep=" << l.ep << " needs a mixture-of-experts model; " << m.name << " is dense";
    return os.str();
  }
  if (m.is_moe() && m.experts % l.ep != 0) {
    os << "ep=" << l.ep << " does not divide the " << m.experts << " experts of " << m.name;
    return os.str();
  }
  if ((int64_t{l.dp} * l.cp) % l.ep != 0) {
    os << "ep=" << l.ep << " does not divide dp x cp = " << int64_t{l.dp} * l.cp
       << " (expert-parallel ranks are taken from the data-parallel ones)";
    return os.str();
  }
  if (s.global_batch % (int64_t{l.dp} * l.micro_batch) != 0) {
    os << "--global-batch " << s.global_batch << " is not divisible by dp=" << l.dp
       << " x mb=" << l.micro_batch;
    return os.str();
  }
  if (l.sp && l.tp == 1) return "sp=on needs tp > 1 (sequence parallelism splits along the tensor-parallel ranks)";
  if (l.zero >= 2 && l.pp > 1) {
    os << "zero=" << l.zero << " with pp=" << l.pp
       << " is not supported (gradients are sharded per micro-batch; DeepSpeed and Megatron "
          "allow only ZeRO-1 with pipelines)";
    return os.str();
  }
  (void)hw;
  return "";
}

}  // namespace tessera::plan
