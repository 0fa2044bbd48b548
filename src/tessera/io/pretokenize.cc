// UTF-8 checks, the byte-level table, normalizers (utf8proc) and regex splitting (PCRE2).
#include "tessera/io/pretokenize.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "tessera/base/error.h"
#include "tessera/base/strings.h"
#include "tessera/io/json_file.h"

namespace tessera::io {

namespace {

// Length of the valid UTF-8 sequence at p (n bytes left), or 0 when it is invalid; then
// *subpart is the length of its maximal subpart (the bytes one U+FFFD replaces).
int utf8_sequence(const uint8_t* p, size_t n, int* subpart) {
  const uint8_t c = p[0];
  int len;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    *subpart = 1;
    return 0;
  }
  for (int k = 1; k < len; ++k) {
    const uint8_t b = k < static_cast<int>(n) ? p[k] : 0;
    const bool ok = k < static_cast<int>(n) && (k == 1 ? (b >= lo && b <= hi) : (b >= 0x80 && b <= 0xBF));
    if (!ok) {
      *subpart = k;
      return 0;
    }
  }
  return len;
}

struct ByteLevelTables {
  std::array<std::string, 256> chars;      // byte -> UTF-8 of its char
  std::array<uint8_t, 256> order;          // GPT-2's bs order
  std::array<int16_t, 324> code_to_byte;   // code point -> byte, -1 if not in the alphabet
  ByteLevelTables() {
    std::array<int, 256> code{};
    std::array<bool, 256> printable{};
    int k = 0;
    for (int b = 0; b < 256; ++b) {
      printable[b] = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      if (printable[b]) {
        code[b] = b;
        order[k++] = static_cast<uint8_t>(b);
      }
    }
    int extra = 0;
    for (int b = 0; b < 256; ++b) {
      if (!printable[b]) {
        code[b] = 256 + extra++;
        order[k++] = static_cast<uint8_t>(b);
      }
    }
    code_to_byte.fill(-1);
    for (int b = 0; b < 256; ++b) {
      code_to_byte[code[b]] = static_cast<int16_t>(b);
      const int c = code[b];
      if (c < 0x80) {
        chars[b] = std::string(1, static_cast<char>(c));
      } else {  // all codes are < 0x800: two bytes
        chars[b] = {static_cast<char>(0xC0 | (c >> 6)), static_cast<char>(0x80 | (c & 0x3F))};
      }
    }
  }
};

const ByteLevelTables& tables() {
  static const ByteLevelTables t;
  return t;
}

// Unicode's White_Space set, as a character-class body.
constexpr const char* kWhiteSpaceClass = R"(\t-\r\x{85}\p{Z})";

// Rewrites \s and \S (outside classes) to White_Space; see SplitRegex.
std::string rewrite_whitespace(const std::string& p) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char d = p[i + 1];
      if (d == 's') {
        out += in_class ? std::string(kWhiteSpaceClass) : "[" + std::string(kWhiteSpaceClass) + "]";
      } else if (d == 'S' && !in_class) {
        out += "[^" + std::string(kWhiteSpaceClass) + "]";
      } else if (d == 'Q') {  // \Q...\E is literal text: copy it unchanged
        const size_t e = p.find("\\E", i + 2);
        const size_t stop = e == std::string::npos ? p.size() : e + 2;
        out.append(p, i, stop - i);
        i = stop - 1;
        continue;
      } else {
        out += c;
        out += d;
      }
      ++i;
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal member, not the end of the class.
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];
      continue;
    }
    if (in_class && c == '[' && i + 1 < p.size() && p[i + 1] == ':') {  // [:alpha:]
      const size_t e = p.find(":]", i + 2);
      if (e != std::string::npos) {
        out.append(p, i, e + 2 - i);
        i = e + 1;
        continue;
      }
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

// Per-thread match data and JIT stack: pcre2 match data cannot be shared across threads.
struct MatchState {
  pcre2_match_data* data = pcre2_match_data_create(1, nullptr);
  pcre2_jit_stack* stack = pcre2_jit_stack_create(32 * 1024, 16 * 1024 * 1024, nullptr);
  pcre2_match_context* context = pcre2_match_context_create(nullptr);
  MatchState() { pcre2_jit_stack_assign(context, nullptr, stack); }
  ~MatchState() {
    pcre2_match_context_free(context);
    pcre2_jit_stack_free(stack);
    pcre2_match_data_free(data);
  }
};

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof buf);
  return reinterpret_cast<const char*>(buf);
}

}  // namespace

