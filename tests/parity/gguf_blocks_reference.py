"""Independent NumPy transcription of GGUF v3 and llama.cpp's block formats, for
tests/io/gguf_test.cc and tests/model/gguf_model_test.cc. Written from the published
layouts (ggml-common.h's block structs, ggml-quants.c's dequantize_row_* and
quantize_row_*_ref, gguf.md's file layout, convert_hf_to_gguf.py's tensor names and
LlamaModel.permute), not from Tessera's C++.

Usage:
  gguf_blocks_reference.py read FILE.gguf OUT.safetensors OUT.json
      every tensor of FILE dequantized to f32 (shape: dims outermost first) into OUT, and
      the metadata and tensor infos as JSON ({"version", "alignment", "data_start",
      "metadata": {key: [type, value]}, "tensors": [{"name", "ne", "type", "offset"}]}).
  gguf_blocks_reference.py quant IN.safetensors OUT.safetensors
      for each f32 (rows, cols) tensor NAME of IN: NAME.q8_0, NAME.q4_0 and (cols a multiple
      of 256) NAME.q4_k as U8 (rows, row bytes), quantized as quantize_row_*_ref does, and
      NAME.f16 / NAME.bf16 as U8 (rows, 2 cols) converted round-to-nearest-even.
  gguf_blocks_reference.py convert HF_DIR FILE.gguf
      checks that an f32 GGUF export holds the Hugging Face checkpoint in HF_DIR under
      convert_hf_to_gguf.py's names, Llama's q / k rows permuted as LlamaModel.permute does
      (not for qwen2); prints "ok N tensors", exits 1 naming the first mismatch.

All arithmetic is float32 in ggml's operation order, so the outputs are bit-exact.
"""
import json
import struct
import sys

import numpy as np
from safetensors_np import load as _st_load, save as st_save  # this directory

F = np.float32


def st_load(path):
    return _st_load(path)[0]


# ---- GGUF ---------------------------------------------------------------------------------

# gguf_type: scalar struct formats (8 string, 9 array).
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
# ggml_type -> (name, block size, bytes per block), from ggml.c's type_traits.
_TYPES = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 8: ("Q8_0", 32, 34),
          12: ("Q4_K", 256, 144), 14: ("Q6_K", 256, 210), 30: ("BF16", 1, 2)}


def gguf_read(path):
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b"GGUF":
        raise ValueError("bad magic")
    pos = 4

    def rd(fmt):
        nonlocal pos
        v = struct.unpack_from(fmt, data, pos)[0]
        pos += struct.calcsize(fmt)
        return v

    def rstr():
        nonlocal pos
        n = rd("<Q")
        s = data[pos:pos + n]
        pos += n
        return s.decode("utf-8")

    def rval(t):
        if t == 8:
            return rstr()
        if t == 9:
            et = rd("<I")
            n = rd("<Q")
            return [et, [rval(et) for _ in range(n)]]
        return rd(_SCALAR[t])

    version = rd("<I")
    n_tensors = rd("<Q")
    n_kv = rd("<Q")
    meta = {}
    for _ in range(n_kv):
        key = rstr()
        t = rd("<I")
        meta[key] = [t, rval(t)]
    alignment = meta.get("general.alignment", [4, 32])[1]
    infos = []
    for _ in range(n_tensors):
        name = rstr()
        nd = rd("<I")
        ne = [rd("<Q") for _ in range(nd)]
        typ = rd("<I")
        off = rd("<Q")
        infos.append({"name": name, "ne": ne, "type": typ, "offset": off})
    data_start = (pos + alignment - 1) // alignment * alignment
    return data, {"version": version, "alignment": alignment, "data_start": data_start,
                  "metadata": meta, "tensors": infos}


