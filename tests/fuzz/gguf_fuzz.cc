// libFuzzer target: parse_gguf_header on arbitrary bytes must either throw tessera::Error or
// return a header whose invariants hold; an accepted header then goes through what a model
// load reads from it (the model config, the tokenizer), which may only throw tessera::Error.
// Anything else is a bug (crash, sanitizer report, other exception type, broken invariant).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <set>
#include <string>

#include "fuzz_util.h"
#include "tessera/io/gguf.h"
#include "tessera/io/gguf_tokenizer.h"
#include "tessera/model/gguf_model.h"

// A file without tokenizer.ggml.pre logs a warning; at thousands of inputs a second that
// would bury libFuzzer's own output.
extern "C" int LLVMFuzzerInitialize(int*, char***) {
  setenv("TESSERA_LOG", "error", 1);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace tessera;
  io::GgufHeader h;
  try {
    h = io::parse_gguf_header(data, size, "fuzz.gguf");
  } catch (const Error&) {
    return 0;
  } catch (...) {
    fuzz::unexpected_exception();
  }
  // Accepted: unique keys and names, each tensor's bytes what its dims and type need, aligned,
  // inside the file and disjoint from the others.
  std::set<std::string> keys, names;
  for (const auto& [k, v] : h.metadata)
    if (!keys.insert(k).second) fuzz::invariant_failed("duplicate key accepted: " + k);
  if (h.alignment == 0 || (h.alignment & (h.alignment - 1)) != 0) fuzz::invariant_failed("alignment");
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  for (const io::GgufTensorInfo& t : h.tensors) {
    if (!names.insert(t.name).second) fuzz::invariant_failed("duplicate tensor accepted: " + t.name);
    if (t.ne.empty() || t.ne.size() > 4) fuzz::invariant_failed("dims of " + t.name);
    int64_t rows = 1;
    for (size_t d = 1; d < t.ne.size(); ++d) rows *= t.ne[d];
    const int64_t row = io::ggml_row_bytes(t.type, t.ne[0], "fuzz");
    if (static_cast<uint64_t>(row * rows) != t.nbytes) fuzz::invariant_failed("byte size of " + t.name);
    if ((h.data_start + t.offset) % h.alignment != 0) fuzz::invariant_failed("alignment of " + t.name);
    if (h.data_start + t.offset + t.nbytes > size) fuzz::invariant_failed("data of " + t.name + " past the end");
    if (t.nbytes > 0) spans.emplace_back(t.offset, t.offset + t.nbytes);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i)
    if (spans[i - 1].second > spans[i].first) fuzz::invariant_failed("overlapping tensors accepted");
  for (const auto& [k, v] : h.metadata) (void)v.describe();

  try {
    (void)model::gguf_model_config(h, "fuzz.gguf");
  } catch (const Error&) {
  } catch (...) {
    fuzz::unexpected_exception();
  }
  try {
    const io::Tokenizer tok = io::tokenizer_from_gguf(h, "fuzz.gguf");
    (void)tok.decode(tok.encode("Hello <|im_start|> world 123"));
  } catch (const Error&) {
  } catch (...) {
    fuzz::unexpected_exception();
  }
  return 0;
}
