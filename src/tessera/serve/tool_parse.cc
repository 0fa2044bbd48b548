// Tool calling, the output side: the model's text read into OpenAI tool calls, whole
// (parse_tool_output) or as it streams (ToolStreamParser).
//
// Formats: Hermes `<tool_call>{json}</tool_call>` blocks anywhere in the text; Llama 3.1 JSON
// objects `{"name", "parameters"}` separated by ';', after `<|python_tag|>` or when the output
// starts with '{'; "required" output, a JSON array of {"name", "parameters"}; a named function's
// output, which is the arguments. A call is an object with a "name" among the request's tools
// and an object under "arguments" (or "parameters"); its arguments are the model's own JSON text.
// A block that is not such a call stays content, verbatim. Whitespace next to a block is dropped.
#include <algorithm>

#include "tessera/io/json_file.h"
#include "tessera/serve/tool_calls.h"

namespace tessera::serve {
namespace {

constexpr std::string_view kHermesOpen = "<tool_call>", kHermesClose = "</tool_call>";
constexpr std::string_view kPythonTag = "<|python_tag|>";
constexpr int kMaxCallDepth = 128;

bool is_ws(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

std::string lstrip(std::string s) {
  s.erase(s.begin(), std::find_if(s.begin(), s.end(), [](char c) { return !is_ws(c); }));
  return s;
}
std::string rstrip(std::string s) {
  s.erase(std::find_if(s.rbegin(), s.rend(), [](char c) { return !is_ws(c); }).base(), s.end());
  return s;
}

// The length of the longest proper prefix of `tag` that `s` ends with: text held back because
// the next bytes may complete the tag.
size_t partial_tag(std::string_view s, std::string_view tag) {
  for (size_t k = std::min(s.size(), tag.size() - 1); k > 0; --k)
    if (s.substr(s.size() - k) == tag.substr(0, k)) return k;
  return 0;
}

// Reads one JSON object a byte at a time (leading whitespace skipped), noting where its
// top-level "name" string and its "arguments" / "parameters" value are. Syntax is checked only
// for the structure (strings, nesting); a closed object is validated by the JSON library.
class CallScanner {
 public:
  void push(char c) {
    if (closed_) {
      if (!is_ws(c)) junk_ = true;
      return;
    }
    if (junk_) return;
    if (text_.empty()) {
      if (is_ws(c)) return;
      if (c != '{') {
        junk_ = true;
        return;
      }
    }
    const size_t i = text_.size();
    text_ += c;
    if (in_str_) {
      if (esc_) esc_ = false;
      else if (c == '\\') esc_ = true;
      else if (c == '"') string_end(i);
      return;
    }
    switch (c) {
      case '"':
        value_start(i);
        in_str_ = true;
        str_begin_ = i;
        str_is_key_ = depth_ == 1 && key_pos_;
        break;
      case '{':
      case '[':
        value_start(i);
        if (++depth_ == 1) key_pos_ = true;
        break;
      case '}':
      case ']':
        if (--depth_ == 1) {
          if (reading_args_ && args_end_ == npos) args_end_ = i + 1;
        } else if (depth_ == 0) {
          value_end();
          closed_ = true;
        } else if (depth_ < 0) {
          junk_ = true;
        }
        break;
      case ':':
        if (depth_ == 1) {
          key_pos_ = false;
          value_begin_ = npos;
          reading_name_ = key_ == "name";
          reading_args_ = (key_ == "arguments" || key_ == "parameters") && args_begin_ == npos;
        }
        break;
      case ',':
        if (depth_ == 1) {
          value_end();
          key_pos_ = true;
        }
        break;
      default:
        if (!is_ws(c)) value_start(i);
    }
  }

  bool closed() const { return closed_ && !junk_; }
  bool broken() const { return junk_; }
  const std::string& text() const { return text_; }
  const std::optional<std::string>& name() const { return name_; }
  // The arguments' text so far: the value while it is open, all of it once closed.
  std::string_view args() const {
    if (args_begin_ == npos) return {};
    const size_t end = args_end_ != npos ? args_end_ : text_.size();
    return std::string_view(text_).substr(args_begin_, end - args_begin_);
  }

 private:
  static constexpr size_t npos = std::string::npos;
  static std::optional<std::string> decode(const std::string& literal) {
    try {
      return nlohmann::json::parse(literal).get<std::string>();
    } catch (const nlohmann::json::exception&) {
      return std::nullopt;
    }
  }
  void value_start(size_t i) {
    if (depth_ == 1 && !key_pos_ && value_begin_ == npos) {
      value_begin_ = i;
      if (reading_args_) args_begin_ = i;
    }
  }
  void value_end() {
    if (reading_args_ && args_begin_ != npos && args_end_ == npos) {
      size_t e = text_.size() - 1;  // the ',' or '}' just added
      while (e > args_begin_ && is_ws(text_[e - 1])) --e;
      args_end_ = e;
    }
    reading_name_ = reading_args_ = false;
  }
  void string_end(size_t i) {
    in_str_ = false;
    if (depth_ != 1) return;
    const std::string literal = text_.substr(str_begin_, i + 1 - str_begin_);
    if (str_is_key_) {
      key_ = decode(literal).value_or("");
    } else if (reading_name_ && value_begin_ == str_begin_) {
      name_ = decode(literal);
    }
  }

  std::string text_;
  int depth_ = 0;
  bool in_str_ = false, esc_ = false, key_pos_ = false, str_is_key_ = false;
  bool reading_name_ = false, reading_args_ = false, closed_ = false, junk_ = false;
  size_t str_begin_ = 0, value_begin_ = npos, args_begin_ = npos, args_end_ = npos;
  std::string key_;
  std::optional<std::string> name_;
};

bool known(const std::vector<std::string>& names, const std::string& n) {
  return std::find(names.begin(), names.end(), n) != names.end();
}

// The call a closed object holds, or nothing when it is not a well-formed call.
std::optional<ToolCall> to_call(const CallScanner& s, const std::vector<std::string>& names) {
  if (!s.closed() || !s.name() || !known(names, *s.name())) return std::nullopt;
  if (io::find_json_nesting_over(s.text(), kMaxCallDepth) != std::string::npos) return std::nullopt;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(s.text());
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;
  }
  if (!j.is_object() || !j.contains("name") || j["name"] != *s.name()) return std::nullopt;
  if (j.contains("arguments") == j.contains("parameters")) return std::nullopt;  // exactly one
  const auto& args = j.contains("arguments") ? j["arguments"] : j["parameters"];
  if (!args.is_object() || s.args().empty() || s.args()[0] != '{') return std::nullopt;
  return ToolCall{new_tool_call_id(), *s.name(), std::string(s.args())};
}

std::optional<ToolCall> scan_call(std::string_view text, const std::vector<std::string>& names) {
  CallScanner s;
  for (char c : text) s.push(c);
  return to_call(s, names);
}

// Hermes blocks, whole. Text before a block loses its trailing whitespace, text after one its
// leading whitespace; an unclosed last block runs to the end (a partial "</tool_call>" dropped).
ParsedToolOutput parse_hermes(const std::string& text, const std::vector<std::string>& names) {
  ParsedToolOutput r;
  std::string content;
  size_t pos = 0;
  bool after = false;
  while (true) {
    const size_t open = text.find(kHermesOpen, pos);
    std::string seg = text.substr(pos, open == std::string::npos ? std::string::npos : open - pos);
    if (after) seg = lstrip(seg);
    if (open == std::string::npos) {
      content += seg;
      break;
    }
    content += rstrip(seg);
    const size_t body_at = open + kHermesOpen.size();
    const size_t close = text.find(kHermesClose, body_at);
    std::string body = text.substr(body_at, close == std::string::npos ? std::string::npos : close - body_at);
    if (close == std::string::npos) body.erase(body.size() - partial_tag(body, kHermesClose));
    if (auto call = scan_call(body, names)) {
      r.calls.push_back(std::move(*call));
    } else {
      content += std::string(kHermesOpen) + body + (close == std::string::npos ? "" : std::string(kHermesClose));
    }
    after = true;
    if (close == std::string::npos) break;
    pos = close + kHermesClose.size();
  }
  r.content = std::move(content);
  return r;
}

// Llama 3.1 JSON calls: from a leading '{' or after <|python_tag|>, objects separated by ';'.
// The first thing that is not a well-formed call ends the calls; it and the rest are content.
ParsedToolOutput parse_llama3(const std::string& text, const std::vector<std::string>& names) {
  ParsedToolOutput r;
  const size_t first = text.find_first_not_of(" \t\n\r");
  size_t i;
  std::string content;
  if (first != std::string::npos && text[first] == '{') {
    i = first;
  } else if (const size_t tag = text.find(kPythonTag); tag != std::string::npos) {
    content = rstrip(text.substr(0, tag));
    i = tag + kPythonTag.size();
  } else {
    r.content = text;
    return r;
  }
  bool after_object = false;
  while (i < text.size()) {
    const char c = text[i];
    if (is_ws(c)) {
      ++i;
    } else if (c == '{') {
      CallScanner s;
      size_t j = i;
      while (j < text.size() && !s.closed() && !s.broken()) s.push(text[j++]);
      auto call = to_call(s, names);
      if (!call) {
        content += text.substr(i);
        break;
      }
      r.calls.push_back(std::move(*call));
      i = j;
      after_object = true;
    } else if (c == ';' && after_object) {
      after_object = false;
      ++i;
    } else {
      content += text.substr(i);
      break;
    }
  }
  r.content = std::move(content);
  return r;
}

}  // namespace

// ---- streaming --------------------------------------------------------------------------

struct ToolStreamParser::State {
  enum class Mode { kText, kHermesCall, kStart, kRegion, kObject, kRest, kArrayStart, kArrayItem, kArraySep, kArrayEnd, kNamed };

