// TOML -> TrainConfig with every key checked: unknown tables and keys, wrong types and
// out-of-range values are errors naming "table.key".
#include "tessera/model/lora.h"
#include "tessera/train/config.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <iomanip>
#include <limits>
#include <set>
#include <sstream>
#include <type_traits>

#include <toml++/toml.h>

#include "tessera/base/error.h"
#include "tessera/io/json_file.h"
#include "tessera/io/toml_text.h"

namespace tessera::train {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr int64_t kMaxCount = std::numeric_limits<int32_t>::max();  // sizes and counts of things
constexpr int64_t kMaxInt = std::numeric_limits<int64_t>::max();

// Where a float key may lie: [lo, hi], either end open; an infinite end is no bound.
struct Bounds {
  double lo = -kInf, hi = kInf;
  bool lo_open = false, hi_open = false;
  bool contains(double v) const {
    return (lo_open ? v > lo : v >= lo) && (hi_open ? v < hi : v <= hi);
  }
  std::string describe() const {
    std::ostringstream os;
    os << std::setprecision(10);
    if (lo > -kInf && hi < kInf)
      os << "in " << (lo_open ? "(" : "[") << lo << ", " << hi << (hi_open ? ")" : "]");
    else if (lo > -kInf)
      os << (lo_open ? "> " : ">= ") << lo;
    else
      os << (hi_open ? "< " : "<= ") << hi;
    return os.str();
  }
};
constexpr Bounds kPositive{0, kInf, true, false};
constexpr Bounds kNonNegative{0, kInf, false, false};
constexpr Bounds kUnitOpenAbove{0, 1, false, true};  // [0, 1)
constexpr Bounds kUnit{0, 1, false, false};           // [0, 1]

// Reads the keys of one table, remembering which were read so the rest can be reported.
// Numbers are checked as they are read: an integer must lie in [lo, hi] and in the
// destination type (nothing is truncated), a float must be finite and within its Bounds.
class Section {
 public:
  Section(const toml::table* table, std::string name, std::string source)
      : table_(table), name_(std::move(name)), source_(std::move(source)) {}

  void get(const char* key, bool& out) {
    if (const toml::node* node = find(key)) {
      TESSERA_CHECK(node->is_boolean(), where(key), " must be true or false");
      out = *node->value<bool>();
    }
  }

  void get(const char* key, std::string& out) {
    if (const toml::node* node = find(key)) {
      TESSERA_CHECK(node->is_string(), where(key), " must be a string");
      out = *node->value<std::string>();
    }
  }

  template <typename T>
    requires(std::is_integral_v<T> && !std::is_same_v<T, bool>)
  void get(const char* key, T& out, int64_t lo, int64_t hi) {
    // The range of T, as far as a TOML integer (int64) reaches.
    lo = std::max<int64_t>(lo, std::is_signed_v<T> ? int64_t{std::numeric_limits<T>::min()} : 0);
    if (static_cast<uint64_t>(std::numeric_limits<T>::max()) < static_cast<uint64_t>(hi))
      hi = static_cast<int64_t>(std::numeric_limits<T>::max());
    if (const toml::node* node = find(key)) {
      TESSERA_CHECK(node->is_integer(), where(key), " must be an integer");
      const int64_t v = node->as_integer()->get();
      TESSERA_CHECK(v >= lo && v <= hi, where(key), " must be in [", lo, ", ", hi, "], got ", v);
      out = static_cast<T>(v);
    }
  }

  // An array of strings.
  void get(const char* key, std::vector<std::string>& out) {
    if (const toml::node* node = find(key)) {
      const toml::array* a = node->as_array();
      TESSERA_CHECK(a, where(key), " must be an array of strings");
      out.clear();
      for (const toml::node& e : *a) {
        TESSERA_CHECK(e.is_string(), where(key), " must be an array of strings");
        out.push_back(*e.value<std::string>());
      }
    }
  }

  // An array of integers, each in [lo, hi].
  void get(const char* key, std::vector<int64_t>& out, int64_t lo, int64_t hi) {
    if (const toml::node* node = find(key)) {
      const toml::array* a = node->as_array();
      TESSERA_CHECK(a, where(key), " must be an array of integers");
      out.clear();
      for (const toml::node& e : *a) {
        TESSERA_CHECK(e.is_integer(), where(key), " must be an array of integers");
        const int64_t v = e.as_integer()->get();
        TESSERA_CHECK(v >= lo && v <= hi, where(key), " entries must be in [", lo, ", ", hi,
                      "], got ", v);
        out.push_back(v);
      }
    }
  }

