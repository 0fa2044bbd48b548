#!/usr/bin/env python3
"""Independent reference for Tessera's byte-level BPE tokenizer (tests/io/tokenizer_test.cc).

A plain Python reading of Hugging Face byte-level BPE semantics, in the style of OpenAI's
GPT-2 encoder.py: bytes_to_unicode, a `regex` split, the get_pairs / min-rank merge loop,
added-token splitting, ignore_merges, NFC via unicodedata and the template's BOS. It shares
no code with the C++ side. Subcommands:

  encode REQUEST.json OUT.json   encode / decode with one or more tokenizer.json files
  styles BASE.json OUT_DIR       rewrite a trained vocab/merges into the exact tokenizer.json
                                 shapes of GPT-2, Llama 3, Qwen2 and RoBERTa (no hub files here)
  train CORPUS VOCAB_SIZE OUT.json [--special TOK]... [--min-frequency N]
                                 naive BPE trainer (recounts every pair each merge)
  mixed-text OUT [--bytes N]     deterministic mixed-script text (fortunes, CJK, Cyrillic,
                                 Arabic, emoji, digits, code, whitespace runs)
"""
import argparse
import json
import os
import random
import sys
import unicodedata

import regex

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# Unicode White_Space: what Rust's char::is_whitespace (lstrip / rstrip) tests.
WHITE_SPACE = set(chr(c) for c in list(range(0x09, 0x0E)) + [0x20, 0x85, 0xA0, 0x1680] +
                  list(range(0x2000, 0x200B)) + [0x2028, 0x2029, 0x202F, 0x205F, 0x3000])


