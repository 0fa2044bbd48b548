// UTF-8 checks, the byte-level table, normalizers (utf8proc) and regex splitting (PCRE2).
#include "tessera/io/pretokenize.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <utf8proc.h>

#include <cstdlib>
#include <cstring>

#include "tessera/base/error.h"
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
  uint32_t options = PCRE2_UTF | PCRE2_UCP | (literal ? PCRE2_LITERAL : 0);
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

void SplitRegex::split(std::string_view s, bool keep_matches, std::vector<std::string_view>* out) const {
  thread_local MatchState state;
  auto* code = static_cast<const pcre2_code*>(code_.get());
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
  const PCRE2_SIZE n = s.size();
  PCRE2_SIZE pos = 0, last = 0;  // search start; end of what is already emitted
  uint32_t retry = 0;            // set after an empty match: no empty match at the same place
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
    if (start > last) out->push_back(s.substr(last, start - last));
    if (keep_matches) out->push_back(s.substr(start, end - start));
    last = pos = end;
    retry = 0;
  }
  if (last < n) out->push_back(s.substr(last));
}

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
      out.forms_.insert(out.forms_.end(), inner.forms_.begin(), inner.forms_.end());
    }
    return out;
  }
  const int stable = UTF8PROC_STABLE;
  if (type == "NFC") {
    out.forms_.push_back(stable | UTF8PROC_COMPOSE);
  } else if (type == "NFD") {
    out.forms_.push_back(stable | UTF8PROC_DECOMPOSE);
  } else if (type == "NFKC") {
    out.forms_.push_back(stable | UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
  } else if (type == "NFKD") {
    out.forms_.push_back(stable | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT);
  } else {
    fail(where, ".type: unsupported normalizer '", type, "' (supported: NFC, NFD, NFKC, NFKD, Sequence, null)");
  }
  return out;
}

std::string Normalizer::apply(std::string_view s) const {
  bool ascii = true;  // every normal form leaves ASCII unchanged
  for (unsigned char c : s) ascii &= c < 0x80;
  if (ascii || forms_.empty()) return std::string(s);
  std::string cur(s);
  for (int form : forms_) {
    utf8proc_uint8_t* dst = nullptr;
    const utf8proc_ssize_t n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(cur.data()),
                                            static_cast<utf8proc_ssize_t>(cur.size()), &dst,
                                            static_cast<utf8proc_option_t>(form));
    if (n < 0) fail("normalizer: ", utf8proc_errmsg(n));
    cur.assign(reinterpret_cast<const char*>(dst), static_cast<size_t>(n));
    std::free(dst);
  }
  return cur;
}

PreTokenizer PreTokenizer::from_json(const nlohmann::json& j, const std::string& where) {
  PreTokenizer out;
  bool byte_level = false;
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
    TESSERA_CHECK(!byte_level, at, ": a '", type, "' step after the ByteLevel step is not supported");
    Step st;
    if (type == "ByteLevel") {
      byte_level = true;
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
      TESSERA_CHECK(behavior == "Isolated" || behavior == "Removed", at, ".behavior: '", behavior,
                    "' is not supported (supported: Isolated, Removed)");
      TESSERA_CHECK(!json_bool(s, "invert", false, at), at, ".invert: true is not supported");
      st.regex = std::make_shared<SplitRegex>(p->begin().value().get<std::string>(), literal,
                                              at + ".pattern");
      st.keep_matches = behavior == "Isolated";
    } else {
      fail(at, ".type: unsupported pre-tokenizer '", type, "' (supported: ByteLevel, Split, Sequence)");
    }
    out.steps_.push_back(std::move(st));
  };
  TESSERA_CHECK(!j.is_null(), where,
                ": is null; a byte-level BPE tokenizer needs a ByteLevel pre-tokenizer");
  add(j, where, add);
  TESSERA_CHECK(byte_level, where, ": has no ByteLevel step; only byte-level BPE tokenizers are supported");
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

void PreTokenizer::split(std::string_view text, std::vector<std::string_view>* pieces,
                         std::deque<std::string>* arena) const {
  // Each step maps every piece to zero or more pieces; empty pieces never survive.
  std::vector<std::string_view> cur, next;
  if (!text.empty()) cur.push_back(text);
  for (const Step& st : steps_) {
    next.clear();
    for (std::string_view piece : cur) {
      if (st.add_prefix_space && piece.front() != ' ') {
        arena->push_back(" " + std::string(piece));
        piece = arena->back();
      }
      if (st.regex) {
        st.regex->split(piece, st.keep_matches, &next);
      } else {
        next.push_back(piece);
      }
    }
    cur.swap(next);
  }
  pieces->insert(pieces->end(), cur.begin(), cur.end());
}

}  // namespace tessera::io
