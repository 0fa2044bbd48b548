// Builds a Tokenizer from Hugging Face's tokenizer.json (+ tokenizer_config.json), byte-level
// or SentencePiece-style BPE, checking every field it relies on and naming the key at fault.
#include <algorithm>
#include <filesystem>

#include "tessera/base/error.h"
#include "tessera/io/json_file.h"
#include "tessera/io/tokenizer_impl.h"

namespace tessera::io {

namespace {

constexpr int64_t kMaxTokenizerIds = int64_t{1} << 24;     // real vocabularies: <= 262144
constexpr int64_t kMaxTokenizerIdHoles = int64_t{1} << 20;  // ids no token uses

// A token id in the post-processor: an integer in [0, 2^31); never narrowed.
int32_t post_id(const nlohmann::json& v, const std::string& where) {
  TESSERA_CHECK(json_int_in(v, 0, INT32_MAX), where, ": expected a token id, got ", json_brief(v));
  return static_cast<int32_t>(v.get<int64_t>());
}

// tokenizer_config.json writes tokens as "text" or as {"content": "text", ...}.
std::string config_token(const nlohmann::json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_object() && v.contains("content") && v["content"].is_string()) return v["content"];
  return "";
}

// Reads the post-processor's single-sequence template into the ids around the text.
void read_post_processor(const nlohmann::json& p, const std::string& where, std::vector<int32_t>* prefix,
                         std::vector<int32_t>* suffix) {
  if (p.is_null()) return;
  TESSERA_CHECK(p.is_object() && p.contains("type") && p["type"].is_string(), where,
                ": expected null or an object with a \"type\"");
  const std::string type = p["type"];
  if (type == "ByteLevel") return;  // only moves offsets
  if (type == "Sequence") {
    TESSERA_CHECK(p.contains("processors") && p["processors"].is_array(), where, ".processors: expected an array");
    for (size_t i = 0; i < p["processors"].size(); ++i)
      read_post_processor(p["processors"][i], where + ".processors[" + std::to_string(i) + "]", prefix, suffix);
    return;
  }
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    for (const char* key : {"cls", "sep"}) {
      TESSERA_CHECK(p.contains(key) && p[key].is_array() && p[key].size() == 2 && p[key][1].is_number_integer(),
                    where, ".", key, ": expected [\"token\", id]");
    }
    prefix->push_back(post_id(p["cls"][1], where + ".cls[1]"));
    suffix->push_back(post_id(p["sep"][1], where + ".sep[1]"));
    return;
  }
  TESSERA_CHECK(type == "TemplateProcessing", where, ".type: unsupported post-processor '", type,
                "' (supported: TemplateProcessing, ByteLevel, RobertaProcessing, BertProcessing, Sequence, null)");
  TESSERA_CHECK(p.contains("single") && p["single"].is_array(), where, ".single: expected an array");
  const nlohmann::json specials =
      p.contains("special_tokens") && !p["special_tokens"].is_null() ? p["special_tokens"] : nlohmann::json::object();
  TESSERA_CHECK(specials.is_object(), where, ".special_tokens: expected an object");
  bool seen_sequence = false;
  for (size_t i = 0; i < p["single"].size(); ++i) {
    const auto& item = p["single"][i];
    const std::string at = where + ".single[" + std::to_string(i) + "]";
    if (item.is_object() && item.contains("Sequence")) {
      seen_sequence = true;
      continue;
    }
    TESSERA_CHECK(item.is_object() && item.contains("SpecialToken") && item["SpecialToken"].is_object() &&
                      item["SpecialToken"].contains("id") &&
                      item["SpecialToken"]["id"].is_string(),
                  at, ": expected {\"SpecialToken\": {\"id\": ...}} or {\"Sequence\": ...}");
    const std::string name = item["SpecialToken"]["id"];
    TESSERA_CHECK(specials.contains(name) && specials[name].is_object() && specials[name].contains("ids") &&
                      specials[name]["ids"].is_array(),
                  at, ": special token '", name, "' is not in ", where, ".special_tokens");
    for (const auto& id : specials[name]["ids"]) {
      (seen_sequence ? suffix : prefix)->push_back(post_id(id, where + ".special_tokens." + name + ".ids"));
    }
  }
}

}  // namespace

