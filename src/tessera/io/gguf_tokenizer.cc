// tokenizer.ggml.* <-> tokenizer.json: what llama.cpp's converter writes for a byte-level BPE
// tokenizer, and the tokenizer.json that encodes the same way, built back from it; and
// SentencePiece vocabularies ("llama") read as the BPE tokenizer.json Hugging Face makes of them.
#include "tessera/io/gguf_tokenizer.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <limits>
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
  const json decoder = j.value("decoder", json());
  TESSERA_CHECK(decoder.is_null() || (decoder.is_object() && decoder.value("type", "") == "ByteLevel"),
                "GGUF export: the tokenizer is SentencePiece-style BPE; export writes byte-level BPE (\"gpt2\") "
                "tokenizers only");
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

namespace {

// tokenizer.ggml.model "llama": a SentencePiece vocabulary with a score per token, which
// llama.cpp merges by score (the adjacent pair whose merged token scores highest, leftmost
// among equals). Hugging Face's tokenizer.json for the same model (transformers'
// LlamaConverter) is BPE whose merges come from the scores: every split of a token into two
// tokens is a merge, ordered by the merged token's score, highest first (then by token id,
// then by the ids of the two halves). That is the tokenizer built here, with byte fallback
// (the <0xNN> tokens), fuse_unk, and Llama 2's normalizer and decoder.
Tokenizer spm_tokenizer(const GgufHeader& h, const std::string& source, const std::vector<std::string>& tokens,
                        const GgufValue* types, const json& config) {
  auto what = [&](const char* key) { return source + ": " + key; };
  const GgufValue* scores = h.find("tokenizer.ggml.scores");
  TESSERA_CHECK(scores, source, ": no metadata key 'tokenizer.ggml.scores' (a SentencePiece vocabulary merges by score)");
  TESSERA_CHECK(scores->size() == tokens.size(), source, ": tokenizer.ggml.scores has ", scores->size(),
                " entries for ", tokens.size(), " tokens");
  auto type_of = [&](size_t id) { return types ? types->int_at(id, what("tokenizer.ggml.token_type")) : 1; };
  json vocab = json::object(), added = json::array();
  std::map<std::string, int64_t, std::less<>> ids;
  bool byte_tokens = false;
  int64_t unk = -1;
  for (size_t id = 0; id < tokens.size(); ++id) {
    const int64_t type = type_of(id);
    TESSERA_CHECK(type >= 0 && type <= static_cast<int64_t>(GgufTokenType::kByte), source,
                  ": tokenizer.ggml.token_type of token ", id, " is ", type, ", not a llama.cpp token type");
    if (type == static_cast<int64_t>(GgufTokenType::kUnused)) continue;
    const std::string& t = tokens[id];
    const auto [it, fresh] = ids.emplace(t, static_cast<int64_t>(id));
    TESSERA_CHECK(fresh, source, ": tokenizer.ggml.tokens has '", t.substr(0, 40), "' at ids ", it->second, " and ", id);
    vocab[t] = id;  // Hugging Face's converter keeps every piece in the BPE vocabulary
    byte_tokens |= type == static_cast<int64_t>(GgufTokenType::kByte);
    if (type == static_cast<int64_t>(GgufTokenType::kUnknown) && unk < 0) unk = static_cast<int64_t>(id);
    if (type == static_cast<int64_t>(GgufTokenType::kControl) || type == static_cast<int64_t>(GgufTokenType::kUnknown) ||
        type == static_cast<int64_t>(GgufTokenType::kUserDefined)) {
      added.push_back({{"id", id}, {"content", t}, {"single_word", false}, {"lstrip", false}, {"rstrip", false},
                       {"normalized", false}, {"special", type != static_cast<int64_t>(GgufTokenType::kUserDefined)}});
    }
  }
  if (const GgufValue* u = h.find("tokenizer.ggml.unknown_token_id")) {
    unk = static_cast<int64_t>(u->as_uint(what("tokenizer.ggml.unknown_token_id")));
    TESSERA_CHECK(unk < static_cast<int64_t>(tokens.size()), source, ": tokenizer.ggml.unknown_token_id ", unk,
                  " is outside the ", tokens.size(), " tokens");
  }
  struct Merge {
    double score;
    int64_t id, left, right;
  };
  std::vector<Merge> merges;
  const std::string scores_what = what("tokenizer.ggml.scores");
  constexpr size_t kMaxMergedBytes = 1024;  // real pieces: < 100 bytes; bounds a hostile file's cost
  for (const auto& [t, id] : ids) {
    double score = scores->float_at(static_cast<uint64_t>(id), scores_what);
    if (std::isnan(score)) score = -std::numeric_limits<double>::infinity();
    const std::string_view tv = t;
    for (size_t k = 1; k < tv.size() && tv.size() <= kMaxMergedBytes; ++k) {
      if ((static_cast<uint8_t>(tv[k]) & 0xC0) == 0x80) continue;  // split between characters only
      const auto l = ids.find(tv.substr(0, k)), r = ids.find(tv.substr(k));
      if (l != ids.end() && r != ids.end()) merges.push_back({score, id, l->second, r->second});
    }
  }
  std::sort(merges.begin(), merges.end(), [](const Merge& a, const Merge& b) {
    if (a.score != b.score) return a.score > b.score;
    if (a.id != b.id) return a.id < b.id;
    return a.left != b.left ? a.left < b.left : a.right < b.right;
  });
  json merge_list = json::array();
  for (const Merge& m : merges) merge_list.push_back({tokens[m.left], tokens[m.right]});

  bool space_prefix = true;  // llama.cpp's default for SentencePiece vocabularies
  if (const GgufValue* v = h.find("tokenizer.ggml.add_space_prefix"))
    space_prefix = v->as_bool(what("tokenizer.ggml.add_space_prefix"));
  const json replace = {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}};
  json decoders = json::array({{{"type", "Replace"}, {"pattern", {{"String", "\u2581"}}}, {"content", " "}},
                               {{"type", "ByteFallback"}}, {{"type", "Fuse"}}});
  if (space_prefix) decoders.push_back({{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}});
  const json j = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", std::move(added)},
      {"normalizer", space_prefix ? json{{"type", "Sequence"},
                                         {"normalizers", {{{"type", "Prepend"}, {"prepend", "\u2581"}}, replace}}}
                                  : replace},
      {"pre_tokenizer", nullptr},
      {"post_processor", nullptr},
      {"decoder", {{"type", "Sequence"}, {"decoders", std::move(decoders)}}},
      {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", unk >= 0 ? json(tokens[unk]) : json(nullptr)},
                 {"continuing_subword_prefix", nullptr}, {"end_of_word_suffix", nullptr},
                 {"fuse_unk", true}, {"byte_fallback", byte_tokens}, {"ignore_merges", false},
                 {"vocab", std::move(vocab)}, {"merges", std::move(merge_list)}}}};
  return Tokenizer::from_json(j, source, config);
}

}  // namespace

