// `tessera export --format gguf`: a model directory (or GGUF file) as a GGUF file for
// llama.cpp / Ollama (model/gguf_model.h). `tessera export --merge-lora ADAPTER`: a base
// model with a PEFT LoRA adapter merged in, as a Hugging Face directory (model/lora_io.h).
#include <cstdio>
#include <filesystem>
#include <map>

#include "tessera/base/error.h"
#include "tessera/cli/commands.h"
#include "tessera/io/gguf_tokenizer.h"
#include "tessera/model/gguf_model.h"
#include "tessera/model/lora_io.h"
#include "tessera/model/model.h"

namespace tessera::cli {

namespace {

struct ExportFlags {
  std::string format, model, out, type = "f16", name, merge_lora;
  CLI::Option* type_opt = nullptr;
  CLI::Option* name_opt = nullptr;
};

int run_merge_lora(const ExportFlags& f) {
  TESSERA_CHECK(f.format == "hf", "--merge-lora writes --format hf; merge first, then export to GGUF "
                "(tessera export --format gguf --model MERGED_DIR)");
  TESSERA_CHECK(f.type_opt->count() == 0 && f.name_opt->count() == 0, "--type and --name apply to --format gguf");
  const auto r = model::export_merged_lora(f.merge_lora, f.model, f.out);
  std::string files = "model.safetensors";
  for (const auto& name : r.tokenizer_files) files += ", " + name;
  std::printf("wrote %s: %s merged with the LoRA adapter %s (%lld modules, r %lld, alpha %g%s); %s\n",
              f.out.c_str(), f.model.c_str(), f.merge_lora.c_str(), static_cast<long long>(r.modules),
              static_cast<long long>(r.config.rank), r.config.alpha, r.config.rslora ? ", rslora" : "",
              files.c_str());
  return 0;
}

int run_export(ExportFlags f) {
  if (f.format.empty() && !f.merge_lora.empty()) f.format = "hf";
  TESSERA_CHECK(!f.format.empty(), "--format is required: gguf (or hf with --merge-lora ADAPTER_DIR)");
  TESSERA_CHECK(f.format == "gguf" || f.format == "hf", "--format '", f.format,
                "' is not supported (gguf, or hf with --merge-lora)");
  if (!f.merge_lora.empty()) return run_merge_lora(f);
  TESSERA_CHECK(f.format == "gguf", "--format hf needs --merge-lora ADAPTER_DIR (a model directory is already "
                "in Hugging Face format)");
  namespace fs = std::filesystem;
  std::error_code ec;
  TESSERA_CHECK(!fs::equivalent(f.model, f.out, ec), "--out ", f.out, " is the input model");
  model::GgufExportOptions o;
  o.type = model::parse_gguf_export_type(f.type);
  o.name = f.name.empty() ? fs::path(f.model).lexically_normal().filename().string() : f.name;
  if (o.name.empty()) o.name = fs::path(f.model).lexically_normal().parent_path().filename().string();
  const model::Model m = model::Model::load(f.model, DType::kF32);
  const auto tok = io::load_model_tokenizer(f.model);
  const auto report = model::export_gguf(m, tok ? &*tok : nullptr, f.out, o);
  std::map<std::string, int> by_type;
  for (const auto& [name, type] : report.tensors) ++by_type[io::ggml_type_name(type)];
  std::string types;
  for (const auto& [type, n] : by_type) types += (types.empty() ? "" : ", ") + std::to_string(n) + " " + type;
  std::printf("wrote %s: %s, %zu tensors (%s), %.1f MB%s\n", f.out.c_str(), model::arch_name(m.config().arch),
              report.tensors.size(), types.c_str(), fs::file_size(f.out) / 1e6,
              tok ? "" : "; no tokenizer (llama.cpp needs one)");
  return 0;
}

}  // namespace

void add_export(CLI::App& app, Action& action) {
  auto f = std::make_shared<ExportFlags>();
  auto* cmd = app.add_subcommand("export", "Write a model in another format (GGUF for llama.cpp / Ollama), or "
                                 "merge a LoRA adapter into its base model");
  cmd->add_option("--format", f->format, "Output format: gguf, or hf (a Hugging Face directory; with --merge-lora)");
  cmd->add_option("--model", f->model, "Hugging Face model directory (or a GGUF file)")->required();
  cmd->add_option("--out", f->out, "Output file (gguf) or directory (hf)")->required();
  cmd->add_option("--merge-lora", f->merge_lora,
                  "PEFT LoRA adapter directory (adapter_config.json, adapter_model.safetensors) to merge "
                  "into --model; writes --format hf");
  f->type_opt = cmd->add_option("--type", f->type,
                  "Type of the 2-D weights: f32, f16, bf16, q8_0, q4_0, q4_k (norms stay f32; "
                  "see docs/quantization.md)")
      ->capture_default_str();
  f->name_opt = cmd->add_option("--name", f->name, "general.name (default: the model directory's name)");
  cmd->callback([&action, f] { action = [f] { return run_export(*f); }; });
}

}  // namespace tessera::cli
