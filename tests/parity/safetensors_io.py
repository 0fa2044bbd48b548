"""Minimal, dependency-free reader/writer of the safetensors format for torch tensors.

Format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N,
N bytes of JSON {name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}},
then the raw little-endian tensor bytes; offsets are relative to the end of the header.
The writer pads the header with spaces to a multiple of 8 (as the reference library does),
so every tensor starts 8-byte aligned in the file.
"""
import json
import struct
import sys

import numpy as np
import torch

if sys.byteorder != "little":
    raise RuntimeError("safetensors_io assumes a little-endian host")

# safetensors dtype tag -> (torch dtype, numpy dtype used for the raw bytes)
_DTYPES = {
    "F64": (torch.float64, np.float64),
    "F32": (torch.float32, np.float32),
    "F16": (torch.float16, np.float16),
    "BF16": (torch.bfloat16, np.int16),  # numpy has no bf16: move the bits as int16
    "I64": (torch.int64, np.int64),
    "I32": (torch.int32, np.int32),
    "I16": (torch.int16, np.int16),
    "I8": (torch.int8, np.int8),
    "U8": (torch.uint8, np.uint8),
    "BOOL": (torch.bool, np.bool_),
}
_TAG_OF = {torch_dtype: tag for tag, (torch_dtype, _) in _DTYPES.items()}

# The reference implementation refuses headers above 100 MB; so do we.
_MAX_HEADER = 100_000_000


def _tensor_bytes(t):
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def save_file(tensors, path, metadata=None):
    """Writes {name: torch.Tensor} to `path`. metadata: {str: str}, default {"format": "pt"}."""
    header = {}
    blobs = []
    offset = 0
    for name in sorted(tensors):
        t = tensors[name]
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"'{name}' is not a torch.Tensor")
        if t.dtype not in _TAG_OF:
            raise TypeError(f"'{name}' has unsupported dtype {t.dtype}")
        data = _tensor_bytes(t)
        header[name] = {"dtype": _TAG_OF[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    meta = {"format": "pt"} if metadata is None else dict(metadata)
    if meta:
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
            raise TypeError("safetensors __metadata__ must map str to str")
        header = {"__metadata__": meta, **header}
    hbytes = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hbytes += b" " * (-len(hbytes) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(hbytes)))
        f.write(hbytes)
        for data in blobs:
            f.write(data)


def read_header(path):
    """Returns (header dict including __metadata__ if present, byte offset where data starts)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: file shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", raw)
        if n > _MAX_HEADER:
            raise ValueError(f"{path}: header length {n} is implausibly large")
        hbytes = f.read(n)
        if len(hbytes) != n:
            raise ValueError(f"{path}: header truncated ({len(hbytes)} of {n} bytes)")
    header = json.loads(hbytes.decode("utf-8"))
    if not isinstance(header, dict):
        raise ValueError(f"{path}: header is not a JSON object")
    return header, 8 + n


def load_file(path):
    """Reads every tensor of a .safetensors file into {name: torch.Tensor} (CPU, own memory).

    Validates dtype tags, byte counts, bounds, and that the tensors tile the data buffer with
    no gaps or overlaps (the same rule the reference implementation enforces)."""
    header, start = read_header(path)
    with open(path, "rb") as f:
        f.seek(start)
        buf = f.read()
    entries = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        tag = info.get("dtype")
        if tag not in _DTYPES:
            raise ValueError(f"{path}: tensor '{name}' has unknown dtype '{tag}'")
        shape = info.get("shape")
        begin, end = info.get("data_offsets", [None, None])
        torch_dtype, np_dtype = _DTYPES[tag]
        numel = int(np.prod(shape)) if shape else 1
        if end - begin != numel * np.dtype(np_dtype).itemsize:
            raise ValueError(f"{path}: tensor '{name}' {tag}{shape} needs {numel * np.dtype(np_dtype).itemsize}"
                             f" bytes but data_offsets span {end - begin}")
        if not 0 <= begin <= end <= len(buf):
            raise ValueError(f"{path}: tensor '{name}' data_offsets {[begin, end]} outside data of {len(buf)} bytes")
        entries.append((begin, end, name, shape, torch_dtype, np_dtype))
    entries.sort()
    pos = 0
    for begin, end, name, *_ in entries:
        if begin != pos:
            raise ValueError(f"{path}: tensor '{name}' starts at {begin}, expected {pos} (gap or overlap)")
        pos = end
    if pos != len(buf):
        raise ValueError(f"{path}: {len(buf) - pos} trailing bytes after the last tensor")
    out = {}
    for begin, end, name, shape, torch_dtype, np_dtype in entries:
        if begin == end:
            out[name] = torch.empty(shape, dtype=torch_dtype)
            continue
        arr = np.frombuffer(buf, dtype=np_dtype, count=(end - begin) // np.dtype(np_dtype).itemsize,
                            offset=begin).copy()
        t = torch.from_numpy(arr)
        if torch_dtype == torch.bfloat16:
            t = t.view(torch.bfloat16)
        out[name] = t.reshape(shape)
    return out


def load_metadata(path):
    return read_header(path)[0].get("__metadata__", {})