size_t find_invalid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    if (i + 8 <= n) {  // skip runs of ASCII eight bytes at a time
      uint64_t w;
      std::memcpy(&w, p + i, 8);
      if ((w & 0x8080808080808080ull) == 0) {
        i += 8;
        continue;
      }
    }
    int subpart = 0;
    const int len = utf8_sequence(p + i, n - i, &subpart);
    if (len == 0) return i;
    i += len;
  }
  return std::string_view::npos;
}

std::string utf8_lossy(std::string_view s) {
  if (find_invalid_utf8(s) == std::string_view::npos) return std::string(s);
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  std::string out;
  out.reserve(s.size() + 16);
  for (size_t i = 0; i < s.size();) {
    int subpart = 0;
    const int len = utf8_sequence(p + i, s.size() - i, &subpart);
    if (len > 0) {
      out.append(s.data() + i, len);
      i += len;
    } else {
      out += "\xEF\xBF\xBD";
      i += subpart;
    }
  }
  return out;
}

const std::string& byte_level_char(uint8_t b) { return tables().chars[b]; }
const std::array<uint8_t, 256>& byte_level_order() { return tables().order; }

std::string bytes_to_byte_level(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (unsigned char b : bytes) out += tables().chars[b];
  return out;
}

bool byte_level_to_bytes(std::string_view token, std::string* bytes) {
  bytes->clear();
  const auto* p = reinterpret_cast<const uint8_t*>(token.data());
  for (size_t i = 0; i < token.size();) {
    uint32_t cp;
    if (p[i] < 0x80) {
      cp = p[i];
      i += 1;
    } else if ((p[i] & 0xE0) == 0xC0 && i + 1 < token.size()) {
      cp = ((p[i] & 0x1F) << 6) | (p[i + 1] & 0x3F);
      i += 2;
    } else {
      return false;  // every byte-level char is below U+0800
    }
    if (cp >= tables().code_to_byte.size() || tables().code_to_byte[cp] < 0) return false;
    bytes->push_back(static_cast<char>(tables().code_to_byte[cp]));
  }
  return true;
}

SplitRegex::SplitRegex(const std::string& pattern, bool literal, const std::string& where)
    : where_(where) {
  const std::string rewritten = literal ? pattern : rewrite_whitespace(pattern);
  int err = 0;
  PCRE2_SIZE offset = 0;
  // PCRE2_LITERAL refuses PCRE2_UCP (which only changes what classes match).
  uint32_t options = PCRE2_UTF | (literal ? PCRE2_LITERAL : PCRE2_UCP);
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(rewritten.data()), rewritten.size(),
                                   options, &err, &offset, nullptr);
  if (code == nullptr) {
    fail(where, ": cannot compile regex '", pattern, "': ", pcre2_message(err),
         rewritten == pattern ? " at offset " + std::to_string(offset)
                              : " (at offset " + std::to_string(offset) + " of '" + rewritten +
                                    "', the pattern with \\s rewritten)");
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter if JIT is unavailable
  code_ = std::shared_ptr<void>(code, [](void* c) { pcre2_code_free(static_cast<pcre2_code*>(c)); });
}

