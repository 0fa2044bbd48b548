"""PyTorch reference for Tessera's optimizers (tests/train/optim_test.cc).

Writes OUT/optim_reference.safetensors with inputs (initial params, grads per step) and
torch's results for:
  adamw.*  torch.optim.AdamW, 3 steps, weight decay only on the decay group
  clip.*   torch.nn.utils.clip_grad_norm_ (max_norm 1.0)
  amp.*    torch.cuda.amp.GradScaler + clip_grad_norm_ + AdamW over 6 steps with an inf
           and a NaN step, growth_interval 3. GradScaler needs CUDA for two kernels, so
           the real GradScaler class runs with those two kernels ported to CPU torch code.
  muon.*   Keller Jordan's Muon (github.com/KellerJordan/Muon) written out here in f32
           for the 2-D hidden matrices, AdamW for the rest, 3 steps
  muon_plain.*  the same without Nesterov
  ns.*     zeropower_via_newtonschulz5 alone, in f32
Settings and scalar results go into the file's __metadata__ as JSON ("config", "results").
Usage: optim_reference.py --out DIR
"""
import argparse
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from safetensors_io import save_file  # noqa: E402

torch.set_num_threads(1)
torch.manual_seed(1234)

# name, shape, decay flag. The big one spans several 64K-element chunks with a ragged tail.
ADAMW_PARAMS = [
    ("h.0.mlp.c_fc.weight", (48, 32), True),
    ("h.0.big.weight", (300, 257), True),
    ("wte.weight", (64, 32), False),
    ("ln_f.weight", (32,), False),
    ("h.0.mlp.c_fc.bias", (48,), False),
]
HP = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
LR_SCALES = [1.0, 0.5, 0.25]
RESULTS = {}  # scalars (Tessera has no f64 tensors): written as JSON metadata


def make_grad(shape, step):
    g = torch.randn(shape) * 1e-2
    if step == 1:
        # Tiny entries so eps matters in the denominator for some elements.
        g.view(-1)[::7] *= 1e-6
    return g


def adamw_groups(params, flags):
    return [
        {"params": [p for p, d in zip(params, flags) if d], "weight_decay": HP["weight_decay"]},
        {"params": [p for p, d in zip(params, flags) if not d], "weight_decay": 0.0},
    ]


def make_adamw(params, flags):
    return torch.optim.AdamW(adamw_groups(params, flags), lr=HP["lr"],
                             betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"], foreach=False)


def set_lr(opt, base_lr, scale):
    for g in opt.param_groups:
        g["lr"] = base_lr * scale  # the same double product the C++ side forms


def case_adamw(out):
    names = [n for n, _, _ in ADAMW_PARAMS]
    flags = [d for _, _, d in ADAMW_PARAMS]
    params = [torch.randn(s) for _, s, _ in ADAMW_PARAMS]
    for n, p in zip(names, params):
        out[f"adamw.init.{n}"] = p.clone()
    params = [torch.nn.Parameter(p) for p in params]
    opt = make_adamw(params, flags)
    for step, scale in enumerate(LR_SCALES):
        for n, p in zip(names, params):
            p.grad = make_grad(p.shape, step)
            out[f"adamw.grad.{step}.{n}"] = p.grad.clone()
        set_lr(opt, HP["lr"], scale)
        opt.step()
        for n, p in zip(names, params):
            out[f"adamw.out.{step}.{n}"] = p.detach().clone()
    for n, p in zip(names, params):
        out[f"adamw.exp_avg.{n}"] = opt.state[p]["exp_avg"].clone()
        out[f"adamw.exp_avg_sq.{n}"] = opt.state[p]["exp_avg_sq"].clone()


def case_clip(out):
    grads = [torch.randn(s) * 0.05 for _, s, _ in ADAMW_PARAMS]
    for (n, _, _), g in zip(ADAMW_PARAMS, grads):
        out[f"clip.grad.{n}"] = g.clone()
    params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g.clone()
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm=1.0)
    RESULTS["clip.norm"] = float(norm)  # torch's f32 norm
    RESULTS["clip.norm64"] = float(torch.cat([g.double().reshape(-1) for g in grads]).norm())
    for (n, _, _), p in zip(ADAMW_PARAMS, params):
        out[f"clip.out.{n}"] = p.grad.clone()


