// Renders chat conversations with their template and marks the assistant's tokens for the loss.
#include "tessera/serve/chat_sft.h"

#include <algorithm>
#include <string_view>

#include "tessera/base/error.h"
#include "tessera/io/json_file.h"

namespace tessera::serve {
namespace {

using nlohmann::json;

const char* const kRoles[] = {"system", "developer", "user", "assistant", "tool"};

// Up to 24 bytes of `s` as a JSON string, for one-line error messages.
std::string quoted(std::string_view s) {
  constexpr size_t kMax = 24;
  const std::string q = json(std::string(s.substr(0, kMax))).dump(-1, ' ', false, json::error_handler_t::replace);
  return s.size() > kMax ? q + "..." : q;
}

// "" when `prefix` is a prefix of `text`; else where the two part.
std::string prefix_mismatch(const std::string& prefix, const std::string& text) {
  const size_t i = std::mismatch(prefix.begin(), prefix.end(), text.begin(), text.end()).first - prefix.begin();
  if (i == prefix.size()) return "";
  return detail::concat("they part at byte ", i, ": ", quoted(std::string_view(prefix).substr(i)), " vs ",
                        i < text.size() ? quoted(std::string_view(text).substr(i)) : "the end of the text");
}

// Checks the messages and joins list-of-parts content into one string; other keys are kept.
json normalize_messages(const json& messages) {
  TESSERA_CHECK(messages.is_array(), "messages must be a JSON array of {role, content} objects, got ",
                io::json_brief(messages));
  json out = json::array();
  for (size_t i = 0; i < messages.size(); ++i) {
    const json& m = messages[i];
    const std::string where = "messages[" + std::to_string(i) + "]";
    TESSERA_CHECK(m.is_object(), where, " must be an object with role and content, got ", io::json_brief(m));
    const auto role = m.find("role");
    TESSERA_CHECK(role != m.end(), where, " has no role");
    TESSERA_CHECK(role->is_string(), where, ".role must be a string, got ", io::json_brief(*role));
    const std::string r = role->get<std::string>();
    TESSERA_CHECK(std::find(std::begin(kRoles), std::end(kRoles), r) != std::end(kRoles), where, ".role ",
                  quoted(r), " is not one of system, developer, user, assistant, tool");
    const auto content = m.find("content");
    TESSERA_CHECK(content != m.end(), where, " has no content");
    std::string text;
    if (content->is_string()) {
      text = content->get<std::string>();
    } else if (content->is_array()) {
      for (size_t k = 0; k < content->size(); ++k) {
        const json& part = (*content)[k];
        const bool ok = part.is_object() && part.contains("type") && part["type"] == "text" &&
                        part.contains("text") && part["text"].is_string();
        TESSERA_CHECK(ok, where, ".content[", k,
                      "] must be {\"type\": \"text\", \"text\": ...}; other content parts are not supported");
        text += part["text"].get<std::string>();
      }
    } else {
      fail(where, ".content must be a string or a list of text parts, got ", io::json_brief(*content));
    }
    json msg = m;
    msg["content"] = std::move(text);
    out.push_back(std::move(msg));
  }
  return out;
}

// One JSONL line as JSON; errors start ":COL: invalid JSON: " (COL: the 1-based byte in the line).
json parse_line(const std::string& line) {
  const size_t nul = line.find('\0');  // nlohmann would stop reading there
  if (nul != std::string::npos) fail(":", nul + 1, ": invalid JSON: NUL byte");
  const int max_depth = io::JsonLimits{}.max_depth;  // later copies and dumps recurse
  const size_t deep = io::find_json_nesting_over(line, max_depth);
  if (deep != std::string::npos) fail(":", deep + 1, ": invalid JSON: nested deeper than ", max_depth, " levels");
  try {
    return json::parse(line);
  } catch (const json::parse_error& e) {
    std::string what = io::json_error_text(e);  // "parse error at line 1, column 5: syntax error ..."
    const size_t colon = what.rfind("parse error", 0) == 0 ? what.find(": ") : std::string::npos;
    if (colon != std::string::npos) what = what.substr(colon + 2);
    fail(":", e.byte, ": invalid JSON: ", what);
  } catch (const json::exception& e) {  // out_of_range: a number such as 1e999
    fail(": invalid JSON: ", io::json_error_text(e));
  }
}

}  // namespace

SftExample render_sft_example(const ChatTemplate& tmpl, const io::Tokenizer& tok, const json& messages) {
  const json msgs = normalize_messages(messages);
  // The first n messages rendered; template errors name the render that raised them.
  auto render = [&](size_t n, bool add_generation_prompt) {
    try {
      return tmpl.render(json(msgs.begin(), msgs.begin() + static_cast<std::ptrdiff_t>(n)), add_generation_prompt);
    } catch (const Error& e) {
      fail("rendering messages[:", n, "]", add_generation_prompt ? " with add_generation_prompt" : "", ": ",
           e.what());
    }
  };

  // Segments in order, each with its mask; their concatenation must be the whole rendering.
  std::vector<std::pair<std::string, uint8_t>> segments;
  const std::string full = render(msgs.size(), false);
  size_t done = 0;  // bytes of `full` covered by `segments`
  for (size_t k = 0; k < msgs.size(); ++k) {
    if (msgs[k]["role"] != "assistant") continue;
    const std::string where = "messages[" + std::to_string(k) + "] (assistant)";
    const std::string prompt = render(k, true), turn = render(k + 1, false);
    std::string diff = prefix_mismatch(prompt, turn);
    TESSERA_CHECK(diff.empty(), "chat template is not prefix-stable at ", where, ": messages[:", k,
                  "] rendered with add_generation_prompt is not a prefix of messages[:", k + 1, "] rendered; ",
                  diff);
    diff = prefix_mismatch(turn, full);
    TESSERA_CHECK(diff.empty(), "chat template renders ", where, " differently once later messages follow: messages[:",
                  k + 1, "] rendered is not a prefix of the whole conversation rendered; ", diff);
    TESSERA_CHECK(turn.size() > prompt.size(), "chat template renders no text for ", where);
    // A template that renders fewer characters for more messages could make spans overlap.
    TESSERA_CHECK(prompt.size() >= done, "chat template is not prefix-stable at ", where, ": its prompt (",
                  prompt.size(), " bytes) ends inside the previous assistant turn (which ends at byte ", done, ")");
    if (prompt.size() > done) segments.emplace_back(prompt.substr(done), 0);
    segments.emplace_back(turn.substr(prompt.size()), 1);
    done = turn.size();
  }
  TESSERA_CHECK(done > 0, "no assistant message among the ", msgs.size(), " messages: nothing to train on");
  if (full.size() > done) segments.emplace_back(full.substr(done), 0);

  std::string joined;
  SftExample ex;
  for (const auto& [text, trained] : segments) {
    joined += text;
    const std::vector<int32_t> ids = tok.encode(text, /*add_special_tokens=*/false);
    TESSERA_CHECK(!ids.empty() || !trained, "assistant text ", quoted(text), " encodes to no tokens");
    ex.tokens.insert(ex.tokens.end(), ids.begin(), ids.end());
    ex.mask.insert(ex.mask.end(), ids.size(), trained);
  }
  // Holds by the prefix checks above; kept as the statement of what the segments are.
  TESSERA_CHECK(joined == full, "internal error: the SFT segments do not concatenate to the rendering");
  return ex;
}

std::vector<SftExample> render_sft_file(const std::string& path, const ChatTemplate& tmpl, const io::Tokenizer& tok) {
  const std::string bytes = io::read_file_bytes(path);
  std::vector<SftExample> out;
  size_t line_no = 0;
  for (size_t pos = 0; pos < bytes.size();) {
    size_t end = bytes.find('\n', pos);
    if (end == std::string::npos) end = bytes.size();
    const std::string line = bytes.substr(pos, end - pos);
    pos = end + 1;
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const std::string where = path + ":" + std::to_string(line_no);
    json j;
    try {
      j = parse_line(line);
    } catch (const Error& e) {
      fail(where, e.what());  // ":COL: invalid JSON: ..."
    }
    try {
      TESSERA_CHECK(j.is_object() && j.contains("messages"), "expected an object {\"messages\": [...]}, got ",
                    j.is_object() ? "an object without \"messages\"" : io::json_brief(j));
      out.push_back(render_sft_example(tmpl, tok, j["messages"]));
    } catch (const Error& e) {
      fail(where, ": ", e.what());
    }
  }
  return out;
}

}  // namespace tessera::serve
