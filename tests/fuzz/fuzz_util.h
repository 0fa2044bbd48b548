// Helpers shared by the libFuzzer targets: splitting an input into NUL-separated parts,
// a bound on JSON nesting for harness-side parses, the "expected errors only" rule and a
// small byte-level BPE tokenizer built in-process (no files at fuzz time).
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "tessera/base/error.h"
#include "tessera/io/json_file.h"
#include "tessera/io/tokenizer.h"

namespace tessera::fuzz {

// The input cut at its first `max_parts - 1` NUL bytes (missing parts are empty).
inline std::vector<std::string> split_input(const uint8_t* data, size_t size, size_t max_parts) {
  std::vector<std::string> parts;
  const std::string_view all(reinterpret_cast<const char*>(data), size);
  size_t pos = 0;
  while (parts.size() + 1 < max_parts) {
    const size_t nul = all.find('\0', pos);
    if (nul == std::string_view::npos) break;
    parts.emplace_back(all.substr(pos, nul - pos));
    pos = nul + 1;
  }
  parts.emplace_back(all.substr(pos));
  parts.resize(max_parts);
  return parts;
}

// Brackets nested deeper than `limit` outside strings: the harness's own JSON parses skip
// such inputs (deep nesting of the harness's data is not what is being tested).
inline bool nested_deeper_than(const std::string& text, int limit) {
  return tessera::io::find_json_nesting_over(text, limit) != std::string::npos;
}

// Any exception that is not a tessera::Error escaping the code under test is a bug: print
// it and abort so libFuzzer saves the input. Use as `catch (...) { unexpected_exception(); }`
// after `catch (const tessera::Error&)`.
[[noreturn]] inline void unexpected_exception() {
  try {
    throw;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "==fuzz== unexpected exception (not tessera::Error): %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "==fuzz== unexpected exception of unknown type\n");
  }
  std::abort();
}

// A broken invariant on an accepted input: print it and abort.
[[noreturn]] inline void invariant_failed(const std::string& what) {
  std::fprintf(stderr, "==fuzz== invariant broken: %s\n", what.c_str());
  std::abort();
}

// GPT-2's reversible byte -> printable code point map (bytes_to_unicode), as UTF-8.
inline std::vector<std::string> byte_level_alphabet() {
  std::vector<int> bs, cs;
  for (int b = 0; b < 256; ++b)
    if ((b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF)) bs.push_back(b);
  cs = bs;
  int extra = 0;
  for (int b = 0; b < 256; ++b) {
    bool seen = false;
    for (int x : bs) seen = seen || x == b;
    if (!seen) {
      bs.push_back(b);
      cs.push_back(256 + extra++);
    }
  }
  std::vector<std::string> out(256);
  for (size_t i = 0; i < bs.size(); ++i) {
    const int c = cs[i];
    std::string u;
    if (c < 0x80) {
      u += static_cast<char>(c);
    } else {
      u += static_cast<char>(0xC0 | (c >> 6));
      u += static_cast<char>(0x80 | (c & 0x3F));
    }
    out[bs[i]] = u;
  }
  return out;
}

// A GPT-2-style byte-level BPE tokenizer.json: the 256 byte tokens, a few merges, and the
// ChatML / GPT-2 special tokens. Small, but every code path of encode / decode is live.
inline nlohmann::json tiny_tokenizer_json() {
  using nlohmann::json;
  const std::vector<std::string> alpha = byte_level_alphabet();
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[alpha[b]] = b;
  const char* const merges[][2] = {{"\xC4\xA0", "t"}, {"h", "e"}, {"\xC4\xA0t", "he"}, {"i", "n"},
                                   {"\xC4\xA0", "a"}, {"e", "r"}, {"o", "n"}, {"\xC4\xA0", "s"},
                                   {"r", "e"}, {"a", "t"}, {"\xC4\xA0", "w"}, {"o", "r"}};
  json merge_list = json::array();
  int next = 256;
  for (const auto& m : merges) {
    merge_list.push_back(std::string(m[0]) + " " + m[1]);
    vocab[std::string(m[0]) + m[1]] = next++;
  }
  json added = json::array();
  for (const char* t : {"<|endoftext|>", "<|im_start|>", "<|im_end|>"})
    added.push_back({{"id", next++}, {"content", t}, {"single_word", false}, {"lstrip", false},
                     {"rstrip", false}, {"normalized", false}, {"special", true}});
  return {{"version", "1.0"},
          {"truncation", nullptr},
          {"padding", nullptr},
          {"added_tokens", added},
          {"normalizer", nullptr},
          {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true},
                             {"use_regex", true}}},
          {"post_processor", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", false},
                              {"use_regex", true}}},
          {"decoder", {{"type", "ByteLevel"}, {"add_prefix_space", true}, {"trim_offsets", true},
                       {"use_regex", true}}},
          {"model", {{"type", "BPE"}, {"dropout", nullptr}, {"unk_token", nullptr},
                     {"continuing_subword_prefix", ""}, {"end_of_word_suffix", ""}, {"fuse_unk", false},
                     {"byte_fallback", false}, {"vocab", vocab}, {"merges", merge_list}}}};
}

inline const io::Tokenizer& tiny_tokenizer() {
  static const io::Tokenizer tok = io::Tokenizer::from_json(
      tiny_tokenizer_json(), "tiny_tokenizer_json()", {{"eos_token", "<|endoftext|>"}});
  return tok;
}

}  // namespace tessera::fuzz