std::string chat_template_source(const nlohmann::json& config, const std::string& config_source,
                                 const std::string& dir, std::string* origin) {
  if (origin) *origin = config_source;
  constexpr size_t kMaxTemplateBytes = size_t{4} << 20;  // real templates: < 20 kB
  const auto it = config.is_object() ? config.find("chat_template") : config.end();
  if (config.is_object() && it != config.end() && !it->is_null()) {
    if (it->is_string()) return it->get<std::string>();
    TESSERA_CHECK(it->is_array(), config_source,
                  ": key 'chat_template' must be a string or a list of {\"name\", \"template\"}");
    for (const auto& t : *it)
      if (t.is_object() && t.contains("name") && t["name"] == "default" && t.contains("template") &&
          t["template"].is_string())
        return t["template"].get<std::string>();
    fail(config_source, ": key 'chat_template' is a list without a \"default\" template");
  }
  if (dir.empty()) return "";
  const std::string jinja = (std::filesystem::path(dir) / "chat_template.jinja").string();
  std::error_code ec;
  if (!std::filesystem::is_regular_file(jinja, ec)) return "";
  if (origin) *origin = jinja;
  return read_file_bytes(jinja, kMaxTemplateBytes);
}

Tokenizer Tokenizer::from_json(const nlohmann::json& j, const std::string& source,
                               const nlohmann::json& config) {
  return build(j, source, config, source + " (tokenizer_config.json)", "");
}