Tokenizer tokenizer_from_gguf(const GgufHeader& h, const std::string& source) {
  auto need = [&](const char* key) -> const GgufValue& {
    const GgufValue* v = h.find(key);
    TESSERA_CHECK(v, source, ": no metadata key '", key, "' (the file has no tokenizer)");
    return *v;
  };
  auto what = [&](const char* key) { return source + ": " + key; };
  const std::string model = need("tokenizer.ggml.model").as_string(what("tokenizer.ggml.model"));
  TESSERA_CHECK(model == "gpt2" || model == "llama", source, ": tokenizer.ggml.model is '", model,
                "'; Tessera reads byte-level BPE (\"gpt2\") and SentencePiece BPE (\"llama\") tokenizers");
  const std::vector<std::string>& tokens = need("tokenizer.ggml.tokens").as_strings(what("tokenizer.ggml.tokens"));
  const GgufValue* types = h.find("tokenizer.ggml.token_type");
  TESSERA_CHECK(!types || types->size() == tokens.size(), source, ": tokenizer.ggml.token_type has ",
                types ? types->size() : 0, " entries for ", tokens.size(), " tokens");
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
  auto make_config = [&](bool add_bos_default) {
    json config = {{"bos_token", token_key("tokenizer.ggml.bos_token_id")},
                   {"eos_token", token_key("tokenizer.ggml.eos_token_id")},
                   {"add_bos_token", flag("tokenizer.ggml.add_bos_token", add_bos_default)},
                   {"add_eos_token", flag("tokenizer.ggml.add_eos_token", false)},
                   {"tokenizer_class", "PreTrainedTokenizerFast"}};
    if (const GgufValue* t = h.find("tokenizer.chat_template"))
      config["chat_template"] = t->as_string(what("tokenizer.chat_template"));
    return config;
  };
  if (model == "llama") return spm_tokenizer(h, source, tokens, types, make_config(true));  // llama.cpp adds BOS
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

  return Tokenizer::from_json(j, source, make_config(pre->add_bos));
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
