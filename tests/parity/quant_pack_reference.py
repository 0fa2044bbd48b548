"""Independent NumPy transcription of the ecosystem's quantized-linear layouts, for
tests/io/quant_checkpoint_test.cc:

  AutoGPTQ   GPTQ.fasterquant's g_idx, QuantLinear.pack (qlinear_cuda.py: qweight packed
             along the input dim, qzeros along the output dim storing z - 1), its torch
             dequantization (scales[g_idx] * (w - zeros[g_idx]), zeros read + 1), and
             exllama's Q4Matrix::make_sequential + reconstruct (4-bit).
  AutoAWQ    WQLinear_GEMM.from_linear (packed along the output dim in AWQ_ORDER) and
             packing_utils.dequantize_gemm (unpack, AWQ_REVERSE_ORDER, (w - z) * s).

gptq_v2 (GPTQModel) is v1 without the -1 / +1 on zero points.

Usage: quant_pack_reference.py IN.safetensors OUT.safetensors
IN holds, per case NAME (its __metadata__ NAME = {"method", "bits", "group_size", "version"}):
  NAME.W (out, in) f32       the float weight (what pack quantizes; exactly s * (q - z))
  NAME.scales, NAME.zeros    (out, groups) f32, as the quantizer returns them (groups in
                             stored, i.e. act-order, column order)
  NAME.perm (in) i32         act-order: stored column j is W's column perm[j]
  NAME.ours.SUFFIX           the C++ packing, dequantized here as the kernels would
OUT, per case: NAME.qweight / .qzeros / .scales (/ .g_idx) packed from W, NAME.deq_f32 and
NAME.deq_f16 (out, in) from NAME.ours.*, and for 4-bit gptq NAME.exllama_x_map (in) i32
and NAME.exllama_deq (out, in) f16.
"""
import json
import sys

import numpy as np
from safetensors_np import load, save  # this directory


# ---- AutoGPTQ -----------------------------------------------------------------------------

