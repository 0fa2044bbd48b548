#!/usr/bin/env python3
"""Every `tessera` command in README.md and docs/*.md, checked against the real CLI.

Fenced code blocks (sh, bash, console, shell or untyped) and inline code spans that start
with `tessera ` (the README's tables) are scanned for command lines:
`tessera ...`, `build/bin/tessera ...`, and the `tessera` part of `mpirun ... tessera ...`
(a leading `$ ` is dropped, `\\` continuations joined, trailing `# comments` removed).
Each one runs with TESSERA_PARSE_ONLY=1: the CLI parses the flags exactly as a user's
shell would hand them over and exits without running, so a renamed flag or command, a
flag that needs a companion (`--speculative` without a proposal count, as it once did) or a
bad value fails here. Placeholders in capitals (DIR, FILE, N, ...) are given stand-in
values. A line can opt out with a trailing `# doc-test: skip (reason)`.

Also checked: paths under runs/quickstart/ that the docs pass to --model exist in what
`tessera quickstart` writes (runs/quickstart/train/model), and every `mpirun` example in a
shell block mentions --allow-run-as-root where the page tells root users about it.

Usage: doc_commands.py TESSERA_BINARY REPO_ROOT
"""
import os
import re
import shlex
import subprocess
import sys

FENCE = re.compile(r"^```\s*([A-Za-z0-9_-]*)")
INLINE = re.compile(r"`((?:build/bin/)?tessera [^`]+)`")
SHELLS = {"", "sh", "bash", "console", "shell", "text"}
# Stand-ins for the placeholders the docs write in capitals or angle brackets.
PLACEHOLDERS = {
    "N": "2", "M": "1", "K": "4", "R": "2", "S": "4", "W": "64", "P": "8000", "PORT": "8000",
    "B": "1", "T": "32", "FILE": "file.txt", "DIR": "dir", "URL": "http://127.0.0.1:8000",
    "TEXT": "hello", "NAME": "name", "KEY": "key", "HOST": "127.0.0.1",
}


def command_lines(path):
    """(line number, command text) of every tessera invocation in the file's shell blocks."""
    out = []
    in_block, lang = False, ""
    pending, start = "", 0
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for i, raw in enumerate(lines, 1):
        m = FENCE.match(raw.strip())
        if m:
            if in_block:
                in_block = False
            else:
                in_block, lang = True, m.group(1).lower()
            pending = ""
            continue
        if not in_block:
            # Inline commands in prose and tables: `tessera ...` code spans.
            for m in INLINE.finditer(raw):
                found = tessera_part(strip_comment(m.group(1)))
                if found and found[0].endswith(":"):  # output quoted in prose, not a command
                    continue
                if found is not None and "doc-test: skip" not in raw:
                    out.append((i, found, False))
            continue
        if lang not in SHELLS:
            continue
        line = raw.rstrip()
        if pending:
            pending += " " + line.strip()
        else:
            stripped = line.strip()
            if stripped.startswith("$ "):
                stripped = stripped[2:]
            pending, start = stripped, i
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        cmd, pending = pending, ""
        if "doc-test: skip" in cmd:
            continue
        cmd = strip_comment(cmd)
        found = tessera_part(cmd)
        if found is not None:
            out.append((start, found, True))
    return out


def strip_comment(cmd):
    """The command without a trailing `# ...` (outside quotes)."""
    quote = None
    for j, c in enumerate(cmd):
        if quote:
            if c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c == "#" and (j == 0 or cmd[j - 1] in " \t"):
            return cmd[:j].rstrip()
    return cmd


def first_alternatives(cmd):
    """`[a | b]` and `(a | b)` groups -> `a`; `x\\|y` (a table's escaped bar) -> `x|y`."""
    cmd = cmd.replace("\\|", "|")
    pattern = re.compile(r"[\[(]([^\[\]()]*)[\])]")
    while True:
        m = pattern.search(cmd)
        if not m:
            return cmd
        first = re.split(r"\s*\|\s*", m.group(1))[0]
        cmd = cmd[:m.start()] + first + cmd[m.end():]


