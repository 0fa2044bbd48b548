// JSON schemas as GBNF (after llama.cpp's json-schema-to-grammar): one rule per schema
// node, properties in their declared order, whitespace and number lengths bounded so that
// a model cannot loop forever in spaces or digits. Every keyword that constrains values and
// is not enforced here is refused by name rather than ignored.
#include <cmath>
#include <map>
#include <set>

#include "tessera/base/error.h"
#include "tessera/infer/structured/convert.h"

namespace tessera::infer::structured {
namespace {

using json = nlohmann::ordered_json;  // properties keep the schema text's order

// Shared primitives. ws: nothing, a space, or a newline and up to 20 spaces or tabs.
const char* kPrimitives = R"(ws ::= | " " | "\n" [ \t]{0,20}
hex ::= [0-9a-fA-F]
char ::= [^"\\\x00-\x1F] | "\\" (["\\/bfnrt] | "u" ([0-9a-cA-CeEfF] hex hex hex | [dD] [0-7] hex hex))
string ::= "\"" char* "\""
integer ::= "-"? ("0" | [1-9] [0-9]{0,15})
number ::= integer ("." [0-9]{1,16})? ([eE] [-+]? [0-9]{1,2})?
boolean ::= "true" | "false"
null ::= "null"
value ::= object | array | string | number | boolean | null
object ::= "{" ws (string ws ":" ws value ws ("," ws string ws ":" ws value ws)*)? "}"
array ::= "[" ws (value ws ("," ws value ws)*)? "]"
)";

// Keywords that only annotate (or that the value keywords here already cover).
const std::set<std::string> kAnnotations = {
    "title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
    "readOnly", "writeOnly", "format", "$defs", "definitions", "strict", "name", "contentMediaType",
    "contentEncoding"};
const std::set<std::string> kSupported = {
    "type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
    "enum", "const", "minLength", "maxLength", "pattern", "anyOf", "oneOf", "allOf", "$ref", "nullable"};

class Converter {
 public:
  explicit Converter(const json& root) : root_(root) {}

  std::string run() {
    const std::string top = visit(root_, "root-value", "#");
    rules_.emplace_back("root", top);
    while (!pending_.empty()) {  // $ref targets, each converted once
      auto [name, path] = *pending_.begin();
      pending_.erase(pending_.begin());
      const json& target = resolve(path);
      rules_.emplace_back(name, visit(target, name + "-body", path));
    }
    std::string out;
    for (const auto& [n, body] : rules_) out += n + " ::= " + body + "\n";
    return out + kPrimitives;
  }

 private:
  template <typename... Args>
  [[noreturn]] static void err(const std::string& path, Args&&... args) {
    fail("JSON schema at ", path, ": ", std::forward<Args>(args)...);
  }

  std::string rule(const std::string& hint, const std::string& body) {
    std::string base;
    for (char c : hint) base += std::isalnum(static_cast<unsigned char>(c)) ? c : '-';
    if (base.empty()) base = "r";
    std::string name = base;
    for (int k = 1; used_.count(name); ++k) name = base + "-" + std::to_string(k);
    used_.insert(name);
    rules_.emplace_back(name, body);
    return name;
  }

  const json& resolve(const std::string& ref) {
    if (ref.rfind("#", 0) != 0) err(ref, "only local $ref (#/$defs/NAME) is supported");
    const json* at = &root_;
    size_t i = 1;
    while (i < ref.size()) {
      if (ref[i] != '/') err(ref, "malformed $ref");
      const size_t j = std::min(ref.find('/', i + 1), ref.size());
      std::string key;  // JSON pointer escapes: ~1 is '/', ~0 is '~'
      for (size_t k = i + 1; k < j; ++k) {
        if (ref[k] == '~' && k + 1 < j && (ref[k + 1] == '0' || ref[k + 1] == '1')) {
          key += ref[++k] == '1' ? '/' : '~';
        } else {
          key += ref[k];
        }
      }
      if (!at->is_object() || !at->contains(key)) err(ref, "$ref target does not exist");
      at = &(*at)[key];
      i = j;
    }
    return *at;
  }

