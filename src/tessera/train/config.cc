// TOML -> TrainConfig with every key checked: unknown tables and keys, wrong types and
// out-of-range values are errors naming "table.key".
#include "tessera/train/config.h"

#include <set>
#include <sstream>

#include <toml++/toml.h>

#include "tessera/base/error.h"
#include "tessera/io/json_file.h"
#include "tessera/io/toml_text.h"

namespace tessera::train {
namespace {

// Reads the keys of one table, remembering which were read so the rest can be reported.
class Section {
 public:
  Section(const toml::table* table, std::string name, std::string source)
      : table_(table), name_(std::move(name)), source_(std::move(source)) {}

  template <typename T>
  void get(const char* key, T& out) {
    seen_.insert(key);
    if (!table_) return;
    const toml::node* node = table_->get(key);
    if (!node) return;
    if constexpr (std::is_same_v<T, bool>) {
      auto v = node->value<bool>();
      TESSERA_CHECK(v && node->is_boolean(), where(key), " must be true or false");
      out = *v;
    } else if constexpr (std::is_integral_v<T>) {
      TESSERA_CHECK(node->is_integer(), where(key), " must be an integer");
      const int64_t v = *node->value<int64_t>();
      TESSERA_CHECK(std::is_signed_v<T> || v >= 0, where(key), " must not be negative, got ", v);
      out = static_cast<T>(v);
    } else if constexpr (std::is_floating_point_v<T>) {
      TESSERA_CHECK(node->is_number(), where(key), " must be a number");
      out = static_cast<T>(*node->value<double>());
    } else {
      TESSERA_CHECK(node->is_string(), where(key), " must be a string");
      out = *node->value<std::string>();
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
  const toml::table* table_;
  std::string name_, source_;
  std::set<std::string> seen_;
};

void check_positive(bool ok, const Section& s, const char* key, const std::string& what) {
  TESSERA_CHECK(ok, s.where(key), " ", what);
}

void check_one_of(const std::string& v, std::initializer_list<const char*> allowed,
                  const Section& s, const char* key) {
  std::string list;
  for (const char* a : allowed) {
    if (v == a) return;
    list += list.empty() ? a : std::string(", ") + a;
  }
  fail(s.where(key), " is '", v, "', expected one of ", list);
}

}  // namespace

TrainConfig TrainConfig::parse(const std::string& text, const std::string& source) {
  const toml::table root = io::parse_toml_text(text, source);
  TrainConfig c;
  c.source_text = text;
  const std::set<std::string> tables = {"run",      "model",      "data",        "optimizer",
                                        "schedule", "training",   "checkpoint",  "spike_guard",
                                        "logging",  "parallel"};
  for (const auto& [k, v] : root) {
    const std::string key(k.str());
    TESSERA_CHECK(tables.count(key), source, ": unknown table or key '", key, "'");
    TESSERA_CHECK(v.is_table(), source, ": '", key, "' must be a table ([", key, "])");
  }
  auto table = [&](const char* name) { return Section(root[name].as_table(), name, source); };

  Section run = table("run");
  run.get("out_dir", c.out_dir);
  run.check_unknown();
  TESSERA_CHECK(!c.out_dir.empty(), run.where("out_dir"), " must not be empty");

  Section m = table("model");
  auto& mo = c.model;
  m.get("shape", mo.shape);
  m.get("config", mo.config);
  m.get("init_from", mo.init_from);
  m.get("arch", mo.arch);
  m.get("vocab_size", mo.vocab_size);
  m.get("hidden_size", mo.hidden_size);
  m.get("num_layers", mo.num_layers);
  m.get("num_heads", mo.num_heads);
  m.get("num_kv_heads", mo.num_kv_heads);
  m.get("intermediate_size", mo.intermediate_size);
  m.get("max_position_embeddings", mo.max_position_embeddings);
  bool tie = false;  // -1 (keep the shape's choice) unless the key is given
  m.get("tie_word_embeddings", tie);
  if (root["model"]["tie_word_embeddings"]) mo.tie_word_embeddings = tie ? 1 : 0;
  m.get("seed", mo.seed);
  m.check_unknown();
  TESSERA_CHECK(mo.config.empty() || mo.init_from.empty(), m.where("config"),
                " and model.init_from are exclusive (init_from brings its own config.json)");
  if (!mo.arch.empty()) check_one_of(mo.arch, {"llama", "qwen2", "gpt2"}, m, "arch");

  Section d = table("data");
  auto& da = c.data;
  d.get("dir", da.dir);
  d.get("tokenizer", da.tokenizer);
  d.get("seq_len", da.seq_len);
  d.get("batch_size", da.batch_size);
  d.get("grad_accum", da.grad_accum);
  d.get("seed", da.seed);
  d.check_unknown();
  TESSERA_CHECK(!da.dir.empty(), d.where("dir"), " is required (a directory from `tessera data prepare`)");
  check_positive(da.seq_len >= 1 && da.seq_len <= 1 << 20, d, "seq_len", "must be in [1, 1048576]");
  check_positive(da.batch_size >= 1, d, "batch_size", "must be at least 1");
  check_positive(da.grad_accum >= 1, d, "grad_accum", "must be at least 1");

  Section o = table("optimizer");
  auto& op = c.optimizer;
  o.get("name", op.name);
  o.get("lr", op.lr);
  o.get("beta1", op.beta1);
  o.get("beta2", op.beta2);
  o.get("eps", op.eps);
  o.get("weight_decay", op.weight_decay);
  o.get("muon_lr", op.muon_lr);
  o.get("muon_momentum", op.muon_momentum);
  o.get("muon_nesterov", op.muon_nesterov);
  o.get("muon_ns_steps", op.muon_ns_steps);
  o.get("muon_weight_decay", op.muon_weight_decay);
  o.check_unknown();
  check_one_of(op.name, {"adamw", "muon"}, o, "name");
  check_positive(op.lr > 0 && op.lr < 10, o, "lr", "must be in (0, 10)");
  check_positive(op.beta1 >= 0 && op.beta1 < 1, o, "beta1", "must be in [0, 1)");
  check_positive(op.beta2 >= 0 && op.beta2 < 1, o, "beta2", "must be in [0, 1)");
  check_positive(op.eps > 0, o, "eps", "must be positive");
  check_positive(op.weight_decay >= 0, o, "weight_decay", "must not be negative");
  check_positive(op.muon_lr > 0, o, "muon_lr", "must be positive");
  check_positive(op.muon_momentum >= 0 && op.muon_momentum < 1, o, "muon_momentum",
                 "must be in [0, 1)");
  check_positive(op.muon_ns_steps >= 1 && op.muon_ns_steps <= 20, o, "muon_ns_steps",
                 "must be in [1, 20]");
  check_positive(op.muon_weight_decay >= 0, o, "muon_weight_decay", "must not be negative");

  Section t = table("training");
  auto& tr = c.training;
  t.get("steps", tr.steps);
  t.get("precision", tr.precision);
  t.get("bf16_mode", tr.bf16_mode);
  t.get("activation_checkpointing", tr.activation_checkpointing);
  t.get("max_grad_norm", tr.max_grad_norm);
  t.get("eval_every", tr.eval_every);
  t.get("eval_batches", tr.eval_batches);
  t.get("fp16_init_scale", c.fp16_init_scale);
  t.get("fp16_growth_interval", c.fp16_growth_interval);
  t.check_unknown();
  check_positive(tr.steps >= 1, t, "steps", "must be at least 1");
  check_one_of(tr.precision, {"bf16", "fp16", "fp32"}, t, "precision");
  check_one_of(tr.bf16_mode, {"auto", "native", "emulated"}, t, "bf16_mode");
  check_one_of(tr.activation_checkpointing, {"none", "selective", "full"}, t,
               "activation_checkpointing");
  check_positive(tr.eval_every >= 0, t, "eval_every", "must not be negative");
  check_positive(tr.eval_batches >= 0, t, "eval_batches", "must not be negative");
  check_positive(c.fp16_init_scale >= 1, t, "fp16_init_scale", "must be at least 1");
  check_positive(c.fp16_growth_interval >= 1, t, "fp16_growth_interval", "must be at least 1");

  Section s = table("schedule");
  auto& sc = c.schedule;
  sc.total_steps = tr.steps;
  s.get("kind", sc.kind);
  s.get("warmup_steps", sc.warmup_steps);
  s.get("min_lr_ratio", sc.min_lr_ratio);
  s.get("decay_fraction", sc.decay_fraction);
  s.get("wsd_decay", sc.wsd_decay);
  s.check_unknown();
  check_one_of(sc.kind, {"cosine", "wsd", "constant"}, s, "kind");
  check_one_of(sc.wsd_decay, {"linear", "sqrt"}, s, "wsd_decay");
  check_positive(sc.warmup_steps >= 0 && sc.warmup_steps <= tr.steps, s, "warmup_steps",
                 "must be in [0, training.steps]");
  check_positive(sc.min_lr_ratio >= 0 && sc.min_lr_ratio <= 1, s, "min_lr_ratio",
                 "must be in [0, 1]");
  check_positive(sc.decay_fraction >= 0 && sc.decay_fraction <= 1, s, "decay_fraction",
                 "must be in [0, 1]");

  Section k = table("checkpoint");
  k.get("every", c.checkpoint.every);
  k.get("keep", c.checkpoint.keep);
  k.get("async", c.checkpoint.async);
  k.check_unknown();
  check_positive(c.checkpoint.every >= 0, k, "every", "must not be negative");
  check_positive(c.checkpoint.keep >= 1, k, "keep", "must be at least 1");

  Section g = table("spike_guard");
  auto& sg = c.spike_guard;
  g.get("enabled", sg.enabled);
  g.get("sigma", sg.sigma);
  g.get("window", sg.window);
  g.get("min_history", sg.min_history);
  g.get("policy", sg.policy);
  g.get("max_rollbacks", sg.max_rollbacks);
  g.check_unknown();
  check_positive(sg.sigma > 0, g, "sigma", "must be positive");
  check_positive(sg.window >= 2, g, "window", "must be at least 2");
  check_positive(sg.min_history >= 2 && sg.min_history <= sg.window, g, "min_history",
                 "must be in [2, spike_guard.window]");
  check_one_of(sg.policy, {"skip", "rollback"}, g, "policy");

  Section l = table("logging");
  l.get("progress", c.logging.progress);
  l.get("peak_gflops", c.logging.peak_gflops);
  l.get("plot", c.logging.plot);
  l.get("trace", c.logging.trace);
  l.check_unknown();
  check_positive(c.logging.peak_gflops >= 0, l, "peak_gflops", "must not be negative");

  Section p = table("parallel");
  auto& pa = c.parallel;
  p.get("zero_stage", pa.zero_stage);
  p.get("bucket_mb", pa.bucket_mb);
  p.get("offload", pa.offload);
  p.get("prefetch", pa.prefetch);
  p.get("algorithm", pa.algorithm);
  p.get("timeout_s", pa.timeout_s);
  p.check_unknown();
  check_positive(pa.zero_stage >= 0 && pa.zero_stage <= 3, p, "zero_stage", "must be 0, 1, 2 or 3");
  check_positive(pa.bucket_mb > 0, p, "bucket_mb", "must be positive");
  check_positive(pa.timeout_s > 0, p, "timeout_s", "must be positive");
  check_one_of(pa.algorithm, {"auto", "backend", "ring", "hd", "hierarchical"}, p, "algorithm");
  return c;
}

TrainConfig TrainConfig::load(const std::string& path) {
  return parse(io::read_file_bytes(path), path);
}

}  // namespace tessera::train
