#!/usr/bin/env python3
"""Writes the small seed corpus for safetensors_fuzz (valid and invalid headers).

Run from this directory: python3 make_seed_corpus.py. The files are committed; rerun
only to change the seeds.
"""
import json
import os
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus_safetensors")


def st(header, data_len, pad=True):
    text = header if isinstance(header, str) else json.dumps(header, separators=(",", ":"))
    raw = text.encode()
    if pad:
        raw += b" " * ((8 - len(raw) % 8) % 8)
    return struct.pack("<Q", len(raw)) + raw + bytes(range(256)) * (data_len // 256) + bytes(
        range(data_len % 256))


def t(dtype, shape, b, e):
    return {"dtype": dtype, "shape": shape, "data_offsets": [b, e]}


SEEDS = {
    "valid_one_f32": st({"w": t("F32", [2, 3], 0, 24)}, 24),
    "valid_many": st({"__metadata__": {"format": "pt"}, "a": t("BF16", [4], 0, 8),
                      "b": t("I64", [1, 1], 8, 16), "c": t("U8", [3], 16, 19),
                      "d": t("F16", [0, 5], 19, 19), "e": t("I32", [], 19, 23)}, 23),
    "valid_empty": st({}, 0),
    "valid_metadata_only": st({"__metadata__": {"k": "v", "x": ""}}, 0),
    "valid_unpadded": st({"w": t("I8", [5], 0, 5)}, 5, pad=False),
    "bad_overlap": st({"a": t("F32", [2], 0, 8), "b": t("F32", [2], 4, 12)}, 12),
    "bad_hole": st({"a": t("F32", [1], 0, 4), "b": t("F32", [1], 8, 12)}, 12),
    "bad_dtype": st({"a": t("F64", [1], 0, 8)}, 8),
    "bad_shape": st({"a": t("F32", [-1, 4294967296], 0, 4)}, 4),
    "bad_size": st({"a": t("BF16", [4], 0, 12)}, 12),
    "bad_duplicate": st('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                        '"a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}}', 2),
    "bad_truncated": st({"w": t("F32", [2, 3], 0, 24)}, 24)[:40],
}

os.makedirs(OUT, exist_ok=True)
for name, data in SEEDS.items():
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(data)
