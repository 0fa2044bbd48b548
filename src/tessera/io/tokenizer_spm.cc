// The SentencePiece-style side of the BPE tokenizer (Llama 2, Mistral, Gemma tokenizer.json):
// chars to ids with byte fallback, and the decoders (Replace, ByteFallback, Fuse, Strip,
// Metaspace) that turn "▁" back into spaces and "<0xNN>" tokens back into bytes.
#include <algorithm>

#include "tessera/base/error.h"
#include "tessera/base/strings.h"
#include "tessera/io/json_file.h"
#include "tessera/io/tokenizer_impl.h"

namespace tessera::io {

namespace detail {

namespace {

constexpr const char* kDecoders = "ByteLevel, Metaspace, Replace, ByteFallback, Fuse, Strip, Sequence, null";

int utf8_length(unsigned char lead) { return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4; }

// One char of a JSON string field (Strip's content, Metaspace's replacement).
std::string one_char(const nlohmann::json& j, const char* key, const std::string& where) {
  TESSERA_CHECK(j.contains(key) && j[key].is_string(), where, ".", key, ": expected a one-character string");
  const std::string c = j[key];
  TESSERA_CHECK(!c.empty() && static_cast<size_t>(utf8_length(static_cast<unsigned char>(c[0]))) == c.size(), where,
                ".", key, ": expected one character, got ", json_brief(j[key]));
  return c;
}

// Strip (Hugging Face's Strip decoder): up to `start` leading and `stop` trailing `c`s.
void strip(std::string* t, const DecodeStep& st) {
  const std::string& c = st.from;
  size_t front = 0;
  for (size_t k = 0; k < st.start && t->compare(front, c.size(), c) == 0; ++k) front += c.size();
  size_t back = t->size();
  for (size_t k = 0; k < st.stop && back >= front + c.size() && t->compare(back - c.size(), c.size(), c) == 0; ++k)
    back -= c.size();
  *t = t->substr(front, back - front);
}

void add_step(const nlohmann::json& d, const std::string& at, std::vector<DecodeStep>* out) {
  TESSERA_CHECK(d.is_object() && d.contains("type") && d["type"].is_string(), at,
                ": expected an object with a \"type\"");
  const std::string type = d["type"];
  DecodeStep st;
  if (type == "Sequence") {
    TESSERA_CHECK(d.contains("decoders") && d["decoders"].is_array(), at, ".decoders: expected an array");
    for (size_t i = 0; i < d["decoders"].size(); ++i)
      add_step(d["decoders"][i], at + ".decoders[" + std::to_string(i) + "]", out);
    return;
  }
  if (type == "Replace") {
    st.kind = 'r';
    const auto* p = d.contains("pattern") && d["pattern"].is_object() && d["pattern"].size() == 1 ? &d["pattern"]
                                                                                                : nullptr;
    TESSERA_CHECK(p && p->contains("String") && (*p)["String"].is_string(), at,
                  ".pattern: expected {\"String\": \"...\"} (a Regex pattern is not supported)");
    st.from = (*p)["String"];
    TESSERA_CHECK(d.contains("content") && d["content"].is_string(), at, ".content: expected a string");
    st.to = d["content"];
  } else if (type == "ByteFallback") {
    st.kind = 'b';
  } else if (type == "Fuse") {
    st.kind = 'f';
  } else if (type == "Strip") {
    st.kind = 's';
    st.from = one_char(d, "content", at);
    for (const char* key : {"start", "stop"}) {
      TESSERA_CHECK(d.contains(key) && json_int_in(d[key], 0, 1 << 20), at, ".", key,
                    ": expected a non-negative integer, got ", d.contains(key) ? json_brief(d[key]) : "nothing");
    }
    st.start = d["start"].get<size_t>();
    st.stop = d["stop"].get<size_t>();
  } else if (type == "Metaspace") {
    st.kind = 'm';
    st.from = one_char(d, "replacement", at);
    const std::string scheme = json_string(d, "prepend_scheme", "always", at);
    TESSERA_CHECK(scheme == "always" || scheme == "first" || scheme == "never", at, ".prepend_scheme: '", scheme,
                  "' is not one of always, first, never");
    st.prepend = scheme != "never";
    if (d.contains("add_prefix_space") && !d["add_prefix_space"].is_null() &&
        !json_bool(d, "add_prefix_space", true, at))
      st.prepend = false;
  } else {
    fail(at, ".type: unsupported decoder '", type, "' (supported: ", kDecoders, ")",
         type == "ByteLevel" ? "; ByteLevel inside a Sequence is not supported" : "");
  }
  out->push_back(std::move(st));
}

}  // namespace

int byte_fallback_value(std::string_view t) {
  if (t.size() != 6 || !t.starts_with("<0x") || t[5] != '>') return -1;
  int v = 0;
  for (char c : t.substr(3, 2)) {
    const int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                                  : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
    if (d < 0) return -1;
    v = v * 16 + d;
  }
  return v;
}

bool is_sentencepiece_decoder(const nlohmann::json& d, const std::string& where) {
  if (d.is_null()) return false;
  TESSERA_CHECK(d.is_object() && d.contains("type") && d["type"].is_string(), where,
                ": expected null or an object with a \"type\"");
  const std::string type = d["type"];
  if (type == "ByteLevel") return false;
  static const char* const kTypes[] = {"Sequence", "Replace", "ByteFallback", "Fuse", "Strip", "Metaspace"};
  TESSERA_CHECK(std::find(std::begin(kTypes), std::end(kTypes), type) != std::end(kTypes), where,
                ".type: unsupported decoder '", type, "' (supported: ", kDecoders, ")");
  return true;
}

std::vector<DecodeStep> read_decoder(const nlohmann::json& decoder, const std::string& where) {
  std::vector<DecodeStep> out;
  add_step(decoder, where, &out);
  return out;
}

std::string run_decoder(const std::vector<DecodeStep>& steps, std::vector<std::string> tokens) {
  std::vector<std::string> next;
  for (const DecodeStep& st : steps) {
    switch (st.kind) {
      case 'r':
        for (std::string& t : tokens) base::replace_all(&t, st.from, st.to);
        break;
      case 's':
        for (std::string& t : tokens) strip(&t, st);
        break;
      case 'f': {
        std::string all;
        for (const std::string& t : tokens) all += t;
        tokens.assign(1, std::move(all));
        break;
      }
      case 'm':
        for (size_t i = 0; i < tokens.size(); ++i)
          base::replace_all(&tokens[i], st.from, i == 0 && st.prepend ? "" : " ");
        break;
      case 'b': {
        // Runs of "<0xNN>" tokens become their bytes when those are UTF-8, else one U+FFFD each.
        next.clear();
        std::string run;
        size_t run_tokens = 0;
        auto flush = [&] {
          if (run_tokens == 0) return;
          if (find_invalid_utf8(run) == std::string::npos) {
            next.push_back(run);
          } else {
            for (size_t k = 0; k < run_tokens; ++k) next.emplace_back("\xEF\xBF\xBD");
          }
          run.clear();
          run_tokens = 0;
        };
        for (std::string& t : tokens) {
          const int b = byte_fallback_value(t);
          if (b >= 0) {
            run += static_cast<char>(b);
            ++run_tokens;
          } else {
            flush();
            next.push_back(std::move(t));
          }
        }
        flush();
        tokens.swap(next);
        break;
      }
    }
  }
  std::string out;
  for (const std::string& t : tokens) out += t;
  return out;
}

std::string stream_bytes(const std::vector<DecodeStep>& steps, std::string_view token) {
  std::string t(token);
  bool fused = false;  // after a Fuse, Strip and Metaspace's first-token rule touch only the ends
  for (const DecodeStep& st : steps) {
    if (st.kind == 'r') base::replace_all(&t, st.from, st.to);
    if (st.kind == 'm') base::replace_all(&t, st.from, " ");
    if (st.kind == 'f') fused = true;
    if (st.kind == 's' && !fused) strip(&t, st);
    if (st.kind == 'b') {
      const int b = byte_fallback_value(t);
      if (b >= 0) t.assign(1, static_cast<char>(b));
    }
  }
  return t;
}

}  // namespace detail

// Hugging Face's BPE::merge_word for a model without byte-level mapping: each char is its
// vocabulary id; a char that is missing becomes its "<0xNN>" byte tokens (byte_fallback,
// when all of them exist), else unk (consecutive unks fused into one with fuse_unk), else
// nothing. As in Hugging Face, a pending unk is written only when a known char or the end
// follows, so byte-fallback tokens in between come before it.
void Tokenizer::Impl::spm_symbols(std::string_view w, std::vector<int32_t>* ids) const {
  bool unk = false;
  for (size_t i = 0; i < w.size();) {
    const size_t len = std::min<size_t>(detail::utf8_length(static_cast<unsigned char>(w[i])), w.size() - i);
    const std::string_view c = w.substr(i, len);
    i += len;
    int32_t id = -1;
    if (len == 1) {
      id = byte_ids[static_cast<uint8_t>(c[0])];
    } else if (auto it = bytes_ids.find(c); it != bytes_ids.end()) {
      id = it->second;
    }
    if (id >= 0) {
      if (unk) ids->push_back(unk_id);
      unk = false;
      ids->push_back(id);
      continue;
    }
    if (byte_fallback && std::all_of(c.begin(), c.end(), [&](char b) { return byte_fallback_ids[static_cast<uint8_t>(b)] >= 0; })) {
      for (char b : c) ids->push_back(byte_fallback_ids[static_cast<uint8_t>(b)]);
      continue;
    }
    if (unk_id < 0) continue;
    if (unk && !fuse_unk) ids->push_back(unk_id);
    unk = true;
  }
  if (unk) ids->push_back(unk_id);
}

}  // namespace tessera::io
