// CPU calibration: GEMM curves, STREAM bandwidth and an alpha-beta fit of `bench comm`.
#include "tessera/plan/calibrate.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "tessera/base/aligned_alloc.h"
#include "tessera/base/cpu_features.h"
#include "tessera/base/error.h"
#include "tessera/base/strings.h"
#include "tessera/base/thread_pool.h"
#include "tessera/kernels/peak.h"
#include "tessera/model/precision.h"

namespace tessera::plan {
namespace {

int cores() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return 1;
}

double total_memory_bytes() {
  std::ifstream f("/proc/meminfo");
  std::string key;
  double kb = 0;
  while (f >> key >> kb) {
    if (key == "MemTotal:") return kb * 1024;
    f.ignore(256, '\n');
  }
  return 8.0 * (1 << 30);
}

std::string self_exe() {
  char buf[PATH_MAX];
  const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
  TESSERA_CHECK(n > 0, "plan calibrate: cannot find this program's path (/proc/self/exe)");
  return std::string(buf, static_cast<size_t>(n));
}

std::string shell_quote(const std::string& s) {
  std::string q = "'";
  for (char c : s) q += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return q + "'";
}

void note(std::string* log, const std::string& line) {
  if (log) *log += line + "\n";
}

}  // namespace

std::pair<double, double> fit_ring_all_reduce(const std::vector<std::pair<double, double>>& pts,
                                              int p) {
  TESSERA_CHECK(pts.size() >= 2 && p >= 2, "alpha-beta fit: need two or more points of 2+ ranks");
  // Weighted least squares of t = a + b n with weights 1 / t^2 (relative error).
  double s00 = 0, s01 = 0, s11 = 0, r0 = 0, r1 = 0;
  for (const auto& [n, t] : pts) {
    const double w = 1 / (t * t);
    s00 += w, s01 += w * n, s11 += w * n * n, r0 += w * t, r1 += w * n * t;
  }
  const double det = s00 * s11 - s01 * s01;
  double a = (r0 * s11 - r1 * s01) / det, b = (s00 * r1 - s01 * r0) / det;
  if (a < 0 || b <= 0) {  // degenerate: fall back to latency = smallest time, slope through it
    a = std::max(a, 0.0);
    b = std::max(b, 1e-15);
  }
  const double alpha = a / (2.0 * (p - 1));
  const double beta = 2.0 * (p - 1) / p / b;
  return {alpha, beta};
}

std::vector<std::pair<double, double>> parse_bench_comm_json(const std::string& text,
                                                             const std::string& op, int* ranks) {
  std::vector<std::pair<double, double>> pts;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("{\"bench\":\"comm\"", 0) != 0) continue;
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || j.value("op", "") != op) continue;
    pts.push_back({j.at("bytes").get<double>(), j.at("time_us").get<double>() * 1e-6});
    if (ranks) *ranks = j.at("ranks").get<int>();
  }
  return pts;
}