  ToolChoice choice;
  ToolParser parser;
  std::vector<std::string> names;
  std::string named;
  bool parallel = true;

  Mode mode = Mode::kText;
  std::string buf;            // text not yet consumed (a partial tag, or whitespace at the start)
  std::string pending_ws;     // whitespace sent only if text follows
  bool after_block = false;   // whitespace is dropped until text follows
  bool after_object = false;  // llama3: a ';' may follow
  // The current call.
  CallScanner scan;
  std::string raw;            // its text as the model wrote it (content when it is not a call)
  std::string id;
  bool header_sent = false, dropped = false;
  size_t args_sent = 0;
  int64_t index = -1, sent = 0;
  std::vector<ToolCall> calls;  // finished well-formed calls (for parse_tool_output)
  std::string all_content;      // every content byte sent
  Delta out;

  void content(std::string_view s) {
    out.content += s;
    all_content += s;
  }
  // Text outside blocks: whitespace next to a block is dropped.
  void text(std::string_view s) {
    for (char c : s) {
      if (is_ws(c)) {
        if (!after_block) pending_ws += c;
        continue;
      }
      pending_ws += c;
      content(pending_ws);
      pending_ws.clear();
      after_block = false;
    }
  }
  void args_fragment(std::string_view frag) {
    if (frag.empty()) return;
    auto& tc = out.tool_calls;
    if (!tc.empty() && tc.back()["index"] == index && !tc.back().contains("id")) {  // the header keeps ""
      auto& a = tc.back()["function"]["arguments"];
      a = a.get<std::string>() + std::string(frag);
    } else {
      tc.push_back({{"index", index}, {"function", {{"arguments", std::string(frag)}}}});
    }
  }
  void header(const std::string& name) {
    id = new_tool_call_id();
    index = sent++;
    header_sent = true;
    out.tool_calls.push_back(
        {{"index", index}, {"id", id}, {"type", "function"}, {"function", {{"name", name}, {"arguments", ""}}}});
  }
  void start_call() {
    scan = CallScanner();
    raw.clear();
    header_sent = dropped = false;
    args_sent = 0;
  }
  // Sends the header once the name is a known tool and an object of arguments has begun, then
  // the arguments as they grow.
  void progress() {
    if (dropped) return;
    if (!header_sent) {
      const auto a = scan.args();
      if (!scan.name() || !known(names, *scan.name()) || a.empty() || a[0] != '{' || scan.broken()) return;
      if (!parallel && sent >= 1) {
        dropped = true;  // parallel_tool_calls false: the first call only
        return;
      }
      header(*scan.name());
    }
    const auto a = scan.args();
    if (a.size() > args_sent) {
      args_fragment(a.substr(args_sent));
      args_sent = a.size();
    }
  }
  // The current call's text ended. When it is not a call (and nothing of it was sent), its
  // text is content. Returns whether it was a call.
  bool end_call(const std::string& fallback) {
    auto call = to_call(scan, names);
    if (call) {
      progress();
      if (header_sent) {
        call->id = id;
        calls.push_back(std::move(*call));
      }
      return true;
    }
    if (!header_sent) content(fallback);
    return false;
  }
  void push_call(std::string_view s) {
    for (char c : s) {
      raw += c;
      scan.push(c);
    }
    progress();
  }

