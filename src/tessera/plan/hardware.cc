// Hardware presets (datasheet figures), the hardware TOML format, and GEMM rates from
// calibrated curves or the roofline.
#include "tessera/plan/hardware.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iomanip>
#include <set>
#include <sstream>

#include <toml++/toml.h>

#include "tessera/base/error.h"
#include "tessera/io/json_file.h"
#include "tessera/io/toml_text.h"

namespace tessera::plan {

namespace {
constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
}  // namespace

double Hardware::peak(const std::string& dtype) const {
  auto it = peak_flops.find(dtype);
  TESSERA_CHECK(it != peak_flops.end() && it->second > 0, "hardware '", name,
                "' has no peak FLOP/s for ", dtype, " (set peak_tflops_", dtype, " in its TOML file)");
  return it->second;
}

namespace {

// Index i with v[i] <= x < v[i + 1] and the log-space fraction t, clamped to the ends.
std::pair<size_t, double> bracket(const std::vector<double>& v, double x) {
  if (v.size() == 1 || x <= v.front()) return {0, 0.0};
  if (x >= v.back()) return {v.size() - 2, 1.0};
  size_t i = 0;
  while (v[i + 1] < x) ++i;
  return {i, std::log(x / v[i]) / std::log(v[i + 1] / v[i])};
}

}  // namespace

double GemmTable::at(double kk, double mm) const {
  const auto [i, ti] = bracket(k, kk);
  const auto [j, tj] = bracket(mn, mm);
  auto f = [&](size_t a, size_t b) {
    return std::log(flops[std::min(a, k.size() - 1)][std::min(b, mn.size() - 1)]);
  };
  const double lo = f(i, j) + tj * (f(i, j + 1) - f(i, j));
  const double hi = f(i + 1, j) + tj * (f(i + 1, j + 1) - f(i + 1, j));
  double r = std::exp(lo + ti * (hi - lo));
  // Below the grid a GEMM is overhead-bound: its rate falls with its size.
  if (kk < k.front()) r *= kk / k.front();
  if (mm < mn.front()) r *= mm / mn.front();
  return r;
}

double Hardware::gemm_flops(const std::string& dtype, double m, double n, double k,
                            double bytes) const {
  auto it = gemm.find(dtype);
  if (it != gemm.end() && !it->second.empty()) return it->second.at(k, std::sqrt(m * n));
  const double compute = peak(dtype) * compute_efficiency;
  const double intensity = 2 * m * n * k / (bytes * (m * k + k * n + m * n));  // FLOP per byte
  return std::min(compute, intensity * effective_memory_bandwidth());
}

void Hardware::validate(const std::string& where) const {
  auto positive = [&](double v, const char* key) {
    TESSERA_CHECK(v > 0 && std::isfinite(v), where, ": hardware field '", key,
                  "' must be positive, got ", v);
  };
  positive(memory_bytes, "memory_gib");
  positive(memory_bandwidth, "memory_bandwidth_gbps");
  positive(host_memory_bytes, "host_memory_gib");
  TESSERA_CHECK(!peak_flops.empty(), where, ": missing hardware field 'peak_tflops_bf16' (or another dtype)");
  for (const auto& [dt, f] : peak_flops) positive(f, ("peak_tflops_" + dt).c_str());
  TESSERA_CHECK(devices_per_node >= 1, where, ": hardware field 'devices_per_node' must be at least 1");
  positive(intra_bandwidth, "intra_node_bandwidth_gbps");
  positive(inter_bandwidth, "inter_node_bandwidth_gbps");
  TESSERA_CHECK(intra_latency >= 0 && inter_latency >= 0, where, ": link latencies must not be negative");
  auto fraction = [&](double v, const char* key, bool zero_ok) {
    TESSERA_CHECK((zero_ok ? v >= 0 : v > 0) && v <= 1, where, ": hardware field '", key,
                  "' must be in ", zero_ok ? "[0, 1]" : "(0, 1]", ", got ", v);
  };
  fraction(compute_efficiency, "compute_efficiency", false);
  fraction(memory_efficiency, "memory_efficiency", false);
  fraction(link_efficiency, "link_efficiency", false);
  fraction(comm_overlap, "comm_overlap", true);
  TESSERA_CHECK(fragmentation >= 0 && fragmentation < 1, where,
                ": hardware field 'fragmentation' must be in [0, 1), got ", fragmentation);
  TESSERA_CHECK(reserved_bytes >= 0 && reserved_bytes < memory_bytes, where,
                ": hardware field 'reserved_gib' must be in [0, memory_gib)");
  for (const auto& [dt, c] : gemm) {
    bool ok = !c.k.empty() && !c.mn.empty() && c.flops.size() == c.k.size();
    for (size_t i = 0; ok && i < c.k.size(); ++i) {
      ok = c.flops[i].size() == c.mn.size() && c.k[i] > 0 && (i == 0 || c.k[i] > c.k[i - 1]);
      for (double f : c.flops[i]) ok = ok && f > 0;
    }
    for (size_t j = 0; ok && j < c.mn.size(); ++j) ok = c.mn[j] > 0 && (j == 0 || c.mn[j] > c.mn[j - 1]);
    TESSERA_CHECK(ok, where, ": gemm.", dt, ": 'k' and 'mn' must be ascending positive lists and "
                  "'gflops' a list of len(k) rows of len(mn) positive rates");
  }
  TESSERA_CHECK(elementwise_bandwidth >= 0 && optimizer_bandwidth >= 0 && attention_flops >= 0,
                where, ": elementwise / optimizer bandwidths and attention_tflops must not be negative");
}

std::vector<std::string> hardware_preset_names() {
  return {"a100-40g", "a100-80g", "h100-80g", "h200-141g", "cpu"};
}

namespace {

// NVIDIA datasheets (dense, no sparsity). Memory as nvidia-smi reports it. Links: NVLink
// 3 = 600 GB/s and NVLink 4 = 900 GB/s both directions together, i.e. 300 / 450 GB/s
// per direction; one HDR (200 Gb/s) or NDR (400 Gb/s) InfiniBand port per GPU.
Hardware gpu(const std::string& name, double mem_gib, double bw_gbps, double bf16_tf,
             double fp32_tf, double fp8_tf, double int8_tf, double nvlink_gbps, double ib_gbps) {
  Hardware h;
  h.name = name;
  h.memory_bytes = mem_gib * kGiB;
  h.memory_bandwidth = bw_gbps * 1e9;
  h.peak_flops["bf16"] = bf16_tf * 1e12;
  h.peak_flops["fp16"] = bf16_tf * 1e12;
  h.peak_flops["fp32"] = fp32_tf * 1e12;
  if (fp8_tf > 0) h.peak_flops["fp8"] = fp8_tf * 1e12;
  h.peak_flops["int8"] = int8_tf * 1e12;
  h.devices_per_node = 8;
  h.intra_bandwidth = nvlink_gbps * 1e9;
  h.intra_latency = 3e-6;
  h.inter_bandwidth = ib_gbps * 1e9;
  h.inter_latency = 8e-6;
  return h;
}

}  // namespace

std::string cpu_calibration_path() {
  if (const char* p = std::getenv("TESSERA_CPU_CALIBRATION"); p && *p) return p;
  if (const char* x = std::getenv("XDG_CACHE_HOME"); x && *x)
    return std::string(x) + "/tessera/cpu.toml";
  const char* home = std::getenv("HOME");
  return std::string(home && *home ? home : ".") + "/.cache/tessera/cpu.toml";
}

Hardware hardware_preset(const std::string& name) {
  if (name == "a100-40g") return gpu(name, 40, 1555, 312, 19.5, 0, 624, 300, 25);
  if (name == "a100-80g") return gpu(name, 80, 2039, 312, 19.5, 0, 624, 300, 25);
  if (name == "h100-80g") return gpu(name, 81559 / 1024.0, 3350, 989, 67, 1979, 1979, 450, 50);
  if (name == "h200-141g") return gpu(name, 143771 / 1024.0, 4800, 989, 67, 1979, 1979, 450, 50);
  if (name == "cpu") {
    const std::string path = cpu_calibration_path();
    TESSERA_CHECK(std::filesystem::exists(path), "--gpu cpu: no calibration of this machine at ",
                  path, "; run `tessera plan calibrate` first (it measures bench gemm and bench "
                  "comm figures and writes that file), or pass --gpu FILE.toml");
    return hardware_from_toml(io::read_file_bytes(path), path);
  }
  std::string list;
  for (const auto& n : hardware_preset_names()) list += (list.empty() ? "" : ", ") + n;
  fail("unknown --gpu '", name, "' (presets: ", list, "; or a hardware .toml file)");
}

Hardware load_hardware(const std::string& name_or_path) {
  if (name_or_path.ends_with(".toml") || name_or_path.find('/') != std::string::npos)
    return hardware_from_toml(io::read_file_bytes(name_or_path), name_or_path);
  return hardware_preset(name_or_path);
}

namespace {

// The TOML reader's bound on devices_per_node (an int; an NVL72 rack is 72).
constexpr int kMaxDevicesPerNode = 1 << 16;

// Reads top-level keys; every number must be finite (nan / inf are errors naming the key).
struct Reader {
  const toml::table& t;
  std::string source;
  std::set<std::string> seen;

