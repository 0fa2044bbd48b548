// One accelerator (or one CPU rank) and its cluster topology as the planner's cost
// models see them: peak FLOP/s per dtype, memory size and bandwidth, links inside and
// across nodes. Presets, a TOML file format (docs/planner.md), and calibrated curves.
#pragma once
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace tessera::plan {

// Achieved GEMM FLOP/s on a grid of shapes, measured on this machine (plan calibrate):
// (mn x k) @ (k x mn) for each inner size k and outer size mn. A GEMM (m x k) @ (k x n)
// is looked up at (k, sqrt(m n)), interpolated in log-log between grid points.
struct GemmTable {
  std::vector<double> k;                   // ascending
  std::vector<double> mn;                  // ascending
  std::vector<std::vector<double>> flops;  // [k index][mn index], FLOP/s
  bool empty() const { return k.empty(); }
  double at(double k, double mn) const;
};

struct Hardware {
  std::string name;
  std::string source = "preset";  // "preset" or the TOML file it came from
  double memory_bytes = 0;
  double memory_bandwidth = 0;  // bytes/s
  std::map<std::string, double> peak_flops;  // dense FLOP/s by dtype: fp32 bf16 fp16 fp8 int8
  double compute_efficiency = 0.6;  // achievable fraction of peak for large GEMMs
  double memory_efficiency = 0.8;   // achievable fraction of memory bandwidth
  int devices_per_node = 0;
  double intra_bandwidth = 0;  // bytes/s per device per direction inside a node (NVLink)
  double intra_latency = 0;    // seconds per message step
  double inter_bandwidth = 0;  // bytes/s per device per direction across nodes (InfiniBand)
  double inter_latency = 0;
  double link_efficiency = 0.8;  // fraction of link bandwidth collectives reach
  double comm_overlap = 1.0;     // fraction of data-parallel comm that can hide behind compute
  double host_bandwidth = 25e9;  // device <-> host (PCIe) per direction, for offload
  double host_memory_bandwidth = 100e9;  // host DRAM, for the offloaded optimizer step
  double host_memory_bytes = 256.0 * (1 << 30);  // host DRAM per device (DGX: 2 TB / 8 GPUs)
  double reserved_bytes = 1.0 * (1 << 30);  // runtime context, library workspaces
  double fragmentation = 0.10;   // allocator slack as a fraction of what is allocated
  bool store_16bit_as_f32 = false;  // CPU build: 16-bit weights/grads/activations kept in f32
  // CPU build under native bf16 (model::choose_bf16_mode): the activations that feed only
  // matmuls are kept as bf16 copies all the same.
  bool native_bf16_activations = false;
  std::map<std::string, GemmTable> gemm;  // by dtype; empty for the GPU presets
  // Bytes/s of the memory-bound work, in the units of the time model's byte counts
  // (docs/planner.md); 0 = memory_bandwidth x memory_efficiency. Calibrated CPUs
  // measure them on Tessera's own layer kernels and optimizer step.
  double elementwise_bandwidth = 0;
  double optimizer_bandwidth = 0;
  // FLOP/s of the attention kernel (causal FLOPs, forward + backward); 0 = the GEMM rate.
  double attention_flops = 0;

  // Dense peak FLOP/s for `dtype`; throws naming the hardware and dtype when absent.
  double peak(const std::string& dtype) const;
  // Achievable FLOP/s of one (m x k) @ (k x n) matmul in `dtype` with `bytes` per element:
  // the calibrated table where there is one, else the roofline
  // min(peak x compute_efficiency, intensity x bandwidth x memory_efficiency).
  double gemm_flops(const std::string& dtype, double m, double n, double k, double bytes) const;
  double effective_memory_bandwidth() const { return memory_bandwidth * memory_efficiency; }
  double effective_elementwise_bandwidth() const {
    return elementwise_bandwidth > 0 ? elementwise_bandwidth : effective_memory_bandwidth();
  }
  double effective_optimizer_bandwidth() const {
    return optimizer_bandwidth > 0 ? optimizer_bandwidth : effective_memory_bandwidth();
  }
  void validate(const std::string& where) const;
};

std::vector<std::string> hardware_preset_names();  // a100-40g ... h200-141g, cpu
// A GPU preset by name. "cpu" reads the calibration file (cpu_calibration_path()).
Hardware hardware_preset(const std::string& name);
// A preset name or a TOML file path.
Hardware load_hardware(const std::string& name_or_path);
// TOML text as written by hardware_to_toml; `base = "h100-80g"` starts from a preset.
// Unknown keys and missing fields are errors naming `source` and the key.
Hardware hardware_from_toml(const std::string& text, const std::string& source);
std::string hardware_to_toml(const Hardware& hw, const std::string& header_comment = "");
// $TESSERA_CPU_CALIBRATION, else $XDG_CACHE_HOME/tessera/cpu.toml, else ~/.cache/tessera/cpu.toml.
std::string cpu_calibration_path();

}  // namespace tessera::plan