template <typename F>
void SplitRegex::for_each_match(std::string_view s, F&& f) const {
  thread_local MatchState state;
  auto* code = static_cast<const pcre2_code*>(code_.get());
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  const PCRE2_SIZE n = s.size();
  PCRE2_SIZE pos = 0;
  uint32_t retry = 0;  // set after an empty match: no empty match at the same place
  while (pos <= n) {
    const int rc = pcre2_match(code, subject, n, pos, PCRE2_NO_UTF_CHECK | retry, state.data, state.context);
    if (rc == PCRE2_ERROR_NOMATCH) {
      if (retry == 0) break;
      retry = 0;
      ++pos;  // step over one whole character
      while (pos < n && (static_cast<uint8_t>(s[pos]) & 0xC0) == 0x80) ++pos;
      continue;
    }
    if (rc < 0) fail(where_, ": regex match failed: ", pcre2_message(rc));
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(state.data);
    const PCRE2_SIZE start = ov[0], end = ov[1];
    if (start == end) {
      retry = PCRE2_NOTEMPTY_ATSTART | PCRE2_ANCHORED;
      pos = end;
      continue;
    }
    f(static_cast<size_t>(start), static_cast<size_t>(end));
    pos = end;
    retry = 0;
  }
}

void SplitRegex::split(std::string_view s, bool keep_matches, std::vector<std::string_view>* out) const {
  size_t last = 0;  // end of what is already emitted
  for_each_match(s, [&](size_t start, size_t end) {
    if (start > last) out->push_back(s.substr(last, start - last));
    if (keep_matches) out->push_back(s.substr(start, end - start));
    last = end;
  });
  if (last < s.size()) out->push_back(s.substr(last));
}

void SplitRegex::split(std::string_view s, SplitBehavior behavior, bool invert,
                       std::vector<std::string_view>* out) const {
  if (behavior == SplitBehavior::kIsolated || (behavior == SplitBehavior::kRemoved && !invert)) {
    split(s, behavior == SplitBehavior::kIsolated, out);
    return;
  }
  // Hugging Face's NormalizedString::split: the text as (span, is_match) runs, then folded.
  struct Run {
    size_t start, end;
    bool match;
  };
  thread_local std::vector<Run> runs, kept;
  runs.clear();
  kept.clear();
  size_t last = 0;
  for_each_match(s, [&](size_t start, size_t end) {
    if (start > last) runs.push_back({last, start, invert});
    runs.push_back({start, end, !invert});
    last = end;
  });
  if (last < s.size()) runs.push_back({last, s.size(), invert});
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::kRemoved:
      for (const Run& r : runs)
        if (!r.match) kept.push_back(r);
      break;
    case SplitBehavior::kContiguous:
      for (const Run& r : runs) {
        if (!kept.empty() && r.match == previous_match) {
          kept.back().end = r.end;
        } else {
          kept.push_back(r);
        }
        previous_match = r.match;
      }
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const Run& r : runs) {
        if (!kept.empty() && r.match && !previous_match) {
          kept.back().end = r.end;
        } else {
          kept.push_back(r);
        }
        previous_match = r.match;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (size_t i = runs.size(); i-- > 0;) {
        const Run& r = runs[i];
        if (!kept.empty() && r.match && !previous_match) {
          kept.back().start = r.start;
        } else {
          kept.push_back(r);
        }
        previous_match = r.match;
      }
      std::reverse(kept.begin(), kept.end());
      break;
    case SplitBehavior::kIsolated:
      break;
  }
  for (const Run& r : kept)
    if (r.end > r.start) out->push_back(s.substr(r.start, r.end - r.start));
}

namespace {

// The text of a {"String": "..."} pattern (Replace); a Regex pattern is refused.
std::string string_pattern(const nlohmann::json& j, const std::string& where) {
  const auto* p = j.contains("pattern") && j["pattern"].is_object() && j["pattern"].size() == 1 ? &j["pattern"]
                                                                                                : nullptr;
  TESSERA_CHECK(p && p->begin().value().is_string() && (p->contains("String") || p->contains("Regex")), where,
                ".pattern: expected {\"String\": \"...\"}");
  TESSERA_CHECK(p->contains("String"), where, ".pattern: a Regex pattern (", json_brief(p->begin().value()),
                ") is not supported; only {\"String\": ...}");
  return p->begin().value().get<std::string>();
}

}  // namespace