def bytes_to_unicode():
    """GPT-2's reversible map from bytes to printable unicode characters."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


BYTE_ENCODER = bytes_to_unicode()
BYTE_DECODER = {v: k for k, v in BYTE_ENCODER.items()}
BYTE_ORDER = list(BYTE_ENCODER.keys())  # bytes in GPT-2's `bs` order


def to_byte_level(text):
    return "".join(BYTE_ENCODER[b] for b in text.encode("utf-8"))


def config_token(v):
    if isinstance(v, dict):
        return v.get("content")
    return v


class Reference:
    def __init__(self, path):
        with open(path, encoding="utf-8") as f:
            tj = json.load(f)
        config_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
        config = None
        if os.path.exists(config_path):
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        model = tj["model"]
        self.vocab = model["vocab"]
        self.ranks = {}
        for i, m in enumerate(model["merges"]):
            a, b = m.split(" ", 1) if isinstance(m, str) else m
            self.ranks[(a, b)] = i  # a repeated pair keeps its last rank, as a dict build does
        self.ignore_merges = model.get("ignore_merges") or False
        self.unk = self.vocab.get(model["unk_token"]) if model.get("unk_token") else None
        self.id_to_token = {i: t for t, i in self.vocab.items()}
        self.token_to_id = dict(self.vocab)
        self.special_ids = set()
        self.forms = []
        self.parse_normalizer(tj.get("normalizer"))
        self.raw_added, self.norm_added = [], []
        for a in tj.get("added_tokens") or []:
            special = a.get("special", False)
            normalized = a.get("normalized", not special)
            entry = (a["content"], a["id"], a.get("lstrip", False), a.get("rstrip", False))
            if normalized:
                self.norm_added.append((self.normalize(a["content"]),) + entry[1:])
            else:
                self.raw_added.append(entry)
            self.id_to_token[a["id"]] = a["content"]
            self.token_to_id[a["content"]] = a["id"]
            if special:
                self.special_ids.add(a["id"])
        self.steps = []
        self.parse_pre_tokenizer(tj["pre_tokenizer"])
        self.prefix, self.suffix = [], []
        self.parse_post_processor(tj.get("post_processor"))
        self.cache = {}

        eos_guess = None
        for name in ["<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"]:
            i = self.token_to_id.get(name)
            if eos_guess is None and i is not None and i in self.special_ids:
                eos_guess = i

        def from_config(key, fallback):
            if config is None or key not in config:
                return fallback
            if config[key] is None:
                return None
            return self.token_to_id[config_token(config[key])]

        self.bos = from_config("bos_token", self.prefix[0] if self.prefix else None)
        self.eos = from_config("eos_token", eos_guess)
        if config and config.get("add_bos_token") and self.bos is not None and self.prefix[:1] != [self.bos]:
            self.prefix.insert(0, self.bos)
        if config and config.get("add_eos_token") and self.eos is not None and self.suffix[-1:] != [self.eos]:
            self.suffix.append(self.eos)

    def parse_normalizer(self, n):
        if n is None:
            return
        if n["type"] == "Sequence":
            for x in n["normalizers"]:
                self.parse_normalizer(x)
        else:
            assert n["type"] in ("NFC", "NFD", "NFKC", "NFKD"), n
            self.forms.append(n["type"])

    def normalize(self, s):
        for form in self.forms:
            s = unicodedata.normalize(form, s)
        return s

    def parse_pre_tokenizer(self, p):
        if p["type"] == "Sequence":
            for x in p["pretokenizers"]:
                self.parse_pre_tokenizer(x)
        elif p["type"] == "ByteLevel":
            rx = regex.compile(GPT2_PATTERN) if p.get("use_regex", True) else None
            self.steps.append((rx, True, p.get("add_prefix_space", False)))
        elif p["type"] == "Split":
            pat = p["pattern"]
            rx = regex.compile(pat["Regex"]) if "Regex" in pat else regex.compile(regex.escape(pat["String"]))
            self.steps.append((rx, p.get("behavior", "Isolated") == "Isolated", False))
        else:
            raise ValueError("unsupported pre_tokenizer " + p["type"])

    def parse_post_processor(self, p):
        if p is None or p["type"] == "ByteLevel":
            return
        if p["type"] == "Sequence":
            for x in p["processors"]:
                self.parse_post_processor(x)
        elif p["type"] in ("RobertaProcessing", "BertProcessing"):
            self.prefix.append(p["cls"][1])
            self.suffix.append(p["sep"][1])
        elif p["type"] == "TemplateProcessing":
            after = False
            for item in p["single"]:
                if "Sequence" in item:
                    after = True
                    continue
                ids = p["special_tokens"][item["SpecialToken"]["id"]]["ids"]
                (self.suffix if after else self.prefix).extend(ids)
        else:
            raise ValueError("unsupported post_processor " + p["type"])

    @staticmethod
    def split_added(text, tokens):
        """Yields (text, None) and (token, id): the leftmost match, longest among those."""
        out, done, i = [], 0, 0
        while i < len(text):
            best = None
            for content, tid, lstrip, rstrip in tokens:
                if text.startswith(content, i) and (best is None or len(content) > len(best[0])):
                    best = (content, tid, lstrip, rstrip)
            if best is None:
                i += 1
                continue
            start, stop = i, i + len(best[0])
            if best[2]:
                while start > done and text[start - 1] in WHITE_SPACE:
                    start -= 1
            if best[3]:
                while stop < len(text) and text[stop] in WHITE_SPACE:
                    stop += 1
            if start > done:
                out.append((text[done:start], None))
            out.append((text[start:stop], best[1]))
            done = i = stop
        if done < len(text):
            out.append((text[done:], None))
        return out

    def pre_tokenize(self, text):
        pieces = [text]
        for rx, keep, prefix_space in self.steps:
            nxt = []
            for piece in pieces:
                if prefix_space and not piece.startswith(" "):
                    piece = " " + piece
                if rx is None:
                    nxt.append(piece)
                    continue
                last = 0
                for m in rx.finditer(piece):
                    if m.start() == m.end():
                        continue
                    if m.start() > last:
                        nxt.append(piece[last:m.start()])
                    if keep:
                        nxt.append(m.group())
                    last = m.end()
                if last < len(piece):
                    nxt.append(piece[last:])
            pieces = nxt
        return pieces

    def bpe(self, token):
        """token: a byte-level string. Merges the lowest-ranked adjacent pair, the leftmost
        of equals, one at a time (as Hugging Face's priority queue and tiktoken do)."""
        if self.ignore_merges and token in self.vocab:
            return [self.vocab[token]]
        if token in self.cache:
            return self.cache[token]
        word = []
        for c in token:
            if c in self.vocab:
                word.append(c)
            elif self.unk is not None:
                word.append(None)  # unknown char
        while len(word) > 1:
            best = None
            for i in range(len(word) - 1):
                r = self.ranks.get((word[i], word[i + 1]))
                if r is not None and (best is None or r < best[0]):
                    best = (r, i)
            if best is None:
                break
            i = best[1]
            word[i:i + 2] = [word[i] + word[i + 1]]
        ids = [self.unk if t is None else self.vocab[t] for t in word]
        self.cache[token] = ids
        return ids

    def encode(self, text, add_special_tokens=True):
        ids = list(self.prefix) if add_special_tokens else []
        for seg, tid in self.split_added(text, self.raw_added):
            if tid is not None:
                ids.append(tid)
                continue
            seg = self.normalize(seg)
            for seg2, tid2 in self.split_added(seg, self.norm_added):
                if tid2 is not None:
                    ids.append(tid2)
                    continue
                for piece in self.pre_tokenize(seg2):
                    ids.extend(self.bpe(to_byte_level(piece)))
        if add_special_tokens:
            ids.extend(self.suffix)
        return ids

    def decode(self, ids, skip_special_tokens=False):
        out = bytearray()
        for i in ids:
            if skip_special_tokens and i in self.special_ids:
                continue
            tok = self.id_to_token[i]
            if all(c in BYTE_DECODER for c in tok):
                out += bytes(BYTE_DECODER[c] for c in tok)
            else:
                out += tok.encode("utf-8")
        return out.decode("utf-8", errors="replace")


def cmd_encode(args):
    with open(args.request, encoding="utf-8") as f:
        req = json.load(f)
    texts = list(req.get("texts", []))
    for path in req.get("files", []):
        with open(path, encoding="utf-8", newline="") as f:  # keep \r\n as is
            texts.append(f.read())
    out = {}
    for name, path in req["tokenizers"].items():
        ref = Reference(path)
        res = {"ids": [ref.encode(t) for t in texts],
               "ids_no_special": [ref.encode(t, False) for t in texts],
               "bos": ref.bos, "eos": ref.eos}
        decode_lists = req.get("decode", {}).get(name, [])
        res["decoded"] = [ref.decode(ids) for ids in decode_lists]
        res["decoded_skip_special"] = [ref.decode(ids, True) for ids in decode_lists]
        out[name] = res
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=True)