def install_cpu_grad_scaler():
    """Lets the real torch.cuda.amp.GradScaler run on CPU tensors: its control flow
    (unscale_, step skipping, update) is untouched; only the two CUDA-only ATen kernels
    are replaced by ports of their CUDA code (aten/src/ATen/native/cuda/AmpKernels.cu)."""
    import torch.cuda.amp.grad_scaler as gs

    def non_finite_check_and_unscale_(grads, found_inf, inv_scale):
        for g in grads:
            if not bool(torch.isfinite(g).all()):
                found_inf.fill_(1.0)
            if inv_scale.item() != 1.0:
                g.mul_(inv_scale)

    def update_scale_(scale, growth_tracker, found_inf, growth_factor, backoff_factor,
                      growth_interval):
        if found_inf.item():
            scale.copy_(scale.double() * backoff_factor)  # f32 * double, stored as f32
            growth_tracker.fill_(0)
        else:
            successful = int(growth_tracker.item()) + 1
            if successful == growth_interval:
                new_scale = (scale.double() * growth_factor).float()
                if bool(torch.isfinite(new_scale).all()):
                    scale.copy_(new_scale)
                growth_tracker.fill_(0)
            else:
                growth_tracker.fill_(successful)
        return scale

    class CpuReplicator(gs._MultiDeviceReplicator):
        def __init__(self, master):  # the original asserts master.is_cuda
            self.master = master
            self._per_device_tensors = {}

    gs.amp_definitely_not_available = lambda: False
    gs._MultiDeviceReplicator = CpuReplicator
    torch._amp_foreach_non_finite_check_and_unscale_ = non_finite_check_and_unscale_
    torch._amp_update_scale_ = update_scale_
    return gs.GradScaler


AMP = dict(init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5, growth_interval=3,
           max_norm=1.0, steps=6, inf_step=1, nan_step=5)


def case_amp(out):
    GradScaler = install_cpu_grad_scaler()
    names = [n for n, _, _ in ADAMW_PARAMS]
    flags = [d for _, _, d in ADAMW_PARAMS]
    params = [torch.randn(s) for _, s, _ in ADAMW_PARAMS]
    for n, p in zip(names, params):
        out[f"amp.init.{n}"] = p.clone()
    params = [torch.nn.Parameter(p) for p in params]
    opt = make_adamw(params, flags)
    scaler = GradScaler(init_scale=AMP["init_scale"], growth_factor=AMP["growth_factor"],
                        backoff_factor=AMP["backoff_factor"],
                        growth_interval=AMP["growth_interval"])
    scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))
    scales, trackers, norms = [], [], []
    for step in range(AMP["steps"]):
        for i, (n, p) in enumerate(zip(names, params)):
            # fp16 gradients of a scaled loss, widened to f32.
            g = (torch.randn(p.shape) * 0.05 * scaler.get_scale()).half().float()
            if step == AMP["inf_step"] and i == 1:
                g.view(-1)[123] = float("inf")
            if step == AMP["nan_step"] and i == 3:
                g.view(-1)[5] = float("nan")
            p.grad = g
            out[f"amp.grad.{step}.{n}"] = g.clone()
        scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(params, max_norm=AMP["max_norm"])))
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        trackers.append(int(scaler._get_growth_tracker()))
        for n, p in zip(names, params):
            out[f"amp.out.{step}.{n}"] = p.detach().clone()
    RESULTS["amp.scale"] = scales
    RESULTS["amp.growth_tracker"] = trackers
    RESULTS["amp.norm"] = [n if math.isfinite(n) else str(n) for n in norms]


