"""Independent reading of an llm-compressor compressed-tensors fp8 checkpoint
("float-quantized"), for tests/model/quantized_model_test.cc.

Checks config.json's quantization_config has what vLLM's compressed-tensors loader looks
at for its FP8 / FP8_DYNAMIC schemes, decodes every F8_E4M3 `weight` with a transcription
of the OCP e4m3fn format (bias 7, no infinities, S.1111.111 NaN, subnormals m * 2^-9),
multiplies by `weight_scale` (out, 1) per channel or (out, in / group_size) per group,
and checks each value is within fp8's rounding (half a unit in the last place: 2^-4
relative for normals, 2^-10 scale below 2^-6) of the float model's weight.

Usage: fp8_checkpoint_reference.py FLOAT_DIR FP8_DIR OUT_DIR
Writes OUT_DIR/model.safetensors (float32: the float model with every quantized linear
replaced by its dequantized weight) and prints "ok N" (N linears checked).
"""
import json
import os
import sys

import numpy as np
from safetensors_np import load, load_dtypes, save  # this directory


def e4m3_to_f32(codes):
    c = codes.astype(np.int32)
    sign = np.where(c & 0x80, -1.0, 1.0)
    e = (c >> 3) & 0xF
    m = c & 7
    normal = sign * (1.0 + m / 8.0) * np.exp2(e - 7.0)
    sub = sign * m * 2.0 ** -9
    out = np.where(e == 0, sub, normal)
    return np.where((c & 0x7F) == 0x7F, np.nan, out).astype(np.float32)


def main(float_dir, fp8_dir, out_dir):
    cfg = json.load(open(os.path.join(fp8_dir, "config.json")))
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors", qc
    assert qc["format"] == "float-quantized", qc
    assert qc["quantization_status"] == "compressed", qc
    assert qc["ignore"] == ["lm_head"], qc
    (grp,) = qc["config_groups"].values()
    assert grp["targets"] == ["Linear"], grp
    w = grp["weights"]
    assert (w["num_bits"], w["type"], w["symmetric"], w["dynamic"]) == (8, "float", True, False), w
    assert w["strategy"] in ("channel", "group"), w
    group = w["group_size"] if w["strategy"] == "group" else None
    assert grp.get("input_activations") is None, grp  # weight-only (FP8 preset)

    want, _ = load(os.path.join(float_dir, "model.safetensors"))
    got, _ = load(os.path.join(fp8_dir, "model.safetensors"))
    dtypes = load_dtypes(os.path.join(fp8_dir, "model.safetensors"))
    out = {k: v.astype(np.float32) for k, v in want.items()}
    checked = 0
    for name, tag in dtypes.items():
        if not name.endswith(".weight_scale"):
            continue
        mod = name[: -len(".weight_scale")]
        assert dtypes[mod + ".weight"] == "F8_E4M3", (mod, dtypes[mod + ".weight"])
        q = e4m3_to_f32(got[mod + ".weight"])
        assert not np.isnan(q).any(), mod
        s = got[name].astype(np.float32)
        rows, cols = q.shape
        g = cols if group is None else group
        assert s.shape == (rows, cols // g), (mod, s.shape)
        deq = q * np.repeat(s, g, axis=1)
        ref = want[mod + ".weight"].astype(np.float32)
        bound = np.maximum(2.0 ** -4 * np.abs(ref), np.repeat(s, g, axis=1) * 2.0 ** -10) * 1.0001 + 1e-12
        err = np.abs(deq - ref)
        assert (err <= bound).all(), (mod, float((err / bound).max()))
        out[mod + ".weight"] = deq
        checked += 1
    os.makedirs(out_dir, exist_ok=True)
    save(out, os.path.join(out_dir, "model.safetensors"))
    cfg.pop("quantization_config")
    json.dump(cfg, open(os.path.join(out_dir, "config.json"), "w"), indent=2)
    print("ok", checked)


if __name__ == "__main__":
    main(*sys.argv[1:4])