  static bool of_type(const json& v, const std::string& t) {
    if (t == "string") return v.is_string();
    if (t == "integer") return v.is_number_integer() || (v.is_number_float() && v.get<double>() == std::floor(v.get<double>()));
    if (t == "number") return v.is_number();
    if (t == "boolean") return v.is_boolean();
    if (t == "null") return v.is_null();
    if (t == "object") return v.is_object();
    if (t == "array") return v.is_array();
    return false;
  }

  static std::vector<std::string> types(const json& s, const std::string& path) {
    std::vector<std::string> out;
    auto it = s.find("type");
    if (it == s.end()) return out;
    auto check = [&](const json& t) {
      static const std::set<std::string> kTypes = {"string", "integer", "number", "boolean", "null", "object", "array"};
      if (!t.is_string() || !kTypes.count(t.get<std::string>())) err(path, "'type' ", t.dump(), " is not a JSON type");
      out.push_back(t.get<std::string>());
    };
    if (it->is_array()) {
      if (it->empty()) err(path, "'type' is an empty list");
      for (const auto& t : *it) check(t);
    } else {
      check(*it);
    }
    if (s.value("nullable", false)) out.push_back("null");
    return out;
  }

  static int64_t count(const json& s, const char* key, const std::string& path, int64_t dflt) {
    auto it = s.find(key);
    if (it == s.end()) return dflt;
    if (!it->is_number_integer() || it->get<int64_t>() < 0 || it->get<int64_t>() > 10000)
      err(path, "'", key, "' must be an integer in [0, 10000]");
    return it->get<int64_t>();
  }

  // x repeated {lo, hi} with `sep` between (hi < 0: unbounded).
  static std::string list(const std::string& x, const std::string& sep, int64_t lo, int64_t hi) {
    if (hi == 0) return "";
    const std::string more = "(" + sep + " " + x + ")";
    std::string rep;
    const int64_t mlo = std::max<int64_t>(lo - 1, 0);
    if (hi < 0) rep = mlo == 0 ? more + "*" : more + "{" + std::to_string(mlo) + ",}";
    else if (hi - 1 == 0) rep = "";
    else rep = more + "{" + std::to_string(mlo) + "," + std::to_string(hi - 1) + "}";
    const std::string body = x + (rep.empty() ? "" : " " + rep);
    return lo == 0 ? "(" + body + ")?" : body;
  }