Hardware calibrate_cpu(const CalibrateOptions& o, std::string* log) {
  const int ncores = cores();
  const int devices = o.devices > 0 ? o.devices : ncores;
  TESSERA_CHECK(devices <= ncores, "--devices ", devices, " exceeds the ", ncores,
                " cores this process may use (one rank per core at most)");
  const int threads = std::max(1, ncores / devices);
  const int saved_threads = base::num_threads();
  base::set_num_threads(threads);
  Hardware h;
  h.name = "cpu";
  h.source = "calibrated";
  note(log, "calibrate: " + std::to_string(devices) + " device(s) of " + std::to_string(threads) +
                " thread(s) each on " + std::to_string(ncores) + " core(s)");

  // GEMM: `tessera bench gemm`'s measurement (median call of c = a @ b^T) on a grid of
  // inner and outer sizes, every device measuring at once; the peak is the shared probe's
  // (kernels::measure_gemm_peak), also with every device busy.
  const model::Bf16Mode bf16 = model::choose_bf16_mode(DType::kBF16);
  note(log, "  bf16 training here: " + model::describe_compute(DType::kBF16, bf16));
  for (DType dt : {DType::kF32, DType::kBF16}) {
    // The trainer's precision decision: emulated bf16 rounds operands to bf16 values and
    // multiplies in f32, so its rates are f32's.
    if (dt == DType::kBF16 && model::matmul_peak_dtype(bf16) == DType::kF32) {
      h.gemm["bf16"] = h.gemm["fp32"];
      h.peak_flops["bf16"] = h.peak_flops["fp32"];
      note(log, "  bf16 is emulated here: its rates are the f32 ones");
      continue;
    }
    const std::string key = dt == DType::kF32 ? "fp32" : "bf16";
    h.gemm[key] = measure_gemm_table(dt, o, devices, log);
    const auto peaks = on_all_devices(devices, [dt](int) {
      return kernels::measure_gemm_peak(dt, 0.2).gflops * 1e9;
    });
    h.peak_flops[key] = *std::min_element(peaks.begin(), peaks.end());
    note(log, base::strprintf("  %s GEMM peak (shared probe, every device busy): %.0f GFLOP/s per device",
                              dtype_name(dt), h.peak_flops[key] / 1e9));
  }

  // Memory bandwidth per device: STREAM triad with one device's threads alone, and on
  // every device at once (each its own triad, best of 10 repetitions); the smaller. The
  // devices' arrays together are STREAM's size (4x the last-level cache each): beyond it.
  // They sit on the pages Tessera's large tensors get (huge ones where the kernel grants
  // them, base/aligned_alloc.h), since those are what the steps and decode stream.
  const int64_t n = std::max<int64_t>(int64_t{16} << 20, kernels::stream_array_elements() / devices);
  const bool huge = base::huge_pages_enabled();
  const double alone = kernels::measure_stream_triad_gbps(n, 10, huge) * 1e9;
  std::vector<double> each = on_all_devices(devices, [n, huge](int) {
    return kernels::measure_stream_triad_gbps(n, 10, huge) * 1e9;
  });
  std::sort(each.begin(), each.end());
  const double shared = each[each.size() / 2];
  h.memory_bandwidth = std::min(alone, shared);
  note(log, base::strprintf("  stream triad: %.2f GB/s one device alone, %.2f GB/s each "
                            "with all busy -> %.2f GB/s",
                            alone / 1e9, shared / 1e9, h.memory_bandwidth / 1e9));
  h.elementwise_bandwidth = measure_elementwise_bandwidth(devices, log);
  h.optimizer_bandwidth = measure_optimizer_bandwidth(devices, log);
  h.attention_flops = measure_attention_flops(devices, log);
  h.memory_bytes = total_memory_bytes() / devices;
  h.host_memory_bytes = h.memory_bytes;  // "host" and "device" are the same DRAM here
  h.memory_efficiency = 1;  // the figures above are achieved, not datasheet
  h.compute_efficiency = 1;
  h.devices_per_node = devices;
  h.store_16bit_as_f32 = true;  // Tessera's CPU build (docs/distributed.md)
  h.native_bf16_activations = bf16 == model::Bf16Mode::kNative;
  h.comm_overlap = 0;  // the cores that compute also move the bytes: nothing hides
  h.reserved_bytes = 0;
  h.fragmentation = 0;
  h.host_bandwidth = h.memory_bandwidth;  // "offload" stays in the same DRAM
  h.host_memory_bandwidth = h.memory_bandwidth;
  h.link_efficiency = 1;

  // Collectives: `tessera bench comm` under mpirun, as `tessera train --nproc N` runs.
  h.intra_bandwidth = h.inter_bandwidth = h.memory_bandwidth;
  h.intra_latency = h.inter_latency = 5e-6;
  if (devices > 1 && o.comm) {
    const std::string exe = o.tessera_exe.empty() ? self_exe() : o.tessera_exe;
    std::string cmd = "OMP_NUM_THREADS=" + std::to_string(threads) + " " + shell_quote(o.mpirun);
    if (::geteuid() == 0) cmd += " --allow-run-as-root";
    cmd += " --oversubscribe -np " + std::to_string(devices) + " " + shell_quote(exe) +
           " bench comm --ops all_reduce --algorithms auto --min-bytes 4096 --max-bytes " +
           std::to_string(o.max_comm_bytes) + " --min-seconds 0.05 --json 2>&1";
    note(log, "  running: " + cmd);
    FILE* p = ::popen(cmd.c_str(), "r");
    TESSERA_CHECK(p, "plan calibrate: cannot run '", cmd, "'");
    std::string out;
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, p)) > 0;) out.append(buf, n);
    const int status = ::pclose(p);
    int ranks = 0;
    const auto pts = parse_bench_comm_json(out, "all_reduce", &ranks);
    TESSERA_CHECK(status == 0 && pts.size() >= 2, "plan calibrate: `bench comm` under ", o.mpirun,
                  " failed (exit status ", status, "); pass --no-comm to skip collectives. Output: ",
                  out.substr(0, 400));
    const auto [alpha, beta] = fit_ring_all_reduce(pts, ranks);
    h.intra_latency = h.inter_latency = alpha;
    h.intra_bandwidth = h.inter_bandwidth = beta;
    for (const auto& [n, t] : pts) {
      const double model = 2.0 * (ranks - 1) * alpha + 2.0 * (ranks - 1) / ranks * n / beta;
      note(log, base::strprintf("  all_reduce %10.0f bytes: %9.1f us measured, %9.1f us fitted", n,
                                t * 1e6, model * 1e6));
    }
    note(log, base::strprintf("  alpha-beta fit: alpha %.2f us, beta %.2f GB/s", alpha * 1e6,
                              beta / 1e9));
  }
  base::set_num_threads(saved_threads);
  h.validate("plan calibrate");
  return h;
}

}  // namespace tessera::plan