Tokenizer Tokenizer::build(const nlohmann::json& j, const std::string& source, const nlohmann::json& config,
                           const std::string& config_source, const std::string& dir) {
  auto m = std::make_shared<Impl>();
  m->source = source;
  m->json = j;
  m->config = config;
  m->chat_template = chat_template_source(config, config_source, dir, &m->chat_template_origin);
  TESSERA_CHECK(j.is_object(), source, ": expected a JSON object");
  TESSERA_CHECK(j.contains("model") && j["model"].is_object(), source, ": missing \"model\"");
  const auto& model = j["model"];
  const std::string mtype = json_string(model, "type", "BPE", source + ": model");
  TESSERA_CHECK(mtype == "BPE", source, ": model.type is '", mtype, "'; only BPE is supported",
                mtype == "Unigram" ? " (SentencePiece Unigram models, as T5's, are not)" : "");
  TESSERA_CHECK(model.contains("vocab") && model["vocab"].is_object(), source, ": model.vocab: expected an object");
  TESSERA_CHECK(model.contains("merges") && model["merges"].is_array(), source, ": model.merges: expected an array");
  // The decoder tells the two kinds apart: ByteLevel (or none) for byte-level BPE, whose
  // tokens are GPT-2's byte alphabet; Replace / ByteFallback / Fuse / Strip / Metaspace for
  // SentencePiece-style BPE, whose tokens are text with "▁" for a space.
  const nlohmann::json decoder = j.value("decoder", nlohmann::json());
  m->sentencepiece = detail::is_sentencepiece_decoder(decoder, source + ": decoder");
  if (m->sentencepiece) m->decoder = detail::read_decoder(decoder, source + ": decoder");
  m->byte_fallback = json_bool(model, "byte_fallback", false, source + ": model");
  TESSERA_CHECK(!m->byte_fallback || m->sentencepiece, source,
                ": model.byte_fallback is true; that is SentencePiece-style BPE, which needs its decoder "
                "(Replace, ByteFallback, Fuse, Strip or Metaspace), not a ByteLevel one");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    TESSERA_CHECK(!model.contains(key) || model[key].is_null() || model[key] == "", source, ": model.", key,
                  " is not supported (only null or \"\")");
  }
  TESSERA_CHECK(!model.contains("dropout") || model["dropout"].is_null() ||
                    (model["dropout"].is_number() && model["dropout"].get<double>() == 0.0),
                source, ": model.dropout is not supported (use null)");
  m->ignore_merges = json_bool(model, "ignore_merges", false, source + ": model");
  m->fuse_unk = json_bool(model, "fuse_unk", false, source + ": model");

  // Vocabulary and added tokens decide the id space.
  int64_t max_id = -1;
  const auto& vocab = model["vocab"];
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    TESSERA_CHECK(json_int_in(it.value(), 0, INT32_MAX - 1),
                  source, ": model.vocab['", it.key(), "']: expected a non-negative integer id");
    max_id = std::max(max_id, it.value().get<int64_t>());
  }
  const nlohmann::json added = j.contains("added_tokens") && !j["added_tokens"].is_null() ? j["added_tokens"]
                                                                                           : nlohmann::json::array();
  TESSERA_CHECK(added.is_array(), source, ": added_tokens: expected an array");
  for (size_t i = 0; i < added.size(); ++i) {
    const auto& a = added[i];
    TESSERA_CHECK(a.is_object() && a.contains("id") && json_int_in(a["id"], 0, INT32_MAX - 1) &&
                      a.contains("content") && a["content"].is_string(),
                  source, ": added_tokens[", i, "]: expected {\"id\": N, \"content\": \"...\"}");
    max_id = std::max(max_id, a["id"].get<int64_t>());
  }
  // The id space is allocated densely (one entry per id), so it is bounded by the tokens
  // there are: a hostile id of 2^31 - 2 would otherwise ask for ~140 GB.
  const int64_t tokens = static_cast<int64_t>(vocab.size() + added.size());
  TESSERA_CHECK(max_id < kMaxTokenizerIds && max_id < tokens + kMaxTokenizerIdHoles, source, ": token id ", max_id,
                " leaves ", max_id + 1 - tokens, " of ", max_id + 1, " ids unused (at most ", kMaxTokenizerIdHoles,
                " holes and ", kMaxTokenizerIds, " ids are supported)");
  const size_t n = static_cast<size_t>(max_id + 1);
  m->id_token.assign(n, "");
  m->id_bytes.assign(n, "");
  m->id_used.assign(n, 0);
  m->id_special.assign(n, 0);
  m->byte_ids.fill(-1);
  m->byte_fallback_ids.fill(-1);
  std::string bytes;
  for (auto it = vocab.begin(); it != vocab.end(); ++it) {
    const int32_t id = it.value().get<int32_t>();
    TESSERA_CHECK(!m->id_used[id], source, ": model.vocab: id ", id, " is used by both '", m->id_token[id],
                  "' and '", it.key(), "'");
    m->id_used[id] = 1;
    m->id_token[id] = it.key();
    m->token_ids[it.key()] = id;
    if (m->sentencepiece) {  // BPE sees the text itself
      m->bytes_ids[it.key()] = id;
      if (it.key().size() == 1) m->byte_ids[static_cast<uint8_t>(it.key()[0])] = id;
      m->id_bytes[id] = detail::stream_bytes(m->decoder, it.key());
      continue;
    }
    // A token outside the byte-level alphabet cannot come out of BPE; the decoder writes
    // its text as is (Hugging Face's ByteLevel decoder does the same).
    if (byte_level_to_bytes(it.key(), &bytes)) {
      m->bytes_ids[bytes] = id;
      if (bytes.size() == 1) m->byte_ids[static_cast<uint8_t>(bytes[0])] = id;
      m->id_bytes[id] = bytes;
    } else {
      m->id_bytes[id] = it.key();
    }
  }
  if (model.contains("unk_token") && model["unk_token"].is_string()) {
    auto it = m->token_ids.find(model["unk_token"].get<std::string>());
    TESSERA_CHECK(it != m->token_ids.end(), source, ": model.unk_token '", model["unk_token"].get<std::string>(),
                  "' is not in model.vocab");
    m->unk_id = it->second;
  }
  if (m->byte_fallback) {  // the tokens Hugging Face looks up: "<0x0A>", hex digits upper case
    for (int b = 0; b < 256; ++b) {
      static const char kHex[] = "0123456789ABCDEF";
      const std::string name = std::string("<0x") + kHex[b >> 4] + kHex[b & 15] + ">";
      if (auto it = m->bytes_ids.find(name); it != m->bytes_ids.end()) m->byte_fallback_ids[b] = it->second;
    }
  }

  // Merges: rank = position; a later duplicate of a pair wins, as in Hugging Face's map.
  const auto& merges = model["merges"];
  std::vector<detail::MergeTable::Entry> merge_entries;
  merge_entries.reserve(merges.size());
  for (size_t r = 0; r < merges.size(); ++r) {
    const auto& e = merges[r];
    std::string a, b;
    if (e.is_string()) {
      const std::string s = e;
      const size_t sp = s.find(' ');
      TESSERA_CHECK(sp != std::string::npos, source, ": model.merges[", r, "]: '", s, "' is not \"left right\"");
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else {
      TESSERA_CHECK(e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string(), source,
                    ": model.merges[", r, "]: expected \"left right\" or [\"left\", \"right\"]");
      a = e[0];
      b = e[1];
    }
    const auto ia = m->token_ids.find(a), ib = m->token_ids.find(b), ic = m->token_ids.find(a + b);
    TESSERA_CHECK(ia != m->token_ids.end() && ib != m->token_ids.end(), source, ": model.merges[", r, "]: '",
                  ia == m->token_ids.end() ? a : b, "' is not in model.vocab");
    TESSERA_CHECK(ic != m->token_ids.end(), source, ": model.merges[", r, "]: the merged token '", a + b,
                  "' is not in model.vocab");
    merge_entries.push_back({detail::pair_key(ia->second, ib->second), static_cast<int32_t>(r), ic->second});
  }
  m->merges.assign(merge_entries);

  // Added tokens: matched on the raw text unless "normalized"; those are matched in a second
  // pass, on what the first left, after normalization, against their normalized content
  // (Hugging Face's two tries). Its default for a missing "normalized" is !special.
  m->normalizer = Normalizer::from_json(j.value("normalizer", nlohmann::json()), source + ": normalizer");
  for (size_t i = 0; i < added.size(); ++i) {
    const auto& a = added[i];
    const std::string at = source + ": added_tokens[" + std::to_string(i) + "]";
    const int32_t id = a["id"].get<int32_t>();
    const std::string content = a["content"];
    const bool special = json_bool(a, "special", false, at);
    TESSERA_CHECK(!json_bool(a, "single_word", false, at), at, " ('", content, "'): single_word is not supported");
    detail::AddedToken t;
    t.id = id;
    t.lstrip = json_bool(a, "lstrip", false, at);
    t.rstrip = json_bool(a, "rstrip", false, at);
    const bool normalized = json_bool(a, "normalized", !special, at);
    if (normalized) {
      t.content = m->normalizer.apply(content);
      m->normalized_added.add(t);
    } else {
      t.content = content;
      m->raw_added.add(t);
    }
    m->id_used[id] = 1;
    m->id_token[id] = content;
    m->id_special[id] = special;
    m->token_ids[content] = id;
    if (m->sentencepiece) {
      m->id_bytes[id] = detail::stream_bytes(m->decoder, content);
    } else {
      m->id_bytes[id] = byte_level_to_bytes(content, &bytes) ? bytes : content;
    }
  }
  m->raw_added.finish();
  m->normalized_added.finish();

  m->pre_tokenizer = PreTokenizer::from_json(j.value("pre_tokenizer", nlohmann::json()), source + ": pre_tokenizer",
                                             !m->sentencepiece);
  read_post_processor(j.value("post_processor", nlohmann::json()), source + ": post_processor", &m->prefix,
                      &m->suffix);
  for (const auto* ids : {&m->prefix, &m->suffix}) {
    for (int32_t id : *ids)
      TESSERA_CHECK(id >= 0 && static_cast<size_t>(id) < n && m->id_used[id], source,
                    ": post_processor adds token id ", id, ", which is not in the vocabulary");
  }

  // BOS / EOS: tokenizer_config.json when it names them; else the template's first token
  // is BOS and the first special token with a usual end-of-text name is EOS.
  const std::string& cfg_source = config_source;
  auto config_id = [&](const char* key, int32_t fallback) {
    if (!config.is_object() || !config.contains(key)) return fallback;
    if (config[key].is_null()) return -1;
    const std::string tok = config_token(config[key]);
    TESSERA_CHECK(!tok.empty(), cfg_source, ": ", key, ": expected a token string");
    auto it = m->token_ids.find(tok);
    TESSERA_CHECK(it != m->token_ids.end(), cfg_source, ": ", key, " '", tok, "' is not in the vocabulary");
    return it->second;
  };
  int32_t eos_guess = -1;
  for (const char* name : {"<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"}) {
    auto it = m->token_ids.find(std::string(name));
    if (eos_guess < 0 && it != m->token_ids.end() && m->id_special[it->second]) eos_guess = it->second;
  }
  m->bos = config_id("bos_token", m->prefix.empty() ? -1 : m->prefix.front());
  m->eos = config_id("eos_token", eos_guess);
  // add_bos_token / add_eos_token: true adds the token when the template does not already.
  if (config.is_object()) {
    if (json_bool(config, "add_bos_token", false, cfg_source) && m->bos >= 0 &&
        (m->prefix.empty() || m->prefix.front() != m->bos))
      m->prefix.insert(m->prefix.begin(), m->bos);
    if (json_bool(config, "add_eos_token", false, cfg_source) && m->eos >= 0 &&
        (m->suffix.empty() || m->suffix.back() != m->eos))
      m->suffix.push_back(m->eos);
  }
  return Tokenizer(std::move(m));
}

}  // namespace tessera::io