  std::string visit(const json& s, const std::string& hint, const std::string& path) {
    if (s.is_boolean()) {
      if (!s.get<bool>()) err(path, "the schema false matches nothing");
      return "value";
    }
    if (!s.is_object()) err(path, "a schema must be an object or a boolean");
    for (const auto& [k, v] : s.items())
      if (!kSupported.count(k) && !kAnnotations.count(k)) err(path, "the keyword '", k, "' is not supported");
    if (auto it = s.find("$ref"); it != s.end()) {
      if (!it->is_string()) err(path, "'$ref' must be a string");
      for (const auto& [k, v] : s.items())
        if (kSupported.count(k) && k != "$ref") err(path, "'$ref' with '", k, "' beside it is not supported");
      const std::string ref = it->get<std::string>();
      auto [r, added] = refs_.emplace(ref, "");
      if (added) {
        resolve(ref);
        std::string name = "ref";
        for (char c : ref.substr(ref.rfind('/') + 1)) name += std::isalnum(static_cast<unsigned char>(c)) ? c : '-';
        for (int k = 1; used_.count(name); ++k) name = "ref-" + std::to_string(k);
        used_.insert(name);
        r->second = name;
        pending_.emplace(name, ref);
      }
      return r->second;
    }
    const std::vector<std::string> ts = types(s, path);
    if (s.contains("const") || s.contains("enum")) {
      std::vector<json> values;
      if (s.contains("const")) values.push_back(s["const"]);
      if (s.contains("enum")) {
        if (!s["enum"].is_array() || s["enum"].empty()) err(path, "'enum' must be a non-empty list");
        for (const auto& v : s["enum"])
          if (!s.contains("const") || v == s["const"]) values.push_back(v);
      }
      std::string body;
      for (const auto& v : values) {
        bool ok = ts.empty();
        for (const auto& t : ts) ok = ok || of_type(v, t);
        if (!ok) continue;
        body += (body.empty() ? "" : " | ") + gbnf_literal(v.dump());
      }
      if (body.empty()) err(path, "no 'enum' / 'const' value matches the schema's type");
      return rule(hint, body);
    }
    for (const char* k : {"anyOf", "oneOf"})  // oneOf as anyOf (see docs: its branches should not overlap)
      if (auto it = s.find(k); it != s.end()) {
        if (!it->is_array() || it->empty()) err(path, "'", k, "' must be a non-empty list");
        for (const auto& [kk, v] : s.items())
          if (kSupported.count(kk) && kk != k && kk != "nullable") err(path, "'", k, "' with '", kk, "' beside it is not supported");
        std::string body;
        for (size_t i = 0; i < it->size(); ++i)
          body += (i ? " | " : "") + visit((*it)[i], hint + "-" + std::to_string(i), path + "/" + k + "/" + std::to_string(i));
        if (s.value("nullable", false)) body += " | null";
        return rule(hint, body);
      }
    if (auto it = s.find("allOf"); it != s.end()) {
      if (!it->is_array() || it->size() != 1) err(path, "'allOf' is supported with exactly one schema");
      return visit((*it)[0], hint, path + "/allOf/0");
    }
    std::vector<std::string> kinds = ts;
    if (kinds.empty()) {
      if (s.contains("properties") || s.contains("additionalProperties") || s.contains("required")) kinds = {"object"};
      else if (s.contains("items") || s.contains("minItems") || s.contains("maxItems")) kinds = {"array"};
      else if (s.contains("minLength") || s.contains("maxLength") || s.contains("pattern")) kinds = {"string"};
      else return "value";
    }
    std::string body;
    for (const auto& t : kinds) {
      std::string one;
      if (t == "object") one = object(s, hint, path);
      else if (t == "array") one = array(s, hint, path);
      else if (t == "string") one = string(s, hint, path);
      else one = t;  // integer, number, boolean, null
      body += (body.empty() ? "" : " | ") + one;
    }
    return kinds.size() == 1 && body.find(' ') == std::string::npos ? body : rule(hint, body);
  }

  std::string string(const json& s, const std::string& hint, const std::string& path) {
    const int64_t lo = count(s, "minLength", path, 0), hi = count(s, "maxLength", path, -1);
    if (hi >= 0 && hi < lo) err(path, "maxLength < minLength");
    if (auto it = s.find("pattern"); it != s.end()) {
      if (!it->is_string()) err(path, "'pattern' must be a string");
      if (s.contains("minLength") || s.contains("maxLength")) err(path, "'pattern' with minLength / maxLength is not supported");
      // JSON Schema's pattern searches: unanchored ends match anything.
      std::string p = it->get<std::string>();
      const bool start = !p.empty() && p[0] == '^';
      const bool end = !p.empty() && p.back() == '$' && (p.size() < 2 || p[p.size() - 2] != '\\');
      if (start) p.erase(0, 1);
      if (end) p.pop_back();
      const std::string name = rule(hint + "-pattern", "");
      std::string rules;
      try {
        regex_rules((start ? "" : "[\\s\\S]*(?:") + p + (start ? "" : ")") + (end ? "" : "[\\s\\S]*"), true, name, rules);
      } catch (const Error& e) {
        err(path, "'pattern': ", e.what());
      }
      for (auto& [n, b] : rules_)  // the rule was reserved above; fill in its body
        if (n == name) b = rules.substr(name.size() + 5, rules.size() - name.size() - 6);
      return rule(hint, "\"\\\"\" " + name + " \"\\\"\"");
    }
    if (lo == 0 && hi < 0) return "string";
    std::string rep = "char{" + std::to_string(lo) + "," + (hi >= 0 ? std::to_string(hi) : "") + "}";
    if (hi == lo) rep = "char{" + std::to_string(lo) + "}";
    return rule(hint, "\"\\\"\" " + rep + " \"\\\"\"");
  }