def byte_level_tokens(vocab):
    return {t: i for t, i in vocab.items() if all(c in BYTE_DECODER for c in t)}


def added(id_, content, special=True, normalized=False, lstrip=False, rstrip=False):
    return {"id": id_, "content": content, "single_word": False, "lstrip": lstrip, "rstrip": rstrip,
            "normalized": normalized, "special": special}


def byte_level(add_prefix_space=False, use_regex=True):
    return {"type": "ByteLevel", "add_prefix_space": add_prefix_space, "trim_offsets": True, "use_regex": use_regex}


def split_then_byte_level(pattern):
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": False},
        byte_level(False, False)]}


def bpe_model(vocab, merges, ignore_merges=False, array_merges=False):
    return {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
            "ignore_merges": ignore_merges, "vocab": vocab,
            "merges": [m.split(" ", 1) for m in merges] if array_merges else merges}


def tokenizer_json(added_tokens, normalizer, pre, post, model):
    return {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added_tokens,
            "normalizer": normalizer, "pre_tokenizer": pre, "post_processor": post,
            "decoder": byte_level(True, True), "model": model}


def write_style(out_dir, name, tj, config=None):
    d = os.path.join(out_dir, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(tj, f, ensure_ascii=False, indent=2)
    if config is not None:
        with open(os.path.join(d, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, ensure_ascii=False, indent=2)


def cmd_styles(args):
    """The vocab / merges of BASE re-labelled into the shapes the hub's files have."""
    with open(args.base, encoding="utf-8") as f:
        base = json.load(f)
    vocab = byte_level_tokens(base["model"]["vocab"])
    merges = [m if isinstance(m, str) else " ".join(m) for m in base["model"]["merges"]]
    n = max(vocab.values()) + 1

    # GPT-2: <|endoftext|> is in the vocab and an added token (normalized, as in gpt2's file).
    v = dict(vocab, **{"<|endoftext|>": n})
    write_style(args.out_dir, "gpt2", tokenizer_json(
        [added(n, "<|endoftext|>", normalized=True)], None, byte_level(False, True), byte_level(True, False),
        bpe_model(v, merges)))

    # Llama 3: Split regex + ByteLevel, ignore_merges, specials only in added_tokens, BOS
    # from TemplateProcessing. Whole-word tokens that no merge path reaches exercise
    # ignore_merges.
    v = dict(vocab)
    for word in [" Tessera", "こんにちは", "123", " Привет", "\n\n"]:
        bl = to_byte_level(word)
        if bl not in v:
            v[bl] = n
            n += 1
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    toks = [added(n + i, s) for i, s in enumerate(specials)]
    bos = n
    post = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        {"type": "TemplateProcessing",
         "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                  {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
         "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [bos], "tokens": ["<|begin_of_text|>"]}}}]}
    write_style(args.out_dir, "llama3", tokenizer_json(
        toks, None, split_then_byte_level(LLAMA3_PATTERN), post, bpe_model(v, merges, ignore_merges=True)),
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "model_max_length": 131072,
         "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": True})

    # Qwen2: NFC, Split regex (single digits) + ByteLevel, merges as pairs (tokenizers >= 0.20).
    n = max(vocab.values()) + 1
    toks = [added(n + i, s) for i, s in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])]
    # A normalized, non-special added token: matched after NFC, so "cafe\u0301" finds it too.
    toks.append(added(n + 3, "café", special=False, normalized=True))
    write_style(args.out_dir, "qwen2", tokenizer_json(
        toks, {"type": "NFC"}, split_then_byte_level(QWEN2_PATTERN), None,
        bpe_model(vocab, merges, array_merges=True)),
        {"add_bos_token": False, "add_prefix_space": False, "bos_token": None, "eos_token": "<|endoftext|>",
         "errors": "replace", "model_max_length": 32768, "tokenizer_class": "Qwen2Tokenizer"})

    # RoBERTa: ByteLevel with add_prefix_space, <s> ... </s>, <mask> with lstrip.
    v = dict(vocab)
    names = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]
    toks = []
    for i, s in enumerate(names):
        v[s] = n + i
        toks.append(added(n + i, s, lstrip=(s == "<mask>"), normalized=(s == "<mask>")))
    write_style(args.out_dir, "roberta", tokenizer_json(
        toks, None, byte_level(True, True),
        {"type": "RobertaProcessing", "sep": ["</s>", n + 2], "cls": ["<s>", n], "trim_offsets": True,
         "add_prefix_space": True}, bpe_model(v, merges)))


