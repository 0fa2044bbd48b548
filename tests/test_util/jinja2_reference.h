// jinja2 itself (Debian's python3-jinja2) as the reference for chat-template rendering, set up
// the way transformers' apply_chat_template sets it up. Shared by the chat template, SFT and
// tool-calling tests.
#pragma once
#include <filesystem>
#include <fstream>
#include <string>

#include <nlohmann/json.hpp>

#include "test_util/run_command.h"

namespace tessera::testing {

// The same environment as transformers' _compile_jinja_template: sandboxed, trim_blocks,
// lstrip_blocks, loopcontrols, raise_exception / strftime_now globals, HF's tojson.
inline constexpr const char* kJinja2Reference = R"PY(
import json, sys
from datetime import datetime
import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

def strftime_now(fmt):
    return datetime.now().strftime(fmt)

env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
env.filters["tojson"] = tojson
env.globals["raise_exception"] = raise_exception
env.globals["strftime_now"] = strftime_now
d = sys.argv[1]
with open(d + "/template.jinja", encoding="utf-8", newline="") as f:
    template = env.from_string(f.read())
with open(d + "/cases.json", encoding="utf-8") as f:
    cases = json.load(f)
out = []
for case in cases:
    try:
        out.append({"ok": template.render(**case)})
    except jinja2.exceptions.TemplateError as e:
        out.append({"error": str(e)})
with open(d + "/expected.json", "w", encoding="utf-8") as f:
    json.dump(out, f, ensure_ascii=False)
)PY";

// Renders each case (an object of template variables) of the JSON array `cases_json` with
// jinja2 in `dir` (Python keeps the text's key order); returns [{"ok": text} | {"error":
// message}, ...], or null after writing the failure to `*log`.
inline nlohmann::json render_with_jinja2(const std::string& source, const std::string& cases_json,
                                         const std::string& dir, std::string* log) {
  auto write = [](const std::string& path, const std::string& bytes) {
    std::ofstream f(path, std::ios::binary | std::ios::trunc);
    f << bytes;
  };
  write(dir + "/template.jinja", source);
  write(dir + "/cases.json", cases_json);
  write(dir + "/reference.py", kJinja2Reference);
  const auto r = run_command(std::string(TESSERA_PYTHON) + " " + dir + "/reference.py " + dir);
  if (r.code != 0) {
    if (log) *log = r.out;
    return nullptr;
  }
  std::ifstream f(dir + "/expected.json");
  return nlohmann::json::parse(f);
}

}  // namespace tessera::testing