Normalizer Normalizer::from_json(const nlohmann::json& j, const std::string& where) {
  Normalizer out;
  if (j.is_null()) return out;
  TESSERA_CHECK(j.is_object() && j.contains("type") && j["type"].is_string(), where,
                ": expected null or an object with a \"type\"");
  const std::string type = j["type"];
  if (type == "Sequence") {
    TESSERA_CHECK(j.contains("normalizers") && j["normalizers"].is_array(), where,
                  ".normalizers: expected an array");
    for (size_t i = 0; i < j["normalizers"].size(); ++i) {
      const auto inner = from_json(j["normalizers"][i], where + ".normalizers[" + std::to_string(i) + "]");
      out.steps_.insert(out.steps_.end(), inner.steps_.begin(), inner.steps_.end());
    }
    return out;
  }
  const int stable = UTF8PROC_STABLE;
  Step st;
  if (type == "NFC") {
    st.form = stable | UTF8PROC_COMPOSE;
  } else if (type == "NFD") {
    st.form = stable | UTF8PROC_DECOMPOSE;
  } else if (type == "NFKC") {
    st.form = stable | UTF8PROC_COMPOSE | UTF8PROC_COMPAT;
  } else if (type == "NFKD") {
    st.form = stable | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT;
  } else if (type == "Prepend") {
    st.kind = 'p';
    TESSERA_CHECK(j.contains("prepend") && j["prepend"].is_string(), where, ".prepend: expected a string");
    st.text = j["prepend"];
  } else if (type == "Replace") {
    st.kind = 'r';
    st.text = string_pattern(j, where);
    TESSERA_CHECK(j.contains("content") && j["content"].is_string(), where, ".content: expected a string");
    st.to = j["content"];
  } else {
    fail(where, ".type: unsupported normalizer '", type,
         "' (supported: NFC, NFD, NFKC, NFKD, Prepend, Replace, Sequence, null)");
  }
  out.steps_.push_back(std::move(st));
  return out;
}

std::string Normalizer::apply(std::string_view s) const {
  std::string cur(s);
  for (const Step& st : steps_) {
    if (st.kind == 'p') {
      if (!cur.empty()) cur.insert(0, st.text);
      continue;
    }
    if (st.kind == 'r') {
      base::replace_all(&cur, st.text, st.to);
      continue;
    }
    bool ascii = true;  // every normal form leaves ASCII unchanged
    for (unsigned char c : cur) ascii &= c < 0x80;
    if (ascii) continue;
    utf8proc_uint8_t* dst = nullptr;
    const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(cur.data()),
                                            static_cast<utf8proc_ssize_t>(cur.size()), &dst,
                                            static_cast<utf8proc_option_t>(st.form));
    if (n < 0) fail("normalizer: ", utf8proc_errmsg(n));
    cur.assign(reinterpret_cast<const char*>(dst), static_cast<size_t>(n));
    std::free(dst);
  }
  return cur;
}