  const toml::node* node(const std::string& key) {
    seen.insert(key);
    return t.get(key);
  }
  bool number(const std::string& key, double& out, double scale = 1) {
    const toml::node* n = node(key);
    if (!n) return false;
    TESSERA_CHECK(n->is_number(), source, ": '", key, "' must be a number");
    const double v = io::toml_number(*n);
    TESSERA_CHECK(std::isfinite(v), source, ": '", key, "' must be a finite number, got ", v);
    out = v * scale;
    return true;
  }
  void check_unknown() const {
    for (const auto& [k, v] : t) {
      const std::string key(k.str());
      TESSERA_CHECK(seen.count(key), source, ": unknown hardware field '", key, "'");
    }
  }
};

std::vector<double> number_list(const toml::table& t, const std::string& key,
                                 const std::string& where) {
  const toml::array* a = t.get_as<toml::array>(key);
  TESSERA_CHECK(a, where, ".", key, " must be a list of numbers");
  std::vector<double> v;
  for (const auto& e : *a) {
    TESSERA_CHECK(e.is_number(), where, ".", key, " must be a list of numbers");
    v.push_back(io::toml_number(e));
    TESSERA_CHECK(std::isfinite(v.back()), where, ".", key, " must be a list of finite numbers, got ",
                  v.back());
  }
  return v;
}

}  // namespace

Hardware hardware_from_toml(const std::string& text, const std::string& source) {
  const toml::table root = io::parse_toml_text(text, source);
  Reader r{root, source, {}};
  Hardware h;
  bool has_base = false;
  if (const toml::node* b = r.node("base")) {
    TESSERA_CHECK(b->is_string(), source, ": 'base' must be a preset name string");
    const std::string base = *b->value<std::string>();
    TESSERA_CHECK(base != "cpu", source, ": 'base' cannot be cpu (copy the calibration file instead)");
    h = hardware_preset(base);
    has_base = true;
  }
  h.source = source;
  if (const toml::node* n = r.node("name")) {
    TESSERA_CHECK(n->is_string(), source, ": 'name' must be a string");
    h.name = *n->value<std::string>();
  }
  if (h.name.empty()) h.name = std::filesystem::path(source).stem().string();
  auto required = [&](const char* key, double& out, double scale) {
    const bool present = r.number(key, out, scale);
    TESSERA_CHECK(present || has_base, source, ": missing hardware field '", key, "'");
  };
  required("memory_gib", h.memory_bytes, kGiB);
  required("memory_bandwidth_gbps", h.memory_bandwidth, 1e9);
  bool any_peak = false;
  for (const char* dt : {"fp32", "bf16", "fp16", "fp8", "int8"}) {
    double v = 0;
    if (r.number(std::string("peak_tflops_") + dt, v, 1e12)) h.peak_flops[dt] = v, any_peak = true;
  }
  TESSERA_CHECK(any_peak || has_base, source, ": missing hardware field 'peak_tflops_bf16' (or "
                "peak_tflops_fp32 / fp16 / fp8 / int8)");
  double dpn = h.devices_per_node;
  required("devices_per_node", dpn, 1);
  TESSERA_CHECK(dpn >= 1 && dpn <= kMaxDevicesPerNode && dpn == std::floor(dpn), source,
                ": 'devices_per_node' must be an integer in [1, ", kMaxDevicesPerNode, "], got ", dpn);
  h.devices_per_node = static_cast<int>(dpn);
  required("intra_node_bandwidth_gbps", h.intra_bandwidth, 1e9);
  required("intra_node_latency_us", h.intra_latency, 1e-6);
  required("inter_node_bandwidth_gbps", h.inter_bandwidth, 1e9);
  required("inter_node_latency_us", h.inter_latency, 1e-6);
  r.number("compute_efficiency", h.compute_efficiency);
  r.number("memory_efficiency", h.memory_efficiency);
  r.number("link_efficiency", h.link_efficiency);
  r.number("comm_overlap", h.comm_overlap);
  r.number("host_bandwidth_gbps", h.host_bandwidth, 1e9);
  r.number("host_memory_bandwidth_gbps", h.host_memory_bandwidth, 1e9);
  r.number("reserved_gib", h.reserved_bytes, kGiB);
  r.number("host_memory_gib", h.host_memory_bytes, kGiB);
  r.number("fragmentation", h.fragmentation);
  r.number("elementwise_bandwidth_gbps", h.elementwise_bandwidth, 1e9);
  r.number("optimizer_bandwidth_gbps", h.optimizer_bandwidth, 1e9);
  r.number("attention_tflops", h.attention_flops, 1e12);
  if (const toml::node* n = r.node("store_16bit_as_f32")) {
    TESSERA_CHECK(n->is_boolean(), source, ": 'store_16bit_as_f32' must be true or false");
    h.store_16bit_as_f32 = *n->value<bool>();
  }
  if (const toml::node* n = r.node("native_bf16_activations")) {
    TESSERA_CHECK(n->is_boolean(), source, ": 'native_bf16_activations' must be true or false");
    h.native_bf16_activations = *n->value<bool>();
  }
  if (const toml::node* g = r.node("gemm")) {
    TESSERA_CHECK(g->is_table(), source, ": 'gemm' must be a table ([gemm.fp32])");
    for (const auto& [k, v] : *g->as_table()) {
      const std::string dt(k.str());
      const std::string where = source + ": gemm." + dt;
      TESSERA_CHECK(v.is_table(), where, " must be a table with 'k', 'mn' and 'gflops'");
      const toml::table& t = *v.as_table();
      for (const auto& [kk, vv] : t) {
        const std::string key(kk.str());
        TESSERA_CHECK(key == "k" || key == "mn" || key == "gflops", where, ": unknown key '", key, "'");
      }
      GemmTable c;
      c.k = number_list(t, "k", where);
      c.mn = number_list(t, "mn", where);
      const toml::array* rows = t.get_as<toml::array>("gflops");
      TESSERA_CHECK(rows, where, ".gflops must be a list of lists of numbers");
      for (const auto& row : *rows) {
        TESSERA_CHECK(row.is_array(), where, ".gflops must be a list of lists of numbers");
        std::vector<double> r2;
        for (const auto& e : *row.as_array()) {
          TESSERA_CHECK(e.is_number(), where, ".gflops must be a list of lists of numbers");
          const double f = io::toml_number(e);
          TESSERA_CHECK(std::isfinite(f), where, ".gflops must be a list of lists of finite numbers, got ", f);
          r2.push_back(f * 1e9);
        }
        c.flops.push_back(r2);
      }
      h.gemm[dt] = c;
    }
  }
  r.check_unknown();
  h.validate(source);
  return h;
}

std::string hardware_to_toml(const Hardware& h, const std::string& header_comment) {
  std::ostringstream os;
  os << std::setprecision(6);
  if (!header_comment.empty()) os << header_comment;
  os << "name = \"" << h.name << "\"\n";
  os << "memory_gib = " << h.memory_bytes / kGiB << "\n";
  os << "memory_bandwidth_gbps = " << h.memory_bandwidth / 1e9 << "\n";
  for (const auto& [dt, f] : h.peak_flops) os << "peak_tflops_" << dt << " = " << f / 1e12 << "\n";
  os << "compute_efficiency = " << h.compute_efficiency << "\n";
  os << "memory_efficiency = " << h.memory_efficiency << "\n";
  os << "devices_per_node = " << h.devices_per_node << "\n";
  os << "intra_node_bandwidth_gbps = " << h.intra_bandwidth / 1e9 << "\n";
  os << "intra_node_latency_us = " << h.intra_latency * 1e6 << "\n";
  os << "inter_node_bandwidth_gbps = " << h.inter_bandwidth / 1e9 << "\n";
  os << "inter_node_latency_us = " << h.inter_latency * 1e6 << "\n";
  os << "link_efficiency = " << h.link_efficiency << "\n";
  os << "comm_overlap = " << h.comm_overlap << "\n";
  os << "host_bandwidth_gbps = " << h.host_bandwidth / 1e9 << "\n";
  os << "host_memory_bandwidth_gbps = " << h.host_memory_bandwidth / 1e9 << "\n";
  os << "reserved_gib = " << h.reserved_bytes / kGiB << "\n";
  os << "host_memory_gib = " << h.host_memory_bytes / kGiB << "\n";
  os << "fragmentation = " << h.fragmentation << "\n";
  os << "store_16bit_as_f32 = " << (h.store_16bit_as_f32 ? "true" : "false") << "\n";
  if (h.native_bf16_activations) os << "native_bf16_activations = true\n";
  if (h.elementwise_bandwidth > 0)
    os << "elementwise_bandwidth_gbps = " << h.elementwise_bandwidth / 1e9 << "\n";
  if (h.optimizer_bandwidth > 0)
    os << "optimizer_bandwidth_gbps = " << h.optimizer_bandwidth / 1e9 << "\n";
  if (h.attention_flops > 0) os << "attention_tflops = " << h.attention_flops / 1e12 << "\n";
  auto list = [&](const std::vector<double>& v, double scale) {
    os << "[";
    for (size_t i = 0; i < v.size(); ++i) os << (i ? ", " : "") << v[i] / scale;
    os << "]";
  };
  for (const auto& [dt, c] : h.gemm) {
    os << "\n[gemm." << dt << "]  # achieved GFLOP/s of (mn x k) @ (k x mn), one row per k\n";
    os << "k = ";
    list(c.k, 1);
    os << "\nmn = ";
    list(c.mn, 1);
    os << "\ngflops = [\n";
    for (const auto& row : c.flops) {
      os << "  ";
      list(row, 1e9);
      os << ",\n";
    }
    os << "]\n";
  }
  return os.str();
}

}  // namespace tessera::plan
