// Chat conversations rendered for supervised fine-tuning: the chat template's text tokenized with
// a loss mask that is 1 exactly on what the assistant wrote (its content and end-of-turn text).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/io/tokenizer.h"
#include "tessera/serve/chat_template.h"

namespace tessera::serve {

// One conversation rendered for training. Invariant: tokens.size() == mask.size().
struct SftExample {
  std::vector<int32_t> tokens;  // (n,) ids of the whole rendering
  std::vector<uint8_t> mask;    // (n,) 1: written by the assistant, incl. its end-of-turn text; 0: the rest
};

// messages: [{"role": "system"|"developer"|"user"|"assistant"|"tool", "content": ...}, ...]
// (OpenAI style; the roles the server accepts). content is a string or OpenAI's list of
// {"type": "text", "text": ...} parts, which are joined into one string (as the server does);
// other parts, and null content, are an error. Other keys of a message (name, tool_calls, ...)
// are passed to the template as they are.
//
// Assistant turn k's span comes from the template itself: render(messages[:k],
// add_generation_prompt=true) must be a prefix of render(messages[:k+1], false), and that must be
// a prefix of the whole conversation's render(messages, false); the characters between the two
// prefixes are the assistant's. The rendering is cut into segments at those span boundaries and
// each segment is tokenized on its own (encode(segment, add_special_tokens=false): special tokens
// written in the text, such as the template's bos_token, are matched as special tokens), so the
// prompt before a turn is tokenized exactly as it is at inference, when it is encoded alone.
// Text after the last assistant turn (a trailing user or tool message) is mask 0.
//
// Errors (tessera::Error, one line): messages not an array, a message that is not an object, a
// role missing or not one of the above, bad content, no assistant message, a template error
// (naming the render that raised it), a template that is not prefix-stable or renders an
// assistant turn differently once later messages follow (naming the message), an assistant turn
// that renders as no text.
SftExample render_sft_example(const ChatTemplate& tmpl, const io::Tokenizer& tok, const nlohmann::json& messages);

// Reads a JSONL file of {"messages": [...]} objects, one per line (blank lines skipped; other
// keys of the object are ignored), and renders each with render_sft_example. Errors name the
// file and the 1-based line: "chats.jsonl:17: no assistant message".
std::vector<SftExample> render_sft_file(const std::string& path, const ChatTemplate& tmpl, const io::Tokenizer& tok);

}  // namespace tessera::serve