def cmd_train(args):
    """Naive BPE: recount every pair after every merge. Highest count first; equal counts go
    to the smallest (left bytes, right bytes)."""
    with open(args.corpus, encoding="utf-8", newline="") as f:
        text = f.read()
    specials = args.special or []
    segments = Reference.split_added(text, [(s, 0, False, False) for s in specials]) if specials else [(text, None)]
    rx = regex.compile(GPT2_PATTERN)
    words = {}
    for seg, tid in segments:
        if tid is not None:
            continue
        for m in rx.finditer(seg):
            key = tuple(bytes([b]) for b in m.group().encode("utf-8"))
            words[key] = words.get(key, 0) + 1
    tokens = [bytes([b]) for b in BYTE_ORDER]
    known = set(tokens)
    merges = []
    target = args.vocab_size - 256 - len(specials)
    while len(tokens) - 256 < target:
        pairs = {}
        for w, c in words.items():
            for p in zip(w, w[1:]):
                pairs[p] = pairs.get(p, 0) + c
        if not pairs:
            sys.exit("no pairs left")
        best_count = max(pairs.values())
        if best_count < args.min_frequency:
            sys.exit("min frequency reached")
        a, b = min(p for p, c in pairs.items() if c == best_count)
        merges.append((a, b))
        if a + b not in known:
            known.add(a + b)
            tokens.append(a + b)
        new_words = {}
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] = new_words.get(tuple(out), 0) + c
        words = new_words

    def bl(t):
        return "".join(BYTE_ENCODER[x] for x in t)
    vocab = {bl(t): i for i, t in enumerate(tokens)}
    for i, s in enumerate(specials):
        vocab[s] = len(tokens) + i
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump({"vocab": vocab, "merges": [bl(a) + " " + bl(b) for a, b in merges]}, f, ensure_ascii=True)


CJK = ["我们今天去公园散步，天气非常好。", "机器学习模型需要大量的数据来训练。", "东京は日本の首都です。",
       "ひらがなとカタカナと漢字を混ぜて書きます。", "서울은 대한민국의 수도입니다.", "한국어 문장도 토큰화해야 합니다!",
       "中文标点：“引号”、《书名号》……", "全角文字ＡＢＣ１２３と半角ABC123"]
CYRILLIC = ["Привет, как дела? Всё хорошо.", "Съешь же ещё этих мягких французских булок, да выпей чаю.",
            "Москва — столица России.", "Ёлка и ёжик в лесу."]
ARABIC = ["مرحبا بالعالم", "اللغة العربية جميلة جداً.", "السلام عليكم ورحمة الله", "٣٤٥ رقم عربي"]
OTHER = ["Ελληνικά: Γειά σου Κόσμε!", "हिन्दी में लिखा गया वाक्य।", "עברית: שלום עולם", "ไทย: สวัสดีครับ",
         "Tiếng Việt có dấu: Xin chào thế giới", "Zürich, Straße, naïve café, résumé, Ångström",
         "e\u0301 n\u0303 a\u0308 o\u0302\u0323 (decomposed accents)", "Z\u0351\u0352a\u0353l\u0354g\u0355o\u0356",
         "∑∫√∞≠≤≥ €£¥₹ ←→↑↓ ┌─┐│└┘", "zero\u200bwidth\u200djoin\ufeffbom", "nbsp\u00a0ideo\u3000nel\u0085ls\u2028mvs\u180ex"]
