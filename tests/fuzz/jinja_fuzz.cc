// libFuzzer target: the Jinja chat-template interpreter. Input: TEMPLATE, a NUL byte, then
// the render variables as JSON: an object ({"messages": [...], "add_generation_prompt": ...,
// "bos_token": ..., "eos_token": ..., other variables}) or a bare messages array; missing or
// unparsable variables get a two-message conversation. Parse with jinja::Template, render with
// the globals ChatTemplate::render sets. tessera::Error is the expected failure; anything else
// (other exceptions, sanitizer reports, stack overflow, -timeout / -rss_limit_mb) is a bug.
// Renders run under a tight budget (the defaults allow 2 s and 16 MiB per render, too slow
// for fuzzing); the limits themselves are what keeps every input fast and small.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "tessera/serve/jinja.h"

namespace {

using namespace tessera;
using serve::jinja::Value;

Value default_messages() {
  return Value::parse(R"([{"role":"system","content":"Be brief."},{"role":"user","content":"Hi there!"}])");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto parts = fuzz::split_input(data, size, 2);
  Value globals = Value::object();
  if (!fuzz::nested_deeper_than(parts[1], 32)) {
    Value v = Value::parse(parts[1], nullptr, /*allow_exceptions=*/false);
    if (v.is_object()) globals = std::move(v);
    else if (v.is_array()) globals["messages"] = std::move(v);
  }
  if (!globals.contains("messages")) globals["messages"] = default_messages();
  if (!globals.contains("add_generation_prompt")) globals["add_generation_prompt"] = true;
  if (!globals.contains("bos_token")) globals["bos_token"] = "<s>";
  if (!globals.contains("eos_token")) globals["eos_token"] = "</s>";
  try {
    const serve::jinja::Template t(parts[0]);
    static const serve::jinja::Limits tight =
        serve::jinja::parse_template_limits("iterations=20000,output=1M,string=1M,list=20000,time=1s");
    (void)t.render(globals, tight);
  } catch (const Error&) {
    return 0;
  } catch (...) {
    fuzz::unexpected_exception();
  }
  return 0;
}
