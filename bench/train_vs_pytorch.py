#!/usr/bin/python3
"""PyTorch side of `bench/train_vs_pytorch`: GPT-2 124M full training steps on CPU.

  train_vs_pytorch.py [--batch 4] [--seq 64] [--steps 5] [--warmup 2] [--threads N]
                      [--no-optimizer] [--json]

Uses the plain-PyTorch GPT2LMHeadModel of tests/parity/hf_models.py (same maths as HF's
eager GPT-2), random init, random tokens. One step = forward, cross-entropy loss, backward,
torch.nn.utils.clip_grad_norm_(1.0) and torch.optim.AdamW (foreach; no decay on
embeddings, norms and biases), as Tessera's trainer does; --no-optimizer times forward +
backward only. Modes: fp32, and bf16 autocast (weights stay
f32, matmuls run in bf16). Reports the median step time of --steps timed steps as tokens/s.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "parity"))
import hf_models  # noqa: E402

GPT2_124M = {
    "model_type": "gpt2", "vocab_size": 50257, "n_embd": 768, "n_layer": 12, "n_head": 12,
    "n_positions": 1024, "n_ctx": 1024, "n_inner": None, "layer_norm_epsilon": 1e-5,
    "activation_function": "gelu_new", "tie_word_embeddings": True,
}


def build_model(seed):
    torch.manual_seed(seed)
    model = hf_models.GPT2LMHeadModel(GPT2_124M)
    with torch.no_grad():  # HF's _init_weights: N(0, 0.02) for matrices, zero biases, unit norms
        for name, p in model.named_parameters():
            if name.endswith("ln_1.weight") or name.endswith("ln_2.weight") or name.endswith("ln_f.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02)
    return model.train()


def make_optimizer(model):
    decay = [p for n, p in model.named_parameters() if p.dim() == 2 and ".wte." not in n and ".wpe." not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() == 2 and ".wte." not in n and ".wpe." not in n)]
    return torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": other, "weight_decay": 0.0}],
                             lr=1e-3, betas=(0.9, 0.95), foreach=True)


def time_mode(model, x, y, mode, warmup, steps, opt):
    times, cpu = [], 0.0
    for i in range(warmup + steps):
        model.zero_grad(set_to_none=opt is None)
        t0, c0 = time.perf_counter(), time.process_time()
        if mode == "bf16_autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = hf_models.lm_loss(model(x), y)
        else:
            loss = hf_models.lm_loss(model(x), y)
        loss.backward()
        if opt is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        dt = time.perf_counter() - t0
        dc = time.process_time() - c0
        if not torch.isfinite(loss):
            raise RuntimeError(f"{mode}: loss is {loss.item()}")
        if i >= warmup:
            times.append(dt)
            cpu += dc
    # CPU seconds per wall second over the timed steps: well below --threads means the
    # machine was busy with other work and the timings are pessimistic.
    return statistics.median(times), times, loss.item(), cpu / sum(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))  # the cores we may run on
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-optimizer", action="store_true", help="forward + backward only")
    ap.add_argument("--json", action="store_true", help="also print one JSON object with the results")
    args = ap.parse_args()
    if args.seq > GPT2_124M["n_positions"] or min(args.batch, args.seq, args.steps) < 1:
        raise SystemExit(f"--batch/--seq/--steps must be >= 1 and --seq <= {GPT2_124M['n_positions']}")
    torch.set_num_threads(args.threads)

    model = build_model(args.seed)
    gen = torch.Generator().manual_seed(args.seed + 1)
    x = torch.randint(0, GPT2_124M["vocab_size"], (args.batch, args.seq), generator=gen)
    y = torch.randint(0, GPT2_124M["vocab_size"], (args.batch, args.seq), generator=gen)
    tokens = args.batch * args.seq
    n_params = sum(p.numel() for p in model.parameters())
    print(f"pytorch {torch.__version__}, {args.threads} threads, GPT-2 {n_params / 1e6:.1f}M params, "
          f"batch {args.batch} x seq {args.seq}, warmup {args.warmup}, median of {args.steps}, "
          f"{'forward + backward' if args.no_optimizer else 'full step (clip + AdamW)'}")
    result = {}
    for mode in ("fp32", "bf16_autocast"):
        opt = None if args.no_optimizer else make_optimizer(model)
        med, times, loss, util = time_mode(model, x, y, mode, args.warmup, args.steps, opt)
        result[f"{mode}_tokens_per_s"] = tokens / med
        print(f"  {mode:14s} step {med * 1e3:8.1f} ms median (min {min(times) * 1e3:.1f}, "
              f"max {max(times) * 1e3:.1f})  {tokens / med:9.1f} tokens/s  loss {loss:.4f}  "
              f"cpu util {util:.2f} cores")
        result[f"{mode}_cpu_util"] = util
    if args.json:
        print(json.dumps({**result, "batch": args.batch, "seq": args.seq, "steps": args.steps,
                          "threads": args.threads, "torch_version": torch.__version__}))


if __name__ == "__main__":
    main()