def gptq_g_idx(perm, group_size):
    # GPTQ.fasterquant: g_idx = [i // groupsize for i in range(columns)], then under actorder
    # g_idx = g_idx[invperm] with invperm = argsort(perm).
    columns = perm.shape[0]
    g_idx = np.array([i // group_size for i in range(columns)], dtype=np.int32)
    invperm = np.argsort(perm, kind="stable")
    return g_idx[invperm]


def gptq_pack(W, scales, zeros, g_idx, bits, v1):
    # QuantLinear.pack(linear, scales, zeros, g_idx) of qlinear_cuda.py.
    infeatures = W.shape[1]
    scales = scales.T.copy()
    zeros = zeros.T.copy()
    scale_zeros = zeros * scales
    half_scales = scales.astype(np.float16)
    intweight = []
    for idx in range(infeatures):
        g = g_idx[idx]
        intweight.append(np.round((W[:, idx] + scale_zeros[g]) / half_scales[g]).astype(np.int32)[:, None])
    intweight = np.concatenate(intweight, axis=1)
    intweight = intweight.T.copy().astype(np.uint32)

    i = 0
    row = 0
    qweight = np.zeros((intweight.shape[0] // 32 * bits, intweight.shape[1]), dtype=np.uint32)
    while row < qweight.shape[0]:
        for j in range(i, i + (32 // bits)):
            qweight[row] |= intweight[j] << np.uint32(bits * (j - i))
        i += 32 // bits
        row += 1
    qweight = qweight.astype(np.int32)

    if v1:
        zeros -= 1
    zeros = zeros.astype(np.uint32)
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 32 * bits), dtype=np.uint32)
    i = 0
    col = 0
    while col < qzeros.shape[1]:
        for j in range(i, i + (32 // bits)):
            qzeros[:, col] |= zeros[:, j] << np.uint32(bits * (j - i))
        i += 32 // bits
        col += 1
    qzeros = qzeros.astype(np.int32)
    return qweight, qzeros, half_scales, g_idx.astype(np.int32)


def gptq_dequantize(qweight, qzeros, scales, g_idx, bits, v1, dtype):
    # QuantLinear.forward's torch path (qlinear_cuda.py), returning W (out, in); `dtype` is
    # the arithmetic: the scales' dtype (f16 checkpoints; f32 is the weight_dtype=float32 path).
    wf = np.arange(0, 32, bits, dtype=np.int32)[None, :]
    small = np.int16 if bits == 8 else np.int8
    zeros = np.right_shift(np.repeat(qzeros[:, :, None], 32 // bits, axis=2), wf[None, :, :]).astype(small)
    zeros = np.bitwise_and(zeros, (2 ** bits) - 1)
    if v1:
        zeros = zeros + 1
    zeros = zeros.reshape(scales.shape)
    weight = np.right_shift(np.repeat(qweight[:, None, :], 32 // bits, axis=1), wf[:, :, None]).astype(small)
    weight = np.bitwise_and(weight, (2 ** bits) - 1)
    weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
    g = g_idx.astype(np.int64)
    # torch keeps int16 * half in half; numpy would widen, so the (exact) difference is cast.
    weights = scales.astype(dtype)[g] * (weight.astype(np.int32) - zeros[g].astype(np.int32)).astype(dtype)
    return weights.T.copy()


def exllama_reconstruct(qweight, qzeros, scales, g_idx, v1):
    # exllama's Q4Matrix::make_sequential (x_map from a counting sort of g_idx) and
    # reconstruct_kernel (half(q - z) * scale over runs of sequential rows); W (out, in).
    height, groups = g_idx.shape[0], scales.shape[0]
    group_size = height // groups
    g_idx_map = np.zeros(groups, dtype=np.int64)
    for i in range(height):
        g_idx_map[g_idx[i]] += 1
    acc = 0
    for i in range(groups):
        tmp = g_idx_map[i]
        g_idx_map[i] = acc
        acc += tmp
    x_map_inv = np.zeros(height, dtype=np.int64)
    for row in range(height):
        target_group = g_idx[row]
        x_map_inv[row] = g_idx_map[target_group]
        g_idx_map[target_group] += 1
    x_map = np.zeros(height, dtype=np.int64)
    for row in range(height):
        x_map[x_map_inv[row]] = row
    q = qweight.view(np.uint32)
    z = qzeros.view(np.uint32)
    out = np.zeros((height, q.shape[1]), dtype=np.float16)
    for r in range(height):  # sequential row r holds original row x_map[r]
        src = x_map[r]
        w_read = (q[src // 8] >> np.uint32(4 * (src % 8))) & np.uint32(0xF)
        group = r // group_size
        cols = np.arange(q.shape[1])
        w_zero = ((z[group, cols // 8] >> (4 * (cols % 8)).astype(np.uint32)) & np.uint32(0xF)).astype(np.int64)
        w_zero += 1 if v1 else 0
        out[r] = (w_read.astype(np.int64) - w_zero).astype(np.float16) * scales[group]
    W = np.zeros((q.shape[1], height), dtype=np.float16)
    W[:, x_map] = out.T
    return x_map.astype(np.int32), W


# ---- AutoAWQ ------------------------------------------------------------------------------

def awq_pack(W, scales, zeros, group_size):
    # WQLinear_GEMM.from_linear(linear, w_bit=4, group_size, scales, zeros) with scales and
    # zeros (groups, out) as AutoAWQ's quantizer hands them over.
    w_bit = 4
    scales = scales.T.copy()
    zeros = zeros.T.copy()
    scale_zeros = zeros * scales
    half_scales = scales.astype(np.float16)
    pack_num = 32 // w_bit
    intweight = []
    for idx in range(W.shape[1]):
        intweight.append(np.round((W[:, idx] + scale_zeros[idx // group_size])
                                  / half_scales[idx // group_size]).astype(np.int32)[:, None])
    intweight = np.concatenate(intweight, axis=1)
    intweight = intweight.T.copy().astype(np.int32)
    qweight = np.zeros((intweight.shape[0], intweight.shape[1] // 32 * w_bit), dtype=np.int32)
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    for col in range(intweight.shape[1] // pack_num):
        for i in range(pack_num):
            qweight_col = intweight[:, col * pack_num + order_map[i]]
            qweight[:, col] |= qweight_col << (i * w_bit)
    zeros = zeros.astype(np.int32)
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 32 * w_bit), dtype=np.int32)
    for col in range(zeros.shape[1] // pack_num):
        for i in range(pack_num):
            qzero_col = zeros[:, col * pack_num + order_map[i]]
            qzeros[:, col] |= qzero_col << (i * w_bit)
    return qweight, qzeros, half_scales


def awq_dequantize(qweight, qzeros, scales, group_size, dtype):
    # packing_utils.dequantize_gemm: unpack_awq, reverse_awq_order, mask, (w - z) * s; W (out, in).
    bits = 4
    shifts = np.arange(0, 32, bits, dtype=np.int32)
    iweights = np.right_shift(qweight[:, :, None], shifts[None, None, :]).astype(np.int8)
    iweights = iweights.reshape(iweights.shape[0], -1)
    izeros = np.right_shift(qzeros[:, :, None], shifts[None, None, :]).astype(np.int8)
    izeros = izeros.reshape(izeros.shape[0], -1)
    reverse_order = np.arange(izeros.shape[-1], dtype=np.int32).reshape(-1, 32 // bits)
    reverse_order = reverse_order[:, [0, 4, 1, 5, 2, 6, 3, 7]].reshape(-1)
    izeros = izeros[:, reverse_order]
    iweights = iweights[:, reverse_order]
    iweights = np.bitwise_and(iweights, (2 ** bits) - 1)
    izeros = np.bitwise_and(izeros, (2 ** bits) - 1)
    scales = np.repeat(scales.astype(dtype), group_size, axis=0)
    izeros = np.repeat(izeros, group_size, axis=0)
    return ((iweights - izeros).astype(dtype) * scales).T.copy()


def main():
    tensors, meta = load(sys.argv[1])
    out = {}
    for name, spec in meta.items():
        if not name.startswith("case:"):
            continue
        name = name[len("case:"):]
        c = json.loads(spec)
        W = tensors[name + ".W"].astype(np.float32)
        scales = tensors[name + ".scales"].astype(np.float32)
        zeros = tensors[name + ".zeros"].astype(np.float32)
        perm = tensors[name + ".perm"].astype(np.int64)
        group = c["group_size"] if c["group_size"] != -1 else W.shape[1]
        ours = {k[len(name) + 6:]: v for k, v in tensors.items() if k.startswith(name + ".ours.")}
        if c["method"] == "gptq":
            v1 = c["version"] == 1
            g_idx = gptq_g_idx(perm, group)
            qw, qz, s, gi = gptq_pack(W, scales, zeros, g_idx, c["bits"], v1)
            out.update({name + ".qweight": qw, name + ".qzeros": qz, name + ".scales": s, name + ".g_idx": gi})
            args = (ours["qweight"], ours["qzeros"], ours["scales"], ours["g_idx"], c["bits"], v1)
            out[name + ".deq_f32"] = gptq_dequantize(*args, np.float32)
            out[name + ".deq_f16"] = gptq_dequantize(*args, np.float16)
            if c["bits"] == 4:
                x_map, Wx = exllama_reconstruct(ours["qweight"], ours["qzeros"], ours["scales"], ours["g_idx"], v1)
                out[name + ".exllama_x_map"] = x_map
                out[name + ".exllama_deq"] = Wx
        else:
            qw, qz, s = awq_pack(W, scales, zeros, group)
            out.update({name + ".qweight": qw, name + ".qzeros": qz, name + ".scales": s})
            args = (ours["qweight"], ours["qzeros"], ours["scales"], group)
            out[name + ".deq_f32"] = awq_dequantize(*args, np.float32)
            out[name + ".deq_f16"] = awq_dequantize(*args, np.float16)
    save(out, sys.argv[2])


if __name__ == "__main__":
    main()