def tensor_bytes(data, h, info):
    _, block, size = _TYPES[info["type"]]
    n = int(np.prod(info["ne"]))
    start = h["data_start"] + info["offset"]
    return np.frombuffer(data[start:start + n // block * size], dtype=np.uint8)


# ---- dequantization (ggml-quants.c dequantize_row_*) ----------------------------------------


def f16(b):  # (.., 2) uint8 -> f32
    return np.ascontiguousarray(b).view(np.float16).astype(F)[..., 0]


def deq_q8_0(raw):
    b = raw.reshape(-1, 34)
    d = f16(b[:, 0:2])[:, None]
    qs = b[:, 2:].view(np.int8).astype(F)
    return (qs * d).reshape(-1)


def deq_q4_0(raw):
    b = raw.reshape(-1, 18)
    d = f16(b[:, 0:2])[:, None]
    qs = b[:, 2:].astype(np.int32)
    lo = ((qs & 0x0F) - 8).astype(F)
    hi = ((qs >> 4) - 8).astype(F)
    return np.concatenate([lo * d, hi * d], axis=1).reshape(-1)


def scale_min_k4(j, q):  # q: (nb, 12) uint8 -> (sc, m) (nb,) int
    q = q.astype(np.int32)
    if j < 4:
        return q[:, j] & 63, q[:, j + 4] & 63
    return (q[:, j + 4] & 0xF) | ((q[:, j - 4] >> 6) << 4), (q[:, j + 4] >> 4) | ((q[:, j] >> 6) << 4)


def deq_q4_k(raw):
    b = raw.reshape(-1, 144)
    d = f16(b[:, 0:2])
    dmin = f16(b[:, 2:4])
    scales = b[:, 4:16]
    qs = b[:, 16:].astype(np.int32)
    out = np.empty((b.shape[0], 256), dtype=F)
    for c in range(4):
        q = qs[:, 32 * c:32 * c + 32]
        for half, nib in ((0, q & 0xF), (1, q >> 4)):
            sc, m = scale_min_k4(2 * c + half, scales)
            d1 = (d * sc.astype(F))[:, None]
            m1 = (dmin * m.astype(F))[:, None]
            out[:, 64 * c + 32 * half:64 * c + 32 * half + 32] = d1 * nib.astype(F) - m1
    return out.reshape(-1)


def deq_q6_k(raw):
    b = raw.reshape(-1, 210)
    ql_all = b[:, 0:128].astype(np.int32)
    qh_all = b[:, 128:192].astype(np.int32)
    sc_all = b[:, 192:208].view(np.int8).astype(F)
    d = f16(b[:, 208:210])
    out = np.empty((b.shape[0], 256), dtype=F)
    for n in range(2):
        ql = ql_all[:, 64 * n:64 * n + 64]
        qh = qh_all[:, 32 * n:32 * n + 32]
        sc = sc_all[:, 8 * n:8 * n + 8]
        for l in range(32):
            s = l // 16
            q1 = ((ql[:, l] & 0xF) | (((qh[:, l] >> 0) & 3) << 4)) - 32
            q2 = ((ql[:, l + 32] & 0xF) | (((qh[:, l] >> 2) & 3) << 4)) - 32
            q3 = ((ql[:, l] >> 4) | (((qh[:, l] >> 4) & 3) << 4)) - 32
            q4 = ((ql[:, l + 32] >> 4) | (((qh[:, l] >> 6) & 3) << 4)) - 32
            base = 128 * n
            out[:, base + l] = (d * sc[:, s + 0]) * q1.astype(F)
            out[:, base + l + 32] = (d * sc[:, s + 2]) * q2.astype(F)
            out[:, base + l + 64] = (d * sc[:, s + 4]) * q3.astype(F)
            out[:, base + l + 96] = (d * sc[:, s + 6]) * q4.astype(F)
    return out.reshape(-1)


def dequantize(raw, typ):
    name = _TYPES[typ][0]
    if name == "F32":
        return raw.view(F).copy()
    if name == "F16":
        return raw.view(np.float16).astype(F)
    if name == "BF16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(F)
    return {"Q8_0": deq_q8_0, "Q4_0": deq_q4_0, "Q4_K": deq_q4_k, "Q6_K": deq_q6_k}[name](raw)


# ---- quantization (quantize_row_*_ref) ---------------------------------------------------


def f16_bits(x):
    return np.asarray(x, dtype=F).astype(np.float16).view(np.uint16)


def roundf(v):  # C's roundf: half away from zero (exact in float64 for float32 inputs)
    v = v.astype(np.float64)
    return np.where(v >= 0, np.floor(v + 0.5), -np.floor(-v + 0.5))


def quant_q8_0(x):
    b = x.reshape(-1, 32)
    amax = np.max(np.abs(b), axis=1)
    d = (amax / F(127)).astype(F)
    idv = np.where(d != 0, F(1) / np.where(d != 0, d, F(1)), F(0)).astype(F)
    q = roundf((b * idv[:, None]).astype(F)).astype(np.int8)
    out = np.empty((b.shape[0], 34), dtype=np.uint8)
    out[:, 0:2] = f16_bits(d).view(np.uint8).reshape(-1, 2)
    out[:, 2:] = q.view(np.uint8)
    return out.reshape(-1)


def quant_q4_0(x):
    b = x.reshape(-1, 32)
    mx = b[np.arange(b.shape[0]), np.argmax(np.abs(b), axis=1)]  # first of the largest |x|
    d = (mx / F(-8)).astype(F)
    idv = np.where(d != 0, F(1) / np.where(d != 0, d, F(1)), F(0)).astype(F)
    v = ((b * idv[:, None]).astype(F) + F(8.5)).astype(F)
    q = np.minimum(15, np.trunc(v).astype(np.int8).astype(np.int32))
    out = np.empty((b.shape[0], 18), dtype=np.uint8)
    out[:, 0:2] = f16_bits(d).view(np.uint8).reshape(-1, 2)
    out[:, 2:] = (q[:, :16] | (q[:, 16:] << 4)).astype(np.uint8)
    return out.reshape(-1)


def nearest_int(v):  # ggml's: round half to even through the float adder
    f = (np.asarray(v, dtype=F) + F(12582912.0)).astype(F)
    return (f.view(np.int32) & 0x007FFFFF) - 0x00400000


def acc(a):  # a float32 sum in index order, as a C loop `s += a[i]` from 0 makes it
    return np.add.accumulate(np.asarray(a, dtype=F), dtype=F)[-1]


def make_qkx2_quants(x, w, nmax=15, rmin=F(-1.0), rdelta=F(0.1), nstep=20):
    n = x.shape[0]
    mn = x[0]
    mx = x[0]
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
    sum_w = acc(w)
    sum_x = acc(w * x)
    if mn > 0:
        mn = F(0)
    if mx == mn:
        return F(0), -mn, np.zeros(n, dtype=np.int32)
    iscale = F(nmax) / F(mx - mn)
    scale = F(1) / iscale
    L = np.clip(nearest_int(iscale * (x - mn)), 0, nmax)
    diff = (scale * L.astype(F) + mn) - x
    best = acc(w * (diff * diff))
    for step in range(nstep + 1):
        iscale = F(F(rmin + F(rdelta * F(step))) + F(nmax)) / F(mx - mn)
        la = np.clip(nearest_int(iscale * (x - mn)), 0, nmax)
        lf = la.astype(F)
        sum_l = acc(w * lf)
        sum_l2 = acc((w * lf) * lf)
        sum_xl = acc((w * lf) * x)
        D = F(F(sum_w * sum_l2) - F(sum_l * sum_l))
        if D > 0:
            this_scale = F(F(F(sum_w * sum_xl) - F(sum_x * sum_l)) / D)
            this_min = F(F(F(sum_l2 * sum_x) - F(sum_l * sum_xl)) / D)
            if this_min > 0:
                this_min = F(0)
                this_scale = F(sum_xl / sum_l2)
            diff = (this_scale * lf + this_min) - x
            cur = acc(w * (diff * diff))
            if cur < best:
                L = la
                best = cur
                scale = this_scale
                mn = this_min
    return scale, F(-mn), L


def quant_q4_k(x):
    blocks = x.reshape(-1, 256)
    out = np.zeros((blocks.shape[0], 144), dtype=np.uint8)
    for bi, xb in enumerate(blocks):
        L = np.zeros(256, dtype=np.int32)
        scales = np.zeros(8, dtype=F)
        mins = np.zeros(8, dtype=F)
        for j in range(8):
            xs = xb[32 * j:32 * j + 32]
            av_x = np.sqrt(F(acc(xs * xs) / F(32)))
            weights = (av_x + np.abs(xs)).astype(F)
            scales[j], mins[j], L[32 * j:32 * j + 32] = make_qkx2_quants(xs, weights)
        max_scale = F(0)
        max_min = F(0)
        for j in range(8):
            if scales[j] > max_scale:
                max_scale = scales[j]
            if mins[j] > max_min:
                max_min = mins[j]
        inv_scale = F(63) / max_scale if max_scale > 0 else F(0)
        inv_min = F(63) / max_min if max_min > 0 else F(0)
        sc = np.zeros(12, dtype=np.int32)
        for j in range(8):
            ls = min(63, int(nearest_int(F(inv_scale * scales[j]))) & 0xFF)
            lm = min(63, int(nearest_int(F(inv_min * mins[j]))) & 0xFF)
            if j < 4:
                sc[j] = ls
                sc[j + 4] = lm
            else:
                sc[j + 4] = (ls & 0xF) | ((lm & 0xF) << 4)
                sc[j - 4] |= (ls >> 4) << 6
                sc[j] |= (lm >> 4) << 6
        d16 = f16_bits([F(max_scale / F(63))])
        m16 = f16_bits([F(max_min / F(63))])
        d = d16.view(np.float16).astype(F)[0]
        dmin = m16.view(np.float16).astype(F)[0]
        sc8 = sc.astype(np.uint8)[None, :]
        for j in range(8):
            s, m = scale_min_k4(j, sc8)
            dj = F(d * F(s[0]))
            if dj == 0:
                continue
            dm = F(dmin * F(m[0]))
            L[32 * j:32 * j + 32] = np.clip(nearest_int(((xb[32 * j:32 * j + 32] + dm).astype(F) / dj).astype(F)), 0, 15)
        out[bi, 0:2] = d16.view(np.uint8)
        out[bi, 2:4] = m16.view(np.uint8)
        out[bi, 4:16] = sc8[0]
        for c in range(4):
            out[bi, 16 + 32 * c:16 + 32 * c + 32] = (L[64 * c:64 * c + 32] | (L[64 * c + 32:64 * c + 64] << 4)).astype(np.uint8)
    return out.reshape(-1)


def bf16_bits(x):  # round to nearest even, as ggml_compute_fp32_to_bf16 (no NaNs here)
    u = np.asarray(x, dtype=F).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


# ---- commands ---------------------------------------------------------------------------


def cmd_read(path, out_st, out_json):
    data, h = gguf_read(path)
    out = {}
    for info in h["tensors"]:
        raw = tensor_bytes(data, h, info)
        out[info["name"]] = dequantize(raw, info["type"]).reshape(list(reversed(info["ne"])))
    st_save(out, out_st)
    with open(out_json, "w") as f:
        json.dump(h, f)


def cmd_quant(in_st, out_st):
    out = {}
    for name, x in st_load(in_st).items():
        rows, cols = x.shape
        x = x.astype(F)
        out[name + ".q8_0"] = quant_q8_0(x).reshape(rows, -1)
        out[name + ".q4_0"] = quant_q4_0(x).reshape(rows, -1)
        if cols % 256 == 0:
            out[name + ".q4_k"] = quant_q4_k(x).reshape(rows, -1)
        out[name + ".f16"] = f16_bits(x).view(np.uint8).reshape(rows, -1)
        out[name + ".bf16"] = bf16_bits(x).view(np.uint8).reshape(rows, -1)
    st_save(out, out_st)


# convert_hf_to_gguf.py's names (gguf-py's tensor_mapping for llama / qwen2).
_BLOCK = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
          "mlp.down_proj": "ffn_down"}


def gguf_name(hf):
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    parts = hf.split(".")
    layer, module, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
    return f"blk.{layer}.{_BLOCK[module]}.{kind}"


def llama_permute(w, n_head, n_head_kv):  # LlamaModel.permute
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2)
            .reshape(w.shape))