  void get(const char* key, double& out, Bounds bounds = {}) {
    if (const toml::node* node = find(key)) {
      TESSERA_CHECK(node->is_number(), where(key), " must be a number");
      const double v = io::toml_number(*node);
      TESSERA_CHECK(std::isfinite(v), where(key), " must be a finite number, got ", v);
      TESSERA_CHECK(bounds.contains(v), where(key), " must be ", bounds.describe(), ", got ", v);
      out = v;
    }
  }

  std::string where(const std::string& key) const {
    return source_ + ": " + (name_.empty() ? key : name_ + "." + key);
  }

  void check_unknown() const {
    if (!table_) return;
    for (const auto& [k, v] : *table_) {
      const std::string key(k.str());
      TESSERA_CHECK(seen_.count(key), source_, ": unknown key '",
                    name_.empty() ? key : name_ + "." + key, "'");
    }
  }

 private:
  const toml::node* find(const char* key) {
    seen_.insert(key);
    return table_ ? table_->get(key) : nullptr;
  }

  const toml::table* table_;
  std::string name_, source_;
  std::set<std::string> seen_;
};

void check_one_of(const std::string& v, std::initializer_list<const char*> allowed,
                  const Section& s, const char* key) {
  std::string list;
  for (const char* a : allowed) {
    if (v == a) return;
    list += list.empty() ? a : std::string(", ") + a;
  }
  fail(s.where(key), " is '", v, "', expected one of ", list);
}

// Each step multiplies decayed weights by 1 - lr * weight_decay (at the peak lr); at or
// below 0 that zeroes or flips them.
void check_decay(double lr, double weight_decay, const Section& s, const char* lr_key,
                 const char* decay_key) {
  TESSERA_CHECK(lr * weight_decay < 1, s.where(decay_key), " * ", lr_key, " must be below 1 (",
                "each step multiplies the weights by 1 - lr * weight_decay), got ", weight_decay,
                " * ", lr, " = ", lr * weight_decay);
}

}  // namespace