  void run();
  void finish();
};

// Consumes `buf` as far as it can be decided; what may still change (a partial tag, an open
// object's end) waits for more text.
void ToolStreamParser::State::run() {
  while (!buf.empty()) {
    switch (mode) {
      case Mode::kNamed:  // the whole output is the arguments
        if (!header_sent) header(named);
        args_fragment(buf);
        raw += buf;
        buf.clear();
        return;
      case Mode::kText: {
        const std::string_view tag = parser == ToolParser::kHermes ? kHermesOpen : kPythonTag;
        const size_t at = buf.find(tag);
        if (at == std::string::npos) {
          const size_t keep = partial_tag(buf, tag);
          text(std::string_view(buf).substr(0, buf.size() - keep));
          buf.erase(0, buf.size() - keep);
          return;
        }
        text(std::string_view(buf).substr(0, at));
        pending_ws.clear();
        buf.erase(0, at + tag.size());
        if (parser == ToolParser::kHermes) {
          start_call();
          mode = Mode::kHermesCall;
        } else {
          mode = Mode::kRegion;
        }
        break;
      }
      case Mode::kHermesCall: {
        const size_t close = buf.find(kHermesClose);
        if (close == std::string::npos) {
          const size_t keep = partial_tag(buf, kHermesClose);
          push_call(std::string_view(buf).substr(0, buf.size() - keep));
          buf.erase(0, buf.size() - keep);
          return;
        }
        push_call(std::string_view(buf).substr(0, close));
        buf.erase(0, close + kHermesClose.size());
        end_call(std::string(kHermesOpen) + raw + std::string(kHermesClose));
        mode = Mode::kText;
        after_block = true;
        break;
      }
      case Mode::kStart: {  // llama3: a leading '{' starts calls
        const size_t first = buf.find_first_not_of(" \t\n\r");
        if (first == std::string::npos) return;
        if (buf[first] == '{') {
          buf.erase(0, first);
          mode = Mode::kRegion;
        } else {
          mode = Mode::kText;
        }
        break;
      }
      case Mode::kRegion: {  // llama3: objects separated by ';'
        const char c = buf[0];
        if (is_ws(c) || (c == ';' && after_object)) {
          if (c == ';') after_object = false;
          buf.erase(0, 1);
        } else if (c == '{') {
          start_call();
          mode = Mode::kObject;
        } else {
          mode = Mode::kRest;
        }
        break;
      }
      case Mode::kObject: {
        size_t j = 0;
        while (j < buf.size() && !scan.closed() && !scan.broken()) {
          raw += buf[j];
          scan.push(buf[j++]);
        }
        buf.erase(0, j);
        progress();
        if (!scan.closed() && !scan.broken()) return;
        if (!end_call(raw)) {
          mode = Mode::kRest;
        } else if (choice == ToolChoice::kRequired) {
          mode = Mode::kArraySep;
        } else {
          mode = Mode::kRegion;
          after_object = true;
        }
        break;
      }
      case Mode::kArrayStart:  // "required": [ {...}, {...} ]
      case Mode::kArrayItem:
      case Mode::kArraySep:
      case Mode::kArrayEnd: {
        const char c = buf[0];
        if (is_ws(c)) {
          buf.erase(0, 1);
        } else if (mode == Mode::kArrayStart && c == '[') {
          buf.erase(0, 1);
          mode = Mode::kArrayItem;
        } else if (mode == Mode::kArrayItem && c == '{') {
          start_call();
          mode = Mode::kObject;
        } else if ((mode == Mode::kArrayItem || mode == Mode::kArraySep) && c == ']') {
          buf.erase(0, 1);
          mode = Mode::kArrayEnd;
        } else if (mode == Mode::kArraySep && c == ',') {
          buf.erase(0, 1);
          mode = Mode::kArrayItem;
        } else {
          mode = Mode::kRest;
        }
        break;
      }
      case Mode::kRest:  // what follows a broken call, verbatim
        content(buf);
        buf.clear();
        return;
    }
  }
}

void ToolStreamParser::State::finish() {
  switch (mode) {
    case Mode::kNamed:
      if (!header_sent) header(named);
      calls.push_back({id, named, raw});
      break;
    case Mode::kText:
    case Mode::kStart:
      text(buf);
      content(pending_ws);
      break;
    case Mode::kHermesCall:  // unclosed: the held-back part of "</tool_call>" is dropped
      end_call(std::string(kHermesOpen) + raw);
      break;
    case Mode::kObject:  // unclosed: never a call
      end_call(raw);
      break;
    default:
      break;
  }
  buf.clear();
  pending_ws.clear();
}

ToolStreamParser::ToolStreamParser(const ToolRequest& t) : s_(std::make_unique<State>()) {
  s_->choice = t.choice;
  s_->parser = t.parser;
  s_->names = t.names;
  s_->named = t.named;
  s_->parallel = t.parallel;
  if (t.choice == ToolChoice::kNamed) s_->mode = State::Mode::kNamed;
  else if (t.choice == ToolChoice::kRequired) s_->mode = State::Mode::kArrayStart;
  else if (t.parser == ToolParser::kLlama3Json) s_->mode = State::Mode::kStart;
  else s_->mode = State::Mode::kText;  // hermes (or no parser: all text)
  if (!t.active()) s_->parser = ToolParser::kNone;
}
ToolStreamParser::~ToolStreamParser() = default;
ToolStreamParser::ToolStreamParser(ToolStreamParser&&) noexcept = default;

ToolStreamParser::Delta ToolStreamParser::feed(std::string_view text) {
  if (s_->parser == ToolParser::kNone && s_->choice != ToolChoice::kNamed && s_->choice != ToolChoice::kRequired) {
    Delta d;
    d.content = std::string(text);
    return d;
  }
  s_->buf += text;
  s_->run();
  return std::exchange(s_->out, Delta{});
}

ToolStreamParser::Delta ToolStreamParser::finish() {
  if (s_->parser == ToolParser::kNone && s_->choice != ToolChoice::kNamed && s_->choice != ToolChoice::kRequired)
    return {};
  s_->run();
  s_->finish();
  return std::exchange(s_->out, Delta{});
}

int64_t ToolStreamParser::calls() const { return s_->sent; }

ParsedToolOutput parse_tool_output(const ToolRequest& t, const std::string& text) {
  ParsedToolOutput r;
  if (t.choice == ToolChoice::kNamed || t.choice == ToolChoice::kRequired) {
    ToolStreamParser p(t);
    p.feed(text);
    p.finish();
    r.calls = std::move(p.s_->calls);
    if (!p.s_->all_content.empty() || r.calls.empty()) r.content = p.s_->all_content;
    return r;
  }
  if (!t.active()) {
    r.content = text;
    return r;
  }
  r = t.parser == ToolParser::kHermes ? parse_hermes(text, t.names) : parse_llama3(text, t.names);
  if (!t.parallel && r.calls.size() > 1) r.calls.resize(1);
  if (!r.calls.empty() && r.content && r.content->empty()) r.content.reset();
  return r;
}

}  // namespace tessera::serve