PreTokenizer PreTokenizer::from_json(const nlohmann::json& j, const std::string& where, bool byte_level) {
  PreTokenizer out;
  bool seen_byte_level = false;
  const char* supported = byte_level ? "ByteLevel, Split, Sequence" : "Metaspace, Split, Sequence, null";
  // Steps run on raw bytes here and the byte-level mapping is applied last, so a step
  // after ByteLevel (which would see mapped chars such as 'Ġ') cannot be honoured.
  auto add = [&](const nlohmann::json& s, const std::string& at, auto&& self) -> void {
    TESSERA_CHECK(s.is_object() && s.contains("type") && s["type"].is_string(), at,
                  ": expected an object with a \"type\"");
    const std::string type = s["type"];
    if (type == "Sequence") {
      TESSERA_CHECK(s.contains("pretokenizers") && s["pretokenizers"].is_array(), at,
                    ".pretokenizers: expected an array");
      for (size_t i = 0; i < s["pretokenizers"].size(); ++i)
        self(s["pretokenizers"][i], at + ".pretokenizers[" + std::to_string(i) + "]", self);
      return;
    }
    TESSERA_CHECK(!seen_byte_level, at, ": a '", type, "' step after the ByteLevel step is not supported");
    Step st;
    if (type == "ByteLevel" && byte_level) {
      seen_byte_level = true;
      st.add_prefix_space = json_bool(s, "add_prefix_space", false, at);
      if (json_bool(s, "use_regex", true, at))
        st.regex = std::make_shared<SplitRegex>(kGpt2SplitPattern, false, at);
    } else if (type == "Split") {
      const auto* p = s.contains("pattern") && s["pattern"].is_object() && s["pattern"].size() == 1
                          ? &s["pattern"] : nullptr;
      const bool literal = p && p->contains("String");
      TESSERA_CHECK(p && (literal || p->contains("Regex")) && p->begin().value().is_string(), at,
                    ".pattern: expected {\"Regex\": \"...\"} or {\"String\": \"...\"}");
      const std::string behavior = json_string(s, "behavior", "Isolated", at);
      static constexpr std::pair<const char*, SplitBehavior> kBehaviors[] = {
          {"Removed", SplitBehavior::kRemoved},
          {"Isolated", SplitBehavior::kIsolated},
          {"MergedWithPrevious", SplitBehavior::kMergedWithPrevious},
          {"MergedWithNext", SplitBehavior::kMergedWithNext},
          {"Contiguous", SplitBehavior::kContiguous}};
      const auto* b = std::find_if(std::begin(kBehaviors), std::end(kBehaviors),
                                   [&](const auto& k) { return behavior == k.first; });
      TESSERA_CHECK(b != std::end(kBehaviors), at, ".behavior: '", behavior,
                    "' is not supported (supported: Removed, Isolated, MergedWithPrevious, MergedWithNext, "
                    "Contiguous)");
      st.behavior = b->second;
      st.invert = json_bool(s, "invert", false, at);
      st.regex = std::make_shared<SplitRegex>(p->begin().value().get<std::string>(), literal,
                                              at + ".pattern");
    } else if (type == "Metaspace" && !byte_level) {
      TESSERA_CHECK(s.contains("replacement") && s["replacement"].is_string(), at,
                    ".replacement: expected a one-character string");
      st.metaspace = s["replacement"];
      int subpart = 0;
      TESSERA_CHECK(!st.metaspace.empty() &&
                        utf8_sequence(reinterpret_cast<const uint8_t*>(st.metaspace.data()), st.metaspace.size(),
                                      &subpart) == static_cast<int>(st.metaspace.size()),
                    at, ".replacement: expected one character, got ", json_brief(s["replacement"]));
      const std::string scheme = json_string(s, "prepend_scheme", "always", at);
      TESSERA_CHECK(scheme == "always" || scheme == "first" || scheme == "never", at, ".prepend_scheme: '", scheme,
                    "' is not one of always, first, never");
      st.prepend = scheme[0];
      if (s.contains("add_prefix_space") && !s["add_prefix_space"].is_null() &&
          !json_bool(s, "add_prefix_space", true, at)) {
        TESSERA_CHECK(!s.contains("prepend_scheme") || scheme == "never", at,
                      ".add_prefix_space: false does not match prepend_scheme '", scheme, "'");
        st.prepend = 'n';
      }
      st.metaspace_split = s.contains("split") && s["split"].is_null() ? true : json_bool(s, "split", true, at);
      out.track_start_ |= st.prepend == 'f';
    } else {
      fail(at, ".type: unsupported pre-tokenizer '", type, "' (supported: ", supported, ")",
           type == "ByteLevel" ? " (ByteLevel needs a ByteLevel decoder)" : "",
           type == "Metaspace" ? " (Metaspace needs a SentencePiece-style decoder)" : "");
    }
    out.steps_.push_back(std::move(st));
  };
  if (!byte_level) {
    if (!j.is_null()) add(j, where, add);
    return out;
  }
  TESSERA_CHECK(!j.is_null(), where,
                ": is null; a byte-level BPE tokenizer needs a ByteLevel pre-tokenizer");
  add(j, where, add);
  TESSERA_CHECK(seen_byte_level, where, ": has no ByteLevel step; only byte-level BPE tokenizers are supported");
  return out;
}

