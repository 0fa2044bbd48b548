#!/usr/bin/env python3
"""The independent references of the structured-output tests (structured_test.cc):
Python's `re` for regexes and python3-jsonschema for schemas, plus the random schemas.

  structured_oracle.py regex CASES.json      [{"regex", "strings"}] -> [[bool per string]]
  structured_oracle.py schemas N SEED        N random schemas (only keywords Tessera supports)
  structured_oracle.py validate CASES.json   [{"schema", "outputs"}] -> [[null | "why" per output]]
  structured_oracle.py utf8 LO HI            every code point in [LO, HI] as UTF-8 hex, one a line
"""
import json
import random
import re
import sys

import jsonschema


def cmd_regex(path):
    cases = json.load(open(path, encoding="utf-8"))
    out = []
    for c in cases:
        r = re.compile(c["regex"], re.ASCII)
        out.append([r.fullmatch(s) is not None for s in c["strings"]])
    json.dump(out, sys.stdout)


NAMES = ["id", "name", "a b", "ключ", 'q"uote', "x\\y", "n1", "value", "tags", "ok", "日本", "_"]
STRINGS = ["", "a", "yes", "no", 'say "hi"', "back\\slash", "tab\there", "日本語", "😀", "line\nbreak"]
PATTERNS = ["^[a-z]{1,5}$", "^\\d{3}-\\d{2}$", "^(yes|no|maybe)$", "^[A-Z][a-z0-9_]{0,6}$", "^x(ab|cd){1,3}y$",
            '^[^"\\\\]{2,4}$', "^\\w{1,3}\\.\\w{1,3}$"]


def rand_value(rng, depth=0):
    k = rng.randrange(8 if depth < 2 else 6)
    if k == 0:
        return rng.choice(STRINGS)
    if k == 1:
        return rng.randrange(-1000, 1000)
    if k == 2:
        return rng.choice([0.5, -2.25, 1e-3, 3.0e10])
    if k == 3:
        return rng.choice([True, False])
    if k == 4:
        return None
    if k == 5:
        return rng.choice(STRINGS[1:])
    if k == 6:
        return [rand_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    return {rng.choice(NAMES): rand_value(rng, depth + 1) for _ in range(rng.randrange(3))}


def rand_schema(rng, depth=0, defs=None):
    kinds = ["string", "string", "integer", "number", "boolean", "null", "enum", "const", "nullable"]
    if depth < 3:
        kinds += ["object", "object", "array", "anyOf", "oneOf"]
    if defs:
        kinds += ["ref"]
    k = rng.choice(kinds)
    if k == "string":
        if rng.random() < 0.3:
            return {"type": "string", "pattern": rng.choice(PATTERNS)}
        lo = rng.randrange(3)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randrange(8)}
    if k in ("integer", "number", "boolean", "null"):
        return {"type": k, "description": "a " + k}
    if k == "enum":
        s = {"enum": [rand_value(rng) for _ in range(1 + rng.randrange(4))]}
        return s
    if k == "const":
        return {"const": rand_value(rng)}
    if k == "nullable":
        return {"type": [rng.choice(["integer", "boolean"]), "null"]}
    if k == "object":
        names = rng.sample(NAMES, 1 + rng.randrange(3))
        props = {n: rand_schema(rng, depth + 1, defs) for n in names}
        s = {"type": "object", "properties": props,
             "required": [n for n in names if rng.random() < 0.6]}
        if rng.random() < 0.5:
            s["additionalProperties"] = False
        return s
    if k == "array":
        lo = rng.randrange(3)
        return {"type": "array", "items": rand_schema(rng, depth + 1, defs), "minItems": lo,
                "maxItems": lo + rng.randrange(3)}
    if k == "anyOf":
        return {"anyOf": [rand_schema(rng, depth + 1, defs) for _ in range(2 + rng.randrange(2))]}
    if k == "oneOf":  # branches of different types, so at most one can match
        types = rng.sample(["integer", "boolean", "null", "string", "array"], 2)
        branches = []
        for t in types:
            if t == "string":
                branches.append({"type": "string", "maxLength": 6})
            elif t == "array":
                branches.append({"type": "array", "items": {"type": "boolean"}, "maxItems": 2})
            else:
                branches.append({"type": t})
        return {"oneOf": branches}
    return {"$ref": "#/$defs/" + rng.choice(sorted(defs))}


def cmd_schemas(n, seed):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 5 == 4:
            defs = {"thing": rand_schema(rng, 2), "other": rand_schema(rng, 2)}
            s = rand_schema(rng, 1, defs)
            s = {"type": "object", "properties": {"main": s, "extra": {"$ref": "#/$defs/thing"}},
                 "required": ["main"], "$defs": defs}
        else:
            s = rand_schema(rng)
        out.append(s)
    json.dump(out, sys.stdout, ensure_ascii=False)


def cmd_validate(path):
    cases = json.load(open(path, encoding="utf-8"))
    out = []
    for c in cases:
        v = jsonschema.Draft202012Validator(c["schema"])
        res = []
        for text in c["outputs"]:
            try:
                doc = json.loads(text)
            except Exception as e:  # noqa: BLE001
                res.append("not JSON: %s" % e)
                continue
            errs = sorted(v.iter_errors(doc), key=lambda e: e.path)
            res.append(None if not errs else errs[0].message)
        out.append(res)
    json.dump(out, sys.stdout)


def cmd_utf8(lo, hi):
    out = []
    for cp in range(lo, hi + 1):
        if 0xD800 <= cp <= 0xDFFF:
            continue
        out.append(chr(cp).encode("utf-8").hex())
    sys.stdout.write("\n".join(out))


if __name__ == "__main__":
    c = sys.argv[1]
    if c == "regex":
        cmd_regex(sys.argv[2])
    elif c == "schemas":
        cmd_schemas(int(sys.argv[2]), int(sys.argv[3]))
    elif c == "validate":
        cmd_validate(sys.argv[2])
    elif c == "utf8":
        cmd_utf8(int(sys.argv[2], 0), int(sys.argv[3], 0))
    else:
        sys.exit("unknown command " + c)
