// tokenizer.ggml.* <-> tokenizer.json: what llama.cpp's converter writes for a byte-level BPE
// tokenizer, and the tokenizer.json that encodes the same way, built back from it.
#include "tessera/io/gguf_tokenizer.h"

#include <filesystem>
#include <map>

#include "tessera/base/error.h"
#include "tessera/base/logging.h"
#include "tessera/io/pretokenize.h"

namespace tessera::io {

namespace {

using nlohmann::json;

// Split patterns of the pre-tokenizers llama.cpp names (llama-vocab.cpp), as the Hugging
// Face tokenizer.json files of those models spell them.
constexpr const char* kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr const char* kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

struct PreTokenizerName {
  const char* name;      // tokenizer.ggml.pre
  const char* pattern;   // the split regex
  bool nfc;              // Qwen2's tokenizer.json normalizes to NFC
  bool ignore_merges;    // Llama 3's: whole words in the vocabulary skip the merges
  bool add_bos;          // llama.cpp's default for add_bos_token
};

// The first entry of each pattern is the name export writes; the others are aliases
// llama.cpp reads the same way.
constexpr PreTokenizerName kPreNames[] = {
    {"gpt-2", kGpt2SplitPattern, false, false, false},
    {"llama-bpe", kLlama3Pattern, false, true, true},
    {"llama3", kLlama3Pattern, false, true, true},
    {"llama-v3", kLlama3Pattern, false, true, true},
    {"qwen2", kQwen2Pattern, true, false, false},
};

std::string known_pre_names() {
  std::string s;
  for (const auto& p : kPreNames) s += std::string(s.empty() ? "" : ", ") + p.name;
  return s;
}

// The split regex of a tokenizer.json pre-tokenizer in the two shapes byte-level BPE
// tokenizers use: ByteLevel with use_regex (GPT-2's pattern), or Split(Regex, Isolated)
// then ByteLevel without it. Empty for anything else.
std::string split_pattern(const json& pre) {
  if (!pre.is_object()) return "";
  if (pre.value("type", "") == "ByteLevel")
    return pre.value("use_regex", true) && !pre.value("add_prefix_space", false) ? kGpt2SplitPattern : "";
  if (pre.value("type", "") != "Sequence" || !pre.contains("pretokenizers")) return "";
  const json& steps = pre["pretokenizers"];
  if (!steps.is_array() || steps.size() != 2) return "";
  const json& split = steps[0];
  const json& bl = steps[1];
  const bool ok = split.is_object() && split.value("type", "") == "Split" &&
                  split.value("behavior", "") == "Isolated" && !split.value("invert", false) &&
                  split.contains("pattern") && split["pattern"].is_object() &&
                  split["pattern"].contains("Regex") && split["pattern"]["Regex"].is_string() &&
                  bl.is_object() && bl.value("type", "") == "ByteLevel" && !bl.value("use_regex", true) &&
                  !bl.value("add_prefix_space", false);
  return ok ? split["pattern"]["Regex"].get<std::string>() : "";
}

}  // namespace

GgufMetadata gguf_tokenizer_metadata(const Tokenizer& tok, int64_t vocab_size) {
  const json j = tok.to_json();
  const std::string pattern = split_pattern(j.value("pre_tokenizer", json()));
  const PreTokenizerName* pre = nullptr;
  for (const auto& p : kPreNames)
    if (!pre && pattern == p.pattern) pre = &p;
  TESSERA_CHECK(pre, "GGUF export: the tokenizer's pre-tokenizer ",
                pattern.empty() ? std::string("is not a split regex then ByteLevel") : "pattern '" + pattern + "'",
                ", which llama.cpp has no name for (it knows GPT-2's, Llama 3's and Qwen2's: ", known_pre_names(), ")");
  TESSERA_CHECK(tok.vocab_size() <= vocab_size, "GGUF export: the tokenizer has ", tok.vocab_size(),
                " ids, more than the model's vocabulary of ", vocab_size);

  std::vector<std::string> tokens(static_cast<size_t>(vocab_size));
  std::vector<int32_t> types(static_cast<size_t>(vocab_size), static_cast<int32_t>(GgufTokenType::kUnused));
  for (int64_t i = 0; i < vocab_size; ++i) tokens[i] = "[PAD" + std::to_string(i) + "]";
  for (const auto& [token, id] : j["model"]["vocab"].items()) {
    tokens[id.get<int64_t>()] = token;
    types[id.get<int64_t>()] = static_cast<int32_t>(GgufTokenType::kNormal);
  }
  if (j.contains("added_tokens") && j["added_tokens"].is_array())
    for (const json& a : j["added_tokens"]) {
      const int64_t id = a["id"].get<int64_t>();
      tokens[id] = a["content"].get<std::string>();
      types[id] = static_cast<int32_t>(a.value("special", false) ? GgufTokenType::kControl : GgufTokenType::kUserDefined);
    }
  std::vector<std::string> merges;
  for (const json& m : j["model"]["merges"])
    merges.push_back(m.is_string() ? m.get<std::string>() : m[0].get<std::string>() + " " + m[1].get<std::string>());

  GgufMetadata md;
  md.emplace_back("tokenizer.ggml.model", GgufValue::string("gpt2"));
  md.emplace_back("tokenizer.ggml.pre", GgufValue::string(pre->name));
  md.emplace_back("tokenizer.ggml.tokens", GgufValue::strings(std::move(tokens)));
  md.emplace_back("tokenizer.ggml.token_type", GgufValue::i32s(types));
  md.emplace_back("tokenizer.ggml.merges", GgufValue::strings(std::move(merges)));
  if (tok.bos_id() >= 0) md.emplace_back("tokenizer.ggml.bos_token_id", GgufValue::u32(static_cast<uint32_t>(tok.bos_id())));
  if (tok.eos_id() >= 0) md.emplace_back("tokenizer.ggml.eos_token_id", GgufValue::u32(static_cast<uint32_t>(tok.eos_id())));
  md.emplace_back("tokenizer.ggml.add_bos_token", GgufValue::boolean(tok.add_bos()));
  md.emplace_back("tokenizer.ggml.add_eos_token", GgufValue::boolean(false));
  if (!tok.chat_template().empty()) md.emplace_back("tokenizer.chat_template", GgufValue::string(tok.chat_template()));
  return md;
}

Tokenizer tokenizer_from_gguf(const GgufHeader& h, const std::string& source) {
  auto need = [&](const char* key) -> const GgufValue& {
    const GgufValue* v = h.find(key);
    TESSERA_CHECK(v, source, ": no metadata key '", key, "' (the file has no tokenizer)");
    return *v;
  };
  auto what = [&](const char* key) { return source + ": " + key; };
  const std::string model = need("tokenizer.ggml.model").as_string(what("tokenizer.ggml.model"));
  TESSERA_CHECK(model == "gpt2", source, ": tokenizer.ggml.model is '", model,
                "'; Tessera reads byte-level BPE tokenizers (\"gpt2\")",
                model == "llama" ? ", not SentencePiece (\"llama\")" : "");
  const std::vector<std::string>& tokens = need("tokenizer.ggml.tokens").as_strings(what("tokenizer.ggml.tokens"));
  const GgufValue* types = h.find("tokenizer.ggml.token_type");
  TESSERA_CHECK(!types || types->size() == tokens.size(), source, ": tokenizer.ggml.token_type has ",
                types ? types->size() : 0, " entries for ", tokens.size(), " tokens");
  static const std::vector<std::string> kNone;
  const GgufValue* merges_value = h.find("tokenizer.ggml.merges");
  const std::vector<std::string>& merges =
      merges_value ? merges_value->as_strings(what("tokenizer.ggml.merges")) : kNone;

  const PreTokenizerName* pre = &kPreNames[0];
  if (const GgufValue* p = h.find("tokenizer.ggml.pre")) {
    const std::string name = p->as_string(what("tokenizer.ggml.pre"));
    pre = nullptr;
    for (const auto& k : kPreNames)
      if (!pre && name == k.name) pre = &k;
    TESSERA_CHECK(pre, source, ": tokenizer.ggml.pre '", name, "' is not supported (Tessera reads ",
                  known_pre_names(), ")");
  } else {
    TESSERA_LOG(kWarn, source, ": no tokenizer.ggml.pre; splitting text as GPT-2 does");
  }

  json vocab = json::object();
  json added = json::array();
  std::map<std::string, int64_t> seen;
  const std::string types_what = what("tokenizer.ggml.token_type");
  for (size_t id = 0; id < tokens.size(); ++id) {
    const int64_t type = types ? types->int_at(id, types_what) : 1;
    if (type == static_cast<int64_t>(GgufTokenType::kUnused)) continue;
    const std::string& t = tokens[id];
    const auto [it, fresh] = seen.emplace(t, static_cast<int64_t>(id));
    TESSERA_CHECK(fresh, source, ": tokenizer.ggml.tokens has '", t.substr(0, 40), "' at ids ", it->second,
                  " and ", id);
    if (type == static_cast<int64_t>(GgufTokenType::kControl) ||
        type == static_cast<int64_t>(GgufTokenType::kUserDefined)) {
      const bool special = type == static_cast<int64_t>(GgufTokenType::kControl);
      added.push_back({{"id", id}, {"content", t}, {"single_word", false}, {"lstrip", false},
                       {"rstrip", false}, {"normalized", false}, {"special", special}});
    } else {
      TESSERA_CHECK(type >= 0 && type <= static_cast<int64_t>(GgufTokenType::kByte), source,
                    ": tokenizer.ggml.token_type of token ", id, " is ", type, ", not a llama.cpp token type");
      vocab[t] = id;
    }
  }
  json merge_list = json::array();
  for (const std::string& m : merges) merge_list.push_back(m);

  const json j = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", std::move(added)},
      {"normalizer", pre->nfc ? json{{"type", "NFC"}} : json()},
      {"pre_tokenizer", PreTokenizer::byte_level_json(pre->pattern)},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true}, {"use_regex", true}}},
      {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr},
                 {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr},
                 {"fuse_unk", false}, {"byte_fallback", false}, {"ignore_merges", pre->ignore_merges},
                 {"vocab", std::move(vocab)}, {"merges", std::move(merge_list)}}}};

  // tokenizer_config.json's equivalent: the special tokens by name and whether to add them.
  auto token_key = [&](const char* key) -> json {
    const GgufValue* v = h.find(key);
    if (!v) return nullptr;
    const uint64_t id = v->as_uint(what(key));
    TESSERA_CHECK(id < tokens.size(), source, ": ", key, " ", id, " is outside the ", tokens.size(), " tokens");
    return tokens[id];
  };
  auto flag = [&](const char* key, bool dflt) {
    const GgufValue* v = h.find(key);
    return v ? v->as_bool(what(key)) : dflt;
  };
  json config = {{"bos_token", token_key("tokenizer.ggml.bos_token_id")},
                 {"eos_token", token_key("tokenizer.ggml.eos_token_id")},
                 {"add_bos_token", flag("tokenizer.ggml.add_bos_token", pre->add_bos)},
                 {"add_eos_token", flag("tokenizer.ggml.add_eos_token", false)},
                 {"tokenizer_class", "PreTrainedTokenizerFast"}};
  if (const GgufValue* t = h.find("tokenizer.chat_template"))
    config["chat_template"] = t->as_string(what("tokenizer.chat_template"));
  return Tokenizer::from_json(j, source, config);
}

std::optional<Tokenizer> load_model_tokenizer(const std::string& model_path) {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::is_directory(model_path, ec)) {
    if (!fs::exists(fs::path(model_path) / "tokenizer.json", ec)) return std::nullopt;
    return Tokenizer::load(model_path);
  }
  if (!is_gguf_path(model_path)) return std::nullopt;
  const auto f = GgufFile::open(model_path);
  if (!f->find("tokenizer.ggml.model")) return std::nullopt;
  return tokenizer_from_gguf(f->header(), model_path);
}

}  // namespace tessera::io
