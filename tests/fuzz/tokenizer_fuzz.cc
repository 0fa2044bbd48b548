// libFuzzer target: tokenizer.json loading and the encode / decode round trip. Input:
// TOKENIZER_JSON [NUL TEXT [NUL TOKENIZER_CONFIG_JSON]]; without TEXT a fixed mixed-script
// string is encoded. tessera::Error is the expected failure of from_json (and of encode on
// invalid UTF-8); any other exception, a sanitizer report, ids outside the vocabulary or
// decode refusing encode's own ids is a bug.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "tessera/io/json_file.h"
#include "tessera/io/tokenizer.h"

namespace {

using namespace tessera;

const char* kDefaultText = "Hello, world! <|endoftext|> don't 123 caf\xC3\xA9 \xE4\xBD\xA0\xE5\xA5\xBD \xF0\x9F\x98\x80\n\t x";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto parts = fuzz::split_input(data, size, 3);
  if (parts[1].size() > 512) return 0;  // keep each run short: the text is the easy part
  try {
    nlohmann::json config = nullptr;
    if (!parts[2].empty()) config = io::parse_json_text(parts[2], "tokenizer_config.json");
    const io::Tokenizer tok =
        io::Tokenizer::from_json(io::parse_json_text(parts[0], "tokenizer.json"), "tokenizer.json", config);
    const int64_t vocab = tok.vocab_size();
    const std::string text = parts[1].empty() ? std::string(kDefaultText) : parts[1];
    for (const bool special : {true, false}) {
      std::vector<int32_t> ids;
      try {
        ids = tok.encode(text, special);
      } catch (const Error&) {
        continue;  // invalid UTF-8 and the like: rejected, fine
      }
      for (int32_t id : ids)
        if (id < 0 || id >= vocab)
          fuzz::invariant_failed("encode gave id " + std::to_string(id) + " outside [0, " + std::to_string(vocab) + ")");
      try {
        (void)tok.decode(ids, false);
        (void)tok.decode(ids, true);
        for (int32_t id : ids) (void)tok.decode_token(id);
      } catch (const Error& e) {
        fuzz::invariant_failed(std::string("decode refused encode's ids: ") + e.what());
      }
    }
    for (int32_t id : {tok.bos_id(), tok.eos_id()})
      if (id >= vocab) fuzz::invariant_failed("bos/eos id outside the vocabulary");
    (void)tok.to_json();
  } catch (const Error&) {
    return 0;
  } catch (...) {
    fuzz::unexpected_exception();
  }
  return 0;
}