  std::string array(const json& s, const std::string& hint, const std::string& path) {
    const int64_t lo = count(s, "minItems", path, 0), hi = count(s, "maxItems", path, -1);
    if (hi >= 0 && hi < lo) err(path, "maxItems < minItems");
    std::string item = "value";
    if (auto it = s.find("items"); it != s.end()) {
      if (it->is_array()) err(path, "'items' as a list (tuples) is not supported");
      item = visit(*it, hint + "-item", path + "/items");
    }
    const std::string elems = list(item + " ws", "\",\" ws", lo, hi);
    return rule(hint, "\"[\" ws " + (elems.empty() ? "" : elems + " ") + "\"]\"");
  }

  std::string object(const json& s, const std::string& hint, const std::string& path) {
    const json props = s.value("properties", json::object());
    if (!props.is_object()) err(path, "'properties' must be an object");
    std::set<std::string> required;
    if (auto it = s.find("required"); it != s.end()) {
      if (!it->is_array()) err(path, "'required' must be a list of names");
      for (const auto& r : *it) {
        if (!r.is_string()) err(path, "'required' must be a list of names");
        if (!props.contains(r.get<std::string>()))
          err(path, "required property '", r.get<std::string>(), "' is not in 'properties' (not supported)");
        required.insert(r.get<std::string>());
      }
    }
    const json* extra = s.contains("additionalProperties") ? &s["additionalProperties"] : nullptr;
    if (props.empty()) {  // no declared properties: any keys, values of additionalProperties
      if (extra && extra->is_boolean() && !extra->get<bool>()) return rule(hint, "\"{\" ws \"}\"");
      if (!extra || (extra->is_boolean() && extra->get<bool>())) return "object";
      const std::string v = visit(*extra, hint + "-additional", path + "/additionalProperties");
      const std::string kv = "string ws \":\" ws " + v + " ws";
      return rule(hint, "\"{\" ws (" + kv + " (\",\" ws " + kv + ")*)? \"}\"");
    }
    if (extra && !(extra->is_boolean() && !extra->get<bool>()))
      err(path, "'additionalProperties' other than false beside 'properties' is not supported");
    // Properties in order; first_i: none written yet, rest_i: something written (a comma first).
    std::vector<std::string> kv, names;
    for (const auto& [k, v] : props.items()) {
      names.push_back(k);
      const std::string val = visit(v, hint + "-" + k, path + "/properties/" + k);
      kv.push_back(rule(hint + "-" + k + "-kv", gbnf_literal(json(k).dump()) + " ws \":\" ws " + val + " ws"));
    }
    const size_t n = kv.size();
    std::vector<std::string> first(n + 1), rest(n + 1);
    first[n] = rest[n] = "\"\"";
    for (size_t i = n; i-- > 0;) {
      const bool req = required.count(names[i]) > 0;
      rest[i] = rule(hint + "-rest", req ? "\",\" ws " + kv[i] + " " + rest[i + 1]
                                         : "(\",\" ws " + kv[i] + ")? " + rest[i + 1]);
      first[i] = rule(hint + "-first", req ? kv[i] + " " + rest[i + 1]
                                           : kv[i] + " " + rest[i + 1] + " | " + first[i + 1]);
    }
    return rule(hint, "\"{\" ws " + first[0] + " \"}\"");
  }

  const json& root_;
  std::vector<std::pair<std::string, std::string>> rules_;
  std::set<std::string> used_ = {"root", "ws", "hex", "char", "string", "integer", "number", "boolean",
                                 "null", "value", "object", "array"};
  std::map<std::string, std::string> refs_;     // $ref -> rule name
  std::map<std::string, std::string> pending_;  // rule name -> $ref, not converted yet
};

}  // namespace

std::string json_object_gbnf() { return std::string("root ::= object\n") + kPrimitives; }

std::string json_schema_to_gbnf(const json& schema) { return Converter(schema).run(); }

}  // namespace tessera::infer::structured
