"""PyTorch's AdamW step time on a flat parameter of N elements, the peer figure for
bench/optimizer_bench.cc (docs/optimizers.md). Run with Debian's python3 (torch 1.13):
    /usr/bin/python3 bench/optimizer_vs_pytorch.py [N=124439808] [threads=2]
Prints the median of 7 timed steps after one warm-up step, for foreach=False (torch
1.13's default) and foreach=True, with the same hyperparameters as the C++ bench.
"""
import statistics
import sys
import time

import torch


def main():
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 124439808
    torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
    for foreach in (False, True):
        p = torch.nn.Parameter(torch.randn(n) * 0.02)
        p.grad = torch.randn(n) * 1e-3
        opt = torch.optim.AdamW([p], lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                                foreach=foreach)
        opt.step()
        times = []
        for _ in range(7):
            t = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t)
        s = statistics.median(times)
        print(f"torch {torch.__version__} AdamW foreach={foreach}: {s * 1e3:.1f} ms/step, "
              f"{n / s / 1e9:.3f} Gelem/s, {torch.get_num_threads()} threads")


if __name__ == "__main__":
    main()