PreTokenizer PreTokenizer::byte_level(const std::string& pattern) {
  PreTokenizer out;
  Step split, byte_level;
  split.regex = std::make_shared<SplitRegex>(pattern.empty() ? std::string(kGpt2SplitPattern) : pattern, false,
                                             "pattern");
  out.steps_ = {split, byte_level};
  return out;
}

nlohmann::json PreTokenizer::byte_level_json(const std::string& pattern) {
  nlohmann::json bl = {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true},
                       {"use_regex", true}};
  if (pattern.empty() || pattern == kGpt2SplitPattern) return bl;
  bl["use_regex"] = false;
  nlohmann::json split = {{"type", "Split"}, {"pattern", {{"Regex", pattern}}},
                          {"behavior", "Isolated"}, {"invert", false}};
  return {{"type", "Sequence"}, {"pretokenizers", nlohmann::json::array({split, bl})}};
}

void PreTokenizer::metaspace_step(const Step& st, std::string_view piece, bool at_start,
                                  std::vector<std::string_view>* out, std::vector<uint8_t>* out_start,
                                  std::deque<std::string>* arena) const {
  // Hugging Face's order: spaces become the replacement, then it is prepended (always, or
  // only to the piece at the start of the input), then the piece is cut before each one.
  const std::string_view rep = st.metaspace;
  const bool prepend = (st.prepend == 'a' || (st.prepend == 'f' && at_start));
  std::string_view s = piece;
  const bool has_space = piece.find(' ') != std::string_view::npos;
  const bool add_rep = prepend && !piece.starts_with(rep) && piece[0] != ' ';  // ' ' becomes rep
  if (has_space || add_rep) {
    std::string t;
    t.reserve(piece.size() + rep.size() * 4);
    for (char c : piece) {
      if (c == ' ') {
        t += rep;
      } else {
        t += c;
      }
    }
    if (add_rep) t.insert(0, rep);
    arena->push_back(std::move(t));
    s = arena->back();
  }
  size_t begin = 0;
  if (st.metaspace_split) {
    for (size_t k = s.find(rep, 1); k != std::string_view::npos; k = s.find(rep, k + rep.size())) {
      if (k > begin) {
        out->push_back(s.substr(begin, k - begin));
        if (out_start) out_start->push_back(at_start && begin == 0);
      }
      begin = k;
    }
  }
  out->push_back(s.substr(begin));
  if (out_start) out_start->push_back(at_start && begin == 0);
}

void PreTokenizer::split(std::string_view text, std::vector<std::string_view>* pieces,
                         std::deque<std::string>* arena, bool at_start) const {
  // Each step maps every piece to zero or more pieces; empty pieces never survive. With a
  // Metaspace "first" step, `starts` says which pieces begin the input.
  std::vector<std::string_view> cur, next;
  std::vector<uint8_t> starts, next_starts;
  if (!text.empty()) {
    cur.push_back(text);
    starts.push_back(at_start);
  }
  for (const Step& st : steps_) {
    next.clear();
    next_starts.clear();
    for (size_t k = 0; k < cur.size(); ++k) {
      std::string_view piece = cur[k];
      if (!st.metaspace.empty()) {
        metaspace_step(st, piece, track_start_ && starts[k], &next, track_start_ ? &next_starts : nullptr, arena);
        continue;
      }
      if (st.add_prefix_space && piece.front() != ' ') {
        arena->push_back(" " + std::string(piece));
        piece = arena->back();
      }
      const size_t before = next.size();
      if (st.regex) {
        st.regex->split(piece, st.behavior, st.invert, &next);
      } else {
        next.push_back(piece);
      }
      if (track_start_)
        for (size_t i = before; i < next.size(); ++i)
          next_starts.push_back(starts[k] && i == before && next[i].data() == piece.data());
    }
    cur.swap(next);
    starts.swap(next_starts);
  }
  pieces->insert(pieces->end(), cur.begin(), cur.end());
}

}  // namespace tessera::io