# --- Muon, as published (KellerJordan/Muon muon.py), with f32 instead of bf16 ---
def zeropower_via_newtonschulz5(G, steps):
    assert G.ndim >= 2
    a, b, c = (3.4445, -4.7750, 2.0315)
    X = G.float()  # the published code: G.bfloat16()
    if G.size(-2) > G.size(-1):
        X = X.mT
    X = X / (X.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        A = X @ X.mT
        B = b * A + c * A @ A
        X = a * X + B @ X
    if G.size(-2) > G.size(-1):
        X = X.mT
    return X


def muon_update(grad, momentum, beta=0.95, ns_steps=5, nesterov=True):
    momentum.lerp_(grad, 1 - beta)
    update = grad.lerp_(momentum, beta) if nesterov else momentum
    update = zeropower_via_newtonschulz5(update, steps=ns_steps)
    update *= max(1, grad.size(-2) / grad.size(-1)) ** 0.5
    return update


class Muon(torch.optim.Optimizer):
    def __init__(self, params, lr=0.02, weight_decay=0.0, momentum=0.95, nesterov=True,
                 ns_steps=5):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                                      nesterov=nesterov, ns_steps=ns_steps))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    state["momentum_buffer"] = torch.zeros_like(p)
                update = muon_update(p.grad, state["momentum_buffer"], beta=group["momentum"],
                                     ns_steps=group["ns_steps"], nesterov=group["nesterov"])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update.reshape(p.shape), alpha=-group["lr"])


# name, shape, decay, muon
MUON_PARAMS = [
    ("h.0.attn.c_attn.weight", (48, 32), True, True),   # tall: iterated on the transpose
    ("h.0.mlp.c_proj.weight", (32, 80), True, True),    # wide
    ("wte.weight", (64, 32), False, False),
    ("ln_f.weight", (32,), False, False),
    ("h.0.mlp.c_fc.bias", (48,), False, False),
]
MUON_HP = dict(muon_lr=0.02, muon_momentum=0.95, muon_nesterov=True, muon_ns_steps=5,
               muon_weight_decay=0.01)


def case_muon(out, prefix, nesterov):
    names = [n for n, *_ in MUON_PARAMS]
    params = [torch.nn.Parameter(torch.randn(s)) for _, s, _, _ in MUON_PARAMS]
    for n, p in zip(names, params):
        out[f"{prefix}.init.{n}"] = p.detach().clone()
    mu = [p for p, (_, _, _, m) in zip(params, MUON_PARAMS) if m]
    rest = [(p, d) for p, (_, _, d, m) in zip(params, MUON_PARAMS) if not m]
    muon = Muon(mu, lr=MUON_HP["muon_lr"], weight_decay=MUON_HP["muon_weight_decay"],
                momentum=MUON_HP["muon_momentum"], nesterov=nesterov,
                ns_steps=MUON_HP["muon_ns_steps"])
    adamw = make_adamw([p for p, _ in rest], [d for _, d in rest])
    for step, scale in enumerate(LR_SCALES):
        for n, p in zip(names, params):
            p.grad = make_grad(p.shape, step)
            out[f"{prefix}.grad.{step}.{n}"] = p.grad.clone()
        for g in muon.param_groups:
            g["lr"] = MUON_HP["muon_lr"] * scale
        set_lr(adamw, HP["lr"], scale)
        muon.step()
        adamw.step()
        for n, p in zip(names, params):
            out[f"{prefix}.out.{step}.{n}"] = p.detach().clone()
    for n, p in zip(names, params):
        if p in muon.state:
            out[f"{prefix}.momentum.{n}"] = muon.state[p]["momentum_buffer"].clone()


def case_ns(out):
    for tag, shape in (("tall", (40, 24)), ("wide", (24, 56)), ("square", (32, 32))):
        g = torch.randn(shape)
        out[f"ns.in.{tag}"] = g
        out[f"ns.out.{tag}"] = zeropower_via_newtonschulz5(g, 5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    out = {}
    case_adamw(out)
    case_clip(out)
    case_amp(out)
    case_muon(out, "muon", True)
    case_muon(out, "muon_plain", False)  # momentum without Nesterov
    case_ns(out)
    config = {
        "adamw": {**HP, "lr_scales": LR_SCALES,
                  "params": [[n, list(s), d] for n, s, d in ADAMW_PARAMS]},
        "amp": AMP,
        "muon": {**HP, **MUON_HP, "lr_scales": LR_SCALES,
                 "params": [[n, list(s), d, m] for n, s, d, m in MUON_PARAMS]},
        "muon_plain": {**HP, **MUON_HP, "muon_nesterov": False, "lr_scales": LR_SCALES,
                       "params": [[n, list(s), d, m] for n, s, d, m in MUON_PARAMS]},
    }
    save_file(out, os.path.join(args.out, "optim_reference.safetensors"),
              metadata={"config": json.dumps(config), "results": json.dumps(RESULTS)})


if __name__ == "__main__":
    main()