TrainConfig TrainConfig::parse(const std::string& text, const std::string& source) {
  const toml::table root = io::parse_toml_text(text, source);
  TrainConfig c;
  c.source_text = text;
  c.source = source;
  const std::set<std::string> tables = {"run",      "model",      "data",        "optimizer",
                                        "schedule", "training",   "checkpoint",  "spike_guard",
                                        "logging",  "parallel", "lora"};
  for (const auto& [k, v] : root) {
    const std::string key(k.str());
    TESSERA_CHECK(tables.count(key), source, ": unknown table or key '", key, "'");
    TESSERA_CHECK(v.is_table(), source, ": '", key, "' must be a table ([", key, "])");
  }
  auto table = [&](const char* name) { return Section(root[name].as_table(), name, source); };

  Section run = table("run");
  run.get("out_dir", c.out_dir);
  run.get("save_dtype", c.save_dtype);
  run.check_unknown();
  TESSERA_CHECK(c.save_dtype == "f32" || c.save_dtype == "bf16", run.where("save_dtype"),
                " must be \"f32\" or \"bf16\", got \"", c.save_dtype, "\"");
  TESSERA_CHECK(!c.out_dir.empty(), run.where("out_dir"), " must not be empty");

  // Sizes are overrides of the shape (0 = keep it); the model's own validation bounds
  // the result (model::ModelConfig::validate, run by build_model).
  Section m = table("model");
  auto& mo = c.model;
  m.get("shape", mo.shape);
  m.get("config", mo.config);
  m.get("init_from", mo.init_from);
  m.get("arch", mo.arch);
  m.get("vocab_size", mo.vocab_size, 0, kMaxCount);
  m.get("hidden_size", mo.hidden_size, 0, kMaxCount);
  m.get("num_layers", mo.num_layers, 0, kMaxCount);
  m.get("num_heads", mo.num_heads, 0, kMaxCount);
  m.get("num_kv_heads", mo.num_kv_heads, 0, kMaxCount);
  m.get("intermediate_size", mo.intermediate_size, 0, kMaxCount);
  m.get("max_position_embeddings", mo.max_position_embeddings, 0, kMaxCount);
  bool tie = false;  // -1 (keep the shape's choice) unless the key is given
  m.get("tie_word_embeddings", tie);
  if (root["model"]["tie_word_embeddings"]) mo.tie_word_embeddings = tie ? 1 : 0;
  m.get("seed", mo.seed, 0, kMaxInt);
  m.check_unknown();
  TESSERA_CHECK(mo.config.empty() || mo.init_from.empty(), m.where("config"),
                " and model.init_from are exclusive (init_from brings its own config.json)");
  if (!mo.arch.empty()) check_one_of(mo.arch, {"llama", "qwen2", "gpt2"}, m, "arch");

  // seq_len against the model's max_position_embeddings: build_model (trainer_setup.cc).
  Section d = table("data");
  auto& da = c.data;
  d.get("format", da.format);
  d.get("path", da.path);
  d.get("val_fraction", da.val_fraction, {0, 1, false, true});
  d.get("dir", da.dir);
  d.get("tokenizer", da.tokenizer);
  d.get("seq_len", da.seq_len, 1, int64_t{1} << 20);
  d.get("batch_size", da.batch_size, 1, kMaxCount);
  d.get("grad_accum", da.grad_accum, 1, kMaxCount);
  d.get("seed", da.seed, 0, kMaxInt);
  d.check_unknown();
  if (!da.format.empty()) check_one_of(da.format, {"tokens", "chat"}, d, "format");
  TESSERA_CHECK(da.path.empty() || da.format == "chat", d.where("path"), " (a JSONL of conversations) needs "
                "data.format = \"chat\"");
  if (da.format == "chat" && !da.path.empty()) {
    TESSERA_CHECK(!da.tokenizer.empty() || !c.model.init_from.empty(), d.where("path"), " needs a tokenizer with a "
                  "chat template: data.tokenizer or model.init_from");
    if (da.dir.empty()) da.dir = c.out_dir + "/chat_data";
  }
  TESSERA_CHECK(!da.dir.empty(), d.where("dir"), " is required (a directory from `tessera data prepare`",
                da.format == "chat" ? ", or data.path" : "", ")");

  Section o = table("optimizer");
  auto& op = c.optimizer;
  o.get("name", op.name);
  o.get("lr", op.lr, {0, 10, true, true});
  o.get("beta1", op.beta1, kUnitOpenAbove);
  o.get("beta2", op.beta2, kUnitOpenAbove);
  // Used in f32: below ~1e-38 it rounds to 0 (0 / 0 for a weight with no gradient yet);
  // above 1 it is a typo for 1e-x.
  o.get("eps", op.eps, {1e-30, 1});
  o.get("weight_decay", op.weight_decay, kNonNegative);
  o.get("muon_lr", op.muon_lr, {0, 10, true, true});
  o.get("muon_momentum", op.muon_momentum, kUnitOpenAbove);
  o.get("muon_nesterov", op.muon_nesterov);
  o.get("muon_ns_steps", op.muon_ns_steps, 1, 20);
  o.get("muon_weight_decay", op.muon_weight_decay, kNonNegative);
  o.check_unknown();
  check_one_of(op.name, {"adamw", "muon"}, o, "name");
  check_decay(op.lr, op.weight_decay, o, "optimizer.lr", "weight_decay");
  check_decay(op.muon_lr, op.muon_weight_decay, o, "optimizer.muon_lr", "muon_weight_decay");

  Section t = table("training");
  auto& tr = c.training;
  t.get("steps", tr.steps, 1, kMaxInt);
  t.get("precision", tr.precision);
  t.get("bf16_mode", tr.bf16_mode);
  t.get("activation_checkpointing", tr.activation_checkpointing);
  t.get("max_grad_norm", tr.max_grad_norm);  // any finite value; <= 0 turns clipping off
  t.get("eval_every", tr.eval_every, 0, kMaxInt);
  t.get("eval_batches", tr.eval_batches, 0, kMaxInt);
  t.get("moe_capacity_factor", tr.moe_capacity_factor, {0, 1e6, false, false});
  t.get("moe_bias_update_rate", tr.moe_bias_update_rate, kUnit);
  t.get("mtp_loss_weight", tr.mtp_loss_weight, {0, 1e3, false, false});
  t.get("memory_limit_mb", tr.memory_limit_mb, kNonNegative);
  t.get("fp16_init_scale", c.fp16_init_scale, {1, 1e38});  // held in f32 (max ~3.4e38)
  t.get("fp16_growth_interval", c.fp16_growth_interval, 1, kMaxInt);
  t.check_unknown();
  check_one_of(tr.precision, {"bf16", "fp16", "fp32"}, t, "precision");
  check_one_of(tr.bf16_mode, {"auto", "native", "emulated"}, t, "bf16_mode");
  check_one_of(tr.activation_checkpointing, {"none", "selective", "full"}, t,
               "activation_checkpointing");

  Section s = table("schedule");
  auto& sc = c.schedule;
  sc.total_steps = tr.steps;
  s.get("kind", sc.kind);
  s.get("warmup_steps", sc.warmup_steps, 0, kMaxInt);
  s.get("min_lr_ratio", sc.min_lr_ratio, kUnit);
  s.get("decay_fraction", sc.decay_fraction, kUnit);
  s.get("wsd_decay", sc.wsd_decay);
  s.check_unknown();
  check_one_of(sc.kind, {"cosine", "wsd", "constant"}, s, "kind");
  check_one_of(sc.wsd_decay, {"linear", "sqrt"}, s, "wsd_decay");
  TESSERA_CHECK(sc.warmup_steps <= tr.steps, s.where("warmup_steps"),
                " must be in [0, training.steps = ", tr.steps, "], got ", sc.warmup_steps);

  Section k = table("checkpoint");
  k.get("every", c.checkpoint.every, 0, kMaxInt);
  k.get("keep", c.checkpoint.keep, 1, kMaxCount);
  k.get("async", c.checkpoint.async);
  k.check_unknown();

  Section g = table("spike_guard");
  auto& sg = c.spike_guard;
  g.get("enabled", sg.enabled);
  g.get("sigma", sg.sigma, kPositive);
  g.get("window", sg.window, 2, kMaxInt);
  g.get("min_history", sg.min_history, 2, kMaxInt);
  g.get("policy", sg.policy);
  g.get("max_rollbacks", sg.max_rollbacks, 0, kMaxInt);  // 0: never roll back
  g.check_unknown();
  TESSERA_CHECK(sg.min_history <= sg.window, g.where("min_history"),
                " must be in [2, spike_guard.window = ", sg.window, "], got ", sg.min_history);
  check_one_of(sg.policy, {"skip", "rollback"}, g, "policy");

  Section l = table("logging");
  l.get("progress", c.logging.progress);
  l.get("peak_gflops", c.logging.peak_gflops, kNonNegative);
  l.get("plot", c.logging.plot);
  l.get("trace", c.logging.trace);
  l.check_unknown();

  Section lo = table("lora");
  auto& lr = c.lora;
  lr.enabled = root["lora"].as_table() != nullptr;
  lo.get("rank", lr.rank, 1, 1 << 16);
  lo.get("alpha", lr.alpha, kPositive);
  lo.get("dropout", lr.dropout, kUnitOpenAbove);
  lo.get("rslora", lr.rslora);
  lo.get("target_modules", lr.target_modules);
  lo.get("init_from", lr.init_from);
  lo.get("quantize_base", lr.quantize_base);
  if (!lr.quantize_base.empty()) check_one_of(lr.quantize_base, {"int8", "int4", "fp8"}, lo, "quantize_base");
  lo.get("seed", lr.seed, 0, kMaxInt);
  lo.check_unknown();
  if (lr.enabled) {
    TESSERA_CHECK(!lr.target_modules.empty(), lo.where("target_modules"), " is empty");
    for (const auto& m : lr.target_modules)
      TESSERA_CHECK(m == "all-linear" || model::parse_lora_module(m), lo.where("target_modules"), ": '", m,
                    "' is not one of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, all-linear");
    TESSERA_CHECK(!c.model.init_from.empty(), lo.where("rank"), ": LoRA fine-tunes a model: set model.init_from");
  }

  Section p = table("parallel");
  auto& pa = c.parallel;
  p.get("zero_stage", pa.zero_stage, 0, 3);
  p.get("bucket_mb", pa.bucket_mb, {0, 1 << 20, true, false});  // x 2^20 must fit int64
  p.get("offload", pa.offload);
  p.get("prefetch", pa.prefetch);
  p.get("algorithm", pa.algorithm);
  p.get("timeout_s", pa.timeout_s, kPositive);
  // Mesh axes; their product against the world size is checked when the job starts.
  p.get("dp", pa.dp, 0, 65536);
  for (auto [key, v] : {std::pair<const char*, int64_t*>{"tp", &pa.tp}, {"pp", &pa.pp}, {"cp", &pa.cp},
                        {"ep", &pa.ep}})
    p.get(key, *v, 1, 65536);
  p.get("cp_method", pa.cp_method);
  p.get("sequence_parallel", pa.sequence_parallel);
  p.get("sp_overlap", pa.sp_overlap);
  p.get("pp_schedule", pa.pp_schedule);
  p.get("pp_virtual_stages", pa.pp_virtual_stages, 1, 1024);
  p.get("pp_layers", pa.pp_layers, 1, 1 << 20);
  p.check_unknown();
  check_one_of(pa.algorithm, {"auto", "backend", "ring", "hd", "hierarchical"}, p, "algorithm");
  check_one_of(pa.pp_schedule, {"gpipe", "1f1b", "interleaved"}, p, "pp_schedule");
  check_one_of(pa.cp_method, {"ring", "ulysses"}, p, "cp_method");
  return c;
}

TrainConfig TrainConfig::load(const std::string& path) {
  return parse(io::read_file_bytes(path), path);
}

}  // namespace tessera::train
