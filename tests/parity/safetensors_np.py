"""The safetensors format with NumPy only (no torch: the quantization references start
fast): load returns ({name: array}, metadata) with BF16 widened to float32 and F8_E4M3
left as its uint8 codes (NumPy has no fp8; load_dtypes says which tensors were F8_E4M3);
save writes {name: array} with the header padded to a multiple of 8, as the reference
library does."""
import json
import struct

import numpy as np

_NP = {"F32": np.float32, "F16": np.float16, "I32": np.int32, "I64": np.int64, "I8": np.int8, "U8": np.uint8}
_TAG = {np.dtype(v): k for k, v in _NP.items()}


def load_dtypes(path):
    """{name: safetensors dtype tag} of the file's tensors."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    return {k: v["dtype"] for k, v in header.items()}


def load(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    meta = header.pop("__metadata__", {})
    out = {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        dt = {"BF16": np.int16, "F8_E4M3": np.uint8}.get(info["dtype"]) or _NP[info["dtype"]]
        a = np.frombuffer(data[8 + n + b:8 + n + e], dtype=dt).reshape(info["shape"])
        if info["dtype"] == "BF16":
            a = (a.astype(np.uint16).astype(np.uint32) << 16).view(np.float32)
        out[name] = a.copy()
    return out, meta


def save(tensors, path):
    header, blobs, off = {}, [], 0
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        raw = a.tobytes()
        header[name] = {"dtype": _TAG[a.dtype], "shape": list(a.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h + b"".join(blobs))