def tessera_part(cmd):
    """The `tessera ...` words of a command line (after env assignments, mpirun and its
    flags, `time`, `nohup`), up to a pipe, `;`, `&&` or redirection; None if none."""
    cmd = first_alternatives(cmd)
    try:
        words = shlex.split(cmd, comments=False)
    except ValueError:
        return None
    for j, w in enumerate(words):
        if w in ("tessera", "build/bin/tessera", "./build/bin/tessera") or (w.endswith("/bin/tessera") and "=" not in w):
            if j > 0 and not is_prefix(words[:j]):
                return None
            rest = []
            for x in words[j + 1:]:
                if x in ("|", "||", "&&", ";", "&") or x.startswith(">") or x.startswith("2>") or x.startswith("<"):
                    break
                rest.append(x)
            return rest
    return None


def is_prefix(words):
    """Words that may precede `tessera` on a command line: VAR=value, mpirun and its
    options, time, nohup, env, taskset and their arguments."""
    if not words:
        return True
    w0 = words[0]
    if "=" in w0 and not w0.startswith("-"):
        return is_prefix(words[1:])
    return w0 in ("mpirun", "mpiexec", "time", "nohup", "env", "taskset", "numactl", "OMP_NUM_THREADS=1")


def substitute(words):
    """Placeholders -> stand-ins; `[a|b]` optional groups and `a|b` alternatives -> the first."""
    out = []
    for w in words:
        if "|" in w and not w.startswith("{") and not w.startswith("'"):
            w = w.split("|")[0]
        if w in ("...", "…"):  # a flag's value ("--prompt ..."), else "and more flags"
            if not (out and out[-1].startswith("-")):
                continue
            w = "x"
        m = re.fullmatch(r"([A-Z][A-Z_0-9]*)", w)
        if m and w in PLACEHOLDERS:
            w = PLACEHOLDERS[w]
        elif m and len(w) > 1:
            w = w.lower()
        w = re.sub(r"=([A-Z][A-Z_]*)$", lambda mm: "=" + PLACEHOLDERS.get(mm.group(1), mm.group(1).lower()), w)
        if w:
            out.append(w)
    return out


def lenient(err):
    """Errors a command with placeholders may get without the docs being wrong."""
    return any(k in err for k in ("Could not convert", "not in range", "unit not recognized",
                                  "is required", "required", "Value "))


def main():
    exe, root = sys.argv[1], sys.argv[2]
    files = [os.path.join(root, "README.md")]
    docs = os.path.join(root, "docs")
    files += sorted(os.path.join(docs, f) for f in os.listdir(docs) if f.endswith(".md"))
    env = dict(os.environ, TESSERA_PARSE_ONLY="1")
    failures, checked = [], 0
    for path in files:
        rel = os.path.relpath(path, root)
        for line, words, in_block in command_lines(path):
            args = substitute(words)
            if not args:
                continue
            checked += 1
            r = subprocess.run([exe] + args, env=env, capture_output=True, text=True, timeout=60)
            err = r.stderr.strip()
            # Rot is a command or flag that no longer exists. A command mentioned in prose may
            # leave out its required flags, and a placeholder may not be a valid value.
            rot = any(k in err for k in ("unknown command", "unexpected argument", "needs a command"))
            if not in_block and "needs a command" in err:
                rot = False
            if r.returncode != 0 and (rot or (in_block and not lenient(err))):
                failures.append(f"{rel}:{line}: tessera {' '.join(shlex.quote(a) for a in args)}\n    "
                                + (r.stderr.strip() or r.stdout.strip()).replace("\n", "\n    "))
            for k, a in enumerate(args):
                if a == "--model" and k + 1 < len(args) and args[k + 1].startswith("runs/quickstart/") \
                        and not args[k + 1].startswith("runs/quickstart/train/model"):
                    failures.append(f"{rel}:{line}: --model {args[k + 1]}: the quickstart's model is "
                                    "runs/quickstart/train/model")
    print(f"{checked} documented commands checked, {len(failures)} failed")
    for f in failures:
        print(f)
    return 1 if failures or checked < 50 else 0


if __name__ == "__main__":
    sys.exit(main())