def cmd_convert(hf_dir, path):
    with open(hf_dir + "/config.json") as f:
        cfg = json.load(f)
    hf = st_load(hf_dir + "/model.safetensors")
    data, h = gguf_read(path)
    infos = {i["name"]: i for i in h["tensors"]}
    llama = cfg["model_type"] == "llama"
    n_head = cfg["num_attention_heads"]
    n_kv = cfg.get("num_key_value_heads", n_head)
    if cfg.get("tie_word_embeddings", False):
        hf.pop("lm_head.weight", None)
    for name, w in sorted(hf.items()):
        g = gguf_name(name)
        if g not in infos:
            sys.exit(f"{name}: no tensor {g} in {path}")
        if llama and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = llama_permute(w, n_head, n_head)
        if llama and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = llama_permute(w, n_head, n_kv)
        info = infos.pop(g)
        if info["ne"] != list(reversed(w.shape)):
            sys.exit(f"{name}: {g} has ne {info['ne']}, expected {list(reversed(w.shape))}")
        got = dequantize(tensor_bytes(data, h, info), info["type"]).reshape(w.shape)
        if not np.array_equal(got.view(np.uint32), w.astype(F).view(np.uint32)):
            sys.exit(f"{name}: {g} differs from the checkpoint (first at {np.argwhere(got != w)[0].tolist()})")
    if infos:
        sys.exit(f"{path}: tensors not in the checkpoint: {sorted(infos)}")
    print(f"ok {len(hf)} tensors")


def main():
    cmd, args = sys.argv[1], sys.argv[2:]
    {"read": cmd_read, "quant": cmd_quant, "convert": cmd_convert}[cmd](*args)


if __name__ == "__main__":
    main()
