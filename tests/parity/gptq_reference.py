"""GPTQ, transcribed with NumPy from the published algorithm (Frantar et al. 2022, Algorithm 1)
as AutoGPTQ's GPTQ.fasterquant runs it, for tests/kernels/gptq_test.cc.

    gptq_reference.py IN.safetensors OUT.safetensors

IN holds, per case NAME, "NAME.W" (out, in) f32 and "NAME.H" (in, in) f32 (X^T X of the
calibration rows), and metadata "case:NAME" = {"bits", "group", "sym", "act_order",
"percdamp", "block"}. OUT gets "NAME.codes" (out, in) i32 in stored (act-order) column
order, "NAME.scales" / "NAME.zeros" (out, in / group) f32 and "NAME.perm" (in) i32.

The error compensation runs in float64. The quantizer's group parameters follow GPTQ's
Quantizer.find_params in float32 (the range always includes 0), with one change that the
AutoGPTQ v1 checkpoint format forces and Tessera's round-to-nearest shares: a zero point
of 0 becomes 1 with the scale max / (2^bits - 2).
"""
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_io  # noqa: E402
import torch  # noqa: E402


def find_params(x, bits, sym):
    """x: one row's group, float32. Returns (scale, zero) as float32."""
    maxq = np.float32(2 ** bits - 1)
    xmin = np.minimum(np.float32(0), x.min())
    xmax = np.maximum(np.float32(0), x.max())
    if sym:
        xmax = np.maximum(-xmin, xmax)
        if xmin < 0:
            xmin = -xmax
    if xmin == 0 and xmax == 0:
        xmin, xmax = np.float32(-1), np.float32(1)
    scale = np.float32((xmax - xmin) / maxq)
    zero = np.float32((maxq + 1) / 2) if sym else np.float32(np.rint(-xmin / scale))
    if zero == 0:
        zero = np.float32(1)
        scale = np.float32(xmax / (maxq - np.float32(1)))
    return scale, zero


def fasterquant(W, H, bits, group, sym, act_order, percdamp, block):
    W = W.astype(np.float64).copy()
    H = H.astype(np.float64).copy()
    rows, cols = W.shape
    maxq = 2 ** bits - 1
    dead = np.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    perm = np.arange(cols)
    if act_order:
        perm = np.argsort(-np.diag(H), kind="stable")
        W = W[:, perm]
        H = H[perm][:, perm]
    damp = percdamp * np.mean(np.diag(H))
    H[np.arange(cols), np.arange(cols)] += damp
    L = np.linalg.cholesky(H)
    Linv = np.linalg.inv(L)
    Hinv = np.linalg.cholesky(Linv.T @ Linv).T  # upper: Hinv = U^T U
    G = cols // group
    scales = np.zeros((rows, G), np.float32)
    zeros = np.zeros((rows, G), np.float32)
    codes = np.zeros((rows, cols), np.int32)
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        count = i2 - i1
        W1 = W[:, i1:i2].copy()
        Err1 = np.zeros((rows, count))
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(count):
            c = i1 + i
            g = c // group
            if c % group == 0:
                for r in range(rows):
                    scales[r, g], zeros[r, g] = find_params(W[r, c:c + group].astype(np.float32), bits, sym)
            w = W1[:, i]
            d = Hinv1[i, i]
            s = scales[:, g].astype(np.float64)
            z = zeros[:, g].astype(np.float64)
            q = np.clip(np.rint(w / s) + z, 0, maxq)
            codes[:, c] = q.astype(np.int32)
            err1 = (w - s * (q - z)) / d
            W1[:, i:] -= np.outer(err1, Hinv1[i, i:])
            Err1[:, i] = err1
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    return codes, scales, zeros, perm.astype(np.int32)


def main():
    src, dst = sys.argv[1], sys.argv[2]
    tensors = safetensors_io.load_file(src)
    meta = safetensors_io.load_metadata(src)
    out = {}
    for key, value in meta.items():
        if not key.startswith("case:"):
            continue
        name = key[len("case:"):]
        p = json.loads(value)
        W = tensors[name + ".W"].numpy()
        H = tensors[name + ".H"].numpy()
        codes, scales, zeros, perm = fasterquant(W, H, p["bits"], p["group"], p["sym"], p["act_order"],
                                                 p["percdamp"], p["block"])
        out[name + ".codes"] = torch.from_numpy(codes)
        out[name + ".scales"] = torch.from_numpy(scales)
        out[name + ".zeros"] = torch.from_numpy(zeros)
        out[name + ".perm"] = torch.from_numpy(perm)
    safetensors_io.save_file(out, dst)


if __name__ == "__main__":
    main()
