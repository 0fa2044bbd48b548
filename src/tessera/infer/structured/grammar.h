// Structured outputs' grammar: a byte-level context-free grammar (the IR every constraint
// compiles to) and its GBNF parser (llama.cpp's syntax). Char classes over code points
// become UTF-8 byte sequences here, so the matcher never decodes UTF-8 and a token that
// ends inside a character is stepped like any other.
#pragma once
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace tessera::infer::structured {

using ByteSet = std::array<uint64_t, 4>;  // bit b set: byte b matches

inline bool byte_in(const ByteSet& s, unsigned char b) { return (s[b >> 6] >> (b & 63)) & 1; }

// Rules of alternatives of symbols, flattened as llama.cpp's: each alternative is a run of
// elements ended by kEnd. No rule is left-recursive (the parser refuses such grammars), so
// expanding a rule always reaches a byte set or the end of the input grammar in finite steps.
struct Grammar {
  enum Kind : uint8_t { kEnd, kBytes, kRule };
  struct Elem {
    Kind kind = kEnd;
    uint32_t arg = 0;  // kBytes: index into sets; kRule: rule id
  };
  std::vector<Elem> elems;
  std::vector<std::vector<uint32_t>> rules;  // per rule, the offsets of its alternatives
  std::vector<std::string> names;            // per rule (generated rules get "name_N")
  std::vector<ByteSet> sets;
  uint32_t root = 0;
};

// Parses GBNF: `name ::= alternatives` rules (one per line, or continued inside parentheses
// or on lines that start with `|`), "literals" with \n \r \t \\ \" \xHH \uHHHH \UHHHHHHHH
// escapes, [classes] with ranges and ^ negation, `.` (any character), ( groups ), | and the
// postfix operators * + ? {m} {m,} {m,n}; # comments. The start rule is `root`. Errors are
// tessera::Error "grammar: line L: ..." naming the rule or character at fault.
Grammar parse_gbnf(std::string_view text);

// Code point range [lo, hi] as UTF-8 byte-range sequences (each a list of per-byte
// [first, last] ranges), surrogates excluded: RE2's / Rust regex's UTF-8 range splitting.
std::vector<std::vector<std::pair<uint8_t, uint8_t>>> utf8_sequences(uint32_t lo, uint32_t hi);

}  // namespace tessera::infer::structured