EMOJI = ["😀", "😂", "👍🏽", "👨‍👩‍👧‍👦", "🇯🇵", "🇩🇪", "❤️", "🔥", "1️⃣", "🏳️‍🌈", "🤖", "🎉", "👩🏿‍💻", "🐍"]
CODE = ["def f(x):\n    return x ** 2  # square\n", "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}\n",
        "if (a && b || !c) { return -1; }", "SELECT * FROM users WHERE id = 42;",
        "    \n\n        indented();\r\n", "x = {'key': [1, 2, 3], \"k2\": None}", "#include <vector>\n"]
WORDS = ["don't", "I'LL", "we've", "they're", "it's", "She'd", "YOU'RE", "'S", "O'Neil", "rock'n'roll"]
SPECIAL_TEXT = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|eot_id|>", "<s>", "</s>",
                "<mask>", "<|endof", "<|im_start|>user\n", " <mask> "]


ENGLISH = ["The quick brown fox jumps over the lazy dog.", "It was the best of times, it was the worst of times.",
           "A journey of a thousand miles begins with a single step.", "Don't panic, and always know where your towel is."]


def fortunes():
    """English text from Debian's `fortunes` package (a few built-in sentences without it)."""
    root = "/usr/share/games/fortunes"
    if not os.path.isdir(root):
        return ENGLISH
    out = []
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if "." in name or not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            out.extend(x.strip("\n") for x in f.read().split("\n%\n") if x.strip())
    return out or ENGLISH


def mixed_text(n_bytes, seed=20261130):
    rng = random.Random(seed)
    fort = fortunes()
    parts, size = [], 0

    def number():
        k = rng.randrange(6)
        if k == 0:
            return str(rng.randrange(10 ** rng.randrange(1, 12)))
        if k == 1:
            return "%d.%02d" % (rng.randrange(1000), rng.randrange(100))
        if k == 2:
            return "{:,}".format(rng.randrange(10 ** 9))
        if k == 3:
            return "2026-%02d-%02d" % (rng.randrange(1, 13), rng.randrange(1, 29))
        if k == 4:
            return "+1 (555) %03d-%04d" % (rng.randrange(1000), rng.randrange(10000))
        return "v%d.%d.%d" % (rng.randrange(10), rng.randrange(20), rng.randrange(100))

    kinds = [(lambda: rng.choice(fort), 8), (lambda: rng.choice(CJK), 2), (lambda: rng.choice(CYRILLIC), 1),
             (lambda: rng.choice(ARABIC), 1), (lambda: rng.choice(OTHER), 1),
             (lambda: "".join(rng.choice(EMOJI) for _ in range(rng.randrange(1, 5))), 1),
             (number, 1), (lambda: rng.choice(CODE), 1), (lambda: rng.choice(WORDS), 1),
             (lambda: rng.choice(SPECIAL_TEXT), 1),
             (lambda: rng.choice([" " * rng.randrange(2, 40), "\t" * rng.randrange(1, 5), "\n" * rng.randrange(2, 6),
                                  "\r\n", " \n \n", "  \t \n"]), 1)]
    population = [k for k, w in kinds for _ in range(w)]
    while size < n_bytes:
        s = rng.choice(population)()
        sep = rng.choice([" ", " ", " ", "\n", "", ", ", "\n\n"])
        parts.append(s + sep)
        size += len((s + sep).encode("utf-8"))
    return "".join(parts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("encode")
    p.add_argument("request")
    p.add_argument("out")
    p = sub.add_parser("styles")
    p.add_argument("base")
    p.add_argument("out_dir")
    p = sub.add_parser("train")
    p.add_argument("corpus")
    p.add_argument("vocab_size", type=int)
    p.add_argument("out")
    p.add_argument("--special", action="append")
    p.add_argument("--min-frequency", type=int, default=2)
    p = sub.add_parser("mixed-text")
    p.add_argument("out")
    p.add_argument("--bytes", type=int, default=120000)
    args = ap.parse_args()
    if args.cmd == "encode":
        cmd_encode(args)
    elif args.cmd == "styles":
        cmd_styles(args)
    elif args.cmd == "train":
        cmd_train(args)
    else:
        with open(args.out, "w", encoding="utf-8", newline="") as f:
            f.write(mixed_text(args.bytes))


if __name__ == "__main__":
    main()
